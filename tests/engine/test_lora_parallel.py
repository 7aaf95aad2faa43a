"""LoRA under tensor, pipeline and data parallelism matches one process.

Each layout runs as real processes (gloo on 127.0.0.1, a timeout on every process) on the same
global batch, seed and adapter initialisation as a single-process run: after two AdamW steps the
losses, the gradient norms (replicated adapter tensors counted once) and every adapter tensor
(gathered to full tensors by ``get_per_tensor_param(adapter_only=True)``) agree within 1e-5,
and ``B`` is no longer zero. Launches: megatron TP=2 x PP=2 (4 ranks), megatron DP=2 with
the distributed optimizer (2 ranks), fsdp2 DP=2 (2 ranks) and a LoRA critic (value head, whose
value layer trains with the adapters) at megatron TP=2 and at DP=2 with the distributed
optimizer (2 ranks each), and megatron TP=2 with the fused projections sharing their ``A``
(``share_a``, Xavier-drawn: Megatron-Bridge's ``lora`` type), each against its backend's
single-process run; each saves a checkpoint that one process loads back to exactly the
adapters the layout trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 2
LENGTHS = [6, 11, 3, 9, 14, 5, 8, 12]
TOLERANCE = 1e-5
LORA = {"rank": 4, "alpha": 16, "target_modules": ["q", "k", "v", "o", "gate", "up", "down"]}
SHARED_A = {**LORA, "share_a": True, "a_init": "xavier"}


def _config(
    parallel: dict[str, Any], options: dict[str, Any], lora: dict[str, Any]
) -> dict[str, Any]:
    from tests.factories import tiny_model

    return {
        "model": tiny_model(num_layers=2, vocab_size=64, hidden_size=32),
        "parallel": parallel,
        "backend": options,
        "micro_batch_size": 2,
        "seed": 11,
        "optimizer": {"lr": 1e-2, "clip_grad": 1.0},
        "lora": lora,
    }


def train_lora(
    backend: str,
    parallel: dict[str, Any],
    options: dict[str, Any],
    checkpoint: str | None = None,
    head: str = "lm",
    lora: dict[str, Any] = LORA,
) -> dict[str, Any]:
    """On every rank: train a LoRA LM (or critic: ``head="value"``) on this rank's
    data-parallel shard; report the losses and the full adapter tensors this rank exports (a
    critic's value layer with them); save a checkpoint when given a directory."""
    from engine import Engine
    from engine.data.batching import take_rows
    from engine.losses import sft_loss, value_regression_loss
    from tests.factories import random_batch

    config = _config(parallel, options, lora)
    loss = sft_loss if head == "lm" else value_regression_loss
    engine = Engine.build(head=head, backend=backend, device="cpu", config=config).initialize()
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    shard = len(LENGTHS) // dp_size
    losses, norms = [], []
    with engine.train_mode():
        for step in range(STEPS):
            batch = take_rows(
                random_batch(LENGTHS, 64, seed=step), slice(dp_rank * shard, (dp_rank + 1) * shard)
            )
            result = engine.train_batch(batch, loss)
            losses.append(result.get("loss"))
            norms.append(result["grad_norm"])
    adapters = {name: t.clone() for name, t in engine.get_per_tensor_param(adapter_only=True)}
    if checkpoint is not None:
        engine.save_checkpoint(checkpoint)
    return {
        "losses": losses,
        "grad_norms": norms,
        "adapters": adapters,
        "output_rank": engine.holds_outputs(),
    }


def load_lora(
    backend: str,
    checkpoint: str,
    options: dict[str, Any],
    head: str = "lm",
    lora: dict[str, Any] = LORA,
) -> dict[str, torch.Tensor]:
    """In one process: the adapters of the checkpoint, as exported after loading it."""
    from engine import Engine

    config = _config({}, options, lora)
    engine = Engine.build(head=head, backend=backend, device="cpu", config=config).initialize()
    engine.load_checkpoint(checkpoint)
    return dict(engine.get_per_tensor_param(adapter_only=True))


@pytest.fixture(scope="module")
def single_processes() -> dict[str, dict[str, Any]]:
    """Each backend's single-process run, made when a test first asks for it."""
    return {}


@pytest.mark.parametrize(
    ("backend", "world", "parallel", "options", "head", "lora"),
    [
        (
            "megatron",
            4,
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel": True},
            {},
            "lm",
            LORA,
        ),
        ("megatron", 2, {}, {"use_distributed_optimizer": True}, "lm", LORA),
        ("fsdp2", 2, {}, {}, "lm", LORA),
        ("megatron", 2, {"tensor_parallel_size": 2}, {}, "value", LORA),
        ("megatron", 2, {}, {"use_distributed_optimizer": True}, "value", LORA),
        ("megatron", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}, {}, "lm", SHARED_A),
    ],
    ids=[
        "megatron-tp2-sp-xpp2",
        "megatron-dp2-distributed-optimizer",
        "fsdp2-dp2",
        "megatron-tp2-critic",
        "megatron-dp2-distributed-optimizer-critic",
        "megatron-tp2-sp-shared-a",
    ],
)
def test_lora_at_every_parallel_layout_matches_one_process(
    single_processes: dict[str, dict[str, Any]],
    tmp_path: Path,
    backend: str,
    world: int,
    parallel: dict[str, Any],
    options: dict[str, Any],
    head: str,
    lora: dict[str, Any],
) -> None:
    key = f"{backend}-{head}-{lora is SHARED_A}"
    if key not in single_processes:
        (single_processes[key],) = run_ranks(
            train_lora, 1, backend, {}, {}, None, head, lora, timeout=180
        )
    single_process = single_processes[key]
    expected = single_process["adapters"]
    assert all(float(t.abs().max()) > 1e-3 for n, t in expected.items() if "lora_B" in n)
    assert (head != "lm") == any(name.endswith("score.weight") for name in expected)
    checkpoint = str(tmp_path / "checkpoints")
    reports = run_ranks(
        train_lora, world, backend, parallel, options, checkpoint, head, lora, timeout=400
    )
    for report in reports:  # replicated adapters count once in the norm, sharded ones whole
        assert report["grad_norms"] == pytest.approx(single_process["grad_norms"], rel=TOLERANCE)
        if report["output_rank"]:
            assert report["losses"] == pytest.approx(
                single_process["losses"], rel=TOLERANCE, abs=1e-6
            )
    gathered: dict[str, torch.Tensor] = {}
    for report in reports:
        for name, tensor in report["adapters"].items():
            if name in gathered:  # every tensor-parallel and data-parallel rank has it whole
                torch.testing.assert_close(tensor, gathered[name], atol=1e-6, rtol=0)
            gathered[name] = tensor
    assert set(gathered) == set(expected)
    for name, tensor in gathered.items():
        torch.testing.assert_close(tensor, expected[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)
    # the checkpoint holds each rank's shard where it belongs: one process reads it back whole
    (loaded,) = run_ranks(load_lora, 1, backend, checkpoint, options, head, lora, timeout=180)
    assert loaded.keys() == gathered.keys()
    assert all(torch.equal(loaded[name], gathered[name]) for name in gathered)
