"""transformers attention that also runs packed rows: ``PACKED_SDPA``, registered with
transformers' attention interface (and its mask interface) on first use.

A right-padded micro-batch goes through transformers' own ``sdpa`` function and mask, unchanged.
A packed row (its sequences back to back, positions restarting at each) is handed over with
``packed_bounds``, the host offsets of its sequences, which transformers passes from the model's
forward down to every attention layer: each sequence then attends causally to itself alone
(:func:`strategies.model.packed_attention.attend_per_sequence`), in every supported family (Llama,
Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral: their attention layers forward those keyword
arguments), with a layer's sliding window where it has one. The caller hands a packed row an
all-ones 2-D attention mask, so transformers builds no ``[T, T]`` mask for it (with none, it
would detect the packing from the positions and build one).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from strategies.backends.fsdp2.ulysses import attend_across_ranks
from strategies.model.packed_attention import attend_per_sequence

PACKED_SDPA = "composable_engine_packed_sdpa"
#: The keyword the model's forward passes down to the attention layers for a packed row.
PACKED_BOUNDS = "packed_bounds"


@functools.cache
def packed_sdpa() -> str:
    """Register :data:`PACKED_SDPA` with transformers (once); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def causal_mask(*args: Any, **kwargs: Any) -> Any:
        """transformers' SDPA mask, told there is no padding: the engine's rows are
        right-padded and causal, so no real token sees the padding after it, and a packed row
        is attended per sequence whatever the mask. Reading the 2-D mask (to find it all ones)
        would wait for the device once per micro-batch."""
        kwargs["attention_mask"] = None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, causal_mask)
    return PACKED_SDPA


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed_bounds: Sequence[int] | None = None,
    sequence_group: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` ``[b, heads, s, dim]``, ``key`` /
    ``value`` ``[b, groups, s, dim]`` -> (``[b, s, heads, dim]``, no weights); with
    ``sequence_group``, ``s`` is this rank's part of the row (``fsdp2.ulysses``)."""
    # transformers' window of w: each query sees itself and the w - 1 keys before it
    window = None if sliding_window is None else (sliding_window - 1, 0)
    if sequence_group is not None:
        out = attend_across_ranks(
            query,
            key,
            value,
            sequence_group,
            packed_bounds,
            scale=scaling,
            window=window,
            dropout=dropout,
        )
        return out.transpose(1, 2).contiguous(), None
    if packed_bounds is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = attend_per_sequence(
        query, key, value, packed_bounds, scale=scaling, window=window, dropout=dropout
    )
    return out.transpose(1, 2).contiguous(), None
