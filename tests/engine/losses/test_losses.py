"""RL losses as pure tensor functions: global normalisation, formulas, masking, configuration.

No engine is built: micro-batches come from ``engine.data.batching`` and the ``LossContext`` global
counts are summed by hand the way the engine does (``scored_tokens``, ``sequences`` and every
per-token ``*mask`` field, over all data-parallel ranks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from engine.data.batching import from_token_lists, jagged_lengths, split_fixed
from engine.losses import (
    AGG_MODES,
    KL_TYPES,
    POLICY_LOSSES,
    RESPONSE_MASK,
    SCORED_TOKENS,
    SEQUENCES,
    ActorLoss,
    CriticLoss,
    LossContext,
    PolicyTerms,
    RolloutCorrection,
    aggregate,
    bradley_terry_loss,
    dual_clip_by_default,
    entropy_bonus,
    field_granularity,
    is_token_separable,
    kl_controller,
    kl_loss,
    kl_penalized_rewards,
    kl_penalty,
    needs_fields,
    register_policy_loss,
    required_fields,
    score_regression_loss,
    sft_loss,
    value_regression_loss,
)
from heads import PER_SEQUENCE, PER_TOKEN
from heads.errors import BatchError, ConfigError, UnknownStrategyError

HORIZON = 16
OUTPUT_NAMES = ("log_probs", "entropy", "values")
LossFn = Callable[[Mapping[str, torch.Tensor], TensorDict, LossContext], Any]


# -- test data -------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """Sequences with per-token batch fields (lists) and head outputs (padded float64 ``[n, L]``;
    padding positions hold ``fill``)."""

    tokens: list[list[int]]
    fields: dict[str, list[list[float]]]
    outputs: dict[str, torch.Tensor]

    def rows(self, sequence_ids: Sequence[int]) -> TensorDict:
        return from_token_lists(
            [self.tokens[i] for i in sequence_ids],
            **{name: [rows[i] for i in sequence_ids] for name, rows in self.fields.items()},
        )


def make_rollout(
    lengths: Sequence[int], seed: int, mask_prob: float = 0.6, corrupt: bool = False
) -> Rollout:
    """A random rollout; ``response_mask`` is random (never the first token). With ``corrupt``,
    every masked-out and padding position of every output and batch field holds NaN or +-inf."""
    gen = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths)
    valid = torch.arange(width) < torch.tensor(lengths)[:, None]
    mask = (torch.rand(n, width, generator=gen) < mask_prob) & valid
    mask[:, 0] = False
    log_probs = -3.0 * torch.rand(n, width, generator=gen, dtype=torch.float64)
    values = torch.randn(n, width, generator=gen, dtype=torch.float64)
    per_token = {
        "old_log_probs": log_probs
        + 0.4 * torch.randn(n, width, generator=gen, dtype=torch.float64),
        "ref_log_probs": log_probs
        + 0.4 * torch.randn(n, width, generator=gen, dtype=torch.float64),
        "advantages": torch.randn(n, width, generator=gen, dtype=torch.float64),
        "returns": torch.randn(n, width, generator=gen, dtype=torch.float64),
        "values": values + 0.4 * torch.randn(n, width, generator=gen, dtype=torch.float64),
    }
    rollout_gen = torch.Generator().manual_seed(seed + 1)  # leaves the draws above unchanged
    per_token["rollout_log_probs"] = per_token["old_log_probs"] + 0.3 * torch.randn(
        n, width, generator=rollout_gen, dtype=torch.float64
    )
    outputs = {
        "log_probs": log_probs,
        "entropy": 2.0 * torch.rand(n, width, generator=gen, dtype=torch.float64),
        "values": values,
    }
    if corrupt:
        poison = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
        junk = poison[torch.randint(0, 3, (n, width), generator=gen)]
        per_token = {k: torch.where(mask, v, junk) for k, v in per_token.items()}
        outputs = {k: torch.where(mask, v, junk) for k, v in outputs.items()}
    tokens = [torch.randint(0, 50, (length,), generator=gen).tolist() for length in lengths]
    fields = {
        name: [row[:length].tolist() for row, length in zip(value, lengths, strict=True)]
        for name, value in {**per_token, RESPONSE_MASK: mask.double()}.items()
    }
    return Rollout(tokens=tokens, fields=fields, outputs=outputs)


def global_counts(rows: TensorDict) -> dict[str, float]:
    """What the engine's ``_global_counts`` computes for one rank's (jagged) batch."""
    lengths = jagged_lengths(rows["input_ids"])
    counts = {SCORED_TOKENS: float((lengths - 1).sum()), SEQUENCES: float(len(lengths))}
    for name in rows.keys():
        if str(name).endswith("mask"):
            counts[str(name)] = float(rows[name].values().sum())
    return counts


def run_ranks(
    loss_fn: LossFn, rollout: Rollout, ranks: Sequence[Sequence[int]], micro_batch_size: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Sum of every micro-batch share on every "rank" (global counts summed over the ranks), and
    the gradient of that sum w.r.t. the head outputs."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in rollout.outputs.items()}
    rank_rows = [rollout.rows(ids) for ids in ranks]
    counts: dict[str, float] = {}
    for rows in rank_rows:
        for key, value in global_counts(rows).items():
            counts[key] = counts.get(key, 0.0) + value
    total = torch.zeros((), dtype=torch.float64)
    for ids, rows in zip(ranks, rank_rows, strict=True):
        micro_batches = split_fixed(rows, micro_batch_size)
        for index, mb in enumerate(micro_batches):
            sequences = torch.as_tensor(ids)[mb.indices]
            width = mb.attention_mask.shape[1]
            outputs = {k: leaf[sequences, :width] for k, leaf in leaves.items()}
            ctx = LossContext(
                micro_batch_index=index,
                num_micro_batches=len(micro_batches),
                data_parallel_size=len(ranks),
                global_counts=counts,
            )
            loss, metrics = loss_fn(outputs, mb.data, ctx)
            # numbers, or one-element tensors the engine fetches at the end of the step
            assert all(
                isinstance(value, float)
                or (
                    isinstance(value, torch.Tensor)
                    and value.numel() == 1
                    and not value.requires_grad
                )
                for value in metrics.values()
            )
            total = total + loss
    total.backward()
    return total.detach(), {k: leaf.grad for k, leaf in leaves.items()}


def whole_batch(rollout: Rollout) -> tuple[TensorDict, dict[str, torch.Tensor], LossContext]:
    """The whole rollout as one padded micro-batch, its outputs and its context."""
    rows = rollout.rows(range(len(rollout.tokens)))
    (mb,) = split_fixed(rows, len(rollout.tokens))
    outputs = {k: v.detach().clone().requires_grad_() for k, v in rollout.outputs.items()}
    ctx = LossContext(
        micro_batch_index=0,
        num_micro_batches=1,
        data_parallel_size=1,
        global_counts=global_counts(rows),
    )
    return mb.data, outputs, ctx


def aggregate_loss(mode: str) -> LossFn:
    def loss_fn(outputs: Mapping[str, torch.Tensor], batch: TensorDict, ctx: LossContext) -> Any:
        mask = batch[RESPONSE_MASK]
        value = aggregate(
            outputs["values"], mask, mode, ctx, mask_key=RESPONSE_MASK, horizon=HORIZON
        )
        return value, {}

    return loss_fn


LOSSES: dict[str, Callable[[str], LossFn]] = {
    "aggregate": aggregate_loss,
    "actor": lambda mode: ActorLoss(
        loss_agg_mode=mode, horizon=HORIZON, entropy_coeff=0.01, kl_coeff=0.1, kl_type="k3"
    ),
    "critic": lambda mode: CriticLoss(loss_agg_mode=mode, horizon=HORIZON, cliprange_value=0.2),
    "policy_loss": lambda mode: ActorLoss(
        loss_agg_mode=mode, horizon=HORIZON, clip_ratio_high=0.28, clip_ratio_c=None
    ),
    "value_loss": lambda mode: CriticLoss(
        loss_agg_mode=mode, horizon=HORIZON, cliprange_value=None
    ),
    "entropy_bonus": lambda mode: functools.partial(
        entropy_bonus, loss_agg_mode=mode, horizon=HORIZON
    ),
    "kl_loss_k2": lambda mode: functools.partial(
        kl_loss, kl_type="k2", loss_agg_mode=mode, horizon=HORIZON
    ),
    "actor_gspo": lambda mode: ActorLoss(
        policy_loss="gspo", loss_agg_mode=mode, horizon=HORIZON, kl_coeff=0.1, kl_type="k3+"
    ),
    "actor_cispo": lambda mode: ActorLoss(
        policy_loss="cispo", loss_agg_mode=mode, horizon=HORIZON, clip_ratio_high=0.28
    ),
    "actor_token_tis": lambda mode: ActorLoss(
        loss_agg_mode=mode,
        horizon=HORIZON,
        rollout_correction=RolloutCorrection(level="token", upper=1.2),
    ),
    "actor_gspo_sequence_mask": lambda mode: ActorLoss(
        policy_loss="gspo",
        loss_agg_mode=mode,
        horizon=HORIZON,
        rollout_correction=RolloutCorrection(level="sequence", mode="mask", upper=3.0),
    ),
    "actor_cispo_geometric_mask": lambda mode: ActorLoss(
        policy_loss="cispo",
        loss_agg_mode=mode,
        horizon=HORIZON,
        rollout_correction=RolloutCorrection(level="geometric", mode="mask", lower=0.9, upper=1.1),
    ),
    **{
        f"kl_loss_{kind}": lambda mode, kind=kind: functools.partial(
            kl_loss, kl_type=kind, loss_agg_mode=mode, horizon=HORIZON
        )
        for kind in ("abs", "k1+", "low_var_kl+")
    },
    **{
        f"actor_{name}": lambda mode, name=name, options=options: ActorLoss(
            policy_loss=name,
            policy_options=options,
            loss_agg_mode=mode,
            horizon=HORIZON,
            clip_ratio_high=0.28,
            entropy_coeff=0.01,
        )
        for name, options in (
            ("sapo", {"tau_pos": 1.0, "tau_neg": 2.0}),
            ("gpg", {}),
            ("geo_mean", {}),
            ("dro", {"dro_beta": 0.5}),
            ("dppo_tv", {}),
            ("dppo_kl", {}),
            ("bypass_mode", {"loss_type": "reinforce", "rollout_is": "token"}),
        )
    },
    "actor_bypass_mode_sequence": lambda mode: ActorLoss(
        policy_loss="bypass_mode",
        policy_options={"loss_type": "reinforce", "rollout_is": "sequence"},
        loss_agg_mode=mode,
        horizon=HORIZON,
    ),
}
#: Policy losses whose value depends on the micro-batch's own statistics (as verl's do), so
#: they are left out of the split-invariance properties above: Clip-Cov and KL-Cov.
MICRO_BATCH_LOCAL = {
    "actor_clip_cov": lambda mode: ActorLoss(
        policy_loss="clip_cov",
        policy_options={"clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0},
        loss_agg_mode=mode,
        horizon=HORIZON,
    ),
    "actor_kl_cov": lambda mode: ActorLoss(
        policy_loss="kl_cov",
        policy_options={"kl_cov_ratio": 0.2},
        loss_agg_mode=mode,
        horizon=HORIZON,
    ),
}

rollout_shapes = st.lists(st.integers(1, 9), min_size=1, max_size=6)
mask_probs = st.sampled_from([0.0, 0.3, 0.8, 1.0])
fast = settings(max_examples=30, deadline=None)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def assert_same_grads(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    for name in OUTPUT_NAMES:
        left, right = a[name], b[name]
        assert (left is None) == (right is None), name
        if left is not None and right is not None:
            torch.testing.assert_close(left, right, rtol=1e-9, atol=1e-12)


# -- global normalisation --------------------------------------------------------------------------
@pytest.mark.parametrize("loss", sorted(LOSSES))
@fast
@given(
    lengths=rollout_shapes,
    mask_prob=mask_probs,
    mode=st.sampled_from(AGG_MODES),
    split=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_micro_batch_shares_add_up_to_the_unsplit_loss_with_equal_gradients(
    loss: str, lengths: list[int], mask_prob: float, mode: str, split: int, seed: int
) -> None:
    rollout = make_rollout(lengths, seed, mask_prob)
    everyone = [list(range(len(lengths)))]
    loss_fn = LOSSES[loss](mode)
    whole, whole_grads = run_ranks(loss_fn, rollout, everyone, len(lengths))
    split_total, split_grads = run_ranks(loss_fn, rollout, everyone, split)
    assert_same(split_total, whole)
    assert_same_grads(split_grads, whole_grads)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@fast
@given(
    lengths=st.lists(st.integers(1, 9), min_size=2, max_size=6),
    mask_prob=mask_probs,
    mode=st.sampled_from(AGG_MODES),
    cut=st.integers(1, 5),
    split=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_two_ranks_with_global_counts_summed_over_both_equal_one_rank_with_everything(
    loss: str, lengths: list[int], mask_prob: float, mode: str, cut: int, split: int, seed: int
) -> None:
    rollout = make_rollout(lengths, seed, mask_prob)
    n = len(lengths)
    cut = min(cut, n - 1)
    loss_fn = LOSSES[loss](mode)
    one_rank, one_grads = run_ranks(loss_fn, rollout, [list(range(n))], n)
    two_ranks, two_grads = run_ranks(
        loss_fn, rollout, [list(range(cut)), list(range(cut, n))], split
    )
    assert_same(two_ranks, one_rank)
    assert_same_grads(two_grads, one_grads)


# -- token separability --------------------------------------------------------------------------
#: The losses of LOSSES that declare themselves token-separable: every one whose policy loss is
#: per token (GSPO pools a sequence ratio; the value losses are not asked).
SEPARABLE = {
    "actor",
    "policy_loss",
    "entropy_bonus",
    "kl_loss_k2",
    "actor_cispo",
    "actor_token_tis",
    "actor_cispo_geometric_mask",
    *(f"kl_loss_{kind}" for kind in ("abs", "k1+", "low_var_kl+")),
    *(f"actor_{name}" for name in ("sapo", "gpg", "dro", "dppo_tv", "dppo_kl", "bypass_mode")),
}


def gradient_with_only(
    loss_fn: LossFn,
    batch: tuple[TensorDict, dict[str, torch.Tensor], LossContext],
    real: torch.Tensor,
) -> dict[str, torch.Tensor | None]:
    """The loss's gradient w.r.t. the outputs of ``batch`` (:func:`whole_batch`) when only the
    ``real`` positions hold them (zeros elsewhere), as the fused LM head asks a token-separable
    loss chunk by chunk."""
    data, outputs, ctx = batch
    leaves = {k: v.detach().clone().requires_grad_() for k, v in outputs.items()}
    shown = {k: torch.where(real, leaf, torch.zeros_like(leaf)) for k, leaf in leaves.items()}
    loss, _ = loss_fn(shown, data, ctx)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return dict(zip(leaves, grads, strict=True))


def test_the_losses_declaring_themselves_token_separable_are_the_per_token_ones() -> None:
    every = {**LOSSES, **MICRO_BATCH_LOCAL}
    declared = {name for name, make in every.items() if is_token_separable(make("token-mean"))}
    assert declared == SEPARABLE


@pytest.mark.parametrize("loss", sorted(SEPARABLE))
@fast
@given(
    lengths=rollout_shapes,
    mask_prob=mask_probs,
    mode=st.sampled_from(AGG_MODES),
    real_prob=st.sampled_from([0.2, 0.5, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_a_token_separable_loss_gives_each_token_the_same_gradient_whatever_the_others_hold(
    loss: str, lengths: list[int], mask_prob: float, mode: str, real_prob: float, seed: int
) -> None:
    """What ``token_separable`` promises: with any subset of tokens real and zeros elsewhere,
    the gradient at the real tokens is the one with every token real."""
    batch = whole_batch(make_rollout(lengths, seed, mask_prob))
    shape = batch[1]["values"].shape
    loss_fn = LOSSES[loss](mode)
    everything = gradient_with_only(loss_fn, batch, torch.ones(shape, dtype=torch.bool))
    real = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < real_prob
    some = gradient_with_only(loss_fn, batch, real)
    for name, grad in everything.items():
        chunk = some[name]
        if grad is None:
            assert chunk is None or not chunk.any(), name
            continue
        assert chunk is not None, name
        assert_same(chunk[real], grad[real])


def test_gspo_is_not_token_separable_and_the_check_above_tells() -> None:
    """The property test can fail: GSPO's sequence ratio makes a token's gradient depend on
    the other tokens of its sequence."""
    batch = whole_batch(make_rollout([6, 8], seed=5, mask_prob=1.0))
    shape = batch[1]["values"].shape
    loss_fn = LOSSES["actor_gspo"]("token-mean")
    assert not is_token_separable(loss_fn)
    everything = gradient_with_only(loss_fn, batch, torch.ones(shape, dtype=torch.bool))
    real = torch.zeros(shape, dtype=torch.bool)
    real[:, :4] = True
    some = gradient_with_only(loss_fn, batch, real)
    lp_all, lp_some = everything["log_probs"], some["log_probs"]
    assert lp_all is not None and lp_some is not None
    assert not torch.allclose(lp_some[real], lp_all[real])


def padded(
    right: torch.Tensor, lengths: Sequence[int], width: int, side: str, fill: float
) -> torch.Tensor:
    """Right-padded ``[n, L]`` rows re-padded to ``width`` on ``side``, padding set to ``fill``
    (differentiable: the rows are gathered from ``right``)."""
    column = torch.arange(width)
    length = torch.tensor(lengths)[:, None]
    source = column - (width - length) if side == "left" else column.expand(len(lengths), -1)
    valid = (source >= 0) & (source < length)
    gathered = right.gather(1, source.clamp(0, right.shape[1] - 1))
    return torch.where(valid, gathered, torch.full((), fill, dtype=right.dtype))


@pytest.mark.parametrize("loss", sorted(LOSSES))
@fast
@given(
    lengths=rollout_shapes,
    mask_prob=mask_probs,
    mode=st.sampled_from(AGG_MODES),
    side=st.sampled_from(["left", "right"]),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_left_padding_and_wider_padding_give_the_same_loss_and_gradients(
    loss: str, lengths: list[int], mask_prob: float, mode: str, side: str, extra: int, seed: int
) -> None:
    batch, _, ctx = whole_batch(make_rollout(lengths, seed, mask_prob))
    rollout = make_rollout(lengths, seed, mask_prob)
    results = []
    for padding_side, width in (("right", max(lengths)), (side, max(lengths) + extra)):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in rollout.outputs.items()}
        outputs = {k: padded(v, lengths, width, padding_side, math.nan) for k, v in leaves.items()}
        fields = {
            str(name): padded(value, lengths, width, padding_side, 0)
            for name, value in batch.items()
        }
        value, _ = LOSSES[loss](mode)(outputs, TensorDict(fields, batch_size=[len(lengths)]), ctx)
        grads = torch.autograd.grad(value, list(leaves.values()), allow_unused=True)
        results.append((value.detach(), dict(zip(leaves, grads, strict=True))))
    (natural, natural_grads), (repadded, repadded_grads) = results
    assert_same(repadded, natural)
    assert_same_grads(repadded_grads, natural_grads)


# -- formulas --------------------------------------------------------------------------------------
@given(lengths=rollout_shapes, mask_prob=mask_probs, seed=st.integers(0, 2**16))
@fast
def test_each_aggregation_mode_matches_its_formula_on_the_whole_batch(
    lengths: list[int], mask_prob: float, seed: int
) -> None:
    batch, outputs, ctx = whole_batch(make_rollout(lengths, seed, mask_prob))
    x, m = outputs["values"].detach(), batch[RESPONSE_MASK].double()
    n = len(lengths)
    per_sequence_sum = (x * m).sum(-1)
    per_sequence_count = m.sum(-1)
    per_sequence_mean = torch.where(
        per_sequence_count > 0, per_sequence_sum / per_sequence_count.clamp(min=1), 0.0
    )
    expected = {
        "token-mean": (x * m).sum() / m.sum() if m.sum() > 0 else torch.tensor(0.0),
        "token-sum": (x * m).sum(),
        "seq-mean-token-sum": per_sequence_sum.sum() / n,
        "seq-mean-token-mean": per_sequence_mean.sum() / n,
        "seq-mean-token-sum-norm": (per_sequence_sum / HORIZON).sum() / n,
    }
    for mode in AGG_MODES:
        got = aggregate(x, m, mode, ctx, mask_key=RESPONSE_MASK, horizon=HORIZON)
        torch.testing.assert_close(got, expected[mode].double(), msg=mode)


def test_actor_loss_is_ppo_dual_clip_minus_entropy_plus_kl_token_mean() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([7, 3, 9, 5], seed=3, mask_prob=0.8))
    low, high, c, ent_coeff, kl_coeff = 0.2, 0.28, 3.0, 0.01, 0.1
    loss_fn = ActorLoss(
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        entropy_coeff=ent_coeff,
        kl_coeff=kl_coeff,
        kl_type="low_var_kl",
    )
    loss, metrics = loss_fn(outputs, batch, ctx)

    m = batch[RESPONSE_MASK].double()
    logp, ent = outputs["log_probs"].detach(), outputs["entropy"].detach()
    old, ref = batch["old_log_probs"].double(), batch["ref_log_probs"].double()
    adv = batch["advantages"].double()
    ratio = torch.exp(logp - old)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    l_clip = torch.maximum(l1, l2)
    l3 = -adv * c
    pg = torch.where(adv < 0, torch.minimum(l_clip, l3), l_clip)
    k3 = torch.clamp(torch.exp(ref - logp) - (ref - logp) - 1, -10, 10)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * m).sum() / m.sum()

    expected = mean(pg) - ent_coeff * mean(ent) + kl_coeff * mean(k3)
    torch.testing.assert_close(loss, expected)
    assert metrics["pg_loss"] == pytest.approx(float(mean(pg)))
    assert metrics["pg_clipfrac"] == pytest.approx(float(mean((l2 > l1).double())))
    assert metrics["ppo_kl"] == pytest.approx(float(mean(old - logp)))
    lower = ((l_clip > l3) & (adv < 0)).double()
    assert metrics["pg_clipfrac_lower"] == pytest.approx(float(mean(lower)))
    assert metrics["entropy"] == pytest.approx(float(mean(ent)))
    assert metrics["kl"] == pytest.approx(float(mean(k3)))
    assert 0 < metrics["pg_clipfrac"] < 1  # the data exercises the clip


def test_policy_loss_without_dual_clip_is_the_plain_clipped_surrogate() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([6, 8], seed=5, mask_prob=1.0))
    loss, metrics = ActorLoss(clip_ratio_c=None, clip_ratio_low=0.1)(outputs, batch, ctx)
    m = batch[RESPONSE_MASK].double()
    adv, old = batch["advantages"].double(), batch["old_log_probs"].double()
    ratio = torch.exp(outputs["log_probs"].detach() - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.9, 1.2))
    torch.testing.assert_close(loss, (pg * m).sum() / m.sum())
    assert metrics["pg_clipfrac_lower"] == 0.0
    assert set(metrics) == {
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "pg_clipfrac_lower",
        "entropy",
        "kl",
    }


def test_gspo_is_the_papers_sequence_level_clipped_objective_in_value_and_gradient() -> None:
    """GSPO's objective: ``mean_i max(-A_i s_i, -A_i clip(s_i))`` with the sequence ratio
    ``s_i = exp(mean_t (logp - logp_old))``, differentiated through ``s_i`` itself."""
    batch, outputs, ctx = whole_batch(make_rollout([7, 4, 9, 5, 8, 6], seed=8, mask_prob=0.9))
    m = batch[RESPONSE_MASK].double()
    assert (m.sum(-1) > 0).all()
    sequence_advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -0.2], dtype=torch.float64)
    batch["advantages"] = sequence_advantages[:, None] * m
    low, high = 0.05, 0.08
    gspo = ActorLoss(
        policy_loss="gspo",
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=None,
        loss_agg_mode="seq-mean-token-mean",
    )
    loss, metrics = gspo(outputs, batch, ctx)
    (gradient,) = torch.autograd.grad(loss, outputs["log_probs"])

    logp = outputs["log_probs"].detach().clone().requires_grad_()
    old = batch["old_log_probs"].double()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    a = sequence_advantages
    per_sequence = torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high))
    expected = per_sequence.mean()
    (expected_gradient,) = torch.autograd.grad(expected, logp)

    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(gradient, expected_gradient * m)
    clipped = (-a * torch.clamp(s, 1 - low, 1 + high) > -a * s).double()
    assert metrics["pg_clipfrac"] == pytest.approx(float((clipped[:, None] * m).sum() / m.sum()))
    assert 0 < metrics["pg_clipfrac"] < 1  # some sequences are clipped, some are not


def reinforce(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: Any,
) -> PolicyTerms:
    """A policy loss research code might register: plain REINFORCE, nothing clipped."""
    never = torch.zeros_like(mask, dtype=torch.bool)
    return PolicyTerms(per_token=-advantages * log_probs, clipped=never, clipped_lower=never)


def test_dual_clipping_is_vanillas_default_only_and_an_explicit_bound_is_always_kept() -> None:
    assert ActorLoss().clip_ratio_c == 3.0
    assert ActorLoss(policy_loss="gspo").clip_ratio_c is None
    assert ActorLoss(policy_loss="cispo").clip_ratio_c is None
    assert ActorLoss(clip_ratio_c=None).clip_ratio_c is None
    assert ActorLoss(policy_loss="gspo", clip_ratio_c=2.0).clip_ratio_c == 2.0

    try:
        register_policy_loss("plain")(reinforce)
        register_policy_loss("dual")(dual_clip_by_default(2.5)(functools.partial(reinforce)))
        assert ActorLoss(policy_loss="plain").clip_ratio_c is None
        assert ActorLoss(policy_loss="dual").clip_ratio_c == 2.5
    finally:
        POLICY_LOSSES.unregister("plain")
        POLICY_LOSSES.unregister("dual")


def test_gspo_by_default_has_no_dual_clip_and_gets_one_only_when_asked() -> None:
    rollout = make_rollout([7, 4, 9, 5, 8, 6], seed=8, mask_prob=0.9)
    batch, outputs, ctx = whole_batch(rollout)
    m = batch[RESPONSE_MASK].double()
    # sequences far above the clip range with negative advantages: where dual clipping acts
    batch["old_log_probs"] = (outputs["log_probs"].detach() - 0.5) * m
    batch["advantages"] = -torch.ones_like(m) * m
    default, default_metrics = ActorLoss(policy_loss="gspo")(outputs, batch, ctx)
    without, _ = ActorLoss(policy_loss="gspo", clip_ratio_c=None)(outputs, batch, ctx)
    dual, dual_metrics = ActorLoss(policy_loss="gspo", clip_ratio_c=1.5)(outputs, batch, ctx)
    assert torch.equal(default, without)
    assert default_metrics["pg_clipfrac_lower"] == 0.0
    torch.testing.assert_close(dual, torch.tensor(1.5, dtype=torch.float64))  # -A * c
    assert float(default) == pytest.approx(math.exp(0.5))  # -A * s, s = exp(0.5)
    assert dual_metrics["pg_clipfrac_lower"] == 1.0


def test_cispo_is_minus_the_clipped_detached_ratio_times_advantage_times_log_prob() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([7, 4, 9, 5], seed=13, mask_prob=0.9))
    low, high = 0.1, 0.15
    loss, metrics = ActorLoss(policy_loss="cispo", clip_ratio_low=low, clip_ratio_high=high)(
        outputs, batch, ctx
    )
    (gradient,) = torch.autograd.grad(loss, outputs["log_probs"])

    m = batch[RESPONSE_MASK].double()
    logp = outputs["log_probs"].detach()
    adv, old = batch["advantages"].double(), batch["old_log_probs"].double()
    ratio = torch.exp(logp - old)
    weight = torch.clamp(ratio, 1 - low, 1 + high)  # a number: no gradient flows through it
    torch.testing.assert_close(loss, (-weight * adv * logp * m).sum() / m.sum())
    torch.testing.assert_close(gradient, -weight * adv * m / m.sum())
    assert metrics["pg_clipfrac"] == pytest.approx(float(((weight != ratio) * m).sum() / m.sum()))
    assert 0 < metrics["pg_clipfrac"] < 1
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_research_code_registers_its_own_policy_loss_and_selects_it_by_name() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([5, 6], seed=3, mask_prob=1.0))
    try:
        register_policy_loss("reinforce")(reinforce)
        loss, _ = ActorLoss(policy_loss="reinforce")(outputs, batch, ctx)
        m = batch[RESPONSE_MASK].double()
        expected = (-batch["advantages"].double() * outputs["log_probs"].detach() * m).sum()
        torch.testing.assert_close(loss, expected / m.sum())
        with pytest.raises(ConfigError, match="already registered"):
            register_policy_loss("reinforce")(reinforce)
    finally:
        POLICY_LOSSES.unregister("reinforce")


def test_a_misspelt_policy_loss_is_refused_at_construction_with_the_closest_name() -> None:
    with pytest.raises(
        UnknownStrategyError, match=r"ActorLoss\.policy_loss: .*did you mean 'gspo'"
    ):
        ActorLoss(policy_loss="gpso")
    names = ("vanilla", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro")
    assert POLICY_LOSSES.names() == sorted([*names, "dppo_tv", "dppo_kl", "bypass_mode"])


def test_kl_in_the_reward_subtracts_beta_times_the_log_ratio_on_response_tokens() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.1, -9.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.7, -1.0], [-0.3, -0.4, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    penalised, kl = kl_penalized_rewards(rewards, logp.requires_grad_(), ref, mask, coeff=0.1)
    torch.testing.assert_close(kl, (logp.detach() - ref) * mask)
    torch.testing.assert_close(penalised, (rewards - 0.1 * (logp.detach() - ref)) * mask)
    assert penalised.dtype == torch.float64 and not penalised.requires_grad
    _, k3 = kl_penalized_rewards(rewards, logp, ref, mask, coeff=0.1, kind="k3")
    torch.testing.assert_close(k3, kl_penalty(logp.detach(), ref, "k3") * mask)


def test_the_adaptive_kl_controller_follows_the_ziegler_update_and_the_fixed_one_stays() -> None:
    controller = kl_controller("adaptive", 0.1, target=0.5, horizon=1000)
    expected = 0.1
    for current_kl in (0.6, 0.5, 5.0, 0.0, 0.45):
        controller.update(current_kl, n_steps=64)
        error = min(max(current_kl / 0.5 - 1, -0.2), 0.2)
        expected *= 1 + error * 64 / 1000
        assert controller.value == pytest.approx(expected, rel=1e-12)
    fixed = kl_controller("fixed", 0.1)
    fixed.update(5.0, n_steps=64)
    assert fixed.value == 0.1


def test_kl_controller_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="target and horizon"):
        kl_controller("adaptive", 0.1)
    with pytest.raises(ConfigError, match="'fixed' or 'adaptive'"):
        kl_controller("pid", 0.1)
    with pytest.raises(ConfigError, match=r"AdaptiveKLController\.target must be > 0"):
        kl_controller("adaptive", 0.1, target=0.0, horizon=10)
    with pytest.raises(ConfigError, match=r"AdaptiveKLController\.horizon \(100\) must exceed"):
        kl_controller("adaptive", 0.1, target=1.0, horizon=100).update(0.5, n_steps=500)


def test_critic_loss_is_half_the_clipped_squared_error_token_mean() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([5, 9, 4], seed=11, mask_prob=0.9))
    c = 0.2
    loss, metrics = CriticLoss(cliprange_value=c)(outputs, batch, ctx)
    m = batch[RESPONSE_MASK].double()
    v, v_old, r = outputs["values"].detach(), batch["values"].double(), batch["returns"].double()
    unclipped = (v - r) ** 2
    clipped = (torch.clamp(v, v_old - c, v_old + c) - r) ** 2

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * m).sum() / m.sum()

    torch.testing.assert_close(loss, 0.5 * mean(torch.maximum(unclipped, clipped)))
    assert metrics["vf_loss"] == pytest.approx(float(loss))
    assert metrics["vf_clipfrac"] == pytest.approx(float(mean((clipped > unclipped).double())))
    assert metrics["vpred_mean"] == pytest.approx(float(mean(v)))
    assert 0 < metrics["vf_clipfrac"] < 1


def test_value_loss_without_clipping_is_half_the_squared_error_and_needs_no_old_values() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([5, 9, 4], seed=12))
    del batch["values"]
    loss, _ = CriticLoss(cliprange_value=None, loss_agg_mode="token-sum")(outputs, batch, ctx)
    m = batch[RESPONSE_MASK].double()
    r = batch["returns"].double()
    torch.testing.assert_close(loss, 0.5 * (((outputs["values"].detach() - r) ** 2) * m).sum())
    assert "values" not in CriticLoss(cliprange_value=None).required_fields


@pytest.mark.parametrize("kind", KL_TYPES)
def test_kl_estimators_match_their_formulas(kind: str) -> None:
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -30.0, -0.2], dtype=torch.float64)
    ref = torch.tensor([-1.2, -0.5, -0.3, -3.0, -0.1, -40.0], dtype=torch.float64)
    d = logp - ref
    k3 = torch.clamp(torch.exp(-d) + d - 1, -10, 10)
    expected = {"k1": d, "k2": 0.5 * d**2, "k3": k3, "low_var_kl": k3, "abs": d.abs()}
    torch.testing.assert_close(kl_penalty(logp, ref, kind), expected[kind.rstrip("+")])


@pytest.mark.parametrize("kind", [kind for kind in KL_TYPES if kind.endswith("+")])
def test_straight_through_kl_has_its_base_estimators_value_and_k2s_gradient(kind: str) -> None:
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -30.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.2, -0.5, -0.3, -3.0, -0.1], dtype=torch.float64)
    value = kl_penalty(logp, ref, kind)
    (gradient,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(value, kl_penalty(logp, ref, kind[:-1]))
    torch.testing.assert_close(gradient, (logp - ref).detach())  # d/dlogp of 0.5 (logp - ref)^2


def test_k2_plus_is_accepted_like_the_other_straight_through_names_and_is_k2_bit_for_bit() -> None:
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -30.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.2, -0.5, -0.3, -3.0, -0.1], dtype=torch.float64)
    assert "k2+" in KL_TYPES and ActorLoss(kl_type="k2+").kl_type == "k2+"
    plus, plain = kl_penalty(logp, ref, "k2+"), kl_penalty(logp, ref, "k2")
    (plus_grad,) = torch.autograd.grad(plus.sum(), logp)
    (plain_grad,) = torch.autograd.grad(plain.sum(), logp)
    assert torch.equal(plus, plain) and torch.equal(plus_grad, plain_grad)


def test_low_var_kl_is_clamped_to_ten_and_its_gradient_stays_finite() -> None:
    logp = torch.tensor([-200.0, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -200.0, -1.0], dtype=torch.float64)
    kl = kl_penalty(logp, ref, "low_var_kl")
    kl.sum().backward()
    assert kl.tolist() == [10.0, 10.0, 0.0]
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_entropy_bonus_and_kl_loss_are_minus_mean_entropy_and_mean_kl() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([4, 7], seed=2))
    m = batch[RESPONSE_MASK].double()
    ent_loss, ent_metrics = entropy_bonus(outputs, batch, ctx)
    mean_entropy = (outputs["entropy"].detach() * m).sum() / m.sum()
    torch.testing.assert_close(ent_loss, -mean_entropy)
    assert ent_metrics == {"entropy": pytest.approx(float(mean_entropy))}
    kl, kl_metrics = kl_loss(outputs, batch, ctx, kl_type="k1")
    k1 = outputs["log_probs"].detach() - batch["ref_log_probs"].double()
    torch.testing.assert_close(kl, (k1 * m).sum() / m.sum())
    assert kl_metrics["kl"] == pytest.approx(float(kl))


def test_metrics_are_the_micro_batch_local_statistics_while_the_loss_is_its_global_share() -> None:
    rollout = make_rollout([5, 6, 7, 8], seed=9, mask_prob=1.0)
    rows = rollout.rows(range(4))
    first, _ = split_fixed(rows, 2)
    outputs = {
        k: v[first.indices, : first.attention_mask.shape[1]] for k, v in rollout.outputs.items()
    }
    ctx = LossContext(
        micro_batch_index=0,
        num_micro_batches=2,
        data_parallel_size=1,
        global_counts=global_counts(rows),
    )
    loss, metrics = CriticLoss(cliprange_value=None)(outputs, first.data, ctx)
    m = first.data[RESPONSE_MASK].double()
    local = 0.5 * (((outputs["values"] - first.data["returns"].double()) ** 2) * m).sum()
    assert metrics["vf_loss"] == pytest.approx(float(local / m.sum()))
    torch.testing.assert_close(loss, local / ctx.global_count(RESPONSE_MASK))
    assert float(loss) < metrics["vf_loss"]  # a share: this micro-batch holds 9 of 22 tokens


# -- masking ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", sorted(LOSSES))
@settings(max_examples=15, deadline=None)
@given(
    lengths=rollout_shapes,
    mode=st.sampled_from(AGG_MODES),
    split=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_nan_and_inf_in_masked_out_positions_never_reach_the_loss_or_gradients(
    loss: str, lengths: list[int], mode: str, split: int, seed: int
) -> None:
    everyone = [list(range(len(lengths)))]
    loss_fn = LOSSES[loss](mode)
    clean, clean_grads = run_ranks(loss_fn, make_rollout(lengths, seed), everyone, split)
    dirty, dirty_grads = run_ranks(
        loss_fn, make_rollout(lengths, seed, corrupt=True), everyone, split
    )
    assert torch.isfinite(dirty)
    assert_same(dirty, clean)
    for grad in dirty_grads.values():
        assert grad is None or torch.isfinite(grad).all()
    assert_same_grads(dirty_grads, clean_grads)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_an_all_zero_mask_gives_zero_loss_and_zero_gradients(loss: str, mode: str) -> None:
    rollout = make_rollout([3, 5, 1], seed=4, mask_prob=0.0, corrupt=True)
    total, grads = run_ranks(LOSSES[loss](mode), rollout, [[0, 1, 2]], 2)
    assert float(total) == 0.0
    for grad in grads.values():
        assert grad is None or not grad.any()


def test_masked_out_tokens_do_not_count_but_zero_mask_sequences_count_as_sequences() -> None:
    x = torch.tensor([[0.0, 2.0, 4.0], [0.0, 9.0, 9.0]], dtype=torch.float64)
    m = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    ctx = LossContext(
        micro_batch_index=0,
        num_micro_batches=1,
        data_parallel_size=1,
        global_counts={"loss_mask": 2.0, SEQUENCES: 2.0},
    )
    assert float(aggregate(x, m, "token-mean", ctx, mask_key="loss_mask")) == 3.0
    assert float(aggregate(x, m, "seq-mean-token-mean", ctx)) == 1.5
    assert float(aggregate(x, m, "seq-mean-token-sum", ctx)) == 3.0


# -- configuration and the loss_fn convention ------------------------------------------------------
BAD_CONFIGS = [
    (ActorLoss, "clip_ratio_low", 1.0),
    (ActorLoss, "clip_ratio_low", -0.1),
    (ActorLoss, "clip_ratio_high", -0.2),
    (ActorLoss, "clip_ratio_high", math.nan),
    (ActorLoss, "clip_ratio_high", True),
    (ActorLoss, "clip_ratio_c", 1.0),
    (ActorLoss, "clip_ratio_c", 0.5),
    (ActorLoss, "entropy_coeff", -0.01),
    (ActorLoss, "kl_coeff", math.inf),
    (ActorLoss, "kl_type", "k4"),
    (ActorLoss, "kl_type", "k2++"),
    (ActorLoss, "kl_type", "k4+"),
    (ActorLoss, "policy_loss", 3),
    (ActorLoss, "loss_agg_mode", "mean"),
    (ActorLoss, "horizon", 0),
    (ActorLoss, "horizon", 2.5),
    (ActorLoss, "mask_key", 3),
    (CriticLoss, "cliprange_value", 0.0),
    (CriticLoss, "cliprange_value", "0.5"),
    (CriticLoss, "loss_agg_mode", "token_mean"),
    (CriticLoss, "horizon", -1),
]


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    BAD_CONFIGS,
    ids=[f"{c.__name__}.{f}={v!r}" for c, f, v in BAD_CONFIGS],
)
def test_a_bad_config_value_raises_config_error_naming_the_field(
    cls: type, field: str, value: object
) -> None:
    with pytest.raises(ConfigError, match=rf"{cls.__name__}\.{field}\b"):
        cls(**{field: value})


@pytest.mark.parametrize("cls", [ActorLoss, CriticLoss])
def test_seq_mean_token_sum_norm_needs_a_horizon(cls: type) -> None:
    with pytest.raises(ConfigError, match=rf"{cls.__name__}\.horizon"):
        cls(loss_agg_mode="seq-mean-token-sum-norm")
    assert cls(loss_agg_mode="seq-mean-token-sum-norm", horizon=512).horizon == 512


def test_bad_options_raise_config_error_naming_the_option() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([4, 6], seed=1))
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        ActorLoss(clip_ratio_c=0.9)
    with pytest.raises(ConfigError, match="cliprange_value"):
        CriticLoss(cliprange_value=-1.0)
    with pytest.raises(ConfigError, match="mode"):
        aggregate(outputs["values"], batch[RESPONSE_MASK], "token_mean", ctx)
    with pytest.raises(ConfigError, match="horizon"):
        aggregate(outputs["values"], batch[RESPONSE_MASK], "seq-mean-token-sum-norm", ctx)
    with pytest.raises(ConfigError, match="mask_key"):
        aggregate(outputs["values"], batch[RESPONSE_MASK], "token-mean", ctx)
    with pytest.raises(ConfigError, match="kl type"):
        kl_penalty(outputs["log_probs"], batch["ref_log_probs"], "k9")


def test_required_fields_follow_the_configuration_and_partials() -> None:
    assert required_fields(ActorLoss()) == ("old_log_probs", "advantages")
    assert required_fields(ActorLoss(kl_coeff=0.1, mask_key="turn_mask")) == (
        "old_log_probs",
        "advantages",
        "ref_log_probs",
        "turn_mask",
    )
    assert required_fields(CriticLoss()) == ("returns", "values")
    assert required_fields(functools.partial(sft_loss)) == ()
    assert required_fields(functools.partial(ActorLoss(kl_coeff=0.1))) == (
        "old_log_probs",
        "advantages",
        "ref_log_probs",
    )
    assert required_fields(value_regression_loss) == ("returns",)
    assert required_fields(kl_loss) == ("ref_log_probs",)


def test_losses_declare_the_granularity_of_the_fields_they_read() -> None:
    assert field_granularity(ActorLoss(kl_coeff=0.1, mask_key="turn_mask")) == dict.fromkeys(
        ("old_log_probs", "advantages", "ref_log_probs", "turn_mask"), PER_TOKEN
    )
    assert field_granularity(CriticLoss()) == {"returns": PER_TOKEN, "values": PER_TOKEN}
    assert field_granularity(functools.partial(kl_loss, kl_type="k1")) == {
        "ref_log_probs": PER_TOKEN
    }
    assert field_granularity(value_regression_loss) == {"returns": PER_TOKEN}
    assert field_granularity(score_regression_loss) == {"targets": PER_SEQUENCE}
    assert field_granularity(bradley_terry_loss) == {
        "pair_id": PER_SEQUENCE,
        "chosen": PER_SEQUENCE,
    }


def test_plain_field_names_declare_no_granularity_and_a_bad_one_is_refused_by_field() -> None:
    @needs_fields("pair_id", returns=PER_TOKEN)
    def mixed(outputs: Any, batch: Any, ctx: LossContext) -> Any:
        raise AssertionError("not called")

    class Old:
        required_fields = ("returns", "scores")

    assert required_fields(mixed) == ("pair_id", "returns")
    assert field_granularity(mixed) == {"returns": PER_TOKEN}
    assert required_fields(Old()) == ("returns", "scores")
    assert field_granularity(Old()) == {}
    with pytest.raises(ConfigError, match="needs_fields: field 'returns' has granularity 'row'"):
        needs_fields(returns="row")  # type: ignore[arg-type]

    class Bad:
        required_fields: ClassVar[dict[str, str]] = {"returns": "per_token"}

    with pytest.raises(ConfigError, match=r"Bad\.required_fields: field 'returns'"):
        required_fields(Bad())


def test_a_users_own_loss_function_keeps_working_alongside_the_library() -> None:
    def my_loss(
        outputs: Mapping[str, torch.Tensor], batch: TensorDict, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        pg, pg_metrics = ActorLoss()(outputs, batch, ctx)
        vf, _ = entropy_bonus(outputs, batch, ctx)
        return pg + 0.5 * vf, {"mine": 1.0, **pg_metrics}

    assert required_fields(my_loss) == ()
    batch, outputs, ctx = whole_batch(make_rollout([4, 6], seed=1))
    loss, metrics = my_loss(outputs, batch, ctx)
    assert loss.shape == () and metrics["mine"] == 1.0 and "pg_clipfrac" in metrics


def test_the_mask_is_loss_mask_then_response_mask_or_the_named_field() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([4, 6], seed=1, mask_prob=1.0))
    only_last = torch.zeros_like(batch[RESPONSE_MASK])
    only_last[:, -1] = 1.0
    counts = {**ctx.global_counts, "loss_mask": 2.0, "last_mask": 2.0}
    narrowed = LossContext(
        micro_batch_index=0, num_micro_batches=1, data_parallel_size=1, global_counts=counts
    )
    batch_with_loss_mask = batch.clone()
    batch_with_loss_mask["loss_mask"] = only_last
    batch_with_named = batch.clone()
    batch_with_named["last_mask"] = only_last
    by_loss_mask, _ = CriticLoss()(outputs, batch_with_loss_mask, narrowed)
    by_name, _ = CriticLoss(mask_key="last_mask")(outputs, batch_with_named, narrowed)
    by_response, _ = CriticLoss()(outputs, batch_with_named, narrowed)
    torch.testing.assert_close(by_loss_mask, by_name)
    assert not torch.allclose(by_loss_mask, by_response)


def test_a_batch_without_a_loss_or_response_mask_is_a_batch_error() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([4, 6], seed=1))
    del batch[RESPONSE_MASK]
    with pytest.raises(BatchError, match="response_mask"):
        ActorLoss()(outputs, batch, ctx)


def test_entropy_coeff_without_the_heads_entropy_output_says_how_to_enable_it() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([4, 6], seed=1))
    del outputs["entropy"]
    with pytest.raises(ConfigError, match="compute_entropy"):
        ActorLoss(entropy_coeff=0.01)(outputs, batch, ctx)
    _, metrics = ActorLoss()(outputs, batch, ctx)
    assert "entropy" not in metrics


def test_sft_and_value_regression_losses_still_use_the_scored_tokens() -> None:
    batch, outputs, ctx = whole_batch(make_rollout([4, 6], seed=1))
    scored = batch["attention_mask"].double()
    scored[:, 0] = 0
    sft, _ = sft_loss(outputs, batch, ctx)
    torch.testing.assert_close(sft, -(outputs["log_probs"].detach() * scored).sum() / scored.sum())
    reg, _ = value_regression_loss(outputs, batch, ctx)
    err = (outputs["values"].detach() - batch["returns"].double()) ** 2
    torch.testing.assert_close(reg, 0.5 * (err * scored).sum() / scored.sum())
