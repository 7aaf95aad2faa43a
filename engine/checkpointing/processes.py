"""Which process saves: where its process id means the same process, and whether it still runs."""

from __future__ import annotations

import os
import socket

import psutil


def process_space() -> str:
    """Where a process id means the same process as here: this host and its pid namespace
    (containers on one host may share a host name, not their process ids); usable in a file
    name."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "unknown"
    return f"{socket.gethostname()}@{namespace}"


def is_alive(space: str, pid: int) -> bool:
    """Whether the process ``pid`` of ``space`` may still run (another space's: not known)."""
    if space != process_space() or space.endswith("@unknown"):
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
