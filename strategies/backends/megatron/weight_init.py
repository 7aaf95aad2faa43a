"""Layout-independent weight initialisation.

Every parameter is drawn as its full (unsharded) tensor from a generator seeded by the engine
seed and the parameter's *global* name, then this rank keeps its shard, split the way megatron
splits it (``partition_dim``, ``partition_stride``). So the same seed gives the same model at
any tensor / pipeline / data parallel layout and on any device: TP=2 or PP=2 runs start from
exactly the weights of the single-process run.

Scheme (Llama-style, as megatron's defaults): matrices and embeddings ~ N(0, std); output
projections of each layer (attention ``linear_proj``, MLP ``linear_fc2``) ~ N(0, std /
sqrt(2 * num_layers)); norm weights 1; biases 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import attrs
import torch

from strategies.model.weight_draws import normal_from_name
from strategies.part_configs import PartsConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
#: A routed expert's number: sequential experts (local spec) ``experts.local_experts.E.*``, or
#: TransformerEngine's grouped GEMM ``experts.linear_fc1.weightE``.
_EXPERT = re.compile(r"\.experts\.(?:local_experts\.(\d+)\.|linear_fc[12]\.weight(\d+)$)")
_SCALED_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")
_EMBEDDING = "embedding.word_embeddings.weight"


def initialize_parameters(
    chunk: torch.nn.Module, config: PartsConfig, only: tuple[str, ...] | None = None
) -> None:
    """Re-draw every parameter of a GPTModel chunk (or those whose global name starts with one
    of ``only``) from (seed, global name)."""

    std = config.model.init_method_std
    scaled_std = std / math.sqrt(2.0 * config.model.num_layers)
    with torch.no_grad():
        for global_name, param in global_parameters(chunk):
            if only is not None and not global_name.startswith(only):
                continue
            if param.dim() == 1:
                param.fill_(1.0 if global_name.endswith("weight") else 0.0)
                continue
            layout = TensorParallelLayout.of(global_name, param)
            sigma = scaled_std if global_name.endswith(_SCALED_OUTPUTS) else std
            full = normal_from_name(list(layout.full_shape), sigma, config.seed, global_name)
            param.copy_(layout.shard(full).to(dtype=param.dtype, device=param.device))


def global_parameters(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Parameters named as in the single-process model (global layer numbers; global expert
    numbers under expert parallelism; the last pipeline stage's copy of a tied embedding under
    the embedding's name)."""
    layer_numbers = _global_layer_numbers(chunk)
    expert_offset = _expert_offset(chunk)
    for name, param in chunk.named_parameters():
        yield _global_name(name, param, layer_numbers, expert_offset), param


def is_expert_parameter(global_name: str) -> bool:
    """Whether the parameter belongs to a routed expert (split over expert-parallel ranks)."""
    return _EXPERT.search(global_name) is not None


def expert_number(name: str) -> int | None:
    """The expert number in a parameter name (local or global, as the name has it), or None."""
    match = _EXPERT.search(name)
    return int(match.group(match.lastindex or 0)) if match else None


def renumber_expert(name: str, number: int) -> str:
    """``name`` with its expert number replaced by ``number``."""
    match = _EXPERT.search(name)
    if match is None:
        raise ValueError(f"{name!r} is not a routed expert's parameter")
    group = match.lastindex or 0
    return f"{name[: match.start(group)]}{number}{name[match.end(group) :]}"


def tensor_parallel_place(global_name: str) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that shards this parameter: routed experts
    are sharded over megatron's expert tensor-parallel group, everything else over the
    tensor-parallel group."""
    from megatron.core import parallel_state as ps

    if is_expert_parameter(global_name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _expert_offset(chunk: torch.nn.Module) -> int:
    """Global number of this rank's first local expert (0 without expert parallelism)."""
    from megatron.core import parallel_state as ps

    config = getattr(chunk, "config", None)
    experts = getattr(config, "num_moe_experts", None)
    if not experts:
        return 0
    size = ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * (experts // size)


@attrs.frozen
class TensorParallelLayout:
    """How a parameter is split over its (expert) tensor-parallel group: this rank's part of
    the full tensor (``full_shape``) along ``dim``, in ``stride`` interleaved pieces, as
    megatron's ``_initialize_affine_weight_cpu`` splits it (``size`` 1: held whole)."""

    rank: int
    size: int
    dim: int
    stride: int
    full_shape: tuple[int, ...]

    @classmethod
    def of(cls, global_name: str, param: torch.Tensor) -> TensorParallelLayout:
        rank, size = tensor_parallel_place(global_name)
        if not getattr(param, "tensor_model_parallel", False):
            size = 1
        dim = int(getattr(param, "partition_dim", 0))
        full_shape = list(param.shape)
        full_shape[dim] *= size
        stride = int(getattr(param, "partition_stride", 1))
        return cls(rank if size > 1 else 0, size, dim, stride, tuple(full_shape))

    def indices(self) -> torch.Tensor:
        """The full tensor's indices along ``dim`` this rank holds, in the order it holds them."""
        along = attrs.evolve(self, dim=0)
        return along.shard(torch.arange(self.full_shape[self.dim]))

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a tensor of ``full_shape``, or any tensor as long along
        ``dim``)."""
        if self.size == 1:
            return full
        per_stride = full.shape[self.dim] // self.size // self.stride
        pieces = torch.split(full, per_stride, dim=self.dim)
        return torch.cat(pieces[self.rank :: self.size], dim=self.dim)


def unshard(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of ``_shard``: the full tensor from every rank's part, in rank order."""
    pieces = [torch.chunk(shard, stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def _global_layer_numbers(chunk: torch.nn.Module) -> dict[int, int]:
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", [])
    return {index: int(layer.layer_number) for index, layer in enumerate(layers)}


def _global_name(
    name: str, param: torch.nn.Parameter, layer_numbers: dict[int, int], expert_offset: int
) -> str:
    if getattr(param, "shared_embedding", False):
        return _EMBEDDING  # the last stage's copy of a tied embedding
    expert = expert_number(name)
    if expert is not None and expert_offset:
        name = renumber_expert(name, expert + expert_offset)
    match = _LAYER.match(name)
    if match:
        number = layer_numbers[int(match.group(1))]
        return f"decoder.layers.{number - 1}.{name[match.end() :]}"
    return name
