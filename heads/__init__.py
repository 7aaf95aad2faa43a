"""Model heads: what a model outputs and how raw outputs become per-token or per-sequence
results."""

from heads.base import (
    PER_SEQUENCE,
    PER_TOKEN,
    Granularity,
    Head,
    HeadContext,
    OutputSpec,
    PositionwiseHead,
    ResultSpec,
    SequenceSplit,
    at_last_token,
    next_tokens,
    per_sequence,
    per_token,
    shift_to_scored_token,
)

__all__ = [
    "PER_SEQUENCE",
    "PER_TOKEN",
    "Granularity",
    "Head",
    "HeadContext",
    "OutputSpec",
    "PositionwiseHead",
    "ResultSpec",
    "SequenceSplit",
    "at_last_token",
    "next_tokens",
    "per_sequence",
    "per_token",
    "shift_to_scored_token",
]
