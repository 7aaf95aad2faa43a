"""Batches (jagged <-> padded, validation, micro-batches) and micro-batch planning."""

from engine.data.batching import (
    ATTENTION_MASK,
    INPUT_IDS,
    MicroBatch,
    from_token_lists,
    jagged,
    sequence_lengths,
    to_jagged,
    to_padded,
)
from engine.data.micro_batching import (
    MicroBatchPlan,
    plan_fixed,
    plan_for_data_parallel,
    plan_token_budget,
)

__all__ = [
    "ATTENTION_MASK",
    "INPUT_IDS",
    "MicroBatch",
    "MicroBatchPlan",
    "from_token_lists",
    "jagged",
    "plan_fixed",
    "plan_for_data_parallel",
    "plan_token_budget",
    "sequence_lengths",
    "to_jagged",
    "to_padded",
]
