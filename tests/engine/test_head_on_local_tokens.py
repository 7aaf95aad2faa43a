"""The head on each rank's own tokens where a sequence is split over ranks (megatron context
parallelism, fsdp2 Ulysses): the LM head, fused (the output layer in tiles) and materialised
(the logits whole), on right-padded and packed micro-batches of uneven lengths, trains as one
process does after 3 steps (losses, weights, log-probs, entropy), and the raw output it is
handed never spans more than the rank's part of the row."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch

from heads.base import HeadContext
from heads.lm import LMHead
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
#: Uneven; packed two by two under Ulysses = 2 the first row is 3 + 5 | 8: a sequence boundary
#: exactly on the boundary between the two ranks' halves.
LENGTHS = [3, 5, 8, 6, 7, 2, 9, 4]
HEADS = {
    "fused": {"fused_min_logits": 0},  # the output layer in tiles, never the whole logits
    "materialised": {"fused": False},  # the backend's output layer, the logits whole
}
LAYOUTS = {"padded": {"micro_batch_size": 4}, "packed": {"packing": True, "micro_batch_size": 2}}


@attrs.frozen(kw_only=True)
class RecordingLMHead(LMHead):
    """The LM head, noting the positions each call runs on and the row length it places."""

    seen: ClassVar[list[tuple[str, int]]] = []

    def per_position(
        self, raw: torch.Tensor, next_tokens: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        self.seen.append(("positions", raw.shape[1]))
        return super().per_position(raw, next_tokens, ctx)

    def place(self, per_position: Any, ctx: HeadContext) -> dict[str, torch.Tensor]:
        sequences = 1 if ctx.cu_seqlens is None else len(ctx.cu_seqlens) - 1
        self.seen.append(("row", per_position["log_probs"].shape[1]))
        self.seen.append(("sequences", sequences))
        return super().place(per_position, ctx)


def train_on_split_rows(backend: str, parallel: dict[str, Any]) -> dict[str, Any]:
    """On every rank: for each head variant and layout, 3 SFT steps, then the trained weights,
    the log-probs and entropy of a new batch, and what the head saw."""
    from engine import Engine
    from engine.losses import sft_loss
    from tests.factories import random_batch, tiny_model

    report: dict[str, Any] = {}
    for head_name, options in HEADS.items():
        for layout_name, layout in LAYOUTS.items():
            config = {
                "model": tiny_model(),
                "seed": 5,
                "optimizer": {"lr": 1e-3},
                **layout,
                **parallel,
            }
            head = RecordingLMHead(compute_entropy=True, **options)
            engine = Engine.build(head=head, backend=backend, device="cpu", config=config)
            engine.initialize()
            RecordingLMHead.seen.clear()
            losses = [
                engine.train_batch(random_batch(LENGTHS, 64, seed=step), sft_loss).get("loss")
                for step in range(STEPS)
            ]
            result = engine.infer_batch(random_batch(LENGTHS, 64, seed=STEPS))
            report[head_name, layout_name] = {
                "losses": losses,
                "weights": dict(engine.get_per_tensor_param()),
                "holds": engine.holds_outputs(),
                "log_probs": None if result is None else result["log_probs"].values().clone(),
                "entropy": None if result is None else result["entropy"].values().clone(),
                "seen": list(RecordingLMHead.seen),
            }
    return report


def positions_per_row(seen: list[tuple[str, int]]) -> list[tuple[int, int, int]]:
    """Each head call's (positions it ran on, the row length it placed, its sequences)."""
    calls = []
    for index, (kind, positions) in enumerate(seen):
        if kind == "positions":
            row, sequences = seen[index + 1][1], seen[index + 2][1]
            calls.append((positions, row, sequences))
    return calls


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("backend", "parallel"),
    [
        ("megatron", {"parallel": {"context_parallel_size": 2}}),
        ("fsdp2", {"backend": {"ulysses_size": 2}}),
    ],
    ids=["megatron-cp2", "fsdp2-ulysses2"],
)
def test_the_head_runs_on_each_ranks_own_tokens_and_trains_as_one_process(
    backend: str, parallel: dict[str, Any]
) -> None:
    (expected,) = run_ranks(train_on_split_rows, 1, backend, {}, timeout=300)
    reports = run_ranks(train_on_split_rows, 2, backend, parallel, timeout=400)
    for case, want in expected.items():
        for positions, row, _ in positions_per_row(want["seen"]):
            assert positions == row  # one process: the head runs on the whole row
        holders = [report[case] for report in reports if report[case]["holds"]]
        assert len(holders) == 1, case
        for report in reports:
            got = report[case]
            calls = positions_per_row(got["seen"])
            assert calls, case
            for positions, row, sequences in calls:
                # its half of the row: the row's tokens and the padding that splits each
                # sequence (megatron: into 4 chunks) or the row (Ulysses: into 2) evenly
                assert row <= 2 * positions < row + 4 * sequences, (case, positions, row)
            if got["holds"]:
                assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6), case
            for name, tensor in got["weights"].items():
                torch.testing.assert_close(
                    tensor, want["weights"][name], atol=1e-5, rtol=1e-5, msg=f"{case} {name}"
                )
        for field in ("log_probs", "entropy"):
            torch.testing.assert_close(
                holders[0][field], want[field], atol=1e-5, rtol=1e-5, msg=f"{case} {field}"
            )
