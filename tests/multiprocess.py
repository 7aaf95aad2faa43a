"""Run a function on several ranks (gloo on 127.0.0.1, a store on a port the OS picked, every
process timed out)."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: ``torchrun`` with two ranks on this host, then ``-m`` (the module to run follows). Standalone:
#: torchrun picks its own rendezvous port, so parallel runs never race for one.
TORCHRUN_TWO_RANKS = (
    sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
)  # fmt: skip

#: What a timed-out rank is sent first, to print its threads' stacks (see :func:`launch`).
STACKS_SIGNAL = signal.SIGUSR1
#: How long a timed-out rank is given to print them.
STACKS_GRACE_S = 2.0

#: A rank in a fresh interpreter: the repository importable, then :func:`launch`.
_FRESH = "import sys; sys.path.insert(0, {root!r}); from tests.multiprocess import launch; launch()"


def launch(argv: list[str] | None = None) -> None:
    """A rank's body (argv: module, function, pickled args, result path): call the function, write
    ``("ok", result)`` or ``("error", traceback)``, then leave at once."""
    import importlib
    import traceback

    module_name, function_name, args_path, out_path = (argv or sys.argv[1:])[:4]
    # A rank the launcher finds still running at its timeout is sent STACKS_SIGNAL before it is
    # killed: every thread's stack goes to the rank's output, which the failure shows.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    try:
        with open(args_path, "rb") as handle:
            args = pickle.load(handle)
        function = getattr(importlib.import_module(module_name), function_name)
        result: tuple[str, Any] = ("ok", function(*args))
    except BaseException as error:
        result = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    with open(out_path, "wb") as handle:
        pickle.dump(result, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    # No process-group teardown and no interpreter finalisation: teardown can block on a peer
    # that has already left, and finalising a rank that holds a gloo group aborted it now and
    # then ("terminate called without an active exception", exit -6: seen in 1 of 4 runs of a
    # rank that had already printed its result). The result is written; the launcher kills
    # whatever this rank started along with its process group.
    os._exit(0)


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


def _running(process: Any) -> bool:
    try:
        process.wait(timeout=0)
    except subprocess.TimeoutExpired:
        return True
    return False


def _dump_stacks_then_kill(leaders: list[int]) -> None:
    """Ask each rank still running for its threads' stacks, then SIGKILL every rank's group."""
    for leader in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(leader, STACKS_SIGNAL)
    time.sleep(STACKS_GRACE_S)
    for leader in leaders:
        _kill_group(leader)


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
            argv = [module, function.__name__, args_path, out_path]
            log_path = os.path.join(folder, f"rank{rank}.log")
            log = open(log_path, "w+")  # noqa: SIM115
            # Each rank leads its own process group, so that whatever it started (e.g. Ray, a
            # torchrun child) goes with it when the rank ends or dies.
            request = {"argv": argv, "env": env, "cwd": os.getcwd()}
            worker = _ZYGOTE.fork({**request, "stdout": log_path, "stderr": log_path})
            worker = worker or subprocess.Popen(
                [sys.executable, "-c", _FRESH.format(root=root), *argv],
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
            processes.append((worker, log))
        failures, results = [], []
        deadline, timed_out = time.monotonic() + timeout, set()
        for process, _ in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = {index for index, (other, _) in enumerate(processes) if _running(other)}
                _dump_stacks_then_kill([other.pid for other, _ in processes])
                break
        for rank, (process, log) in enumerate(processes):
            process.wait()
            if not leave_children:
                _kill_group(process.pid)
            log.seek(0)
            output = log.read()[-8000 if rank in timed_out else -4000 :]
            log.close()
            out_path = os.path.join(folder, f"rank{rank}.pkl")
            if rank in timed_out:  # never reported as an exit: a test may expect one (a kill)
                failures.append(
                    f"rank {rank}: still running after {timeout:.0f} s (killed; its threads' "
                    f"stacks at the timeout end its output)\n{output}"
                )
                continue
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


#: What no import reads: the zygote's children may differ from it in these. Megatron's model
#: build sets the ``NVTE_*`` attention choices in the environment of the process that builds
#: (megatron/core/models/common/language_module/language_module.py), so they appear in the test
#: process's environment after its first in-process build, and every child started after would
#: otherwise start fresh.
_NOT_READ_AT_IMPORT = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TMPDIR", "PATH"}
    | {"TORCHELASTIC_USE_AGENT_STORE", "GLOO_SOCKET_IFNAME", "PYTEST_CURRENT_TEST"}
    | {"NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"}
)


class FreshProcessWarning(RuntimeWarning):
    """A child could not fork from the zygote because the environment differs from the one the
    zygote imported under (pytest's warnings summary names the variables)."""


class _ForkedChild:
    """A child the zygote forked: waited for through the status file the zygote writes."""

    def __init__(self, pid: int, status_path: str, zygote: subprocess.Popen[str]) -> None:
        self.pid, self._status_path, self._zygote = pid, status_path, zygote
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if os.path.exists(self._status_path):
                with open(self._status_path) as handle:
                    self.returncode = int(handle.read())
            elif self._zygote.poll() is not None:
                self.returncode = -signal.SIGKILL  # the zygote died: nobody reports this child
            elif deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            else:
                time.sleep(0.02)
        return self.returncode


class _Zygote:
    """The test run's zygote (:mod:`tests.rank_zygote`), started at the first child; ``fork``
    answers None (start a fresh process) where it cannot serve: an environment that differs from
    the zygote's in what imports read, ``TESTS_FRESH_PROCESSES=1``, or a zygote that failed to
    start or died."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._imported_under: dict[str, str] | None = None
        self._imports_set: dict[str, str | None] = {}
        self._warned: set[tuple[str, ...]] = set()
        self._broken = os.environ.get("TESTS_FRESH_PROCESSES") == "1"

    def fork(self, request: dict[str, Any]) -> _ForkedChild | None:
        """``request`` (:mod:`tests.rank_zygote`'s, less ``status``) forked, or None."""
        env = request["env"]
        read = {name: value for name, value in env.items() if name not in _NOT_READ_AT_IMPORT}
        # the same search path however written (an empty entry, the working directory, aside)
        path = env.get("PYTHONPATH", "").split(os.pathsep)
        read["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        if self._broken:
            return None
        if self._imported_under not in (None, self._as_imported(read)):
            self._warn_fresh(self._as_imported(read))
            return None
        try:
            process = self._started(env, read)
            assert process.stdin is not None and process.stdout is not None
            status_path = request["stderr"] + ".status"
            process.stdin.write(json.dumps({**request, "status": status_path}) + "\n")
            process.stdin.flush()
            return _ForkedChild(int(process.stdout.readline()), status_path, process)
        except (OSError, ValueError):
            self._broken = True  # the rest of the run starts fresh processes
            return None

    def _warn_fresh(self, read: dict[str, str]) -> None:
        """Say, once for each set of variables, that children start fresh because of them (a
        test that leaves variables behind, or a library that sets them, costs every later
        child its imports: add them to ``_NOT_READ_AT_IMPORT`` if no import reads them, or
        restore the environment)."""
        under = self._imported_under or {}
        names = tuple(sorted(k for k in read.keys() | under.keys() if read.get(k) != under.get(k)))
        if names not in self._warned:
            self._warned.add(names)
            warnings.warn(
                f"children start fresh processes (about 5 s of imports each): the environment "
                f"differs from the zygote's in {', '.join(names)}",
                FreshProcessWarning,
                stacklevel=4,
            )

    def _as_imported(self, read: dict[str, str]) -> dict[str, str]:
        """``read`` with what the zygote's imports set in the environment (verl's own, e.g.):
        the environment its child runs with, and one a test process that imported those
        libraries itself already has."""
        changed = dict(read)
        for name, value in self._imports_set.items():
            if value is None:
                changed.pop(name, None)
            else:
                changed[name] = value
        return changed

    def _started(self, env: dict[str, str], read: dict[str, str]) -> subprocess.Popen[str]:
        if self._process is None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.rank_zygote"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            atexit.register(self._process.kill)
            assert self._process.stdout is not None
            ready, _, imports_set = self._process.stdout.readline().partition(" ")
            if ready != "ready":
                raise OSError("the zygote did not start")
            self._imports_set = json.loads(imports_set)
            self._imported_under = self._as_imported(read)
        return self._process


_ZYGOTE = _Zygote()


def run_command(
    command: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``command`` in a session of its own in ``cwd`` with ``env``, its output captured; after
    ``timeout`` seconds it is killed with whatever it started (Ray's processes too), and the
    output it printed until then is returned with a note of the kill (status -9)."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        stdout, stderr = process.communicate()
        stderr += f"\n(killed after {timeout:.0f} s)"
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_script(
    path: Path, env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python path`` in ``cwd`` with ``env`` (forked from the zygote where it can be), its
    output captured; killed with whatever it started after ``timeout`` seconds."""
    return _run_forked({"script": str(path)}, [sys.executable, str(path)], env, cwd, timeout)


def run_module(
    module: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` in ``cwd`` with ``env`` (forked from the zygote where it can
    be), its output captured; killed with whatever it started after ``timeout`` seconds."""
    command = [sys.executable, "-m", module, *args]
    return _run_forked({"module": module, "args": list(args)}, command, env, cwd, timeout)


def _run_forked(
    request: dict[str, Any], command: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """The zygote's ``request`` (or, where it cannot serve, ``command`` in a fresh process) in
    ``cwd`` with ``env``: :func:`run_script`'s and :func:`run_module`'s body."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        request = {**request, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        child = _ZYGOTE.fork(request)
        if child is None:
            with open(out, "w") as stdout, open(err, "w") as stderr:
                child = subprocess.Popen(
                    command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True
                )
        note = ""
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            note = f"\n(killed after {timeout:.0f} s)"
        _kill_group(child.pid)  # what it left running; all of it after the timeout
        returncode = child.wait()
        return subprocess.CompletedProcess(
            command, returncode, out.read_text(), err.read_text() + note
        )
