"""Core attention for megatron's local layer spec through ``scaled_dot_product_attention``,
for right-padded and for packed (``thd``) micro-batches.

Megatron's local ``DotProductAttention`` materialises the ``[batch, heads, seq, seq]`` score
matrix (and its softmax, kept for backward) and refuses ``PackedSeqParams`` (only
TransformerEngine's attention takes the ``thd`` layout). This subclass computes the same causal
attention with SDPA, whose fused kernels hold no score matrix and skip the masked half:

* right-padded rows (the engine passes no attention mask, so the local path applies its causal
  mask to the whole row): one causal SDPA call over the row. Every position, padding included,
  gets what the local path gives it; real tokens never see the padding after them.
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
import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F

from heads.errors import ConfigError


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
            if packed_seq_params is not None:
                if packed_seq_params.qkv_format != "thd" or not self._sdpa_expresses_it():
                    raise ConfigError(
                        "packed micro-batches on megatron's local layer spec support causal "
                        "self-attention in the thd layout with vanilla softmax only"
                    )
                return self._packed(query, key, value, packed_seq_params)
            if attention_mask is None and attention_bias is None and self._sdpa_expresses_it():
                return self._padded(query, key, value)
            return super().forward(  # type: ignore[no-any-return, unused-ignore]
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )

        def _sdpa_expresses_it(self) -> bool:
            """Causal self-attention with a vanilla softmax: what one SDPA call computes."""
            return self.softmax_offset is None and self.attn_mask_type == AttnMaskType.causal

        def _padded(
            self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
        ) -> torch.Tensor:
            """Right-padded rows, ``query`` ``[s, b, heads, dim]``, ``key``/``value``
            ``[s, b, groups, dim]`` -> ``[s, b, heads * dim]``: the local path's causal mask
            over the whole row, so every position (padding too) gets what the local path gives
            it, without the ``[b, heads, s, s]`` score matrix."""
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            with self._dropout_rng():
                out = self._attend(q, k, v)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

        def _packed(
            self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
        ) -> torch.Tensor:
            """``query`` ``[t, heads, dim]``, ``key``/``value`` ``[t, groups, dim]`` ->
            ``[t, heads * dim]``, causal inside each ``cu_seqlens_q`` segment."""
            bounds = params.cu_seqlens_q.tolist()
            pieces = []
            with self._dropout_rng():
                for start, end in itertools.pairwise(bounds):
                    # [s, heads, dim] -> [1, heads, s, dim]: 4-D input lets the CPU pick its
                    # fused (flash) kernel, which also skips the causal half
                    q, k, v = (x[start:end].transpose(0, 1)[None] for x in (query, key, value))
                    pieces.append(self._attend(q, k, v)[0].transpose(0, 1))
            return torch.cat(pieces).reshape(query.shape[0], -1)

        def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """Causal attention of ``[n, heads, s, dim]`` queries over ``[n, groups, s, dim]``
            keys and values with the local path's scale, sliding window and dropout."""
            scale = self.softmax_scale
            if self.config.apply_query_key_layer_scaling:  # the softmax multiplies it back
                scale *= self.layer_number
            # the local path's own choice for this layer (window_size, window_attn_skip_freq)
            window: tuple[int, int] | None = self.scale_mask_softmax.window_size
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if window is None else _window(q.shape[2], window, q),
                dropout_p=self.attention_dropout.p if self.training else 0.0,
                is_causal=window is None,
                scale=scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )

        def _dropout_rng(self) -> contextlib.AbstractContextManager[Any]:
            """As the local path: each tensor-parallel rank draws its own dropout (its heads)."""
            if self.attention_dropout.p and self.training and not self.config.sequence_parallel:
                return tensor_parallel.get_cuda_rng_tracker().fork()
            return contextlib.nullcontext()

    return PackedDotProductAttention


def _window(length: int, window: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """Which keys each query of a ``length``-token sequence sees under megatron's sliding window
    ``(left, right)``: keys ``i - left`` to ``i + right`` (True: attended), as its local mask."""
    offsets = torch.arange(length, device=like.device)
    relative = offsets[None, :] - offsets[:, None]  # key - query
    return (relative >= -window[0]) & (relative <= window[1])
