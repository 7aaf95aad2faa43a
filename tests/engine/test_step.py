"""One prepared step (engine.step): its sequence lengths are taken once, and its counts (with
every rank's refusal of its batch) are summed over the data-parallel ranks in one all-reduce,
on both backends, with and without MoE router losses.

Counting collectives: every ``torch.distributed.all_reduce`` of a step is tallied by the project
function that asked for it (``tests.collectives``). The gradient sync and norm are the backend's
(megatron's DDP, torch's FSDP): counting by origin tells them apart from the engine's numbers
without depending on their dtypes or sizes, and shows any count summed a second time (megatron's
router-loss token total, the verl adapter's ``batch_num_tokens`` did) under its own name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine import Engine
from engine.losses import sft_loss
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model
from tests.multiprocess import run_ranks

LENGTHS = [6, 11, 3, 9, 14, 5, 8, 12]
MOE = {
    "num_experts": 4,
    "experts_per_token": 2,
    "expert_ffn_hidden_size": 32,
    "router_aux_loss_coeff": 0.01,
    "router_z_loss_coeff": 0.001,
}
#: (backend, MoE model, more settings): fixed micro-batches, and packed ones by token budget.
CASES = [
    ("megatron", False, {}),
    ("megatron", True, {}),
    ("megatron", True, {"packing": True, "max_tokens_per_micro_batch": 24}),
    ("fsdp2", False, {}),
    ("fsdp2", False, {"packing": True, "max_tokens_per_micro_batch": 24}),
]


def _build(backend: str, moe: bool, extra: dict[str, Any]) -> Engine:
    config = {
        "model": tiny_model(**(MOE if moe else {})),
        "micro_batch_size": 2,
        "seed": 1,
        **extra,
    }
    return Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()


def count_all_reduces() -> list[dict[str, dict[str, int]]]:
    """On each rank, per case: the all-reduces of one train_batch and one infer_batch by origin
    (after a first step, so that nothing built once is counted)."""
    from engine.data.batching import take_rows
    from tests.collectives import all_reduces

    reports = []
    for backend, moe, extra in CASES:
        destroy_mesh()
        engine = _build(backend, moe, extra)
        rank = engine.get_data_parallel_rank()
        rows = take_rows(random_batch(LENGTHS, 64), slice(rank * 4, rank * 4 + 4))
        engine.train_batch(rows, sft_loss)
        with all_reduces() as train:
            engine.train_batch(rows, sft_loss)
        with all_reduces() as infer:
            engine.infer_batch(rows)
        reports.append({"train": dict(train), "infer": dict(infer)})
    return reports


@pytest.mark.multiprocess
def test_a_data_parallel_step_sums_its_counts_in_exactly_one_all_reduce() -> None:
    from tests.collectives import COUNTS, NOT_COUNTS

    for rank in run_ranks(count_all_reduces, 2, timeout=600):
        for case, report in zip(CASES, rank, strict=True):
            for call, tally in report.items():
                assert tally.get(COUNTS) == 1, (case, call, tally)
                others = set(tally) - {COUNTS}
                assert others <= NOT_COUNTS, (case, call, others - NOT_COUNTS)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every call of ``sequence_lengths``, wherever the engine reaches it from."""
    import engine.data.batching
    import engine.engine
    import engine.step

    counted: list[int] = []
    original = engine.data.batching.sequence_lengths

    def counting(batch: Any) -> Any:
        counted.append(1)
        return original(batch)

    for module in (engine.data.batching, engine.engine, engine.step):
        if hasattr(module, "sequence_lengths"):
            monkeypatch.setattr(module, "sequence_lengths", counting)
    destroy_mesh()
    yield counted
    destroy_mesh()


@pytest.mark.parametrize(
    ("moe", "extra"),
    [(False, {}), (True, {"packing": True, "max_tokens_per_micro_batch": 24})],
    ids=["fixed", "moe-packed-budget"],
)
def test_sequence_lengths_are_computed_once_per_step(
    calls: list[int], moe: bool, extra: dict[str, Any]
) -> None:
    engine = _build("megatron", moe, extra)
    batch = random_batch(LENGTHS, 64)
    for step in (
        lambda: engine.train_batch(batch, sft_loss),
        lambda: engine.infer_batch(batch),
        lambda: engine.forward_backward_batch(batch, sft_loss),
    ):
        calls.clear()
        step()
        assert len(calls) == 1
