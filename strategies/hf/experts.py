"""How mixture-of-experts checkpoints name their routers and experts, and how transformers'
parameters map onto those names.

On disk every family stores one tensor per expert projection (Qwen3-MoE
``model.layers.N.mlp.experts.E.gate_proj.weight``; Mixtral
``model.layers.N.block_sparse_moe.experts.E.w1.weight``). transformers 5.x holds a layer's
experts FUSED in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, each expert's gate rows
first, and ``mlp.experts.down_proj [E, H, I]``; Mixtral's block renamed to ``mlp``) and converts
when it loads and saves; 4.x holds them under the on-disk names. :class:`CheckpointLayout`
maps either onto the on-disk names, so the engine reads and writes what ``save_pretrained``
writes whichever transformers is installed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs
import torch

from strategies.part_configs import ModelConfig

_LAYER = "model.layers.{}.{}"
#: transformers 5.x's in-memory router and fused experts of layer N.
_FUSED = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$"
)


@attrs.frozen
class ExpertNames:
    """A family's on-disk names inside ``model.layers.N``: the MoE block, and each expert's
    (gate, up, down) projections."""

    block: str
    projections: tuple[str, str, str]

    def router(self, layer: int | str) -> str:
        return _LAYER.format(layer, f"{self.block}.gate.weight")

    def expert(self, layer: int | str, expert: int | str) -> tuple[str, str, str]:
        """(gate, up, down) weight names of ``expert`` in ``layer``."""
        gate, up, down = (
            _LAYER.format(layer, f"{self.block}.experts.{expert}.{projection}.weight")
            for projection in self.projections
        )
        return gate, up, down


#: model_type -> its checkpoints' expert names.
EXPERT_NAMES: dict[str, ExpertNames] = {
    "qwen3_moe": ExpertNames("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ExpertNames("block_sparse_moe", ("w1", "w3", "w2")),
}


def moe_family(model: ModelConfig) -> str:
    """The Hugging Face family of a mixture-of-experts ModelConfig: Qwen3-MoE has q/k norms,
    Mixtral has none (``strategies.hf.architecture`` refuses what neither computes)."""
    return "qwen3_moe" if model.qk_layernorm else "mixtral"


class CheckpointLayout:
    """transformers' parameters of a family <-> the tensors its checkpoints hold.

    A fused parameter is the row-wise concatenation of its checkpoint tensors in ``names``
    order (``gate_up_proj[e] = cat(gate_e, up_e)``, ``down_proj[e] = down_e``), so splitting
    and joining are a chunk and a cat. Every other parameter is its own checkpoint tensor.
    """

    def __init__(self, model_type: str | None) -> None:
        self.experts = EXPERT_NAMES.get(model_type or "")

    @classmethod
    def of(cls, model: ModelConfig) -> CheckpointLayout:
        """The layout of ``model``'s Hugging Face family."""
        return cls(moe_family(model) if model.is_moe else None)

    def names(self, name: str, shape: Sequence[int]) -> tuple[str, ...]:
        """The checkpoint tensors the parameter ``name`` of ``shape`` is made of."""
        match = _FUSED.match(name) if self.experts is not None else None
        if match is None or self.experts is None:
            return (name,)
        layer, what = match.groups()
        if what == "gate.weight":
            return (self.experts.router(layer),)
        experts = [self.experts.expert(layer, e) for e in range(shape[0])]
        if what == "experts.gate_up_proj":
            return tuple(name for gate, up, _ in experts for name in (gate, up))
        return tuple(down for _, _, down in experts)

    def split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs of the parameter ``name``; the pieces of a fused
        parameter are each a tensor of its own."""
        names = self.names(name, tensor.shape)
        if len(names) == 1:
            return [(names[0], tensor)]
        rows = tensor.reshape(-1, tensor.shape[-1])
        pieces = torch.chunk(rows, len(names))
        return [(stored, piece.clone()) for stored, piece in zip(names, pieces, strict=True)]

    def join(
        self, name: str, shape: Sequence[int], tensors: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """The parameter ``name`` of ``shape`` from its checkpoint tensors (``names`` order)."""
        if len(tensors) == 1:
            return tensors[0]
        return torch.cat(list(tensors)).reshape(*shape)
