"""Which code makes each all-reduce: a tally by origin, for tests that count a step's
collectives."""

from __future__ import annotations

import collections
import contextlib
import os
import traceback
from collections.abc import Iterator

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: Past these: the shared helpers that make an all-reduce for their callers, and the tests.
_PASSED = (
    os.path.join(ROOT, "strategies", "parallel", "collectives.py"),
    os.path.join(ROOT, "tests", ""),
)
#: Installed packages (a virtual environment inside the repository, as CI makes it) are not
#: the project's code.
_INSTALLED = f"{os.sep}site-packages{os.sep}"
#: The step's one all-reduce of counts (tokens, sequences, mask sums, and the refusal flag).
COUNTS = "engine/step.py:prepare_step"
#: A step's other all-reduces, none of them a count: the reported global loss, the non-finite
#: guard's agreement, the token-budget plan's agreement on the micro-batch count, and the
#: backend's gradient sync and gradient norm.
NOT_COUNTS = {
    "engine/engine.py:_data_parallel_sum_on_device",
    "engine/non_finite.py:reason_to_skip",
    "engine/data/micro_batching.py:_max_over_ranks",
    "strategies/backends/megatron/backend.py:_finalize_without_token_scaling",
    "strategies/backends/megatron/optimizer.py:_squared_norm",
}


def _origin() -> str:
    """``path:function`` of the innermost project frame that asked for the all-reduce (past the
    shared helpers of ``strategies/parallel/collectives.py``); ``?`` for none (torch or megatron
    alone)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if path.startswith(ROOT) and not path.startswith(_PASSED) and _INSTALLED not in path:
            return f"{os.path.relpath(path, ROOT)}:{frame.name}"
    return "?"


@contextlib.contextmanager
def all_reduces() -> Iterator[collections.Counter[str]]:
    """Inside, every ``torch.distributed.all_reduce`` is tallied by origin."""
    tally: collections.Counter[str] = collections.Counter()
    original = dist.all_reduce

    def recording(*args: object, **kwargs: object) -> object:
        tally[_origin()] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    dist.all_reduce = recording  # type: ignore[assignment]
    try:
        yield tally
    finally:
        dist.all_reduce = original
