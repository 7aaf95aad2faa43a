"""Rollout correction: the importance weights ``pi_old / pi_rollout`` against direct formulas,
their truncation and masking, the metrics, every policy loss weighted by them, and bad
configuration refused by name. (Split / rank / padding / NaN invariance: test_losses.py's
``actor_*_tis`` / ``*_mask`` entries.)"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.losses import (
    POLICY_LOSSES,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ActorLoss,
    RolloutCorrection,
    field_granularity,
    register_policy_loss,
    rollout_weights,
)
from engine.losses.rollout_correction import LEVELS, MODES
from heads import PER_TOKEN
from heads.errors import BatchError, ConfigError
from tests.engine.losses.test_losses import make_rollout, reinforce, whole_batch

fast = settings(max_examples=40, deadline=None)


def direct_weights(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, correction: RolloutCorrection
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, dropped) token by token, in plain Python arithmetic."""
    weights = torch.zeros_like(old, dtype=torch.float64)
    dropped = torch.zeros_like(old, dtype=torch.bool)
    for i in range(old.shape[0]):
        tokens = [t for t in range(old.shape[1]) if mask[i, t]]
        for t in tokens:
            if correction.level == "token":
                log_w = float(old[i, t]) - float(rollout[i, t])
            else:
                log_w = math.fsum(float(old[i, u]) - float(rollout[i, u]) for u in tokens)
                if correction.level == "geometric":
                    log_w /= len(tokens)
            w = math.exp(min(max(log_w, -20.0), 20.0))
            if correction.mode == "truncate":
                weights[i, t] = min(w, correction.upper)
            elif correction.lower_bound <= w <= correction.upper:
                weights[i, t] = w
            else:
                dropped[i, t] = True
    return weights, dropped


def _correction(level: str, mode: str, upper: float, lower: float | None) -> RolloutCorrection:
    """A valid correction: mask mode's default lower (1 / upper) exceeds an upper below 1, which
    is refused (every token dropped), so such an upper gets an explicit lower <= upper."""
    if mode == "truncate":
        lower = None
    elif lower is not None or upper < 1.0:
        lower = min(lower if lower is not None else upper / 2, upper)
    return RolloutCorrection(level=level, mode=mode, upper=upper, lower=lower)


corrections = st.builds(
    _correction,
    st.sampled_from(LEVELS),
    st.sampled_from(MODES),
    st.floats(0.5, 4.0),
    st.one_of(st.none(), st.floats(0.05, 1.0)),
)


@fast
@given(
    correction=corrections,
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    mask_prob=st.sampled_from([0.0, 0.5, 1.0]),
    spread=st.sampled_from([0.05, 0.5, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_the_weights_equal_the_direct_formula(
    correction: RolloutCorrection,
    lengths: list[int],
    mask_prob: float,
    spread: float,
    seed: int,
) -> None:
    batch, _, _ = whole_batch(make_rollout(lengths, seed, mask_prob))
    old, mask = batch["old_log_probs"].double(), batch[RESPONSE_MASK]
    gen = torch.Generator().manual_seed(seed)
    rollout = old + spread * torch.randn(old.shape, generator=gen, dtype=torch.float64)
    got = rollout_weights(old, rollout, mask, correction)
    weights, dropped = direct_weights(old, rollout, mask, correction)
    torch.testing.assert_close(got.weights, weights, rtol=1e-12, atol=0.0)
    assert torch.equal(got.dropped, dropped)
    assert not got.weights.requires_grad


def test_token_weights_vary_along_a_sequence_and_sequence_weights_are_the_product() -> None:
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[9.0, -1.2, -1.9, -0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    ratios = torch.exp(old - rollout)[0, 1:4]
    token = rollout_weights(old, rollout, mask, RolloutCorrection(upper=10.0)).weights
    sequence = rollout_weights(old, rollout, mask, RolloutCorrection(level="sequence", upper=10.0))
    geometric = rollout_weights(
        old, rollout, mask, RolloutCorrection(level="geometric", upper=10.0)
    )
    torch.testing.assert_close(token[0, 1:4], ratios)
    torch.testing.assert_close(sequence.weights[0, 1:4], ratios.prod().expand(3))
    torch.testing.assert_close(geometric.weights[0, 1:4], ratios.prod().pow(1 / 3).expand(3))
    for weights in (token, sequence.weights, geometric.weights):
        assert weights[0, 0] == 0.0 and weights[0, 4] == 0.0  # outside the mask


def test_truncation_caps_at_upper_and_masking_drops_outside_the_bounds() -> None:
    old = torch.zeros(1, 6, dtype=torch.float64)
    ratios = torch.tensor([[0.2, 0.5, 0.9, 1.5, 2.0, 30.0]], dtype=torch.float64)
    rollout = old - ratios.log()
    mask = torch.ones(1, 6)
    truncated = rollout_weights(old, rollout, mask, RolloutCorrection(upper=1.6))
    torch.testing.assert_close(
        truncated.weights, torch.tensor([[0.2, 0.5, 0.9, 1.5, 1.6, 1.6]], dtype=torch.float64)
    )
    assert not truncated.dropped.any()
    masked = rollout_weights(
        old, rollout, mask, RolloutCorrection(mode="mask", lower=0.5, upper=2.5)
    )
    torch.testing.assert_close(
        masked.weights, torch.tensor([[0.0, 0.5, 0.9, 1.5, 2.0, 0.0]], dtype=torch.float64)
    )
    assert masked.dropped.tolist() == [[True, False, False, False, False, True]]
    default_lower = rollout_weights(old, rollout, mask, RolloutCorrection(mode="mask", upper=4.0))
    assert default_lower.dropped.tolist() == [[True, False, False, False, False, True]]  # 1/4
    assert RolloutCorrection(mode="mask", upper=4.0).lower_bound == 0.25


def test_the_metrics_report_the_weights_the_dropped_share_and_the_rollout_to_old_kl() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([6, 9, 4, 7], seed=21, mask_prob=0.9))
    correction = RolloutCorrection(level="token", mode="mask", lower=0.8, upper=1.25)
    _, metrics = ActorLoss(rollout_correction=correction)(outputs, batch, ctx)
    m = batch[RESPONSE_MASK].bool()
    old, rollout = batch["old_log_probs"].double(), batch[ROLLOUT_LOG_PROBS].double()
    weights, dropped = direct_weights(old, rollout, m, correction)
    log_ratio = (old - rollout)[m]
    assert metrics["rollout_is_mean"] == pytest.approx(float(weights[m].mean()))
    assert metrics["rollout_is_max"] == pytest.approx(float(weights[m].max()))
    assert metrics["rollout_is_dropped"] == pytest.approx(float(dropped[m].double().mean()))
    assert 0 < metrics["rollout_is_dropped"] < 1
    has_tokens = m.any(-1)
    expected_seq = float((dropped.any(-1) & has_tokens).sum() / has_tokens.sum())
    assert metrics["rollout_is_seq_dropped"] == pytest.approx(expected_seq)
    assert metrics["rollout_old_kl"] == pytest.approx(float((-log_ratio).mean()))
    k3 = torch.exp(log_ratio) - log_ratio - 1
    assert metrics["rollout_old_k3_kl"] == pytest.approx(float(k3.mean()))


POLICY_NAMES = ("vanilla", "gspo", "cispo")


@pytest.mark.parametrize("policy_loss", POLICY_NAMES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_rollout_log_probs_equal_to_old_ones_change_nothing_bit_for_bit(
    policy_loss: str, level: str, mode: str
) -> None:
    batch, outputs, ctx = whole_batch(make_rollout([6, 9, 4, 7], seed=5, mask_prob=0.8))
    batch[ROLLOUT_LOG_PROBS] = batch["old_log_probs"].clone()
    plain = ActorLoss(policy_loss=policy_loss, kl_coeff=0.1, entropy_coeff=0.01)
    corrected = ActorLoss(
        policy_loss=policy_loss,
        kl_coeff=0.1,
        entropy_coeff=0.01,
        rollout_correction=RolloutCorrection(level=level, mode=mode),
    )
    results = []
    for loss_fn in (plain, corrected):
        loss, metrics = loss_fn(outputs, batch, ctx)
        (gradient,) = torch.autograd.grad(loss, outputs["log_probs"])
        results.append((loss, metrics, gradient))
    (loss, metrics, gradient), (loss_c, metrics_c, gradient_c) = results
    assert torch.equal(loss_c, loss) and torch.equal(gradient_c, gradient)
    assert {k: v for k, v in metrics_c.items() if not k.startswith("rollout_")} == metrics
    assert metrics_c["rollout_is_mean"] == 1.0 and metrics_c["rollout_is_max"] == 1.0
    assert metrics_c["rollout_is_dropped"] == 0.0 and metrics_c["rollout_old_kl"] == 0.0


@pytest.mark.parametrize("policy_loss", [*POLICY_NAMES, "registered"])
@pytest.mark.parametrize("level", LEVELS)
def test_every_policy_loss_is_weighted_token_by_token_in_value_and_gradient(
    policy_loss: str, level: str
) -> None:
    batch, outputs, ctx = whole_batch(make_rollout([6, 9, 4, 7], seed=17, mask_prob=0.9))
    correction = RolloutCorrection(level=level, upper=1.3)
    m = batch[RESPONSE_MASK].double()
    old, rollout = batch["old_log_probs"].double(), batch[ROLLOUT_LOG_PROBS].double()
    weights, _ = direct_weights(old, rollout, m, correction)
    assert (weights[m.bool()] != 1.0).any()
    try:
        if policy_loss == "registered":
            register_policy_loss("registered")(reinforce)
        loss_fn = ActorLoss(policy_loss=policy_loss, rollout_correction=correction)
        loss, metrics = loss_fn(outputs, batch, ctx)
        (gradient,) = torch.autograd.grad(loss, outputs["log_probs"])
        unweighted, _ = ActorLoss(policy_loss=policy_loss)(outputs, batch, ctx)

        logp = outputs["log_probs"].detach().clone().requires_grad_()
        terms = POLICY_LOSSES.get(policy_loss)(
            logp * m, old * m, batch["advantages"].double() * m, m, loss_fn
        )
        expected = (terms.per_token * weights * m).sum() / m.sum()
        (expected_gradient,) = torch.autograd.grad(expected, logp)
    finally:
        if policy_loss == "registered":
            POLICY_LOSSES.unregister("registered")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(gradient, expected_gradient)
    assert metrics["pg_loss"] == pytest.approx(float(expected))
    assert not torch.isclose(loss, unweighted)


BAD = [
    ({"level": "tokens"}, "RolloutCorrection.level"),
    ({"mode": "clip"}, "RolloutCorrection.mode"),
    ({"upper": 0.0}, "RolloutCorrection.upper"),
    ({"upper": -2.0}, "RolloutCorrection.upper"),
    ({"upper": math.nan}, "RolloutCorrection.upper"),
    ({"upper": True}, "RolloutCorrection.upper"),
    ({"upper": "2"}, "RolloutCorrection.upper"),
    ({"mode": "mask", "lower": 0.0}, "RolloutCorrection.lower"),
    ({"mode": "mask", "lower": 3.0, "upper": 2.0}, "RolloutCorrection.lower"),
    ({"lower": 0.5}, r"RolloutCorrection\.lower applies to mode='mask' only"),
]


@pytest.mark.parametrize(("options", "names"), BAD, ids=[str(o) for o, _ in BAD])
def test_a_bad_correction_is_refused_naming_the_field(options: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        RolloutCorrection(**options)


def test_actor_loss_takes_a_rollout_correction_and_then_needs_rollout_log_probs() -> None:
    with pytest.raises(ConfigError, match=r"ActorLoss\.rollout_correction must be"):
        ActorLoss(rollout_correction={"level": "token"})  # type: ignore[arg-type]
    assert ROLLOUT_LOG_PROBS not in field_granularity(ActorLoss())
    corrected = ActorLoss(rollout_correction=RolloutCorrection())
    assert field_granularity(corrected)[ROLLOUT_LOG_PROBS] == PER_TOKEN
    batch, outputs, ctx = whole_batch(make_rollout([4, 6], seed=1))
    del batch[ROLLOUT_LOG_PROBS]
    with pytest.raises(BatchError, match="'rollout_log_probs'"):
        corrected(outputs, batch, ctx)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    mask_prob=st.sampled_from([0.5, 1.0]),
    upper=st.floats(1.05, 4.0),
    seed=st.integers(0, 2**16),
)
def test_the_weights_match_verls_on_random_cases(
    lengths: list[int], mask_prob: float, upper: float, seed: int
) -> None:
    """verl 0.9.1's token / sequence TIS and IcePop weights, and its geometric-mean rejection
    (``seq_mean_k1``, bounds ``1/upper_upper``), in float64 (runs where verl is installed)."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    batch, _, _ = whole_batch(make_rollout(lengths, seed, mask_prob))
    mask = batch[RESPONSE_MASK].double()
    if not mask.any():
        return  # verl refuses an empty mask
    old = batch["old_log_probs"].double() * mask
    rollout = batch[ROLLOUT_LOG_PROBS].double() * mask
    for level in ("token", "sequence"):
        for threshold, mode in ((upper, "truncate"), (f"{1 / upper}_{upper}", "mask")):
            ours = rollout_weights(
                old, rollout, mask, RolloutCorrection(level=level, mode=mode, upper=upper)
            )
            try:
                theirs, _ = helper.compute_rollout_correction_weights(
                    old - rollout, mask, rollout_is=level, rollout_is_threshold=threshold
                )
            except ZeroDivisionError:  # verl's effective-sample-size metric, all weights dropped
                assert mode == "mask" and not ours.weights.any()
                continue
            torch.testing.assert_close(ours.weights, theirs, rtol=1e-12, atol=0.0)
    kept, _ = helper.compute_rollout_rejection_mask(
        old - rollout, mask, rollout_rs="seq_mean_k1", rollout_rs_threshold=f"{1 / upper}_{upper}"
    )
    geometric = rollout_weights(
        old, rollout, mask, RolloutCorrection(level="geometric", mode="mask", upper=upper)
    )
    assert torch.equal(geometric.dropped, (kept == 0) & mask.bool())
