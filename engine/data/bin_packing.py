"""Packed partition of sequences by real tokens: bin packing with known bounds, from lengths alone.

A packed micro-batch holds its sequences back to back in one row, so its load is the sum of
its real tokens. Fewest groups under a budget is bin packing (NP-hard), so heuristics with
known bounds (``n`` sequences, ``k`` groups):

* The count comes from first-fit-decreasing (FFD <= 11/9 OPT + 6/9, and at most
  ``2 * ceil(total / budget) - 1`` because any two FFD bins together exceed the budget), then
  lowered while longest-processing-time-first (LPT) still fits in one group fewer.
* The balance for that count is the best of three partitions that fit the budget: LPT (max
  load <= 4/3 of the optimum), MULTIFIT (FFD inside a binary search on the capacity; <= 13/11
  of the optimum plus 1/512) and the optimal in-order (consecutive) split, so the plan is
  never worse than chunking the batch in order into the same number of groups.

Deterministic: ties are broken by sequence index, never by hashing or timing.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Callable, Sequence

from heads.errors import BatchError

__all__ = ["packed_partition"]

Group = list[int]


def packed_partition(sizes: Sequence[int], budget: int, minimum: int) -> list[Group]:
    """Sequence indices in ``max(groups FFD/LPT need, minimum)`` groups whose real tokens fit
    ``budget``, with a small largest load (see the module docstring).

    Every length must fit ``budget`` and ``minimum`` must not exceed ``len(sizes)``: the
    planners check both first, with errors that name the sequence.
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    ffd = _first_fit_decreasing(order, sizes, budget, max_bins=len(sizes))
    if ffd is None:  # unreachable: every sequence fits the budget, so n bins always suffice
        raise AssertionError("first-fit-decreasing needed more bins than sequences")
    count, candidates = len(ffd), [ffd]
    # FFD can miss the fewest count; LPT sometimes packs one group fewer within budget.
    total = sum(sizes)
    while count - 1 >= math.ceil(total / budget):
        fewer = _longest_processing_time(order, sizes, count - 1)
        if _max_load(fewer, sizes) > budget:
            break
        count, candidates = count - 1, [fewer]
    if minimum > count:
        count, candidates = minimum, []
    if not candidates or candidates[0] is ffd:
        lpt = _longest_processing_time(order, sizes, count)
        if _max_load(lpt, sizes) <= budget:
            candidates.append(lpt)
    best_load = min((_max_load(c, sizes) for c in candidates), default=budget + 1)
    lower = max(sizes[order[0]], math.ceil(total / count))  # no partition does better
    if best_load > lower:
        # When nothing fits yet, count >= len(ffd): MULTIFIT at the budget always succeeds.
        multifit = _multifit(order, sizes, count, min(budget, best_load - 1), lower)
        if multifit is not None:
            candidates.append(multifit)
            best_load = _max_load(multifit, sizes)
    if best_load > lower:
        in_order = _in_order(sizes, count, best_load - 1, lower)
        if in_order is not None:
            candidates.append(in_order)
    # The first of equally good candidates wins (a fixed preference: deterministic).
    return min(candidates, key=lambda c: _max_load(c, sizes))


def _max_load(groups: Sequence[Group], sizes: Sequence[int]) -> int:
    return max(sum(sizes[i] for i in group) for group in groups)


def _longest_processing_time(order: Sequence[int], sizes: Sequence[int], count: int) -> list[Group]:
    """LPT: longest first, each into the least-loaded group (ties: lowest group). With at least
    ``count`` sequences no group stays empty; max load <= (4/3 - 1/(3 count)) x optimum."""
    groups: list[Group] = [[] for _ in range(count)]
    heap = [(0, g) for g in range(count)]
    for index in order:
        load, g = heap[0]
        groups[g].append(index)
        heapq.heapreplace(heap, (load + sizes[index], g))
    return groups


def _first_fit_decreasing(
    order: Sequence[int], sizes: Sequence[int], capacity: int, *, max_bins: int
) -> list[Group] | None:
    """FFD into bins of ``capacity`` (``None`` once more than ``max_bins`` are needed).

    A max segment tree over the bins' free space finds the first bin that fits in O(log n)."""
    leaves = 1
    while leaves < max_bins + 1:
        leaves *= 2
    free = [capacity] * (2 * leaves)
    bins: list[Group] = []
    for index in order:
        size = sizes[index]
        if size > capacity:
            return None
        node = 1
        while node < leaves:
            node *= 2
            if free[node] < size:
                node += 1
        slot = node - leaves
        if slot >= max_bins:
            return None
        if slot == len(bins):
            bins.append([])
        bins[slot].append(index)
        free[node] -= size
        node //= 2
        while node:
            left = free[2 * node]
            right = free[2 * node + 1]
            value = left if left > right else right
            if free[node] == value:
                break
            free[node] = value
            node //= 2
    return bins


def _multifit(
    order: Sequence[int], sizes: Sequence[int], count: int, high: int, lower: int
) -> list[Group] | None:
    """MULTIFIT: the smallest capacity (binary search down to 1/512) at which FFD needs at most
    ``count`` bins, searched below ``high``; then split to exactly ``count`` groups."""
    best = _first_fit_decreasing(order, sizes, high, max_bins=count)
    if best is None:
        return None
    low = lower - 1  # below the average (or the longest) nothing fits
    while high - low > max(1, high // 512):
        middle = (low + high) // 2
        packed = _first_fit_decreasing(order, sizes, middle, max_bins=count)
        if packed is None:
            low = middle
        else:
            high, best = middle, packed
    return _split_packed(best, sizes, count)


def _in_order(sizes: Sequence[int], count: int, high: int, lower: int) -> list[Group] | None:
    """The optimal split of the batch, in its order, into ``count`` consecutive groups, if its
    largest load is at most ``high`` (exact binary search; prefix sums make each probe
    O(groups x log n)). It dominates naive in-order chunking with the same count."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def runs(limit: int) -> list[Group] | None:
        found: list[Group] = []
        start = 0
        while start < len(sizes):
            if len(found) == count:
                return None
            stop = bisect_right(prefix, prefix[start] + limit) - 1
            if stop == start:
                return None
            found.append(list(range(start, stop)))
            start = stop
        return found

    best = runs(high)
    if best is None:
        return None
    low = lower - 1
    while high - low > 1:
        middle = (low + high) // 2
        found = runs(middle)
        if found is None:
            low = middle
        else:
            high, best = middle, found

    def split(run: Group) -> tuple[Group, Group]:
        half = (prefix[run[0]] + prefix[run[-1] + 1]) // 2
        cut = min(max(bisect_right(prefix, half) - 1, run[0] + 1), run[-1])
        return run[: cut - run[0]], run[cut - run[0] :]

    return _split_until(best, count, lambda run: prefix[run[-1] + 1] - prefix[run[0]], split)


def _split_packed(groups: list[Group], sizes: Sequence[int], count: int) -> list[Group]:
    def split(group: Group) -> tuple[Group, Group]:
        first, second = _longest_processing_time(_longest_first_of(group, sizes), sizes, 2)
        return first, second

    return _split_until(groups, count, lambda group: sum(sizes[i] for i in group), split)


def _longest_first_of(group: Group, sizes: Sequence[int]) -> list[int]:
    return sorted(group, key=lambda i: (-sizes[i], i))


def _split_until(
    groups: list[Group],
    count: int,
    load: Callable[[Group], int],
    split: Callable[[Group], tuple[Group, Group]],
) -> list[Group]:
    """Split the heaviest splittable group in two until there are ``count`` groups; splitting
    never raises a load, so the largest load and the budget still hold."""
    result = [group for group in groups if group]
    heap = [(-load(group), position) for position, group in enumerate(result) if len(group) > 1]
    heapq.heapify(heap)
    while len(result) < count:
        if not heap:  # fewer sequences than groups: checked by the callers
            raise BatchError(f"cannot make {count} non-empty micro-batches")
        _, position = heapq.heappop(heap)
        first, second = split(result[position])
        result[position] = first
        result.append(second)
        for where, group in ((position, first), (len(result) - 1, second)):
            if len(group) > 1:
                heapq.heappush(heap, (-load(group), where))
    return result
