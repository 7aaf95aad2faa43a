"""Weight sync by shard and by delta (``Engine.get_per_tensor_param_shard``,
``engine.weight_sync.DeltaExport``): each rank's blocks rebuild exactly the full export, and a
receiver seeded with the full export and fed each step's deltas holds exactly the full export
after every step, on both backends, dense, mixture-of-experts and LoRA, in one process and over
the layouts that shard a tensor (data parallel on fsdp2; tensor, pipeline and expert parallel on
megatron)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch

from engine import Engine
from engine.data.batching import take_rows
from engine.losses import sft_loss, value_regression_loss
from engine.weight_sync import DeltaExport, HfDelta
from heads.errors import ConfigError, EngineStateError
from strategies.hf.shards import HfBlock
from tests.factories import random_batch, tiny_model
from tests.multiprocess import run_ranks

STEPS = 3
LENGTHS = [6, 11, 3, 9]
#: megatron's expert-parallel MoE on CPU (as tests/engine/test_moe_parallel.py runs it).
EXPERT_DISPATCH = {"use_distributed_optimizer": True}
LORA = {"rank": 4, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}


def _config(model: str, parallel: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    shape = tiny_model(num_layers=2)
    if model == "moe":
        shape.update(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=32)
    return {
        "model": shape,
        "parallel": parallel or {},
        "micro_batch_size": 2,
        "seed": 5,
        "optimizer": {"lr": 1e-2},
        **extra,
    }


def rebuild(blocks: Iterable[HfBlock]) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors from contributing blocks (NaN where none wrote)."""
    tensors: dict[str, torch.Tensor] = {}
    for block in blocks:
        full = tensors.setdefault(
            block.name, torch.full(block.shape, float("nan"), dtype=block.tensor.dtype)
        )
        if block.contributes:
            block.place(full)
    return tensors


def apply(held: dict[str, torch.Tensor], deltas: Iterable[HfDelta]) -> int:
    """Write each delta's values at its positions (a tensor the receiver lacks starts as zeros);
    the number of elements written."""
    written = 0
    for delta in deltas:
        full = held.setdefault(delta.name, torch.zeros(delta.shape, dtype=delta.dtype))
        full.view(-1)[delta.positions] = delta.values
        written += delta.positions.numel()
    return written


def _step(engine: Engine, seed: int) -> None:
    """One training step on this rank's data-parallel share of a batch."""
    loss = sft_loss if engine.head.name == "lm" else value_regression_loss
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    batch = random_batch(LENGTHS, 64, seed=seed)
    shard = len(LENGTHS) // dp_size
    with engine.train_mode():
        engine.train_batch(take_rows(batch, slice(dp_rank * shard, (dp_rank + 1) * shard)), loss)


def sync_report(engine: Engine, adapter_only: bool = False) -> dict[str, Any]:
    """On every rank: this rank's blocks, its full export, and after each of ``STEPS`` steps
    its deltas and its full export (what a receiver should then hold)."""

    def full() -> dict[str, torch.Tensor]:
        exported = engine.get_per_tensor_param(adapter_only=adapter_only)
        return {name: tensor.clone() for name, tensor in exported}

    def blocks() -> list[HfBlock]:
        return [
            HfBlock(
                name=b.name,
                shape=b.shape,
                rows=b.rows,
                columns=b.columns,
                tensor=b.tensor.clone(),
                contributes=b.contributes,
            )
            for b in engine.get_per_tensor_param_shard(adapter_only=adapter_only)
        ]

    report: dict[str, Any] = {"full": full(), "blocks": blocks(), "steps": []}
    deltas = DeltaExport()
    deltas.prime(engine.get_per_tensor_param_shard(adapter_only=adapter_only), zeros=adapter_only)
    for step in range(STEPS):
        _step(engine, step)
        changes = list(deltas.deltas(engine.get_per_tensor_param_shard(adapter_only=adapter_only)))
        report["steps"].append({"deltas": changes, "full": full()})
    return report


def check_reports(reports: list[dict[str, Any]], seeded: bool = True) -> None:
    """The ranks' blocks rebuild rank 0's full export, no rank's block of a sharded tensor is
    the whole of it, and a receiver of the seed plus the gathered deltas holds each step's full
    export, bit for bit."""
    full = _union(report["full"] for report in reports)
    rebuilt = rebuild(block for report in reports for block in report["blocks"])
    assert list(rebuilt) == list(full) or set(rebuilt) == set(full)
    for name, tensor in full.items():
        assert torch.equal(rebuilt[name], tensor), name
    names = [[block.name for block in report["blocks"]] for report in reports]
    assert all(order == names[0] for order in names), "every rank yields the same order"
    held = {name: tensor.clone() for name, tensor in full.items()} if seeded else {}
    for step in range(STEPS):
        written = apply(held, (d for report in reports for d in report["steps"][step]["deltas"]))
        expected = _union(report["steps"][step]["full"] for report in reports)
        assert written > 0, "a step changed no exported element"
        assert set(held) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor), (step, name)


def _union(exports: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each rank's full export (under pipeline parallelism each stage exports its own layers)."""
    union: dict[str, torch.Tensor] = {}
    for export in exports:
        for name, tensor in export.items():
            if name in union:
                assert torch.equal(union[name], tensor), name
            union[name] = tensor
    return union


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_one_processs_blocks_and_deltas_equal_the_full_export(backend: str, model: str) -> None:
    engine = Engine.build(head="lm", backend=backend, device="cpu", config=_config(model))
    check_reports([sync_report(engine.initialize())])


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
@pytest.mark.parametrize("head", ["lm", "value"])
def test_lora_adapters_sync_alone_by_shard_and_delta(backend: str, head: str) -> None:
    """The adapters (and a value head's layer) only: a receiver that holds none of them yet gets
    their nonzero elements in the first delta (the base was synced before, unchanged since)."""
    config = _config("dense", lora=LORA)
    engine = Engine.build(head=head, backend=backend, device="cpu", config=config).initialize()
    report = sync_report(engine, adapter_only=True)
    check_reports([report], seeded=False)
    assert all(".lora_" in b.name or ".score." in b.name for b in report["blocks"])
    with pytest.raises(ConfigError, match="adapter_only=True"):
        engine.get_per_tensor_param_shard()
    with engine.disable_adapter():
        base = rebuild(engine.get_per_tensor_param_shard())
        assert all(torch.equal(base[n], t) for n, t in engine.get_per_tensor_param())


def test_a_delta_before_any_base_is_refused_by_name() -> None:
    engine = Engine.build(head="lm", backend="fsdp2", device="cpu", config=_config("dense"))
    engine.initialize()
    with pytest.raises(EngineStateError, match=r"DeltaExport\.prime"):
        list(DeltaExport().deltas(engine.get_per_tensor_param_shard()))


def test_a_receiver_of_bf16_weights_gets_only_the_elements_a_step_moved() -> None:
    """bf16 weights at a small learning rate: the delta is the elements whose bf16 value
    changed, fewer than the model's, and still rebuilds the export exactly."""
    config = _config("dense", backend={"weights_dtype": "bfloat16"}, dtype="bfloat16")
    config["optimizer"] = {"lr": 1e-4}
    engine = Engine.build(head="lm", backend="fsdp2", device="cpu", config=config).initialize()
    report = sync_report(engine)
    check_reports([report])
    total = sum(t.numel() for t in report["full"].values())
    changed = sum(d.positions.numel() for d in report["steps"][0]["deltas"])
    assert 0 < changed < total


def sync_over_ranks(layouts: list[tuple[str, str, dict[str, Any], dict[str, Any]]]) -> list[Any]:
    """On each rank: ``sync_report`` of an engine per (backend, model, parallel, extra); with
    LoRA of its adapters; a model named ``value`` is the dense one under a value head."""
    reports = []
    for backend, model, parallel, extra in layouts:
        config = _config("dense" if model == "value" else model, parallel, **extra)
        head = "value" if model == "value" else "lm"
        engine = Engine.build(head=head, backend=backend, device="cpu", config=config)
        reports.append(sync_report(engine.initialize(), adapter_only="lora" in extra))
    return reports


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layouts",
    [
        [
            ("fsdp2", "dense", {}, {}),
            ("fsdp2", "moe", {}, {}),
            ("fsdp2", "value", {}, {}),  # its one-row value layer: rank 1's shard is empty
            ("megatron", "dense", {"tensor_parallel_size": 2}, {}),
            ("megatron", "dense", {"tensor_parallel_size": 2}, {"lora": LORA}),
        ],
        [("megatron", "dense", {"pipeline_parallel_size": 2}, {})],
        [("megatron", "moe", {"expert_parallel_size": 2}, {"backend": EXPERT_DISPATCH})],
    ],
    ids=["fsdp2-dp2-and-megatron-tp2", "megatron-pp2", "megatron-ep2"],
)
def test_two_ranks_blocks_and_deltas_equal_the_full_export(layouts: list[Any]) -> None:
    per_rank = run_ranks(sync_over_ranks, 2, layouts, timeout=300)
    for index, (backend, _, parallel, extra) in enumerate(layouts):
        reports = [ranks[index] for ranks in per_rank]
        check_reports(reports, seeded="lora" not in extra)
        if "lora" not in extra and (backend == "fsdp2" or parallel.get("tensor_parallel_size")):
            # a tensor sharded over the ranks is whole on none of them
            for report in reports:
                embedding = next(b for b in report["blocks"] if "embed_tokens" in b.name)
                assert embedding.tensor.numel() < torch.Size(embedding.shape).numel()


def test_a_receiver_of_another_dtype_gets_the_elements_whose_value_in_it_changed() -> None:
    """float32 weights, a bf16 receiver: compared in bf16, a step at a small learning rate
    moves fewer elements than the model has, and the receiver holds the bf16 export."""
    config = _config("dense")
    config["optimizer"] = {"lr": 1e-4}
    engine = Engine.build(head="lm", backend="megatron", device="cpu", config=config)
    engine.initialize()
    held = {name: t.to(torch.bfloat16) for name, t in engine.get_per_tensor_param()}
    deltas = DeltaExport(dtype=torch.bfloat16)
    deltas.prime(engine.get_per_tensor_param_shard())
    _step(engine, 0)
    changes = list(deltas.deltas(engine.get_per_tensor_param_shard()))
    assert all(d.dtype == torch.bfloat16 for d in changes)
    written = apply(held, changes)
    assert 0 < written < sum(t.numel() for t in held.values())
    for name, tensor in engine.get_per_tensor_param():
        assert torch.equal(held[name], tensor.to(torch.bfloat16)), name
