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

* context parallelism: this rank's queries over the whole row's gathered keys and values, or
  through ring attention (``context_parallel``), as the micro-batch's layout says: the backend
  builds it once per micro-batch and hands it to every layer in ``packed_seq_params``
  (``context_parallel.row_params``), with the mask of the keys each query sees (gathered: built
  by the first layer that asks and reused by the others; ring: per block). No attention dropout
  in the ring.

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

import attrs
import torch

from heads.errors import ConfigError
from strategies.backends.megatron.context_parallel import ContextAttention
from strategies.model.packed_attention import attend_per_sequence
from strategies.parallel.ring_attention import Window, ring_attention


@attrs.frozen
class SoftmaxSettings:
    """The local path's softmax for one call: its scale, attention dropout and sliding window,
    and the RNG the dropout draws from (a context to enter around the attention)."""

    scale: float
    dropout: float
    window: Window
    random: Any


@functools.cache
def packed_dot_product_attention() -> type:
    """The class (built once, on first use, so megatron is imported lazily)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class PackedDotProductAttention(DotProductAttention):  # type: ignore[misc, unused-ignore]
        """Local core attention through SDPA: padded rows in one call, packed ``thd`` input
        sequence by sequence; with context parallelism, this rank's queries over the whole
        row's keys and values (``context_parallel``), as the micro-batch's layout says."""

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
            causal = self.softmax_offset is None and self.attn_mask_type == AttnMaskType.causal
            explicit = attention_mask is not None or attention_bias is not None
            if self.config.context_parallel_size > 1:
                check_context_parallel(causal, explicit, packed_seq_params, self._softmax())
                return attend_across_ranks(
                    query, key, value, packed_seq_params.context, self._softmax()
                )
            if packed_seq_params is not None:
                if packed_seq_params.qkv_format != "thd" or not causal:
                    raise ConfigError(
                        "packed micro-batches on megatron's local layer spec support causal "
                        "self-attention in the thd layout with vanilla softmax only"
                    )
                # on the local spec the backend leaves the offsets on the host (row_params)
                bounds = packed_seq_params.cu_seqlens_q.tolist()
                return attend_packed(query, key, value, bounds, self._softmax())
            if not explicit and causal:
                return attend_padded(query, key, value, self._softmax())
            return super().forward(  # type: ignore[no-any-return, unused-ignore]
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )

        def _softmax(self) -> SoftmaxSettings:
            """The local path's softmax scale, dropout, this layer's own sliding window
            (``window_attn_skip_freq``) and the RNG its dropout draws from."""
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
            return SoftmaxSettings(scale, dropout, self.scale_mask_softmax.window_size, random)

    return PackedDotProductAttention


def check_context_parallel(
    causal: bool, explicit: bool, packed_seq_params: Any, softmax: SoftmaxSettings
) -> None:
    """What context parallelism on megatron's local layer spec attends: causal self-attention
    with a vanilla softmax, no explicit mask or bias, the micro-batch's layout handed down; no
    attention dropout in ring attention."""
    if explicit:
        raise ConfigError(
            "context parallelism on megatron's local layer spec takes causal self-attention "
            "without an explicit mask or bias"
        )
    if not causal:
        raise ConfigError(
            "context parallelism on megatron's local layer spec supports causal self-attention "
            "with vanilla softmax only"
        )
    if not isinstance(getattr(packed_seq_params, "context", None), ContextAttention):
        raise ConfigError(
            "context parallelism on megatron's local layer spec needs the micro-batch's layout "
            "in packed_seq_params (context_parallel.row_params); run the model through the "
            "megatron backend"
        )
    if softmax.dropout and packed_seq_params.context.ring is not None:
        raise ConfigError(
            "ring attention (MegatronBackend.context_parallel_attention='ring') has no "
            f"attention dropout (attention_dropout={softmax.dropout}): it attends block by "
            "block; set attention_dropout=0 or use context_parallel_attention='all_gather'"
        )


def attend_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: Sequence[int],
    softmax: SoftmaxSettings,
) -> torch.Tensor:
    """A packed row's ``[t, heads, dim]`` queries over its ``[t, groups, dim]`` keys and values,
    causal inside each segment of ``bounds`` -> ``[t, heads x dim]``."""
    # [t, heads, dim] -> [1, heads, t, dim] and back
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
    out = _attend(q, k, v, bounds, softmax)
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


def attend_padded(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, softmax: SoftmaxSettings
) -> torch.Tensor:
    """Right-padded rows, ``[s, b, heads, dim]`` queries, causal over each whole row -> ``[s, b,
    heads x dim]``: every position, padding included, gets what the local path gives it."""
    # [s, b, heads, dim] -> [b, heads, s, dim] and back
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    out = _attend(q, k, v, (0, query.shape[0]), softmax)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: Sequence[int],
    softmax: SoftmaxSettings,
) -> torch.Tensor:
    """Causal attention of ``[n, heads, s, dim]`` queries over ``[n, groups, s, dim]`` keys and
    values inside each segment of ``bounds``, with the local path's softmax."""
    with softmax.random:
        return attend_per_sequence(
            q, k, v, bounds, scale=softmax.scale, window=softmax.window, dropout=softmax.dropout
        )


def attend_across_ranks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: ContextAttention,
    softmax: SoftmaxSettings,
) -> torch.Tensor:
    """This rank's queries (``[s / CP, b, heads, dim]``, or ``[t / CP, heads, dim]`` packed)
    over the whole row's keys and values (gathered, or round the ring), causal in the queries'
    row positions and inside their own sequence, as the micro-batch's ``context`` says."""
    layout = context.layout
    packed = layout.row.packed
    if packed:  # [t, heads, dim] -> [t, 1, heads, dim]
        query, key, value = (x[:, None] for x in (query, key, value))
    if context.ring is None:
        key, value = layout.gather(key, 0), layout.gather(value, 0)
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    if context.ring is not None:
        out = ring_attention(q, k, v, context.ring, scale=softmax.scale, window=softmax.window)
    else:
        with softmax.random:
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=context.visible_keys(softmax.window),
                dropout_p=softmax.dropout,
                scale=softmax.scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
    out = out.permute(2, 0, 1, 3)
    if packed:
        return out.reshape(query.shape[0], -1)
    return out.reshape(query.shape[0], query.shape[1], -1)
