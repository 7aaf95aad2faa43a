"""Weight sync by delta: the elements of the Hugging Face weights that changed since the
previous sync, found on each rank's own blocks (``Engine.get_per_tensor_param_shard``).

The first sync sends the whole model (``Engine.get_per_tensor_param``); :meth:`DeltaExport.prime`
then copies this rank's blocks to host memory as the base. Each :meth:`DeltaExport.deltas`
compares the blocks with the base bit for bit (a NaN or a sign of zero that changes is a change),
yields the changed elements' flat positions in their Hugging Face tensor and their values, and
refreshes the base. A receiver that gathers each delta over the default process group and writes
the values at their positions holds exactly the weights of the last sync. In bf16 weights most
elements do not move in a step at a small learning rate, so a delta is a fraction of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs
import torch

from heads.errors import EngineStateError
from strategies.hf.shards import HfBlock

#: Integer dtypes of each element size, to compare floats bit for bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@attrs.frozen(kw_only=True)
class HfDelta:
    """The elements of the Hugging Face tensor ``name`` (``shape``, ``dtype``) this rank found
    changed: their flat ``positions`` (int64) and new ``values`` (empty where none changed or
    this rank's block is a copy another rank contributes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        """What the delta weighs as int32 positions and its values."""
        return self.positions.numel() * 4 + self.values.numel() * self.values.element_size()


@attrs.frozen
class WeightPatch:
    """New ``values`` at flat ``positions`` of one tensor: a delta as a receiver applies it.
    Without positions, ``values`` is the whole tensor (where most of it changed, that is
    smaller than positions and values)."""

    positions: torch.Tensor | None
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (0 if self.positions is None else self.positions.nbytes) + self.values.nbytes

    def apply(self, destination: torch.Tensor) -> None:
        """Write the values into ``destination`` (any view, in its dtype) at their positions."""
        if self.positions is None:
            destination.copy_(self.values.reshape(destination.shape))
            return
        if self.positions.numel() and int(self.positions.max()) >= destination.numel():
            raise ValueError(
                f"a weight patch reaches position {int(self.positions.max())} of a tensor of "
                f"{destination.numel()} elements {tuple(destination.shape)}"
            )
        values = self.values.to(destination.dtype)
        if destination.dim() == 0:  # a scalar: its one element changed, or none did
            if values.numel():
                destination.copy_(values.reshape(()))
            return
        destination[torch.unravel_index(self.positions.long(), destination.shape)] = values


class DeltaExport:
    """This rank's base of each block (host memory, pinned with ``pin_memory``) and the
    changes against it (see the module docstring). ``dtype``: compare and send floating-point
    weights in the dtype the receiver holds (e.g. bf16 for a bf16 rollout engine of float32
    weights: an element whose bf16 value did not change is not sent); None: as exported."""

    def __init__(self, *, pin_memory: bool = False, dtype: torch.dtype | None = None) -> None:
        self.pin_memory = pin_memory
        self.dtype = dtype
        #: Each contributing block's base (flat); None for a block another rank contributes.
        self._base: dict[str, torch.Tensor | None] = {}

    def _flat(self, block: HfBlock) -> torch.Tensor:
        flat = block.tensor.reshape(-1)
        if self.dtype is not None and flat.is_floating_point():
            return flat.to(self.dtype)
        return flat

    def prime(self, blocks: Iterable[HfBlock], *, zeros: bool = False) -> None:
        """Take ``blocks`` as the base, right after a full sync sent the same weights (with
        ``zeros``: a base of zeros, for tensors the receiver does not hold yet, e.g. LoRA
        adapters after a sync of the base model: the first delta then carries their nonzero
        elements). A block another rank contributes needs no base here."""
        for _ in self.priming(blocks, zeros=zeros):
            pass

    def priming(self, blocks: Iterable[HfBlock], *, zeros: bool = False) -> Iterator[HfBlock]:
        """:meth:`prime`, yielding each block once its base is taken: a full sync that sends
        the blocks as they come primes on the way (the base is complete at the end)."""
        self._base = {}
        for block in blocks:
            if not block.contributes:
                self._base[block.name] = None
                yield block
                continue
            flat = self._flat(block)
            base = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=self.pin_memory)
            if zeros:
                base.zero_()
            else:
                base.copy_(flat)
            self._base[block.name] = base
            yield block

    @property
    def names(self) -> list[str]:
        """The blocks of the base, in the order it took them (none before a prime)."""
        return list(self._base)

    def deltas(self, blocks: Iterable[HfBlock]) -> Iterator[HfDelta]:
        """Each block's changes since the base, in the blocks' order; the changed elements of
        the base take their new values. EngineStateError before :meth:`prime`, or for a block
        whose place changed."""
        if not self._base:
            raise EngineStateError(
                "a weight delta before any base: sync the whole model first "
                "(get_per_tensor_param), then DeltaExport.prime (verl: prime_delta_snapshots)"
            )
        for block in blocks:
            local = self._flat(block)
            if block.name not in self._base:
                raise EngineStateError(
                    f"{block.name}: DeltaExport.prime saw no such block (prime again after a full "
                    "sync)"
                )
            base = self._base[block.name]
            if base is None:
                positions, values = torch.empty(0, dtype=torch.long), local[:0]
            elif block.contributes and base.numel() == local.numel() and base.dtype == local.dtype:
                bits = _BITS[local.element_size()]
                held = base.to(local.device, non_blocking=True)
                changed = (local.view(bits) != held.view(bits)).nonzero().reshape(-1)
                values = local[changed]
                base[changed.to(base.device)] = values.to(base.device)
                positions = block.positions(changed)
            else:
                raise EngineStateError(
                    f"{block.name}: this rank's block is not the one DeltaExport.prime saw "
                    "(prime again after a full sync)"
                )
            yield HfDelta(
                name=block.name,
                shape=block.shape,
                dtype=local.dtype,
                positions=positions,
                values=values,
            )
