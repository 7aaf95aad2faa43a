"""Sequence packing: a packed micro-batch (its sequences back to back in one row) gives what
right-padded micro-batches give -- every head's outputs, the loss and the gradients -- whatever
the length mix, micro-batch size, token budget or padding side; backends without the ability
refuse it by name.

Multi-process layouts (TP=2, PP=2, DP=2) are in ``test_packing_parallel.py``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from engine import Engine
from engine.data.batching import from_token_lists, jagged, split_into, to_padded
from engine.losses import LossFn
from heads.base import HeadContext, at_last_token, shift_to_scored_token
from heads.errors import ConfigError
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import raise_outputs_loss, random_batch, tiny_model

VOCAB = 64
HEADS = {"lm": {"compute_entropy": True}, "value": {}, "reward": {}}
#: Same seed, so the same weights; only how batches are cut and laid out differs.
LAYOUTS: dict[str, dict[str, Any]] = {
    "padded": {"micro_batch_size": 1},
    "packed-3": {"packing": True, "micro_batch_size": 3},
    "packed-budget-24": {"packing": True, "max_tokens_per_micro_batch": 24},
    "packed-budget-50": {"packing": True, "max_tokens_per_micro_batch": 50},
}


def build(head: str, **layout: Any) -> Engine:
    config = {
        "model": tiny_model(num_query_groups=2),
        "seed": 5,
        "optimizer": {"lr": 1e-3},
        "head": HEADS[head],
        **layout,
    }
    return Engine.build(head=head, device="cpu", config=config).initialize()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[tuple[str, str], Engine]]:
    destroy_mesh()
    yield {
        (head, name): build(head, **layout) for head in HEADS for name, layout in LAYOUTS.items()
    }
    destroy_mesh()


def gradients(engine: Engine) -> dict[str, torch.Tensor]:
    """Each parameter's accumulated gradient (megatron keeps it in ``main_grad``; FSDP2's
    shards are gathered whole: collective)."""
    from torch.distributed.tensor import DTensor

    found = {}
    for index, module in enumerate(engine.backend.modules()):
        for name, param in module.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            found[f"{index}.{name}"] = grad.detach().clone()
    return found


def loss_and_gradients(
    engine: Engine, batch: TensorDict, loss_fn: LossFn = raise_outputs_loss
) -> tuple[float, dict[str, torch.Tensor]]:
    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward_batch(batch, loss_fn, return_outputs=False)
        grads = gradients(engine)
        engine.optimizer_zero_grad()
    return sum(result["loss"]), grads


def flat(values: torch.Tensor) -> torch.Tensor:
    return values.values() if values.is_nested else values


lengths_mixes = st.lists(st.integers(1, 24), min_size=1, max_size=9)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lengths=lengths_mixes, side=st.sampled_from(["left", "right"]), seed=st.integers(0, 999))
@pytest.mark.parametrize("head", list(HEADS))
def test_packed_outputs_equal_padded_ones_for_every_layout_and_padding_side(
    engines: dict[tuple[str, str], Engine], head: str, lengths: list[int], side: str, seed: int
) -> None:
    """Property: outputs do not depend on packing, micro-batch size, budget or padding side."""
    assert_outputs_match_padded(engines, head, random_batch(lengths, VOCAB, seed=seed), side)


def assert_outputs_match_padded(
    engines: dict[tuple[str, str], Engine], head: str, batch: TensorDict, side: str
) -> None:
    """Each engine of ``head`` gives the ``"padded"`` one's outputs for ``batch``, jagged and
    padded on ``side``, within 1e-5."""
    reference = engines[head, "padded"].infer_batch(batch)
    for (of_head, name), engine in engines.items():
        if of_head != head:
            continue
        for given_batch in (batch, to_padded(batch, side=side)):
            outputs = engine.infer_batch(given_batch)
            assert set(outputs.keys()) == set(reference.keys())
            for key in reference.keys():
                torch.testing.assert_close(
                    flat(outputs[key]), flat(reference[key]), rtol=1e-5, atol=1e-5, msg=name
                )


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lengths=st.lists(st.integers(2, 24), min_size=1, max_size=9), seed=st.integers(0, 999))
@pytest.mark.parametrize("head", list(HEADS))
def test_packed_loss_and_gradients_equal_padded_ones(
    engines: dict[tuple[str, str], Engine], head: str, lengths: list[int], seed: int
) -> None:
    assert_loss_and_gradients_match_padded(engines, head, random_batch(lengths, VOCAB, seed=seed))


def assert_loss_and_gradients_match_padded(
    engines: dict[tuple[str, str], Engine], head: str, batch: TensorDict
) -> None:
    """Each engine of ``head`` gives the ``"padded"`` one's loss and gradients for ``batch``,
    within 1e-5."""
    loss, grads = loss_and_gradients(engines[head, "padded"], batch)
    assert any(bool(g.abs().sum() > 0) for g in grads.values())
    for (of_head, name), engine in engines.items():
        if of_head != head:
            continue
        packed_loss, packed_grads = loss_and_gradients(engine, batch)
        assert packed_loss == pytest.approx(loss, rel=1e-5, abs=1e-5), name
        for key, grad in grads.items():
            torch.testing.assert_close(packed_grads[key], grad, rtol=1e-5, atol=1e-5, msg=key)


def test_a_budget_that_splits_the_batch_unevenly_still_matches(
    engines: dict[tuple[str, str], Engine],
) -> None:
    lengths = [23, 1, 20, 2, 19, 24, 3, 7, 11]  # budget 24: a full row next to mostly-empty ones
    batch = random_batch(lengths, VOCAB, seed=3)
    engine = engines["lm", "packed-budget-24"]
    plan = engine.plan_micro_batches(batch)
    assert plan.packed and plan.max_load <= 24 and len(set(plan.tokens)) > 1
    expected = engines["lm", "padded"].infer_batch(batch)["log_probs"]
    torch.testing.assert_close(
        flat(engine.infer_batch(batch)["log_probs"]), flat(expected), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("side", ["jagged", "left", "right"])
def test_int32_token_ids_give_what_int64_ones_give(
    engines: dict[tuple[str, str], Engine], side: str
) -> None:
    """validate_batch accepts int32 ids; every layout hands the head and the model int64 ones."""
    batch = random_batch([5, 1, 12, 7], VOCAB, seed=4)
    narrow = batch.clone()
    narrow["input_ids"] = jagged([row.int() for row in batch["input_ids"].unbind()])
    if side != "jagged":
        narrow = to_padded(narrow, side=side)
    for name in ("padded", "packed-3"):
        expected = engines["lm", name].infer_batch(batch)
        outputs = engines["lm", name].infer_batch(narrow)
        for key in expected.keys():
            torch.testing.assert_close(flat(outputs[key]), flat(expected[key]), msg=name)


def test_packed_training_steps_follow_padded_ones() -> None:
    destroy_mesh()
    runs = {}
    for name in ("padded", "packed-budget-50"):
        engine = build("value", **LAYOUTS[name])
        batch = random_batch([5, 17, 9, 12, 2, 20], VOCAB, seed=1)
        with engine.train_mode():
            runs[name] = [engine.train_batch(batch, raise_outputs_loss)["loss"] for _ in range(3)]
    assert runs["packed-budget-50"] == pytest.approx(runs["padded"], rel=1e-5, abs=1e-6)
    destroy_mesh()


# --------------------------------------------------------------------------- the packed layout


def test_a_packed_micro_batch_is_one_row_with_its_sequences_back_to_back() -> None:
    batch = from_token_lists([[1, 2, 3], [4], [5, 6]], loss_mask=[[0, 1, 1], [0], [0, 1]])
    (micro_batch,) = split_into(batch, [[0, 1, 2]], packed=True)
    assert micro_batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert micro_batch.cu_seqlens is not None and micro_batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    # loss functions still see right-padded rows
    assert micro_batch.data["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    row = torch.arange(1.0, 7.0)[None]
    assert micro_batch.unpack(row).tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]


def test_the_shift_and_the_last_token_respect_sequence_boundaries() -> None:
    ctx = HeadContext(cu_seqlens=torch.tensor([0, 3, 4, 6]))
    row = torch.arange(1.0, 7.0)[None]
    # each sequence's first token scores 0: nothing carries over from the previous sequence
    assert shift_to_scored_token(row, ctx).tolist() == [[0, 1, 2, 0, 0, 5]]
    assert at_last_token(row, ctx).tolist() == [3, 4, 6]


def test_a_head_that_ignores_the_packed_layout_is_refused_naming_it() -> None:
    from tests.test_plugins import RunningMeanHead

    destroy_mesh()
    engine = Engine.build(
        head=RunningMeanHead(),
        device="cpu",
        config={"model": tiny_model(), "packing": True, "micro_batch_size": 4},
    ).initialize()
    with pytest.raises(ConfigError, match=r"'plugin-running-mean'.*first position"):
        engine.infer_batch(random_batch([4, 6, 3], VOCAB))
    destroy_mesh()


@pytest.fixture
def megatron_state() -> Iterator[Engine]:
    """Megatron's process-global state on the CPU (an engine sets it up), torn down after."""
    destroy_mesh()
    yield build("value")
    destroy_mesh()


def packed_attention(engine: Engine, mask: str = "causal", **overrides: Any) -> Any:
    """Layer 1's packed core attention for ``engine``'s model (megatron config ``overrides``)."""
    from megatron.core.transformer.enums import AttnMaskType

    from strategies.backends.megatron.attention import packed_dot_product_attention
    from strategies.backends.megatron.model import transformer_config

    return packed_dot_product_attention()(
        config=transformer_config(engine.config, overrides),
        layer_number=1,
        attn_mask_type=AttnMaskType[mask],
        attention_type="self",
    )


def thd_params(bounds: list[int]) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = torch.tensor(bounds, dtype=torch.int32)
    longest = int(offsets.diff().max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=offsets,
        cu_seqlens_kv=offsets,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def test_packed_attention_attends_within_each_sequence_only(megatron_state: Engine) -> None:
    """Megatron's local core attention with packed input equals causal attention run on each
    sequence alone (grouped-query heads included)."""
    attention = packed_attention(megatron_state)
    bounds = [0, 5, 6, 13]
    generator = torch.Generator().manual_seed(0)
    heads, groups, dim = 4, 2, 8
    query = torch.randn(13, heads, dim, generator=generator)
    key, value = (torch.randn(13, groups, dim, generator=generator) for _ in range(2))
    out = attention(query, key, value, None, packed_seq_params=thd_params(bounds))
    for start, end in itertools.pairwise(bounds):
        q = query[start:end].transpose(0, 1)
        k, v = (x[start:end].transpose(0, 1).repeat_interleave(2, 0) for x in (key, value))
        scores = (q @ k.transpose(1, 2)) / dim**0.5
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        alone = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        torch.testing.assert_close(
            out[start:end], alone.transpose(0, 1).reshape(end - start, -1), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "overrides",
    [{"window_size": (2, 0)}, {"window_size": (3, 0), "window_attn_skip_freq": 2}],
    ids=["every-layer", "every-other-layer"],
)
def test_packed_attention_keeps_the_sliding_window_of_the_padded_path(
    overrides: dict[str, Any],
) -> None:
    destroy_mesh()
    engines = {
        name: build("value", backend={"transformer_overrides": overrides}, **LAYOUTS[name])
        for name in ("padded", "packed-3")
    }
    batch = random_batch([9, 4, 12, 1, 6], VOCAB, seed=2)
    expected = engines["padded"].infer_batch(batch)["values"]
    plain = build("value", **LAYOUTS["padded"]).infer_batch(batch)["values"]
    assert not torch.allclose(flat(plain), flat(expected), atol=1e-4)  # the window matters
    torch.testing.assert_close(
        flat(engines["packed-3"].infer_batch(batch)["values"]),
        flat(expected),
        rtol=1e-5,
        atol=1e-5,
    )
    destroy_mesh()


def test_packed_attention_dropout_draws_from_the_model_parallel_rng_stream(
    megatron_state: Engine,
) -> None:
    """As on the padded path, each tensor-parallel rank's attention dropout comes from
    megatron's model-parallel RNG tracker, not from the default generator (which every rank
    seeds alike)."""
    from megatron.core import tensor_parallel

    attention = packed_attention(megatron_state, attention_dropout=0.5)
    params = thd_params([0, 5, 13])
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(13, 4, 8, generator=generator) for _ in range(3))
    outputs = []
    for default_seed in (1, 2):
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        torch.manual_seed(default_seed)
        outputs.append(attention(query, key, value, None, packed_seq_params=params))
    attention.eval()
    without_dropout = attention(query, key, value, None, packed_seq_params=params)
    assert not torch.allclose(outputs[0], without_dropout)
    torch.testing.assert_close(outputs[0], outputs[1])


@pytest.mark.parametrize(
    "overrides",
    [{}, {"window_size": (2, 0)}, {"apply_query_key_layer_scaling": True}],
    ids=["causal", "window", "layer-scaling"],
)
def test_padded_attention_equals_megatrons_local_path(
    megatron_state: Engine, overrides: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right-padded rows go through SDPA, not the local path's ``[b, heads, s, s]`` scores, with
    the same outputs and gradients at every position (grouped-query heads included)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attention = packed_attention(megatron_state, **overrides)
    generator = torch.Generator().manual_seed(3)
    length, rows, heads, groups, dim = 9, 3, 4, 2, 8
    inputs = [torch.randn(length, rows, heads, dim, generator=generator)]
    inputs += [torch.randn(length, rows, groups, dim, generator=generator) for _ in range(2)]
    upstream = torch.randn(length, rows, heads * dim, generator=generator)
    results = []
    for forward in (attention.forward, functools.partial(DotProductAttention.forward, attention)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = forward(*leaves, None)
        out.backward(upstream)
        results.append([out, *(x.grad for x in leaves)])
    for ours, local in zip(*results, strict=True):
        torch.testing.assert_close(ours, local, rtol=1e-5, atol=1e-6)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs),
    )
    attention(*inputs, None)
    assert len(calls) == 1  # one fused call for the whole micro-batch


def test_packed_attention_refuses_a_mask_it_cannot_reproduce(megatron_state: Engine) -> None:
    attention = packed_attention(megatron_state, mask="no_mask")
    query = torch.zeros(5, 4, 8)
    with pytest.raises(ConfigError, match="causal self-attention"):
        attention(query, query, query, None, packed_seq_params=thd_params([0, 2, 5]))


# ------------------------------------------------------------------------------- refusals


def test_a_backend_without_the_packing_ability_refuses_it_by_name() -> None:
    from engine.registry import DEVICES, HEADS
    from tests.test_plugins import CoreOnlyBackend

    with pytest.raises(ConfigError, match=r"the plugin-core-only backend lacks the 'packing'"):
        Engine(
            head=HEADS.create("lm"),
            backend=CoreOnlyBackend(),
            platform=DEVICES.create("cpu"),
            config={"model": tiny_model(), "packing": True},
        )


def test_packing_with_context_parallelism_on_transformer_engine_is_refused_before_building(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The local layer spec packs under context parallelism; TransformerEngine's would need
    the padded offsets passed as well."""
    from engine import EngineConfig
    from strategies.backends.megatron import backend as megatron

    config = EngineConfig.from_dict(
        {"model": tiny_model(), "parallel": {"context_parallel_size": 2}}
    )
    megatron.MegatronBackend(layer_spec="local").check_packing(config)
    monkeypatch.setattr(megatron, "uses_transformer_engine", lambda kind: True)
    with pytest.raises(ConfigError, match="packing with context_parallel_size > 1"):
        megatron.MegatronBackend(layer_spec="transformer_engine").check_packing(config)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_the_packing_flag_must_be_a_bool(bad: object) -> None:
    with pytest.raises(ConfigError, match="packing"):
        Engine.build(head="lm", device="cpu", config={"model": tiny_model(), "packing": bad})


# ------------------------------------------------------------------------- megatron row layout


def model_config(
    tp: int = 1, pp: int = 1, virtual: int | None = None, sp: bool = False, cp: int = 1
) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual,
        sequence_parallel=sp,
        context_parallel_size=cp,
    )


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (model_config(), [13, 6]),  # each row as long as its real tokens
        (model_config(tp=2), [13, 6]),  # TP without sequence parallelism splits no sequence dim
        (model_config(tp=4, sp=True), [16, 8]),  # sequence parallel: multiples of TP
        (model_config(pp=2), [13, 13]),  # pipeline: one shape for every micro-batch
        (model_config(tp=2, pp=2, sp=True), [14, 14]),
        # context parallel: each sequence padded to 2 x CP chunks (8 + 4 + 8; 8), then the row
        (model_config(cp=2), [20, 8]),
        (model_config(cp=2, tp=2, sp=True), [24, 8]),  # the row to 2 x CP x TP
        (model_config(cp=3), [24, 6]),  # 6 + 6 + 12; 6
    ],
)
def test_packed_rows_are_padded_at_the_end_as_megatron_requires(
    config: Any, expected: list[int]
) -> None:
    from strategies.backends.megatron.schedule_step import step_layouts

    batch = random_batch([5, 1, 7, 6], VOCAB)
    micro_batches = split_into(batch, [[0, 1, 2], [3]], packed=True)
    assert [row.width for row in step_layouts(micro_batches, config)] == expected


def test_row_padding_is_a_segment_of_its_own_and_positions_restart_per_sequence() -> None:
    from strategies.backends.megatron.context_parallel import row_params
    from strategies.model.row_layout import RowLayout

    cpu = torch.device("cpu")
    row = RowLayout(rows=1, length=6, width=9, sequences=(0, 3, 4, 6), real_lengths=(3, 1, 2))
    params = row_params(row, cpu, host_offsets=False, context=None)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 4, 6, 9]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 3
    assert row.positions_on(cpu).tolist() == [[0, 1, 2, 0, 0, 1, 0, 1, 2]]
    whole = RowLayout(rows=1, length=7, width=7, sequences=(0, 2, 7), real_lengths=(2, 5))
    unpadded = row_params(whole, cpu, host_offsets=False, context=None)
    assert unpadded.cu_seqlens_q.tolist() == [0, 2, 7] and unpadded.max_seqlen_q == 5


def test_packed_offsets_stay_on_the_host_for_the_local_spec_only() -> None:
    """(An accelerator stands in as the meta device.) Megatron's rotary embedding reads the
    offsets as host numbers; TransformerEngine's attention takes them on the device."""
    from strategies.backends.megatron.context_parallel import row_params
    from strategies.model.row_layout import RowLayout

    device = torch.device("meta")
    row = RowLayout(rows=1, length=4, width=6, sequences=(0, 3, 4), real_lengths=(3, 1))
    for host_offsets, where in ((True, "cpu"), (False, "meta")):
        params = row_params(row, device, host_offsets=host_offsets, context=None)
        assert params.cu_seqlens_q.device.type == params.cu_seqlens_kv.device.type == where
        assert row.positions_on(device).device == device
    assert params.cu_seqlens_q.shape == (4,)
