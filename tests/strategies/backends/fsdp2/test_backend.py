"""FSDP2 backend: what it refuses, its weights and schedule, its options (activation
checkpointing, resharding, bf16), padding independence, failure and non-finite steps, offload
and Hugging Face export."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.data.batching import to_padded
from engine.losses import sft_loss, value_regression_loss
from heads.errors import ConfigError, EngineStateError
from strategies.backends.fsdp2.model import REPLICATED_INIT_NAME
from strategies.model.weight_draws import normal_from_name
from tests.factories import random_batch, tiny_model

LOSSES = {"lm": sft_loss, "value": value_regression_loss}
BATCHES = [random_batch([5, 9, 3, 12], 64, seed=step) for step in range(4)]


def build(head_name: str = "lm", **config: Any) -> Engine:
    settings = {"model": tiny_model(), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}, **config}
    engine = Engine.build(head=head_name, backend="fsdp2", device="cpu", config=settings)
    return engine.initialize()


def train(engine: Engine, head: str = "lm", steps: int = 3) -> list[float]:
    return [engine.train_batch(BATCHES[step], LOSSES[head])["loss"] for step in range(steps)]


def weights(engine: Engine) -> dict[str, torch.Tensor]:
    return dict(engine.get_per_tensor_param())


def max_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max(float((first[name] - second[name]).abs().max()) for name in first)


# -- what it refuses ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parallel", "field"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"virtual_pipeline_parallel_size": 2}, "virtual_pipeline_parallel_size=2"),
        ({"context_parallel_size": 2}, "context_parallel_size=2"),
        ({"expert_parallel_size": 2}, "expert_parallel_size=2"),
        ({"sequence_parallel": True}, "sequence_parallel=True"),
    ],
)
def test_model_parallel_settings_are_refused_naming_the_field_before_any_process_group(
    monkeypatch: pytest.MonkeyPatch, parallel: dict[str, Any], field: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(
        "torch.distributed.init_process_group",
        lambda *a, **k: pytest.fail("a process group was created"),
    )
    with pytest.raises(ConfigError, match=rf"ParallelConfig\.{field}: the fsdp2 backend"):
        Engine.build(head="lm", backend="fsdp2", device="cpu", config={"parallel": parallel})


def test_a_replicate_size_that_does_not_divide_the_world_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"replicate_size \(2\) must divide the world size 3"):
        Engine.build(head="lm", backend="fsdp2", config={"backend": {"replicate_size": 2}})


@pytest.mark.parametrize(
    ("world", "backend", "model", "message"),
    [
        (3, {"ulysses_size": 2}, {}, r"ulysses_size \(2\) must divide the world size 3"),
        (
            4,
            {"ulysses_size": 4},
            {"num_attention_heads": 6, "num_query_groups": 2, "hidden_size": 48},
            r"num_attention_heads \(6\) must be divisible by ulysses_size \(4\)",
        ),
        (
            4,
            {"ulysses_size": 4},
            {"num_attention_heads": 12, "num_query_groups": 6, "hidden_size": 48},
            r"num_query_groups \(6\) must be a multiple or a divisor of ulysses_size \(4\)",
        ),
        (
            2,
            {"ulysses_size": 2, "attention": "eager"},
            {},
            r"ulysses_size=2 needs attention='sdpa'",
        ),
    ],
)
def test_a_ulysses_layout_the_model_cannot_take_is_refused_naming_the_sizes(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    backend: dict[str, Any],
    model: dict[str, Any],
    message: str,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    config = {"model": tiny_model(**model), "backend": backend}
    with pytest.raises(ConfigError, match=message):
        Engine.build(head="lm", backend="fsdp2", config=config)


def test_a_torch_without_the_fsdp2_calls_it_makes_is_refused_naming_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    with pytest.raises(ConfigError, match=r"needs torch >= 2.8 .* this is torch 2.7.1\+cpu"):
        Engine.build(head="lm", backend="fsdp2", device="cpu")


def test_unknown_backend_options_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="use_distributed_optimizer"):
        Engine.build(backend="fsdp2", config={"backend": {"use_distributed_optimizer": True}})


def test_no_platform_contributes_to_an_fsdp2_mesh() -> None:
    """FSDP2 runs on each platform's process-group backend as it is: neither the CPU layer
    (megatron's) nor MindSpeed's repatch (megatron's) applies to it."""
    from engine.registry import DEVICES

    for name in DEVICES.names():
        assert DEVICES.create(name).mesh_init_steps("fsdp2") == ()


# -- weights and schedule ----------------------------------------------------------------------
def test_weights_are_drawn_from_the_seed_and_their_name(fresh_mesh: None) -> None:
    model = tiny_model()
    lm, critic = build(seed=7), build("value", seed=7)
    drawn = weights(lm)
    std = 0.02
    assert torch.equal(
        drawn["model.layers.1.self_attn.q_proj.weight"],
        normal_from_name((32, 32), std, 7, "model.layers.1.self_attn.q_proj.weight"),
    )
    scaled = std / math.sqrt(2 * model["num_layers"])
    assert torch.equal(
        drawn["model.layers.0.mlp.down_proj.weight"],
        normal_from_name((32, 64), scaled, 7, "model.layers.0.mlp.down_proj.weight"),
    )
    assert torch.equal(drawn["model.norm.weight"], torch.ones(32))
    value = weights(critic)["score.weight"]
    assert torch.equal(value, normal_from_name((1, 32), std, 7, REPLICATED_INIT_NAME))
    megatron = Engine.build(
        head="value", backend="megatron", device="cpu", config={"model": model, "seed": 7}
    ).initialize()
    assert torch.equal(value, dict(megatron.get_per_tensor_param())["score.weight"])


def test_an_lm_ties_its_output_layer_when_asked_and_a_value_model_never_does() -> None:
    model = {**tiny_model(), "tie_embeddings": True}
    actor, critic = build(model=model), build("value", model=model)
    assert "lm_head.weight" not in weights(actor)
    lm = actor.backend.modules()[0]
    assert lm.get_parameter("lm_head.weight") is lm.get_parameter("model.embed_tokens.weight")
    assert weights(critic)["score.weight"].shape == (1, 32)


def test_norms_and_biases_get_no_weight_decay() -> None:
    engine = build(model={**tiny_model(), "add_qkv_bias": True})
    model = engine.backend.modules()[0]
    names = {id(param): name for name, param in model.named_parameters()}
    optimizer: Any = engine.backend._optimizer
    decayed, exempt = ({names[id(p)] for p in group["params"]} for group in optimizer.param_groups)
    assert all(name.endswith(".bias") or "norm" in name for name in exempt)
    assert any(name.endswith(".bias") for name in exempt)
    assert not any(name.endswith(".bias") or "norm" in name for name in decayed)


@settings(max_examples=25, deadline=None)
@given(
    warmup=st.integers(0, 5),
    decay=st.integers(1, 12),
    style=st.sampled_from(["constant", "linear", "cosine"]),
    min_lr=st.sampled_from([0.0, 1e-5]),
)
def test_the_lr_schedule_is_megatrons(warmup: int, decay: int, style: str, min_lr: float) -> None:
    """Every step's learning rate and weight decay equal megatron's OptimizerParamScheduler's."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from strategies.backends.fsdp2.optimizer import LRSchedule
    from strategies.part_configs import OptimizerConfig, SchedulerConfig

    config: Any = type("Config", (), {})()
    config.optimizer = OptimizerConfig(lr=1e-3, min_lr=min_lr, weight_decay=0.1)
    config.scheduler = SchedulerConfig(
        warmup_steps=warmup, decay_style=style, decay_steps=warmup + decay
    )
    config.total_steps = 100
    param = torch.nn.Parameter(torch.zeros(2))
    ours_optimizer = torch.optim.AdamW([{"params": [param], "wd_mult": 0.0}])
    theirs_optimizer = torch.optim.AdamW([{"params": [param], "wd_mult": 0.0}])
    ours = LRSchedule.from_config(config, ours_optimizer)
    theirs = OptimizerParamScheduler(
        theirs_optimizer,
        init_lr=0.0 if warmup else 1e-3,
        max_lr=1e-3,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=warmup + decay,
        lr_decay_style=style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=warmup + decay,
        wd_incr_style="constant",
    )
    for _ in range(warmup + decay + 3):
        assert ours_optimizer.param_groups[0]["lr"] == theirs_optimizer.param_groups[0]["lr"]
        assert ours_optimizer.param_groups[0]["weight_decay"] == 0.0
        ours.step(1)
        theirs.step(increment=1)


def test_train_batch_reports_the_lr_it_used_and_the_unclipped_grad_norm() -> None:
    engine = build(
        "value", optimizer={"lr": 1e-3, "clip_grad": 1e-6}, scheduler={"warmup_steps": 4}
    )
    used = [engine.train_batch(BATCHES[0], value_regression_loss) for _ in range(3)]
    assert [m["lr"] for m in used] == pytest.approx([0.0, 2.5e-4, 5e-4])
    assert used[1]["grad_norm"] > 1e-3


def test_a_clipped_step_leaves_the_weights_torchs_clip_grad_norm_leaves() -> None:
    """The step reuses the gradient norm the non-finite guard measured; ``clip_grad_norm_``
    measures it again. Same norm, same clipped weights, bit for bit."""
    config: dict[str, Any] = {"optimizer": {"lr": 1e-2, "clip_grad": 0.05}}
    ours = build(**config)
    grad_norm = ours.train_batch(BATCHES[0], sft_loss)["grad_norm"]
    theirs = build(**config)
    theirs.forward_backward_batch(BATCHES[0], sft_loss)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs.backend.modules()[0].parameters(), 0.05)
    theirs.backend._optimizer.step()
    assert grad_norm == float(their_norm) > 0.05  # the clip engaged
    assert max_diff(weights(ours), weights(theirs)) == 0.0


# -- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [{"activation_checkpointing": True}, {"reshard_after_forward": False}, {"attention": "eager"}],
    ids=["activation-checkpointing", "no-reshard-after-forward", "eager-attention"],
)
def test_memory_and_attention_options_train_like_the_defaults(options: dict[str, Any]) -> None:
    plain, varied = build(), build(backend=options)
    assert train(varied) == pytest.approx(train(plain), rel=1e-6, abs=1e-7)
    assert max_diff(weights(varied), weights(plain)) <= 1e-5


def test_bfloat16_engines_train_keep_float32_master_weights_and_return_float32() -> None:
    engine = build("value", dtype="bfloat16")
    losses = train(engine, "value", steps=4)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in engine.backend.modules()[0].parameters())
    assert engine.infer_batch(BATCHES[0])["values"].dtype == torch.float32


def test_cpu_offload_policy_trains_and_exports_bit_exactly() -> None:
    """FSDP2's CPU offload policy moves where the shards live, not a number: on the CPU
    platform (host memory is the device's) the losses, norms, outputs and exported weights of
    an offloaded engine equal the plain one's exactly."""
    plain, offloaded = build(), build(backend={"cpu_offload": True})
    results = [
        [engine.train_batch(batch, sft_loss) for batch in BATCHES[:3]]
        for engine in (plain, offloaded)
    ]
    for name in ("loss", "grad_norm"):
        assert [r[name] for r in results[1]] == [r[name] for r in results[0]], name
    assert max_diff(weights(offloaded), weights(plain)) == 0.0
    torch.testing.assert_close(
        offloaded.infer_batch(BATCHES[3])["log_probs"].values(),
        plain.infer_batch(BATCHES[3])["log_probs"].values(),
        atol=0.0,
        rtol=0.0,
    )


@pytest.mark.parametrize("head", ["lm", "value"])
def test_bfloat16_weights_halve_the_model_and_give_bfloat16_compute_its_numbers(head: str) -> None:
    """``weights_dtype="bfloat16"`` keeps the weights (and AdamW's step on them) in bf16: half
    the bytes. A forward-only engine's outputs under bf16 compute equal those of float32 weights
    cast to bf16 for compute exactly (the same rounding of the same drawn weights); training
    changes the bf16 weights and learns."""
    key = "log_probs" if head == "lm" else "values"
    master = build(head, dtype="bfloat16", forward_only=True)
    half = build(head, dtype="bfloat16", forward_only=True, backend={"weights_dtype": "bfloat16"})
    params = [list(engine.backend.modules()[0].parameters()) for engine in (master, half)]
    assert {p.dtype for p in params[1]} == {torch.bfloat16}
    sizes = [sum(p.to_local().untyped_storage().nbytes() for p in ps) for ps in params]
    assert sizes[1] * 2 == sizes[0]
    expected, got = (engine.infer_batch(BATCHES[0])[key] for engine in (master, half))
    assert torch.equal(
        got.values() if got.is_nested else got,
        expected.values() if expected.is_nested else expected,
    )

    trained = build(head, dtype="bfloat16", backend={"weights_dtype": "bfloat16"})
    before = weights(trained)
    losses = train(trained, head, steps=4)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    after = weights(trained)
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    assert max_diff(after, before) > 0.0


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=6),
    side=st.sampled_from(["left", "right"]),
    seed=st.integers(0, 1000),
)
def test_outputs_do_not_depend_on_padding_side_micro_batch_size_or_token_budget(
    split_engines: dict[str, list[Engine]], lengths: list[int], side: str, seed: int
) -> None:
    """A sequence's outputs are the same however it is padded or grouped with others."""
    batch = random_batch(lengths, 64, seed=seed)
    for engines in split_engines.values():
        reference = engines[0].infer_batch(batch)
        for engine in engines:
            for given_batch in (batch, to_padded(batch, side=side)):
                got = engine.infer_batch(given_batch)
                for key in reference.keys():
                    expected, found = reference[key], got[key]
                    if expected.is_nested:
                        expected, found = expected.values(), found.values()
                    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def split_engines() -> dict[str, list[Engine]]:
    """Per head: engines with the same weights that split batches differently."""
    layouts = [
        {"micro_batch_size": 1},
        {"micro_batch_size": 4},
        {"max_tokens_per_micro_batch": 24},
    ]
    return {
        head: [
            build(head, seed=11, forward_only=True, head=options, **layout) for layout in layouts
        ]
        for head, options in (("lm", {"compute_entropy": True}), ("value", {}), ("reward", {}))
    }


# -- failures ----------------------------------------------------------------------------------
def test_a_step_that_fails_midway_leaves_no_gradient_for_the_next() -> None:
    clean, failed = build(), build()
    calls = []

    def fail_on_the_second_micro_batch(outputs: Any, batch: Any, ctx: Any) -> Any:
        calls.append(ctx.micro_batch_index)
        if ctx.micro_batch_index == 1:
            raise RuntimeError("loss exploded")
        return sft_loss(outputs, batch, ctx)

    with pytest.raises(RuntimeError, match="loss exploded"):
        failed.train_batch(BATCHES[0], fail_on_the_second_micro_batch)
    assert calls == [0, 1]  # the first micro-batch's backward ran, unreduced
    assert failed.train_batch(BATCHES[1], sft_loss)["loss"] == pytest.approx(
        clean.train_batch(BATCHES[1], sft_loss)["loss"]
    )
    assert max_diff(weights(failed), weights(clean)) == 0.0


def test_a_non_finite_gradient_norm_skips_the_step() -> None:
    engine = build()
    before = weights(engine)

    def nan_loss(outputs: Any, batch: Any, ctx: Any) -> Any:
        loss, metrics = sft_loss(outputs, batch, ctx)
        return loss * float("nan"), metrics

    assert math.isnan(engine.train_batch(BATCHES[0], nan_loss)["grad_norm"])
    assert max_diff(weights(engine), before) == 0.0
    assert math.isfinite(engine.train_batch(BATCHES[0], sft_loss)["loss"])


def test_a_forward_only_engine_builds_no_optimizer_and_keeps_its_weights() -> None:
    reference = build(forward_only=True)
    before = weights(reference)
    reference.infer_batch(BATCHES[0])
    assert max_diff(weights(reference), before) == 0.0
    with pytest.raises(EngineStateError, match="forward-only"):
        reference.train_batch(BATCHES[0], sft_loss)


# -- offload -----------------------------------------------------------------------------------
def device_bytes(engine: Engine) -> dict[str, int]:
    """Bytes of this rank's shards of the weights, gradients and Adam moments."""
    backend: Any = engine.backend
    model = backend.modules()[0]
    parts = {
        "model": [p.to_local() for p in model.parameters()],
        "grad": [p.grad.to_local() for p in model.parameters() if p.grad is not None],
        "optimizer": [
            v.to_local()
            for state in backend._optimizer.state.values()
            for v in state.values()
            if v.dim()
        ],
    }
    return {
        name: sum(t.untyped_storage().nbytes() for t in tensors) for name, tensors in parts.items()
    }


@pytest.mark.parametrize("head", ["lm", "value"])
def test_offloading_everything_frees_the_shards_and_training_continues_bit_exactly(
    head: str,
) -> None:
    expected = train(build(head), head, steps=4)
    engine = build(head)
    losses = train(engine, head, steps=2)  # leaves its gradients (no train_mode to zero them)
    before = device_bytes(engine)
    assert all(size > 0 for size in before.values())
    engine.to("cpu")
    assert device_bytes(engine) == {"model": 0, "grad": 0, "optimizer": 0}
    assert engine.backend.offloaded() == {"model", "optimizer", "grad"}
    engine.to("device")
    assert device_bytes(engine) == before
    losses += [engine.train_batch(BATCHES[step], LOSSES[head])["loss"] for step in (2, 3)]
    assert losses == expected


def test_offloading_only_the_optimizer_keeps_the_model_usable() -> None:
    engine = build()
    train(engine, steps=1)
    engine.to("cpu", model=False, grad=False)
    assert device_bytes(engine)["optimizer"] == 0 and device_bytes(engine)["model"] > 0
    assert engine.infer_batch(BATCHES[1]) is not None
    with pytest.raises(EngineStateError, match="optimizer on the device, but it is offloaded"):
        engine.train_batch(BATCHES[1], sft_loss)
    engine.to("device", model=False, grad=False)
    assert engine.train_batch(BATCHES[1], sft_loss)["loss"] > 0


def test_configured_offload_happens_on_leaving_train_and_eval_mode() -> None:
    engine = build("value", offload={"model": True, "optimizer": True, "grad": True})
    with engine.train_mode():
        assert engine.backend.offloaded() == frozenset()
        engine.train_batch(BATCHES[0], value_regression_loss)
    assert engine.backend.offloaded() == {"model", "optimizer", "grad"}
    with pytest.raises(EngineStateError, match="offloaded"):
        engine.infer_batch(BATCHES[0])
    with engine.eval_mode():
        assert engine.backend.offloaded() == {"optimizer", "grad"}
        assert engine.infer_batch(BATCHES[0])["values"].shape[0] == 4


# -- Hugging Face export -----------------------------------------------------------------------
def test_save_hf_writes_a_checkpoint_transformers_loads_with_the_same_log_probs(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    engine = build(model={**tiny_model(), "add_qkv_bias": True, "tie_embeddings": True})
    train(engine, steps=2)
    engine.save_hf(tmp_path / "saved")
    assert not (tmp_path / "saved.saving").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", local_files_only=True)
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"
    batch = BATCHES[3]
    ours = engine.infer_batch(batch)["log_probs"]
    with torch.no_grad():
        for row, expected in zip(batch["input_ids"].unbind(), ours.unbind(), strict=True):
            logits = reloaded(row[None]).logits[0, :-1].float()
            theirs = torch.log_softmax(logits, -1).gather(1, row[1:, None])[:, 0]
            torch.testing.assert_close(theirs, expected[1:], atol=1e-5, rtol=0)
    exported = weights(engine)
    state = reloaded.state_dict()
    assert set(exported) == set(state) - {"lm_head.weight"}  # tied: saved once
    assert all(torch.equal(exported[name], state[name]) for name in exported)


def test_exported_tensors_are_copies_one_at_a_time() -> None:
    engine = build("value")
    pairs = engine.get_per_tensor_param()
    name, tensor = next(pairs)
    assert name == "model.embed_tokens.weight"
    tensor.zero_()
    assert float(weights(engine)["model.embed_tokens.weight"].abs().sum()) > 0
    assert list(weights(engine))[-1] == "score.weight"


def test_after_inference_every_parameter_rests_sharded() -> None:
    """FSDP2 keeps the root's parameters gathered after a forward, for the backward that
    follows; after inference none follows, so the engine shards them again (a rank holds its
    shards only at rest, and verl's save and restore of the old policy reads them as shards)."""
    from torch.distributed.tensor import DTensor

    engine = build("lm")
    model = engine.backend.modules()[0]
    engine.infer_batch(BATCHES[0])
    gathered = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not gathered
    train(engine, steps=1)  # and training goes on from there
    assert all(isinstance(p, DTensor) for p in model.parameters())
