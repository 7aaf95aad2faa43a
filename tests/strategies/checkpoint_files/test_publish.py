"""Checksums written with the bytes: the same as reading the file back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.checkpoint_files.publish import WRITE_CHECKSUM, ChecksummedFile, file_checksum


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.binary(max_size=300), max_size=12), writeback=st.integers(1, 512))
def test_a_file_checksummed_while_written_has_the_checksum_and_size_read_back(
    tmp_path_factory: pytest.TempPathFactory, chunks: list[bytes], writeback: int
) -> None:
    """Whatever the writes and however often the background writeback starts, the entry is
    the file's size and read-back checksum, and ``tell`` is the file position."""
    path = tmp_path_factory.mktemp("written") / "file.bin"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChecksummedFile, "WRITEBACK_BYTES", writeback)
        with ChecksummedFile(path) as stream:
            position = 0
            for chunk in chunks:
                position += stream.write(chunk)
                assert stream.tell() == position
            stream.sync()
    entry = stream.entry()
    assert entry == {"size": os.path.getsize(path), WRITE_CHECKSUM: file_checksum(path)}
    assert path.read_bytes() == b"".join(chunks)


def test_checksum_of_an_empty_file_is_that_of_no_bytes(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.touch()
    with ChecksummedFile(tmp_path / "also-empty") as stream:
        pass
    assert file_checksum(empty) == stream.entry()[WRITE_CHECKSUM]
