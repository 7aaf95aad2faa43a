"""LoRA on megatron's tensor-parallel linears.

Each transformer layer gets a ``lora`` module holding one
:class:`~strategies.model.peft_lora.LoraPair` per Hugging Face target (``q_proj`` ...
``down_proj``); a forward hook on the megatron linear adds the adapters' output to the linear's, in
the linear's own layout:

- column-parallel (``linear_qkv``: q/k/v; ``linear_fc1``: gate/up): ``A`` is replicated and
  reads the full input; its rank-r output goes through ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce backward: ``A``'s gradient sums every rank's part of the
  output); ``B`` is split over the output rows like the base weight, and the targets' outputs
  are placed as megatron lays the fused output out (per query group q, k, v; ``[gate; up]``
  per rank). A target that is not adapted adds zeros.
- row-parallel (``linear_proj``: o; ``linear_fc2``: down): ``A`` is split along the input like
  the base weight, its partial rank-r sums are all-reduced
  (``reduce_from_tensor_model_parallel_region``), ``B`` is replicated.

With sequence parallelism a column-parallel linear's input is this rank's part of the sequence
(the linear gathers it itself): ``A`` reads that part and its rank-r output is gathered along the
sequence (``gather_from_sequence_parallel_region``; backward, reduce-scattered); a row-parallel
linear's output is reduce-scattered along the sequence, and so are ``A``'s partial sums
(``reduce_scatter_to_sequence_parallel_region``) before the replicated ``B``. The replicated
tensor that then sees only the rank's part of the sequence (the column case's ``A``, the row
case's ``B``) is marked ``sequence_parallel``, and megatron's ``finalize_model_grads``
all-reduces its gradient over the tensor-parallel group, as for the norms.

Replicated adapter tensors get the same gradient on every tensor-parallel rank, so megatron's
DDP (data-parallel reduction) and grad norm (which counts replicated tensors once) treat them
as they treat norm weights. Sharded ones carry megatron's tensor-parallel attributes, which
grad norms and ``sharded_state_dict`` read. Every other parameter is frozen, except a
non-vocabulary head's output layer (``ReplicatedOutputLayer``, value and reward heads): that new
layer trains whole, so megatron's DDP and optimizer (the distributed one too, which take the
parameters that require gradients) hold it beside the adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from heads.errors import ConfigError
from strategies.backends.megatron.hf.adapters import fuse_qkv
from strategies.backends.megatron.model import ReplicatedOutputLayer
from strategies.model.peft_lora import (
    AdapterSwitch,
    LoraPair,
    a_owner,
    adapter_delta,
    adapter_names,
    draw_a,
    low_rank_update,
)
from strategies.part_configs import PartsConfig

#: megatron linear (inside a layer) -> (its Hugging Face targets, column-parallel?).
LINEARS: dict[str, tuple[tuple[str, ...], bool]] = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), True),
    "self_attention.linear_proj": (("o_proj",), False),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), True),
    "mlp.linear_fc2": (("down_proj",), False),
}
ADAPTERS = "lora"


def check_lora(config: PartsConfig, uses_te: bool) -> None:
    """What megatron LoRA supports (ConfigError naming the option otherwise)."""
    if config.model.is_moe:
        raise ConfigError(
            "EngineConfig.lora on a mixture-of-experts model is not supported by the megatron "
            "backend yet (expert linears get no adapters); use a dense model"
        )
    if uses_te:
        raise ConfigError(
            "EngineConfig.lora needs MegatronBackend.layer_spec='local' (TransformerEngine's "
            "linears fuse the layer norm into the linear, which the adapters must read after)"
        )


class LayerAdapters(torch.nn.Module):
    """One layer's adapters, by target; knows how megatron's checkpoints shard them."""

    def __init__(self) -> None:
        super().__init__()
        #: state-dict key -> the dimension it is split along over tensor-parallel ranks
        self.tensor_parallel_axes: dict[str, int] = {}

    def pair(self, target: str) -> LoraPair | None:
        found = self._modules.get(target)
        return found if isinstance(found, LoraPair) else None

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[Any, ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sharded: dict[str, Any] = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            self.tensor_parallel_axes,
            sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {})["dp_cp_group"],
        )
        return sharded


def attach_adapters(chunk: torch.nn.Module, config: PartsConfig, switch: AdapterSwitch) -> None:
    """Freeze ``chunk`` but a non-vocabulary head's output layer, and give each of its layers
    its adapters (drawn from (seed, Hugging Face name), this rank's shard kept) and the hooks
    that apply them."""
    from megatron.core import parallel_state as ps

    lora = config.lora
    assert lora is not None
    for param in chunk.parameters():
        param.requires_grad_(False)
    embedding = getattr(chunk, "embedding", None)
    if embedding is not None and getattr(chunk.config, "recompute_granularity", None):
        # megatron's recompute is a reentrant checkpoint: its output has a gradient only if an
        # input does, and the frozen embedding's output has none (peft's
        # enable_input_require_grads, for the same reason).
        embedding.register_forward_hook(_input_requires_grad)
    head_layer = head_output_layer(chunk)
    if head_layer is not None:
        head_layer.requires_grad_(True)
    tp_rank, tp_size = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
    )
    sizes = _target_sizes(config)
    for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
        number = int(layer.layer_number) - 1
        adapters = LayerAdapters()
        for target in lora.target_modules:
            fan_in, fan_out, column = sizes[target]
            owner = a_owner(target, lora)
            a_name, _ = adapter_names(number, owner)
            full_a = draw_a((lora.rank, fan_in), config.seed, a_name, lora.a_init)
            # column-parallel: B split over its rows; row-parallel: A over its columns
            split_name, split = ("lora_B", 0) if column else ("lora_A", 1)
            if column:
                pair = LoraPair(fan_in, lora.rank, fan_out // tp_size)
                shard_a = full_a
            else:
                pair = LoraPair(fan_in // tp_size, lora.rank, fan_out)
                shard_a = full_a.chunk(tp_size, dim=1)[tp_rank]
            reference = next(layer.parameters())
            pair.to(device=reference.device, dtype=reference.dtype)
            with torch.no_grad():
                pair.lora_A.weight.copy_(shard_a)
                pair.lora_B.weight.zero_()
            for part in ("lora_A", "lora_B"):
                weight = pair.get_parameter(f"{part}.weight")
                _mark(weight, split if part == split_name else None, tp_size)
                # the replicated tensor that reads (column: A) or writes (row: B) the rank's
                # part of the sequence: its gradient is a partial sum (see the module)
                weight.sequence_parallel = (  # type: ignore[attr-defined]
                    config.parallel.sequence_parallel and part != split_name and tp_size > 1
                )
            shared = adapters.pair(owner)
            if shared is not None:  # share_a: the fused linear's first target's A
                pair.lora_A = shared.lora_A
            adapters.tensor_parallel_axes[f"{target}.{split_name}.weight"] = split
            adapters.add_module(target, pair)
        layer.add_module(ADAPTERS, adapters)
        for path, (targets, column) in LINEARS.items():
            if any(adapters.pair(target) for target in targets):
                hook = _column_hook if column else _row_hook
                layer.get_submodule(path).register_forward_hook(
                    hook(adapters, targets, config, switch)
                )


def _input_requires_grad(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _mark(param: torch.Tensor, dim: int | None, tp_size: int) -> None:
    """megatron's tensor-parallel attributes (``dim`` None: replicated)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, dim is not None and tp_size > 1, dim or 0, 1)


def _target_sizes(config: PartsConfig) -> dict[str, tuple[int, int, bool]]:
    """Per target: (full input size, full output size, column-parallel?)."""
    model = config.model
    head_dim = model.head_dim or model.hidden_size // model.num_attention_heads
    attention = model.num_attention_heads * head_dim
    kv = (model.num_query_groups or model.num_attention_heads) * head_dim
    hidden, ffn = model.hidden_size, model.resolved_ffn_hidden_size
    return {
        "q_proj": (hidden, attention, True),
        "k_proj": (hidden, kv, True),
        "v_proj": (hidden, kv, True),
        "o_proj": (attention, hidden, False),
        "gate_proj": (hidden, ffn, True),
        "up_proj": (hidden, ffn, True),
        "down_proj": (ffn, hidden, False),
    }


Hook = Callable[[torch.nn.Module, tuple[Any, ...], Any], Any]


def _column_hook(
    adapters: LayerAdapters, targets: tuple[str, ...], config: PartsConfig, switch: AdapterSwitch
) -> Hook:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    lora = config.lora
    assert lora is not None
    tp_size = ps.get_tensor_model_parallel_world_size()
    # A's rank-r output into the tensor-parallel region as the linear's input enters it
    enter = (
        mappings.gather_from_sequence_parallel_region
        if config.parallel.sequence_parallel and tp_size > 1
        else mappings.copy_to_tensor_model_parallel_region
    )
    groups = (config.model.num_query_groups or config.model.num_attention_heads) // tp_size
    sizes = _target_sizes(config)

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not switch.enabled:
            return output
        out, bias = output
        x = args[0]
        pieces = []
        lows: dict[int, torch.Tensor] = {}  # per A: a shared one (share_a) reads x once
        for target in targets:
            pair = adapters.pair(target)
            if pair is None:
                pieces.append(out.new_zeros(*out.shape[:-1], sizes[target][1] // tp_size))
                continue
            if id(pair.lora_A) not in lows:
                lows[id(pair.lora_A)] = enter(
                    low_rank_update(x, pair.lora_A, lora, module.training)
                )
            pieces.append(pair.lora_B(lows[id(pair.lora_A)]) * lora.scale)
        delta = _fuse_last(pieces, groups) if len(pieces) == 3 else torch.cat(pieces, dim=-1)
        return out + delta.to(out.dtype), bias

    return hook


def _row_hook(
    adapters: LayerAdapters, targets: tuple[str, ...], config: PartsConfig, switch: AdapterSwitch
) -> Hook:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    lora = config.lora
    assert lora is not None
    (target,) = targets
    # A's partial sums out of the tensor-parallel region as the linear's output leaves it
    leave = (
        mappings.reduce_scatter_to_sequence_parallel_region
        if config.parallel.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        else mappings.reduce_from_tensor_model_parallel_region
    )

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        pair = adapters.pair(target)
        if not switch.enabled or pair is None:
            return output
        out, bias = output
        low = leave(low_rank_update(args[0], pair.lora_A, lora, module.training))
        return out + (pair.lora_B(low) * lora.scale).to(out.dtype), bias

    return hook


def _fuse_last(pieces: list[torch.Tensor], groups: int) -> torch.Tensor:
    """q, k, v outputs (last dimension) in megatron's fused per-query-group layout."""
    return torch.cat([piece.unflatten(-1, (groups, -1)) for piece in pieces], dim=-1).flatten(-2)


def head_output_layer(chunk: torch.nn.Module) -> ReplicatedOutputLayer | None:
    """The chunk's output layer when it is a head's own (not the vocabulary's): it trains
    with LoRA; None on other pipeline stages and for LM heads."""
    layer = getattr(chunk, "output_layer", None)
    return layer if isinstance(layer, ReplicatedOutputLayer) else None


def layer_adapters(chunk: torch.nn.Module) -> dict[int, LayerAdapters]:
    """The chunk's adapters by global layer number (0-based); empty without LoRA."""
    found: dict[int, LayerAdapters] = {}
    for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
        adapters = getattr(layer, ADAPTERS, None)
        if isinstance(adapters, LayerAdapters):
            found[int(layer.layer_number) - 1] = adapters
    return found


def is_adapter_parameter(local_name: str) -> bool:
    return f".{ADAPTERS}." in local_name


def merged_delta(
    layer: int,
    linear: str,
    adapters: LayerAdapters,
    full: Callable[[str, torch.Tensor], torch.Tensor],
    config: PartsConfig,
) -> torch.Tensor | None:
    """``(B @ A) * scale`` of the targets of ``linear`` (``self_attention.linear_qkv``...) laid
    out as its full weight, float32 (zeros for a target without adapter); None when none of
    them is adapted. ``full(global name, param)`` gives an adapter tensor's full value."""
    lora = config.lora
    assert lora is not None
    targets, _ = LINEARS[linear]
    if not any(adapters.pair(target) for target in targets):
        return None
    sizes = _target_sizes(config)
    device = next(adapters.parameters()).device
    deltas = []
    for target in targets:
        pair = adapters.pair(target)
        fan_in, fan_out, _ = sizes[target]
        if pair is None:
            deltas.append(torch.zeros(fan_out, fan_in, device=device))
            continue
        prefix = _global_prefix(layer, target)
        a = full(f"{prefix}.lora_A.weight", pair.lora_A.weight)
        b = full(f"{prefix}.lora_B.weight", pair.lora_B.weight)
        deltas.append(adapter_delta(a, b, lora.scale))
    if len(deltas) == 3:
        groups = config.model.num_query_groups or config.model.num_attention_heads
        return fuse_qkv(deltas[0], deltas[1], deltas[2], groups)
    return torch.cat(deltas, dim=0)


def adapter_parameters(
    chunk: torch.nn.Module,
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(Hugging Face name, global name, parameter) of every adapter tensor of ``chunk``."""
    for layer, adapters in layer_adapters(chunk).items():
        for target, pair in adapters.named_children():
            assert isinstance(pair, LoraPair)
            a_name, b_name = adapter_names(layer, target)
            prefix = _global_prefix(layer, target)
            yield a_name, f"{prefix}.lora_A.weight", pair.lora_A.weight
            yield b_name, f"{prefix}.lora_B.weight", pair.lora_B.weight


def adapter_tensors(
    chunk: torch.nn.Module, full: Callable[[str, torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) of every adapter tensor of ``chunk``."""
    for hf_name, global_name, param in adapter_parameters(chunk):
        yield hf_name, full(global_name, param).clone()


def _global_prefix(layer: int, target: str) -> str:
    """The global name of layer ``layer``'s adapter of ``target`` (``init.global_parameters``)."""
    return f"decoder.layers.{layer}.{ADAPTERS}.{target}"
