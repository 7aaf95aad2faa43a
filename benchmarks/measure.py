"""Measurement helpers the benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from torch.profiler import ProfilerActivity, profile


def high_water_mark() -> int:
    """This process's peak resident memory (``VmHWM`` in ``/proc/self/status``), bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_allocated(fn: Callable[[], None]) -> int:
    """Peak bytes allocated by ``fn`` beyond what was live before it, from profiler events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # kineto's raw events: one "[memory]" event per allocation (+bytes) and free (-bytes)
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def time_calls(owner: Any, name: str, key: str, into: MutableMapping[str, float]) -> None:
    """Wrap ``owner.name`` so that the seconds spent in it accumulate in ``into[key]``."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def median_step_seconds(step: Callable[[], Any], steps: int, warmup: int = 2) -> float:
    """Median wall time of ``step`` over ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
