"""Layout-independent weight draws: each full (unsharded) tensor from a generator seeded by the
engine seed and the tensor's global name, so any parallel layout and any backend that names a
tensor alike starts from the same values."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the engine seed and a global tensor name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_from_name(shape: Sequence[int], std: float, seed: int, name: str) -> torch.Tensor:
    """The full float32 tensor ``name`` drawn from N(0, std) on the host."""
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(list(shape), dtype=torch.float32).normal_(0.0, std, generator=generator)
