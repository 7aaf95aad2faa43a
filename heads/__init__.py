"""Model heads: what a model outputs and how raw outputs become per-token or per-sequence
results."""

from heads.base import (
    PER_SEQUENCE,
    PER_TOKEN,
    Granularity,
    Head,
    HeadContext,
    OutputSpec,
    ResultSpec,
    at_last_token,
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
    "ResultSpec",
    "at_last_token",
    "per_sequence",
    "per_token",
    "shift_to_scored_token",
]
