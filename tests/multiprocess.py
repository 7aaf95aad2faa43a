"""Run a function on several ranks (gloo on 127.0.0.1, a store on a port the OS picked, every
process timed out)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: ``torchrun`` with two ranks on this host, then ``-m`` (the module to run follows). Standalone:
#: torchrun picks its own rendezvous port, so parallel runs never race for one.
TORCHRUN_TWO_RANKS = (
    sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
)  # fmt: skip

_LAUNCHER = """
import os, pickle, sys, traceback
sys.path.insert(0, {root!r})
import importlib
module_name, function_name, args_path, out_path = sys.argv[1:5]
with open(args_path, "rb") as handle:
    args = pickle.load(handle)
try:
    result = ("ok", getattr(importlib.import_module(module_name), function_name)(*args))
except BaseException as error:
    result = ("error", f"{{type(error).__name__}}: {{error}}\\n{{traceback.format_exc()}}")
with open(out_path, "wb") as handle:
    pickle.dump(result, handle)
sys.stdout.flush()
sys.stderr.flush()
# No process-group teardown and no interpreter finalisation: teardown can block on a peer that
# has already left, and finalising a rank that holds a gloo group aborted it now and then
# ("terminate called without an active exception", exit -6: seen in 1 of 4 runs of a rank that
# had already printed its result). The result is written; the launcher kills whatever this rank
# started along with its process group.
os._exit(0)
"""


def fresh_process_env(**settings: str) -> dict[str, str]:
    """This environment for a launcher run in a fresh process: the repository importable, one
    thread, none of a parent run's rank variables; plus ``settings``."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **settings,
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _kill_group(leader: int) -> None:
    """SIGKILL what is left of a finished rank's process group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)


class RankFailure(AssertionError):
    """A rank raised, crashed or outlived its timeout."""


def run_ranks(
    function: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    leave_children: bool = False,
) -> list[Any]:
    """Call ``function(*args)`` in ``world_size`` fresh processes set up as torchrun would; return
    each rank's result. Raises RankFailure with every failing rank's error and output.
    ``leave_children``: do not kill what a rank left running when it ended (the caller checks
    and cleans up)."""
    root = str(Path(__file__).resolve().parent.parent)
    module = function.__module__
    if module == "__main__":  # run as `python -m package.module`: import it by that name
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    # The test process holds the rendezvous store on a port the OS picked, and every rank
    # connects to it as a client: picking a free port for rank 0 to bind later raced with other
    # processes taking it (then rank 0 failed and its peer waited out its timeout).
    store = rendezvous_store(world_size, timeout)
    with tempfile.TemporaryDirectory() as folder:
        args_path = os.path.join(folder, "args.pkl")
        with open(args_path, "wb") as handle:
            pickle.dump(args, handle)
        processes = []
        for rank in range(world_size):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            }
            out_path = os.path.join(folder, f"rank{rank}.pkl")
            command = [
                sys.executable,
                "-c",
                _LAUNCHER.format(root=root),
                module,
                function.__name__,
                args_path,
                out_path,
            ]
            log = open(os.path.join(folder, f"rank{rank}.log"), "w+")  # noqa: SIM115
            # Each rank leads its own process group, so that whatever it started (e.g. the
            # Manager of megatron's checkpoint writer) goes with it when the rank ends or dies.
            worker = subprocess.Popen(
                command, env=env, stdout=log, stderr=log, start_new_session=True
            )
            processes.append((worker, log))
        failures, results = [], []
        for rank, (process, _) in enumerate(processes):
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other, _ in processes:
                    _kill_group(other.pid)
                failures.append(f"rank {rank}: still running after {timeout:.0f} s (killed)")
                continue
        for rank, (process, log) in enumerate(processes):
            process.wait()
            if not leave_children:
                _kill_group(process.pid)
            log.seek(0)
            output = log.read()[-4000:]
            log.close()
            out_path = os.path.join(folder, f"rank{rank}.pkl")
            if not os.path.exists(out_path):
                failures.append(
                    f"rank {rank}: exited {process.returncode} with no result\n{output}"
                )
                continue
            with open(out_path, "rb") as handle:
                status, value = pickle.load(handle)
            if status == "error":
                failures.append(f"rank {rank}: {value}")
            results.append(value)
        if failures:
            raise RankFailure("\n".join(failures))
        return results


def rendezvous_store(world_size: int, timeout: float) -> Any:
    """A TCPStore the test process holds on a port the OS picks (no pick-then-bind race);
    workers connect to ``store.port`` as clients."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
