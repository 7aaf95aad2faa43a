"""Core attention for megatron's local layer spec that also runs packed (``thd``) micro-batches.

Megatron's local ``DotProductAttention`` refuses ``PackedSeqParams`` (only TransformerEngine's
attention takes the ``thd`` layout). This subclass keeps the local path for right-padded input
and, for packed input, attends within each sequence with ``scaled_dot_product_attention``
(causal; ``strategies.packed_attention``): attention never crosses a sequence boundary and the
cost grows with the sum of the squared sequence lengths, not the squared row length. It is
device-neutral (the CPU, and GPU hosts without TransformerEngine); megatron's rotary embedding
already restarts positions at each sequence in the ``thd`` layout (``cu_seqlens``).

Inside a sequence it attends as the local path does: the same scale, the same sliding window
(``window_size``, per layer as ``window_attn_skip_freq`` says) and attention dropout drawn from
megatron's model-parallel RNG stream; what it cannot reproduce is refused, never ignored.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from heads.errors import ConfigError
from strategies.packed_attention import attend_per_sequence


@functools.cache
def packed_dot_product_attention() -> type:
    """The class (built once, on first use, so megatron is imported lazily)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class PackedDotProductAttention(DotProductAttention):  # type: ignore[misc, unused-ignore]
        """Local core attention; packed ``thd`` input is attended sequence by sequence."""

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if packed_seq_params is None:
                return super().forward(  # type: ignore[no-any-return, unused-ignore]
                    query, key, value, attention_mask, attn_mask_type, attention_bias
                )
            return self._packed(query, key, value, packed_seq_params)

        def _packed(
            self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
        ) -> torch.Tensor:
            """``query`` ``[t, heads, dim]``, ``key``/``value`` ``[t, groups, dim]`` ->
            ``[t, heads * dim]``, causal inside each ``cu_seqlens_q`` segment."""
            if (
                params.qkv_format != "thd"
                or self.softmax_offset is not None
                or self.attn_mask_type != AttnMaskType.causal
            ):
                raise ConfigError(
                    "packed micro-batches on megatron's local layer spec support causal "
                    "self-attention in the thd layout with vanilla softmax only"
                )
            scale = self.softmax_scale
            if self.config.apply_query_key_layer_scaling:  # the softmax multiplies it back
                scale *= self.layer_number
            # the local path's own choice for this layer (window_size, window_attn_skip_freq)
            window: tuple[int, int] | None = self.scale_mask_softmax.window_size
            dropout = self.attention_dropout.p if self.training else 0.0
            # as the local path: each tensor-parallel rank draws its own dropout (its heads)
            random = (
                tensor_parallel.get_cuda_rng_tracker().fork()
                if dropout and not self.config.sequence_parallel
                else contextlib.nullcontext()
            )
            bounds = params.cu_seqlens_q.tolist()
            # [t, heads, dim] -> [1, heads, t, dim] and back
            q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
            with random:
                out = attend_per_sequence(
                    q,
                    k,
                    v,
                    bounds,
                    scale=scale,
                    window=window,
                    dropout=dropout,
                )
            return out[0].transpose(0, 1).reshape(query.shape[0], -1)

    return PackedDotProductAttention
