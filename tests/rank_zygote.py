"""A process that imports the heavy libraries once (torch, megatron-core, transformers,
tensordict, the engine) and forks each test rank, each documentation block and each command-line
run of the engine from that state:
a child starts in a fraction of a second instead of importing them again (about 5 s of CPU).
Started by :mod:`tests.multiprocess` as ``python -m tests.rank_zygote`` with the environment its
children get, less what no import reads (rank variables, ``TMPDIR``, ``PATH``); a child whose
environment differs otherwise starts as a fresh process instead.

Protocol (one JSON object a line on stdin, one line a reply on stdout): ``ready`` once the
imports are done, followed by what they set in the environment (a JSON object, null for a
variable removed: each child gets it too, as its own imports would have set it); then for each
request ``{"env", "cwd", "stdout", "stderr", "status"}`` with ``"argv"`` (a rank:
:func:`tests.multiprocess.launch`'s arguments), ``"script"`` (a path run as ``__main__``) or
``"module"`` and ``"args"`` (as ``python -m module *args``), the forked child's pid. The child
leads a session of its own (so ``killpg(pid)`` ends it and what it started) and writes its
output to the two paths; when it exits, its exit code (negative: the signal) is written to
``status``. The zygote runs one thread and no torch operation, so forking it is safe; it ends
when its stdin closes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import sys
import tempfile
import traceback
from typing import Any

#: What every rank imports anyway; each is imported here once, before any fork.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "tensordict",
    "transformers",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "engine",
    "engine.engine",
    "strategies.backends.megatron.backend",
    "strategies.backends.fsdp2.backend",
    "pytest",
    "hypothesis",
    "tests.multiprocess",
    # where verl is installed: its RL trainer's launcher (verl, Ray, hydra) and the plug-in
    "verl.trainer.main_ppo",
    "engine.integrations.verl.ppo",
    "engine.integrations.verl.adapter",
)


def _fork_rank(request: dict[str, Any]) -> int:
    """Fork one rank (or script) for ``request``; returns its pid. The child never returns: a
    rank leaves through ``os._exit`` (:func:`tests.multiprocess.launch`), a script raises
    SystemExit with its status, so the interpreter ends as ``python script.py`` would (non-daemon
    threads joined, atexit handlers run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        _apply(_IMPORTS_SET)  # as the child's own imports would have
        os.chdir(request["cwd"])
        tempfile.tempdir = None  # TMPDIR is the request's
        if "script" in request:
            status = _run_script(request["script"])
        elif "module" in request:
            status = _run_module(request["module"], request["args"])
        else:
            from tests.multiprocess import launch

            launch(request["argv"])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)
    raise SystemExit(status)


def _run_script(path: str) -> int:
    """Run ``path`` as ``__main__``, as ``python path`` would; its exit status."""
    sys.argv = [path]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    return _exit_status(lambda: runpy.run_path(path, run_name="__main__"))


def _run_module(module: str, args: list[str]) -> int:
    """Run ``module`` as ``__main__`` with ``args``, as ``python -m module *args`` would (the
    working directory first on the search path); its exit status."""
    sys.argv = [module, *args]  # runpy puts the module's path first, as -m does
    sys.path[0] = os.getcwd()
    return _exit_status(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


def _exit_status(main: Any) -> int:
    """Call ``main``; the exit status a Python process ending with it would have."""
    try:
        main()
    except SystemExit as end:
        if end.code is None or isinstance(end.code, int):
            return end.code or 0
        print(end.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _reap(statuses: dict[int, str]) -> None:
    """Write the exit code of every rank that has ended to its status file."""
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = statuses.pop(pid, None)
        if path is not None:
            with open(path + ".part", "w") as handle:
                handle.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".part", path)


#: What the imports above set in the environment (None: removed), e.g. verl's
#: ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``: a child that imported them itself would have it, and
#: the processes it starts (Ray's workers) inherit it.
_IMPORTS_SET: dict[str, str | None] = {}


def _apply(changes: dict[str, str | None]) -> None:
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def main() -> None:
    before = dict(os.environ)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a rank that needs it reports the error itself
            importlib.import_module(name)
    after = dict(os.environ)
    _IMPORTS_SET.update(
        {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    )
    print("ready", json.dumps(_IMPORTS_SET), flush=True)
    statuses: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _reap(statuses)
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = _fork_rank(request)
            statuses[pid] = str(request["status"])
            print(pid, flush=True)


if __name__ == "__main__":
    main()
