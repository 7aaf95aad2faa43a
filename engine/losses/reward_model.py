"""Reward-model losses on per-sequence ``scores`` (the ``reward`` head): pairwise
Bradley-Terry preference loss and score regression."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from engine.losses.contract import (
    SEQUENCES,
    LossContext,
    LossResult,
    needs_fields,
    needs_outputs,
    scalar_output,
)
from heads.base import PER_SEQUENCE
from heads.errors import BatchError

PAIR_ID = "pair_id"
CHOSEN = "chosen"
TARGETS = "targets"


@needs_fields(**{PAIR_ID: PER_SEQUENCE, CHOSEN: PER_SEQUENCE})
@needs_outputs("scores")
def bradley_terry_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> LossResult:
    """``-log sigmoid(score_chosen - score_rejected)`` per preference pair, mean over the
    global pairs (half the global sequences).

    Per-sequence batch fields: ``pair_id`` (int; the two responses of a pair share it) and
    ``chosen`` (1 for the preferred response, 0 for the other). Both rows of a pair must run in
    the same micro-batch: put them next to each other and use an even ``micro_batch_size``
    (or one micro-batch per batch). Metrics (local): ``bt_loss``, ``bt_accuracy`` (share of
    pairs ranked right), ``bt_margin`` (mean chosen - rejected score).
    """
    scores = scalar_output(outputs, "scores", PER_SEQUENCE, "bradley_terry_loss")
    chosen_score, rejected_score = _pairs(scores, batch[PAIR_ID], batch[CHOSEN])
    per_pair = -F.logsigmoid(chosen_score - rejected_score)
    pairs = max(ctx.global_count(SEQUENCES) / 2, 1.0)
    loss = per_pair.sum() / pairs
    margin = (chosen_score - rejected_score).detach()
    return loss, {
        "bt_loss": per_pair.detach().mean(),
        "bt_accuracy": (margin > 0).float().mean(),
        "bt_margin": margin.detach().mean(),
    }


@needs_fields(**{TARGETS: PER_SEQUENCE})
@needs_outputs("scores")
def score_regression_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> LossResult:
    """``0.5 * (score - target)^2`` per sequence, mean over the global sequences; per-sequence
    batch field ``targets``. Metric (local): ``score_loss``."""
    scores = scalar_output(outputs, "scores", PER_SEQUENCE, "score_regression_loss")
    targets = batch[TARGETS]
    if targets.shape != scores.shape:
        raise BatchError(
            f"score_regression_loss needs one 'targets' value per sequence, shape "
            f"{list(scores.shape)}; got {list(targets.shape)}"
        )
    per_sequence = 0.5 * (scores - targets.to(scores.dtype)).square()
    loss = per_sequence.sum() / max(ctx.global_count(SEQUENCES), 1.0)
    return loss, {"score_loss": per_sequence.detach().mean()}


def _pairs(
    scores: torch.Tensor, pair_id: torch.Tensor, chosen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores, rejected scores), one entry per pair of this micro-batch."""
    if pair_id.shape != scores.shape or chosen.shape != scores.shape:
        raise BatchError(
            f"'{PAIR_ID}' and '{CHOSEN}' must hold one value per sequence, shape "
            f"{list(scores.shape)}; got {list(pair_id.shape)} and {list(chosen.shape)}"
        )
    is_chosen = chosen.bool()
    if not bool(((chosen == 0) | (chosen == 1)).all()):
        raise BatchError(f"'{CHOSEN}' must hold 1 (preferred) or 0; got {chosen.tolist()}")
    ids, slot, counts = torch.unique(pair_id, return_inverse=True, return_counts=True)
    picked = torch.zeros(len(ids), dtype=torch.long, device=scores.device)
    picked.index_add_(0, slot, is_chosen.long())
    bad = (counts != 2) | (picked != 1)
    if bool(bad.any()):
        pair = int(ids[bad.nonzero()[0, 0]])
        raise BatchError(
            f"pair_id {pair} has {int(counts[bad][0])} response(s), {int(picked[bad][0])} of "
            "them chosen, in this micro-batch; each pair needs exactly one chosen and one "
            "rejected response in the same micro-batch (keep a pair's rows adjacent and "
            "micro_batch_size even)"
        )
    chosen_score = scores.new_zeros(len(ids)).index_add(0, slot[is_chosen], scores[is_chosen])
    rejected_score = scores.new_zeros(len(ids)).index_add(0, slot[~is_chosen], scores[~is_chosen])
    return chosen_score, rejected_score
