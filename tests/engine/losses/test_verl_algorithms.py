"""The advantage estimators and policy losses named as verl names them equal verl 0.9.1's own
functions (``verl.trainer.ppo.core_algos``) on random cases: values and gradients, float32 and
float64, every aggregation mode, random masks and shuffled groups. Runs where verl is
installed (CI's verl-pins stage).

The cases keep to where the two agree by design (docs/rl.md lists where they differ): every
group has two responses or more and every row a token (verl scores a lone response, the project
gives it 0), and a response's first token is masked in (the optimal token baseline counts its
steps from there; verl from the response tensor's first column).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from engine.losses import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    RESPONSE_MASK,
    SCORED_TOKENS,
    SEQUENCES,
    ActorLoss,
    LossContext,
)
from tests.tolerances import reordered  # noqa: E402

DTYPES = [torch.float32, torch.float64]


def close(got: torch.Tensor, expected: torch.Tensor, terms: int, atol: float = 0.0) -> None:
    """Equal up to the rounding of sums of ``terms`` terms in another order (float64: 1e-7
    relative, which also covers verl's ``+1e-8`` in some denominators), or to ``atol`` where
    the caller knows a larger bound."""
    dtype = expected.dtype
    rtol = reordered(terms) if dtype == torch.float32 else 1e-7
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    atol = max(atol, rtol * scale)
    torch.testing.assert_close(got.to(dtype), expected, rtol=rtol, atol=atol)


# -- random cases ----------------------------------------------------------------------------------
@st.composite
def cases(draw: st.DrawFn, contiguous: bool = False) -> dict[str, Any]:
    """``groups`` groups of 2-4 responses in shuffled rows, responses of 1..``width`` tokens
    starting at column 0 (holes inside unless ``contiguous``), outcome or token rewards."""
    groups = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(2, 4), min_size=groups, max_size=groups))
    width = draw(st.integers(1, 7))
    dtype = draw(st.sampled_from(DTYPES))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    labels = np.array([label for label, size in enumerate(sizes) for _ in range(size)])
    order = torch.randperm(len(labels), generator=generator)
    labels = labels[order.numpy()] * 7 + 3  # arbitrary labels, rows shuffled
    rows = len(labels)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = torch.arange(width) < lengths[:, None]
    if not contiguous:
        holes = torch.rand(rows, width, generator=generator) < 0.2
        mask = mask & ~holes
        mask[:, 0] = True
    if draw(st.booleans()):  # outcome rewards: one score on the last token, few values
        last = (lengths - 1)[:, None] == torch.arange(width)
        scores = torch.randint(0, 3, (rows, 1), generator=generator).to(dtype) / 2
        rewards = torch.where(last & mask, scores, 0.0)
    else:
        rewards = torch.randn(rows, width, generator=generator, dtype=dtype) * mask
    old = -3 * torch.rand(rows, width, generator=generator, dtype=dtype)
    return {
        "rewards": rewards.to(dtype),
        "mask": mask.to(dtype),
        "labels": labels,
        "old_log_probs": old * mask,
        "sum_pi_squared": (0.05 + 0.9 * torch.rand(rows, width, generator=generator)).to(dtype),
        "rollout_is_weights": (0.5 + torch.rand(rows, width, generator=generator)).to(dtype),
        "reward_baselines": torch.randn(rows, generator=generator, dtype=dtype),
        "components": torch.randint(0, 2, (rows, 2), generator=generator).to(dtype),
    }


def ours(name: str, case: dict[str, Any], options: dict[str, Any] | None = None, **inputs: Any):  # type: ignore[no-untyped-def]
    estimator = ADVANTAGE_ESTIMATORS.create(name, options or {})
    return estimator(
        case["rewards"], case["mask"], group_ids=torch.as_tensor(case["labels"]), **inputs
    )


estimator_cases = settings(max_examples=40, deadline=None)


@pytest.mark.parametrize(
    ("name", "verl_name", "options"),
    [
        # verl's vectorised GRPO takes its statistics in float32: its float64 twin is compared
        ("grpo_vectorized", "compute_grpo_outcome_advantage", {}),
        ("grpo_vectorized", "compute_grpo_outcome_advantage", {"scale_by_std": False}),
        ("rloo_vectorized", "compute_rloo_vectorized_outcome_advantage", {}),
        ("opo", "compute_opo_outcome_advantage", {}),
        ("gpg", "compute_gpg_outcome_advantage", {}),
        ("gdpo", "compute_gdpo_outcome_advantage", {}),
    ],
)
@estimator_cases
@given(case=cases())
def test_the_group_estimators_equal_verls(
    name: str, verl_name: str, options: dict[str, Any], case: dict[str, Any]
) -> None:
    advantages, _ = ours(name, case, options)
    verl_options = {"norm_adv_by_std_in_grpo": options["scale_by_std"]} if options else {}
    expected, _ = getattr(core_algos, verl_name)(
        token_level_rewards=case["rewards"].clone(),
        response_mask=case["mask"],
        index=case["labels"],
        **verl_options,
    )
    close(advantages, expected, case["mask"].numel())


@estimator_cases
@given(case=cases(), scale=st.booleans())
def test_grpo_passk_equals_verls(case: dict[str, Any], scale: bool) -> None:
    advantages, _ = ours("grpo_passk", case, {"scale_by_std": scale})
    expected, _ = core_algos.compute_grpo_passk_outcome_advantage(
        token_level_rewards=case["rewards"].clone(),
        response_mask=case["mask"],
        index=case["labels"],
        config={"norm_adv_by_std_in_grpo": scale},
    )
    close(advantages, expected, case["mask"].numel())


@estimator_cases
@given(case=cases(contiguous=True), weights=st.sampled_from([None, [1.0, 0.5]]))
def test_gdpo_with_reward_components_equals_verls(
    case: dict[str, Any], weights: list[float] | None
) -> None:
    """verl reads each component from the batch's non-tensor fields and scores it at the
    response's last token; here they are the ``reward_components`` columns."""
    options = {} if weights is None else {"reward_weights": weights}
    advantages, _ = ours("gdpo", case, options, reward_components=case["components"])
    rows = case["mask"].shape[0]
    prompts = torch.zeros(rows, 2, dtype=torch.long)
    attention = torch.cat([torch.ones(rows, 2), case["mask"]], dim=1).long()
    config = {"gdpo_reward_keys": ["format", "accuracy"], "gdpo_reward_weights": weights}
    expected, _ = core_algos.compute_gdpo_outcome_advantage(
        token_level_rewards=case["rewards"].clone(),
        response_mask=case["mask"],
        index=case["labels"],
        config=config,
        non_tensor_batch={
            "format": case["components"][:, 0].numpy(),
            "accuracy": case["components"][:, 1].numpy(),
        },
        batch={"prompts": prompts, "attention_mask": attention},
    )
    close(advantages, expected.to(advantages.dtype), case["mask"].numel(), gdpo_atol(case, weights))


def gdpo_atol(case: dict[str, Any], weights: list[float] | None) -> float:
    """verl builds GDPO's components as float32 whatever the batch's dtype, so the weighted sum
    of their group z-scores that it whitens carries float32 rounding, and the whitening
    multiplies that by ``1 / sqrt(var + 1e-8)``: by up to 1e4 where the components cancel (0/1
    columns that complement each other in a group give a sum of 0 and a result that is verl's
    rounding, amplified). The bound: the rounding of a sum of the z-scores and the whitening's
    mean (``reordered`` of their terms) times the sum's magnitude, times that factor."""
    components, mask = case["components"].double(), case["mask"].double()
    labels = torch.as_tensor(case["labels"])
    total = torch.zeros(len(labels), dtype=torch.float64)
    for column, weight in zip(components.unbind(-1), weights or [1.0, 1.0], strict=True):
        for label in labels.unique():
            group = labels == label
            values = column[group]
            total[group] += weight * (values - values.mean()) / (values.std() + 1e-6)
    tokens = total[:, None].expand_as(mask)[mask.bool()]
    amplification = float(torch.rsqrt(tokens.var() + 1e-8)) if tokens.numel() > 1 else 1.0
    terms = int(mask.sum()) + 4 * components.shape[1]
    return reordered(terms) * max(1.0, float(tokens.abs().max())) * amplification


@estimator_cases
@given(case=cases())
def test_remax_equals_verls(case: dict[str, Any]) -> None:
    advantages, returns = ours("remax", case, reward_baselines=case["reward_baselines"])
    expected, expected_returns = core_algos.compute_remax_outcome_advantage(
        token_level_rewards=case["rewards"],
        reward_baselines=case["reward_baselines"],
        response_mask=case["mask"],
    )
    close(advantages, expected * case["mask"], case["mask"].shape[1])
    close(returns, expected_returns * case["mask"], case["mask"].shape[1])


@pytest.mark.parametrize(
    ("name", "verl_name", "contiguous"),
    [
        ("optimal_token_baseline", "compute_optimal_token_baseline_advantage", True),
        (
            "tir_optimal_token_baseline",
            "compute_multi_turn_optimal_token_baseline_advantage",
            False,
        ),
    ],
)
@estimator_cases
@given(data=st.data(), weighted=st.booleans(), zero_tail=st.booleans())
def test_the_optimal_token_baselines_equal_verls(
    name: str,
    verl_name: str,
    contiguous: bool,
    data: st.DataObject,
    weighted: bool,
    zero_tail: bool,
) -> None:
    case = data.draw(cases(contiguous=contiguous))
    inputs = {key: case[key] for key in ("old_log_probs", "sum_pi_squared")}
    if weighted:
        inputs["rollout_is_weights"] = case["rollout_is_weights"]
    options = {"handle_zero_tail": zero_tail}
    advantages, returns = ours(name, case, options, **inputs)
    expected, expected_returns = getattr(core_algos, verl_name)(
        token_level_rewards=case["rewards"],
        response_mask=case["mask"],
        index=case["labels"],
        handle_zero_tail=zero_tail,
        **inputs,
    )
    close(advantages, expected, case["mask"].numel())
    close(returns, expected_returns * case["mask"], case["mask"].shape[1])


# -- policy losses ---------------------------------------------------------------------------------
#: (name, our options, verl's PolicyLossConfig / ActorConfig settings, aggregation modes verl
#: honours: None for every mode, else the one it always uses).
POLICY_CASES: list[tuple[str, dict[str, Any], dict[str, Any], str | None]] = [
    ("vanilla", {}, {}, None),
    ("gspo", {}, {}, None),
    ("cispo", {}, {}, None),
    ("gpg", {}, {}, None),
    ("geo_mean", {}, {}, "seq-mean-token-mean"),
    ("dppo_tv", {}, {}, None),
    ("dppo_kl", {}, {}, None),
    ("bypass_mode", {}, {}, None),
    *(
        (name, options, options, forced)
        for name, options, forced in (
            ("sapo", {"tau_pos": 2.0, "tau_neg": 3.0}, "seq-mean-token-mean"),
            ("clip_cov", {"clip_cov_ratio": 0.3, "clip_cov_lb": -0.5, "clip_cov_ub": 0.5}, None),
            ("kl_cov", {"kl_cov_ratio": 0.3, "ppo_kl_coef": 0.5}, None),
            ("dro", {"dro_beta": 0.3}, None),
            ("bypass_mode", {"loss_type": "reinforce", "rollout_is": "token"}, None),
            ("bypass_mode", {"loss_type": "reinforce", "rollout_is": None}, None),
            (
                "bypass_mode",
                {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 1.5},
                None,
            ),
        )
    ),
    ("sapo", {}, {}, "seq-mean-token-mean"),  # verl's tau defaults
]
ROLLOUT_SETTINGS = ("loss_type", "rollout_is", "rollout_is_threshold")
ACTOR_SETTINGS = ("tau_pos", "tau_neg")


def verl_config(name: str, settings: dict[str, Any], mode: str, batch: dict[str, Any]) -> Any:
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    policy = {k: v for k, v in settings.items() if k not in (*ROLLOUT_SETTINGS, *ACTOR_SETTINGS)}
    rollout = {k: v for k, v in settings.items() if k in ROLLOUT_SETTINGS}
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
        policy_loss=PolicyLossConfig(
            loss_mode=name, rollout_correction=RolloutCorrectionConfig(**rollout), **policy
        ),
        **{k: v for k, v in settings.items() if k in ACTOR_SETTINGS},
    )
    config.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=int(batch["mask"].sum()),
        global_batch_size=batch["mask"].shape[0],
        loss_scale_factor=batch["mask"].shape[1],
    )
    return config


@st.composite
def policy_batches(draw: st.DrawFn) -> dict[str, Any]:
    rows, width = draw(st.integers(1, 5)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(DTYPES))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask = torch.rand(rows, width, generator=generator) < draw(st.sampled_from([0.5, 0.9, 1.0]))
    mask[0, 0] = True  # verl's losses are undefined (nan, or an error) on an empty batch
    log_probs = -2 * torch.rand(rows, width, generator=generator, dtype=dtype)
    old = log_probs + 0.3 * torch.randn(rows, width, generator=generator, dtype=dtype)
    advantages = torch.randn(rows, width, generator=generator, dtype=dtype)
    if draw(st.booleans()):  # sequence-level advantages, as GMPO's paper uses them
        advantages = advantages[:, :1].expand(rows, width).clone()
    zero = torch.zeros((), dtype=dtype)
    return {
        "mask": mask.to(dtype),
        "log_probs": torch.where(mask, log_probs, zero),
        "old": torch.where(mask, old, zero),
        "advantages": torch.where(mask, advantages, zero),
    }


def whole_batch(batch: dict[str, Any], **more: torch.Tensor) -> tuple[TensorDict, LossContext]:
    """The batch as one micro-batch (``more``: other per-token fields) and its context."""
    rows = batch["mask"].shape[0]
    fields = {"old_log_probs": batch["old"], "advantages": batch["advantages"], **more}
    data = TensorDict({**fields, RESPONSE_MASK: batch["mask"]}, batch_size=[rows])
    tokens = float(batch["mask"].sum())
    ctx = LossContext(
        micro_batch_index=0,
        num_micro_batches=1,
        data_parallel_size=1,
        global_counts={SCORED_TOKENS: tokens, SEQUENCES: float(rows), RESPONSE_MASK: tokens},
    )
    return data, ctx


def our_loss(
    name: str, options: dict[str, Any], mode: str | None, batch: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    width = batch["mask"].shape[1]
    leaf = batch["log_probs"].clone().requires_grad_()
    data, ctx = whole_batch(batch)
    settings = {} if mode is None else {"loss_agg_mode": mode}
    loss_fn = ActorLoss(
        policy_loss=name,
        policy_options=options,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        horizon=width,
        **settings,
    )
    loss, metrics = loss_fn({"log_probs": leaf}, data, ctx)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), metrics, grad


@pytest.mark.parametrize(
    ("name", "options", "settings", "forced"),
    POLICY_CASES,
    ids=[f"{case[0]}-{index}" for index, case in enumerate(POLICY_CASES)],
)
@settings(max_examples=30, deadline=None)
@given(batch=policy_batches(), mode=st.sampled_from(AGG_MODES), seed=st.integers(0, 2**16))
def test_the_policy_losses_equal_verls_in_value_gradient_and_metrics(
    name: str,
    options: dict[str, Any],
    settings: dict[str, Any],
    forced: str | None,
    batch: dict[str, Any],
    mode: str,
    seed: int,
) -> None:
    """One micro-batch holding the whole batch: verl's normalisation by the global batch
    (``global_batch_info``) then equals the engine's global counts."""
    mode = forced or mode
    torch.manual_seed(seed)  # Clip-Cov's draw, the same for both
    loss, metrics, grad = our_loss(name, options, None if forced else mode, batch)
    leaf = batch["log_probs"].clone().requires_grad_()
    torch.manual_seed(seed)
    expected, verl_metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=batch["old"],
        log_prob=leaf,
        advantages=batch["advantages"],
        response_mask=batch["mask"],
        loss_agg_mode=mode,
        config=verl_config(name, settings, mode, batch),
    )
    (expected_grad,) = torch.autograd.grad(expected, leaf, allow_unused=True)
    terms = batch["mask"].numel()
    close(loss, expected.detach(), terms)
    close(grad, torch.zeros_like(grad) if expected_grad is None else expected_grad, terms)
    for metric in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        if f"actor/{metric}" in verl_metrics:
            got = torch.as_tensor(float(metrics[metric]), dtype=torch.float64)
            close(
                got,
                torch.tensor(float(verl_metrics[f"actor/{metric}"]), dtype=torch.float64),
                terms,
            )


def test_precomputed_rollout_weights_equal_verls_weighted_loss() -> None:
    """verl's trainer hands ``rollout_is_weights`` to its loss; the batch field does the same."""
    generator = torch.Generator().manual_seed(5)
    rows, width = 4, 6
    mask = (torch.rand(rows, width, generator=generator) < 0.7).double()
    batch = {
        "mask": mask,
        "log_probs": -2 * torch.rand(rows, width, generator=generator, dtype=torch.float64) * mask,
        "old": -2 * torch.rand(rows, width, generator=generator, dtype=torch.float64) * mask,
        "advantages": torch.randn(rows, width, generator=generator, dtype=torch.float64) * mask,
    }
    weights = 0.5 + torch.rand(rows, width, generator=generator, dtype=torch.float64)
    mode = "token-mean"
    leaf = batch["log_probs"].clone().requires_grad_()
    expected, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=batch["old"],
        log_prob=leaf,
        advantages=batch["advantages"],
        response_mask=batch["mask"],
        loss_agg_mode=mode,
        config=verl_config("vanilla", {}, mode, batch),
        rollout_is_weights=weights,
    )
    data, ctx = whole_batch(batch, rollout_is_weights=weights)
    got, metrics = ActorLoss(clip_ratio_high=0.28)({"log_probs": leaf.detach()}, data, ctx)
    close(got, expected.detach(), batch["mask"].numel())
    assert "rollout_is_mean" in metrics
