"""Items written from the live tensors: ``own_storage``."""

from __future__ import annotations

import io

import torch

from strategies.checkpoint_files.staged_dcp import own_storage


def _saved(tensor: torch.Tensor) -> bytes:
    stream = io.BytesIO()
    torch.save(tensor, stream)
    return stream.getvalue()


def test_a_view_into_a_flat_buffer_is_written_from_its_own_memory_and_bytes_only() -> None:
    flat = torch.arange(64, dtype=torch.float32)
    view = flat[8:32].view(4, 6)
    own = own_storage(view)
    assert own.data_ptr() == view.data_ptr()  # the same memory, not a copy
    assert own.untyped_storage().nbytes() == view.numel() * view.element_size()
    assert torch.equal(own, view) and own.shape == view.shape and own.dtype == view.dtype
    # torch.save writes a tensor's whole storage: the view alone writes the whole buffer
    assert _saved(own) == _saved(view.clone())
    assert len(_saved(view)) > len(_saved(own))
    flat[8] = -1.0  # it stays the live tensor
    assert own[0, 0] == -1.0


def test_tensors_with_their_own_storage_or_not_contiguous_are_left_as_they_are() -> None:
    whole = torch.ones(3, 4, dtype=torch.bfloat16)
    assert own_storage(whole) is whole
    transposed = torch.arange(12.0).view(3, 4).t()
    assert own_storage(transposed) is transposed
