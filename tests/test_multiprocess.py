"""The test launcher itself: ranks and documentation scripts forked from the zygote get their own
environment, output, exit status and timeout, as fresh processes would."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.multiprocess import (
    FreshProcessWarning,
    RankFailure,
    fresh_process_env,
    run_module,
    run_ranks,
    run_script,
)


def what_a_rank_sees(marker: str) -> dict[str, Any]:
    """One rank (started by ``run_ranks``): its rank variables, and whether the heavy imports
    were already there when it started (forked from the zygote) before it imported anything."""
    preloaded = "megatron.core" in sys.modules
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = [dist.get_rank() + 1]
    import torch

    tensor = torch.tensor(total)
    dist.all_reduce(tensor)
    return {
        "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "sum": int(tensor),
        "marker": marker,
        "preloaded": preloaded,
        "session_leader": os.getsid(0) == os.getpid(),
    }


@pytest.mark.multiprocess
def test_ranks_get_their_own_rank_variables_and_a_session_each() -> None:
    results = run_ranks(what_a_rank_sees, 2, "m", timeout=120)
    assert [(r["rank"], r["world"], r["sum"], r["marker"]) for r in results] == [
        (0, 2, 3, "m"),
        (1, 2, 3, "m"),
    ]
    assert all(r["session_leader"] for r in results)
    if os.environ.get("TESTS_FRESH_PROCESSES") != "1":
        # forked from the zygote: torch, megatron-core and the engine were imported once
        assert all(r["preloaded"] for r in results)


def wait_for_ever_in_a_thread() -> None:
    """One rank that never ends: its main thread waits on a thread that waits on nothing."""
    import threading

    never = threading.Event()
    waiter = threading.Thread(target=never.wait, name="waiting_on_nothing")
    waiter.start()
    waiter.join()


def test_a_rank_past_its_timeout_is_reported_with_its_threads_stacks_never_as_an_exit() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(wait_for_ever_in_a_thread, 1, timeout=5)
    message = str(failure.value)
    assert message.startswith("rank 0: still running after 5 s (killed;")
    assert "exited" not in message  # a test expecting a kill (exited -9) must not pass on a hang
    assert "wait_for_ever_in_a_thread" in message  # the main thread's stack
    assert "in wait" in message  # and the waiting thread's (threading.Event.wait)


def test_a_script_gets_its_output_status_environment_and_directory(tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(
        "import os, sys, tempfile\n"
        "preloaded = 'megatron.core' in sys.modules\n"
        "print(__name__, os.getcwd() == os.path.dirname(sys.argv[0]), preloaded)\n"
        "print('tmp', tempfile.gettempdir() == os.environ['TMPDIR'], file=sys.stderr)\n"
        "raise SystemExit(3)\n"
    )
    result = run_script(script, fresh_process_env(TMPDIR=str(tmp_path)), tmp_path, timeout=60)
    assert result.returncode == 3
    assert result.stderr == "tmp True\n"
    # forked from the zygote, unless told not to: torch, megatron-core and the engine imported
    forked = os.environ.get("TESTS_FRESH_PROCESSES") != "1"
    assert result.stdout == f"__main__ True {forked}\n"


def test_a_module_runs_as_python_dash_m_would_after_a_megatron_build_in_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_module`` is ``python -m``: the module as ``__main__`` with its arguments, found from
    the working directory, its exit status. Megatron's model build sets ``NVTE_*`` in the
    environment of the process that builds (here: as the test process's in-process builds do);
    a child started after still forks from the zygote, and sees the variable."""
    (tmp_path / "probe_module.py").write_text(
        "import os, sys\n"
        "preloaded = 'megatron.core' in sys.modules\n"
        "print(__name__, sys.argv[0] == __file__, sys.argv[1:], preloaded)\n"
        "print(os.environ.get('NVTE_FLASH_ATTN'), file=sys.stderr)\n"
        "raise SystemExit(4)\n"
    )
    run_script(tmp_path / "probe_module.py", fresh_process_env(), tmp_path, timeout=60)  # zygote up
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    result = run_module("probe_module", ["a", "--b"], fresh_process_env(), tmp_path, timeout=60)
    assert result.returncode == 4
    forked = os.environ.get("TESTS_FRESH_PROCESSES") != "1"
    assert result.stdout == f"__main__ True ['a', '--b'] {forked}\n"
    assert result.stderr == "1\n"


@pytest.mark.skipif(os.environ.get("TESTS_FRESH_PROCESSES") == "1", reason="no zygote")
def test_a_child_whose_environment_differs_in_what_imports_read_starts_fresh_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "block.py"
    script.write_text(
        "import os, sys\nprint('megatron.core' in sys.modules, os.environ['TESTS_LEFT_BEHIND'])\n"
    )
    (tmp_path / "nothing.py").write_text("")
    run_script(tmp_path / "nothing.py", fresh_process_env(), tmp_path, timeout=60)  # zygote up
    monkeypatch.setenv("TESTS_LEFT_BEHIND", "1")  # as a test that leaves a variable behind
    with pytest.warns(FreshProcessWarning, match="differs from the zygote's in TESTS_LEFT_BEHIND"):
        result = run_script(script, fresh_process_env(), tmp_path, timeout=60)
    assert result.returncode == 0 and result.stdout == "False 1\n"


def test_a_script_that_raises_fails_with_its_traceback(tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(
        "def f():\n    raise ValueError('no good')\n\nif __name__ == '__main__':\n    f()\n"
    )
    result = run_script(script, fresh_process_env(), tmp_path, timeout=60)
    assert result.returncode == 1
    assert "ValueError: no good" in result.stderr and "line 2, in f" in result.stderr


def test_a_script_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    started = tmp_path / "child.pid"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(started)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    result = run_script(script, fresh_process_env(), tmp_path, timeout=3)
    assert result.returncode != 0
    assert result.stdout == "started\n" and "(killed after 3 s)" in result.stderr
    child = int(started.read_text())
    for _ in range(100):  # the kill reaches the child at once; its reaping by init may lag
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the script's child {child} outlived the timeout")
