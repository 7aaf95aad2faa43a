"""A generator's model and its weights under the names the engine exports: the sync's
destinations, its completeness, and LoRA adapters merged into their linears."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.weight_sync import WeightPatch
from strategies.hf.experts import CheckpointLayout
from strategies.model.peft_lora import adapter_delta


def build_model(hf_config: Any, device: torch.device | None = None) -> torch.nn.Module:
    """A Hugging Face causal LM of ``hf_config`` in float32, for inference (its weights come
    from a sync)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model.to(device or torch.device("cpu")).eval()


class GeneratorWeights:
    """Every name a sync may send -> the model's tensor it fills: checkpoint names (the engine's
    export; a mixture-of-experts layer's experts one tensor each, rows of transformers' fused
    parameters) and transformers' own parameter and buffer names.

    A sync is :meth:`copy` per tensor, then :meth:`end_sync` (what it missed). ``sender`` opens
    the errors (``"the actor"``)."""

    def __init__(self, model: torch.nn.Module, layout: CheckpointLayout, sender: str) -> None:
        self.model = model
        self.layout = layout
        self.sender = sender
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        # the model's parameters and buffers by name: the same objects for its whole life
        # (releasing and allocating weights swaps a parameter's storage, not the parameter)
        self.state = model.state_dict(keep_vars=True)
        # what a sync must fill: each parameter's checkpoint tensors (one, or its experts')
        self.pieces = {name: layout.names(name, shape) for name, shape in self.shapes.items()}
        self.targets = self._targets()
        self.received: set[str] = set()
        #: The dtype each weight was sent in: a merged adapter is rounded to it, as the
        #: trainer's merged export rounds it.
        self.sent_dtypes: dict[str, torch.dtype] = {}
        #: Each adapted linear's base weight (the adapters are merged into a copy of it).
        self.base_weights: dict[str, torch.Tensor] = {}
        self.adapted: set[str] = set()

    @property
    def checkpoint_names(self) -> list[str]:
        """The checkpoint tensors a complete sync fills."""
        return [piece for pieces in self.pieces.values() for piece in pieces]

    def accepts(self, name: str) -> bool:
        return name in self.targets

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one sent tensor into the model."""
        destination = self._destination(name)
        if destination.shape != tensor.shape:
            raise ValueError(
                f"{self.sender} sent {name!r}, which has shape {tuple(tensor.shape)} there and "
                f"{tuple(destination.shape)} in the generator"
            )
        destination.copy_(tensor)
        self.sent_dtypes[name] = tensor.dtype
        parameter, rows = self.targets[name]
        self.received.update(self.pieces.get(parameter, ()) if rows is None else (name,))

    def patch(self, name: str, patch: WeightPatch) -> None:
        """Apply a delta of one sent tensor (changed elements only) to the model."""
        patch.apply(self._destination(name))

    def end_sync(self) -> list[str]:
        """The checkpoint tensors this sync did not fill (sorted); the next sync starts empty."""
        missing = sorted(name for name in self.checkpoint_names if name not in self.received)
        self.received = set()
        return missing

    def forget_adapters(self) -> None:
        """The base weights are being replaced: adapters are merged again at their next sync."""
        self.base_weights, self.adapted = {}, set()

    def merge_adapter(
        self, name: str, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
    ) -> None:
        """Set the linear weight ``name`` to its base weight plus ``(B @ A) * scale`` (float32,
        as the engine's merged export), in the dtype the base was sent in."""
        weight = self._destination(name)
        base = self.base_weights.setdefault(name, weight.detach().clone())
        delta = adapter_delta(lora_a, lora_b, scale)
        if delta.shape != base.shape:
            raise ValueError(
                f"{self.sender} sent an adapter of {name!r} that makes {tuple(delta.shape)}; "
                f"the weight is {tuple(base.shape)}"
            )
        weight.copy_((base.float() + delta).to(self.sent_dtypes.get(name, base.dtype)))
        self.adapted.add(name)
        self.received.add(name)

    def end_adapter_sync(self) -> list[str]:
        """The linears adapted before that this adapter sync left unmerged (sorted)."""
        missing = sorted(self.adapted - self.received)
        self.received = set()
        return missing

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the model's weights under checkpoint names (a sync must equal them)."""
        return {
            stored: piece.detach().clone()
            for name, tensor in self.model.state_dict().items()
            for stored, piece in self.layout.split(name, tensor)
        }

    def _destination(self, name: str) -> torch.Tensor:
        target = self.targets.get(name)
        if target is None:
            raise KeyError(
                f"{self.sender} sent {name!r}, which the generator's "
                f"{type(self.model).__name__} does not have"
            )
        parameter, rows = target
        destination = self.state[parameter].data
        if rows is not None:  # one expert's projection inside a fused parameter
            destination = destination.view(-1, destination.shape[-1])[rows]
        return destination

    def _targets(self) -> dict[str, tuple[str, slice | None]]:
        """Each name a sync may send -> (the model's parameter or buffer, its rows or None)."""
        targets: dict[str, tuple[str, slice | None]] = {}
        for name, tensor in self.state.items():
            shape = self.shapes.get(name, tensor.shape)
            targets[name] = (name, None)
            pieces = self.pieces.get(name) or self.layout.names(name, shape)
            if len(pieces) == 1:  # its own checkpoint tensor, maybe renamed (Mixtral's router)
                targets[pieces[0]] = (name, None)
                continue
            rows = math.prod(shape[:-1]) // len(pieces)
            for index, piece in enumerate(pieces):
                targets[piece] = (name, slice(index * rows, (index + 1) * rows))
        return targets
