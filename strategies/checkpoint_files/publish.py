"""Publishing a directory whole: write it under a temporary name, then rename it into place, so
a reader never sees a half-written checkpoint (engine checkpoints and Hugging Face exports);
and the checksums that let a reader trust each file."""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

import xxhash

from heads.errors import CheckpointError

#: Checksum algorithms a manifest may name; files are written with ``WRITE_CHECKSUM``.
CHECKSUMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
WRITE_CHECKSUM = "xxh3_128"
#: ``{"size": bytes, WRITE_CHECKSUM: hex digest}`` of each file, by its name.
FileChecksums = dict[str, dict[str, Any]]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file or directory to stable storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def file_checksum(path: str | os.PathLike[str], algorithm: str = WRITE_CHECKSUM) -> str:
    """The checksum of a file's bytes, read from disk (mapped, not copied: twice as fast as
    reading it in blocks when it is in the page cache)."""
    digest = CHECKSUMS[algorithm]()
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                digest.update(mapped)
    return str(digest.hexdigest())


class ChecksummedFile(io.IOBase):
    """A new binary file, written sequentially, that checksums the bytes as they are written
    (so nobody has to read the file back to checksum it). Every ``WRITEBACK_BYTES`` a thread
    starts flushing what is written so far to disk, so that the final :meth:`sync` overlaps
    the writing instead of following it."""

    WRITEBACK_BYTES = 32 << 20

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._digest = CHECKSUMS[WRITE_CHECKSUM]()
        self._size = 0
        self._unflushed = 0
        self._writeback: threading.Thread | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        written = self._file.write(view)
        self._size += written
        self._unflushed += written
        if self._unflushed >= self.WRITEBACK_BYTES and not self._writeback_running():
            self._file.flush()
            self._unflushed = 0
            self._writeback = threading.Thread(target=os.fdatasync, args=(self._file.fileno(),))
            self._writeback.start()
        return written

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        """Flush to stable storage."""
        self._join_writeback()
        self._file.flush()
        os.fsync(self._file.fileno())

    def entry(self) -> dict[str, Any]:
        """What a manifest records of this file: its size and checksum."""
        return {"size": self._size, WRITE_CHECKSUM: str(self._digest.hexdigest())}

    def _writeback_running(self) -> bool:
        return self._writeback is not None and self._writeback.is_alive()

    def _join_writeback(self) -> None:
        if self._writeback is not None:
            self._writeback.join()
            self._writeback = None

    def close(self) -> None:
        if self.closed:
            return
        self._join_writeback()  # before its descriptor closes (and could be reused)
        super().close()  # flushes
        self._file.close()


def publish_directory(staging: str, target: str) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is replaced (moved aside first,
    removed after). CheckpointError when the file system refuses."""
    aside = f"{staging}-replaced"
    try:
        if os.path.exists(target):
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(target, aside)
        os.rename(staging, target)
        fsync_path(os.path.dirname(os.path.abspath(target)))
    except OSError as error:
        raise CheckpointError(
            f"cannot move the checkpoint into place at {target}: {error}"
        ) from error
    shutil.rmtree(aside, ignore_errors=True)
