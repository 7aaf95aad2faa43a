"""Model heads: what a model outputs and how raw outputs become per-token results."""

from heads.base import Head, HeadContext, OutputSpec

__all__ = ["Head", "HeadContext", "OutputSpec"]
