"""The repository stands on its own: no tracked file points at files outside it (a clone has
only what is in the repository)."""

from __future__ import annotations

import subprocess

from tests.test_layering import ROOT


def test_no_tracked_file_refers_to_files_outside_the_repository() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    outside = "../" + "shared"  # spelled in two parts so that this file does not match itself
    offenders = [
        name
        for name in filter(None, listed.split("\0"))
        if (ROOT / name).is_file() and outside in (ROOT / name).read_text(errors="ignore")
    ]
    assert offenders == []
