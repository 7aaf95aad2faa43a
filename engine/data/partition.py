"""Exact balanced partition of sequences by padded load (rows x longest row), from lengths alone.

An optimal partition can always be taken as consecutive runs of the sequences sorted by length,
longest first (exchange argument: swapping a longer sequence into the group of the longest one
never raises any group's rows x longest). Greedy filling of that order gives the *minimum*
count, and a binary search over the largest allowed load with the same greedy gives the
*minimum possible maximum load* for the chosen count. Both exact; O(n log n) for ``n``
sequences. Ties are broken by sequence index, so the result is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balanced_partition"]

Run = list[int]


def balanced_partition(lengths: Sequence[int], budget: int, min_groups: int) -> list[list[int]]:
    """Sequence indices in ``max(fewest groups that fit budget, min_groups)`` groups, with the
    least possible largest rows x longest row.

    Every length must fit ``budget`` and ``min_groups`` must not exceed ``len(lengths)``: the
    planners check both first, with errors that name the sequence.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ordered = [lengths[i] for i in order]
    count = max(_run_count(ordered, budget, len(ordered)), min_groups)
    # The least largest load: binary search on the limit; the greedy run count only falls as
    # the limit grows, and a limit of ``budget`` already fits in ``count`` runs.
    low, high = ordered[0] - 1, budget  # ``low`` never fits (a run of one costs its length)
    while high - low > 1:
        middle = (low + high) // 2
        if _run_count(ordered, middle, count) <= count:
            high = middle
        else:
            low = middle
    runs = _halve_until(_runs(ordered, high), count, ordered)
    return [[order[position] for position in run] for run in runs]


def _run_count(ordered: Sequence[int], limit: int, enough: int) -> int:
    """How many greedy runs :func:`_runs` makes (stops counting past ``enough``)."""
    runs, start, total = 0, 0, len(ordered)
    while start < total and runs <= enough:
        start = min(total, start + limit // ordered[start])
        runs += 1
    return runs


def _runs(ordered: Sequence[int], limit: int) -> list[Run]:
    """Greedy maximal runs of a longest-first list with rows x first (longest) <= limit.

    Optimal run count: dropping a run's first element never raises its cost."""
    runs: list[Run] = []
    start, total = 0, len(ordered)
    while start < total:
        stop = min(total, start + limit // ordered[start])
        runs.append(list(range(start, stop)))
        start = stop
    return runs


def _halve_until(runs: list[Run], count: int, ordered: Sequence[int]) -> list[Run]:
    """Halve the heaviest run of two or more until there are ``count`` runs; halving never
    raises a load, so the largest load and the budget still hold."""

    def load(run: Run) -> int:
        return len(run) * ordered[run[0]]

    heap = [(-load(run), position) for position, run in enumerate(runs) if len(run) > 1]
    heapq.heapify(heap)
    while len(runs) < count:
        if not heap:
            raise ValueError(f"cannot make {count} non-empty groups of {len(ordered)} sequences")
        _, position = heapq.heappop(heap)
        run = runs[position]
        half = (len(run) + 1) // 2
        runs[position] = run[:half]
        runs.append(run[half:])
        for where in (position, len(runs) - 1):
            if len(runs[where]) > 1:
                heapq.heappush(heap, (-load(runs[where]), where))
    return runs
