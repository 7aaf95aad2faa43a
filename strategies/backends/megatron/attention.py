"""Core attention for megatron's local layer spec through ``scaled_dot_product_attention``,
for right-padded and for packed (``thd``) micro-batches.

Megatron's local ``DotProductAttention`` materialises the ``[batch, heads, seq, seq]`` score
matrix (and its softmax, kept for backward) and refuses ``PackedSeqParams`` (only
TransformerEngine's attention takes the ``thd`` layout). This subclass computes the same causal
attention with SDPA (``strategies.model.packed_attention``), whose fused kernels hold no score
matrix and skip the masked half:

* right-padded rows (the engine passes no attention mask, so the local path applies its causal
  mask to the whole row): one causal SDPA call over the micro-batch. Every position, padding
  included, gets what the local path gives it; real tokens never see the padding after them.
* packed rows: sequence by sequence, causal inside each, so attention never crosses a sequence
  boundary and the cost grows with the sum of the squared sequence lengths, not the squared row
  length; megatron's rotary embedding already restarts positions at each sequence in the
  ``thd`` layout (``cu_seqlens``).

It attends as the local path does: the same scale, the same sliding window (``window_size``,
per layer as ``window_attn_skip_freq`` says) and attention dropout drawn from megatron's
model-parallel RNG stream. It is device-neutral (the CPU, and GPU hosts without
TransformerEngine). What SDPA cannot express (a softmax offset, a non-causal mask, an explicit
attention mask or bias) goes through the local path when padded and is refused when packed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Sequence
from typing import Any

import torch

from heads.errors import ConfigError
from strategies.backends.megatron.context_parallel import ContextAttention
from strategies.model.packed_attention import attend_per_sequence


@functools.cache
def packed_dot_product_attention() -> type:
    """The class (built once, on first use, so megatron is imported lazily)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class PackedDotProductAttention(DotProductAttention):  # type: ignore[misc, unused-ignore]
        """Local core attention through SDPA: padded rows in one call, packed ``thd`` input
        sequence by sequence; with context parallelism, this rank's queries over the whole
        row's keys and values (``context_parallel``)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            # megatron's local attention refuses context parallelism outright; this one runs it
            local = copy.copy(config)
            local.context_parallel_size = 1
            super().__init__(local, *args, **kwargs)
            self.config = config

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
            if self.config.context_parallel_size > 1:
                if attention_mask is not None or attention_bias is not None:
                    raise ConfigError(
                        "context parallelism on megatron's local layer spec takes causal "
                        "self-attention without an explicit mask or bias"
                    )
                return self._attend_across_ranks(query, key, value, packed_seq_params)
            if packed_seq_params is not None:
                if packed_seq_params.qkv_format != "thd" or not self._sdpa_expresses_it():
                    raise ConfigError(
                        "packed micro-batches on megatron's local layer spec support causal "
                        "self-attention in the thd layout with vanilla softmax only"
                    )
                # [t, heads, dim] -> [1, heads, t, dim] and back
                q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
                # on the local spec the backend leaves the offsets on the host (packed_layout)
                out = self._attend(q, k, v, packed_seq_params.cu_seqlens_q.tolist())
                return out[0].transpose(0, 1).reshape(query.shape[0], -1)
            if attention_mask is None and attention_bias is None and self._sdpa_expresses_it():
                # right-padded rows: [s, b, heads, dim] -> [b, heads, s, dim] and back
                q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
                out = self._attend(q, k, v, (0, query.shape[0]))
                return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
            return super().forward(  # type: ignore[no-any-return, unused-ignore]
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )

        def _attend_across_ranks(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            packed_seq_params: Any,
        ) -> torch.Tensor:
            """This rank's queries (``[s / CP, b, heads, dim]``, or ``[t / CP, heads, dim]``
            packed) over the whole row's keys and values (gathered), causal in the queries'
            row positions and inside their own sequence, as the micro-batch's layout (built
            once, handed to every layer in ``packed_seq_params``) says."""
            if not self._sdpa_expresses_it():
                raise ConfigError(
                    "context parallelism on megatron's local layer spec supports causal "
                    "self-attention with vanilla softmax only"
                )
            context = getattr(packed_seq_params, "context", None)
            if not isinstance(context, ContextAttention):
                raise ConfigError(
                    "context parallelism on megatron's local layer spec needs the "
                    "micro-batch's layout in packed_seq_params (context_parallel.row_params); "
                    "run the model through the megatron backend"
                )
            layout = context.layout
            packed = layout.row.packed
            if packed:  # [t, heads, dim] -> [t, 1, heads, dim]
                query, key, value = (x[:, None] for x in (query, key, value))
            key, value = layout.gather(key, 0), layout.gather(value, 0)
            mask = context.visible_keys(self.scale_mask_softmax.window_size)
            scale, dropout, random = self._softmax_settings()
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            with random:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    dropout_p=dropout,
                    scale=scale,
                    enable_gqa=k.shape[1] != q.shape[1],
                )
            out = out.permute(2, 0, 1, 3)
            if packed:
                return out.reshape(query.shape[0], -1)
            return out.reshape(query.shape[0], query.shape[1], -1)

        def _softmax_settings(self) -> tuple[float, float, Any]:
            """The local path's softmax scale, attention dropout and the RNG it draws from."""
            scale = self.softmax_scale
            if self.config.apply_query_key_layer_scaling:  # the softmax multiplies it back
                scale *= self.layer_number
            dropout = self.attention_dropout.p if self.training else 0.0
            # as the local path: each tensor-parallel rank draws its own dropout (its heads)
            random = (
                tensor_parallel.get_cuda_rng_tracker().fork()
                if dropout and not self.config.sequence_parallel
                else contextlib.nullcontext()
            )
            return scale, dropout, random

        def _sdpa_expresses_it(self) -> bool:
            """Causal self-attention with a vanilla softmax: what SDPA computes."""
            return self.softmax_offset is None and self.attn_mask_type == AttnMaskType.causal

        def _attend(
            self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int]
        ) -> torch.Tensor:
            """Causal attention of ``[n, heads, s, dim]`` queries over ``[n, groups, s, dim]``
            keys and values inside each segment of ``bounds``, with the local path's scale,
            sliding window and dropout."""
            scale, dropout, random = self._softmax_settings()
            with random:
                return attend_per_sequence(
                    q,
                    k,
                    v,
                    bounds,
                    scale=scale,
                    # the local path's own choice for this layer (window_attn_skip_freq)
                    window=self.scale_mask_softmax.window_size,
                    dropout=dropout,
                )

    return PackedDotProductAttention
