"""Micro-batch planning: budget, coverage, minimal count, balance, errors, and data parallelism.

Optimality claims are checked against brute force over every set partition of small batches;
the data-parallel agreement runs in two real gloo processes.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.micro_batching import (
    MicroBatchPlan,
    agree_on_count,
    plan_fixed,
    plan_for_data_parallel,
    plan_token_budget,
)
from heads.errors import BatchError, ConfigError
from tests.multiprocess import run_ranks

# -------------------------------------------------------------------------------------- helpers


def load(group: Sequence[int], lengths: Sequence[int]) -> int:
    """Rows x longest row: what the group costs right-padded."""
    return len(group) * max(lengths[i] for i in group)


def assert_valid(plan: MicroBatchPlan, lengths: Sequence[int], budget: int) -> None:
    """Every sequence exactly once, no empty group, loads as stated and within the budget."""
    flat = [i for group in plan.groups for i in group]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(plan.groups)
    assert plan.padded_tokens == tuple(load(g, lengths) for g in plan.groups)
    assert plan.tokens == tuple(sum(lengths[i] for i in g) for g in plan.groups)
    assert plan.max_tokens_per_micro_batch == budget
    assert plan.max_load <= budget


def in_order_chunks(n: int, count: int) -> list[list[int]]:
    """Naive baseline: the batch in its order cut into ``count`` chunks of near-equal size."""
    size, extra = divmod(n, count)
    chunks, start = [], 0
    for c in range(count):
        stop = start + size + (1 if c < extra else 0)
        chunks.append(list(range(start, stop)))
        start = stop
    return chunks


@cache
def set_partitions(n: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Every partition of ``range(n)`` into non-empty groups (Bell(7) = 877 for n = 7)."""
    if n == 0:
        return ((),)
    found = []
    for rest in set_partitions(n - 1):
        for i in range(len(rest)):
            found.append((*rest[:i], (n - 1, *rest[i]), *rest[i + 1 :]))
        found.append(((n - 1,), *rest))
    return tuple(found)


def brute_force(
    lengths: Sequence[int], budget: int, cost: Callable[[Sequence[int], Sequence[int]], int] = load
) -> tuple[int, dict[int, int]]:
    """(fewest groups within budget, {count: least possible max load with that many groups}),
    a group's load being ``cost(group, lengths)`` (default: padded)."""
    fewest = len(lengths)
    best: dict[int, int] = {}
    for partition in set_partitions(len(lengths)):
        worst = max(cost(g, lengths) for g in partition)
        if worst <= budget:
            fewest = min(fewest, len(partition))
        best[len(partition)] = min(best.get(len(partition), worst), worst)
    return fewest, best


@st.composite
def batches(draw: st.DrawFn, max_sequences: int = 48, max_length: int = 600) -> tuple:
    """(lengths, budget >= longest, min_num_micro_batches <= n)."""
    lengths = draw(st.lists(st.integers(1, max_length), min_size=1, max_size=max_sequences))
    longest = max(lengths)
    budget = draw(st.integers(longest, max(longest, 4 * longest, sum(lengths) + 1)))
    minimum = draw(st.integers(1, len(lengths)))
    return lengths, budget, minimum


small_batches = batches(max_sequences=7, max_length=40)
PROPERTY = settings(max_examples=150, deadline=None)

# ------------------------------------------------------------------------ partition properties


@PROPERTY
@given(batches())
def test_plan_covers_every_sequence_once_within_budget(case: tuple) -> None:
    lengths, budget, minimum = case
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum)
    assert_valid(plan, lengths, budget)
    assert minimum <= plan.num_micro_batches <= len(lengths)


@PROPERTY
@given(batches())
def test_plan_is_deterministic_and_input_type_independent(case: tuple) -> None:
    lengths, budget, minimum = case
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum)
    for same in (list(lengths), tuple(lengths), torch.tensor(lengths)):
        assert plan_token_budget(same, budget, min_num_micro_batches=minimum) == plan


@PROPERTY
@given(batches())
def test_min_num_micro_batches_only_raises_the_count(case: tuple) -> None:
    lengths, budget, minimum = case
    natural = plan_token_budget(lengths, budget).num_micro_batches
    forced = plan_token_budget(lengths, budget, min_num_micro_batches=minimum)
    assert forced.num_micro_batches == max(natural, minimum)


@PROPERTY
@given(batches())
def test_micro_batches_run_heaviest_first(case: tuple) -> None:
    lengths, budget, minimum = case
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum)
    assert list(plan.padded_tokens) == sorted(plan.padded_tokens, reverse=True)
    assert all(list(group) == sorted(group) for group in plan.groups)


# ------------------------------------------------------------------------ count and balance


@settings(max_examples=200, deadline=None)
@given(small_batches)
def test_plan_has_fewest_micro_batches_and_least_max_load(case: tuple) -> None:
    """Solved exactly (sorted consecutive runs + binary search), as brute force confirms."""
    lengths, budget, minimum = case
    fewest, best = brute_force(lengths, budget)
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum)
    assert plan.num_micro_batches == max(fewest, minimum)
    assert plan.max_load == best[plan.num_micro_batches]


@PROPERTY
@given(st.integers(1, 500), st.integers(1, 16), st.integers(1, 100))
def test_equal_lengths_need_exactly_the_lower_bound(length: int, per_batch: int, n: int) -> None:
    budget = per_batch * length
    plan = plan_token_budget([length] * n, budget)
    assert plan.num_micro_batches == math.ceil(n * length / budget) == math.ceil(n / per_batch)


@PROPERTY
@given(batches())
def test_max_load_never_exceeds_in_order_chunking_with_the_same_count(case: tuple) -> None:
    lengths, budget, minimum = case
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum)
    naive = in_order_chunks(len(lengths), plan.num_micro_batches)
    assert plan.max_load <= max(load(chunk, lengths) for chunk in naive)


def test_skewed_batch_is_balanced_strictly_better_than_in_order_chunking() -> None:
    lengths = [1000, 1000, 10, 10, 10, 10]
    plan = plan_token_budget(lengths, 4096, min_num_micro_batches=2)
    naive = max(load(chunk, lengths) for chunk in in_order_chunks(6, 2))
    assert naive == 3000
    assert plan.max_load == 2000


def test_plans_4096_sequences_quickly() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(16, 4096) for _ in range(4096)]
    start = time.perf_counter()
    plan = plan_token_budget(lengths, 16384)
    elapsed = time.perf_counter() - start
    assert_valid(plan, lengths, 16384)
    assert elapsed < 2.0  # about 5 ms on an idle CPU


# ------------------------------------------------------------------------- packed (real tokens)


def tokens(group: Sequence[int], lengths: Sequence[int]) -> int:
    """Real tokens: what the group costs packed back to back in one row."""
    return sum(lengths[i] for i in group)


@PROPERTY
@given(batches())
def test_packed_plan_covers_every_sequence_once_with_real_tokens_within_budget(
    case: tuple,
) -> None:
    lengths, budget, minimum = case
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum, packed=True)
    assert sorted(i for group in plan.groups for i in group) == list(range(len(lengths)))
    assert plan.packed
    assert plan.tokens == tuple(tokens(g, lengths) for g in plan.groups)
    assert plan.loads == plan.tokens
    assert plan.max_load <= budget
    assert plan.num_micro_batches >= minimum
    assert list(plan.tokens) == sorted(plan.tokens, reverse=True)


@settings(max_examples=200, deadline=None)
@given(small_batches)
def test_packed_plan_is_within_the_ffd_and_four_thirds_bounds(case: tuple) -> None:
    """Packing is NP-hard; the count obeys FFD's bound (<= 11/9 OPT + 6/9, Dosa 2007) and the
    max load for that count LPT's / MULTIFIT's (<= 4/3 of the optimum for that count)."""
    lengths, budget, minimum = case
    fewest, best = brute_force(lengths, budget, tokens)
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum, packed=True)
    assert max(fewest, minimum) <= plan.num_micro_batches
    assert plan.num_micro_batches <= max(minimum, (11 * fewest + 6) // 9)
    assert 3 * plan.max_load <= 4 * best[plan.num_micro_batches] + 2  # <= ceil(4/3 OPT)


@PROPERTY
@given(batches(max_sequences=200, max_length=2000))
def test_packed_count_is_below_twice_the_token_lower_bound(case: tuple) -> None:
    """Any two FFD bins together exceed the budget, so count <= 2 * ceil(total/budget) - 1."""
    lengths, budget, _ = case
    plan = plan_token_budget(lengths, budget, packed=True)
    lower = math.ceil(sum(lengths) / budget)
    assert lower <= plan.num_micro_batches <= 2 * lower - 1


@PROPERTY
@given(st.integers(2, 5000), st.data())
def test_complementary_lengths_pack_perfectly(budget: int, data: st.DataObject) -> None:
    halves = data.draw(st.lists(st.integers(1, budget // 2), min_size=1, max_size=40))
    lengths = [x for small in halves for x in (small, budget - small)]
    order = data.draw(st.permutations(range(len(lengths))))
    shuffled = [lengths[i] for i in order]
    plan = plan_token_budget(shuffled, budget, packed=True)
    assert plan.num_micro_batches == len(halves) == sum(lengths) // budget


@PROPERTY
@given(batches())
def test_packed_max_load_never_exceeds_in_order_chunking_with_the_same_count(
    case: tuple,
) -> None:
    lengths, budget, minimum = case
    plan = plan_token_budget(lengths, budget, min_num_micro_batches=minimum, packed=True)
    naive = in_order_chunks(len(lengths), plan.num_micro_batches)
    assert plan.max_load <= max(tokens(chunk, lengths) for chunk in naive)


def test_packing_a_skewed_batch_balances_real_tokens() -> None:
    lengths = [1000, 1000, 10, 10, 10, 10]
    plan = plan_token_budget(lengths, 4096, min_num_micro_batches=2, packed=True)
    assert max(tokens(chunk, lengths) for chunk in in_order_chunks(6, 2)) == 2010
    assert plan.max_load == 1020


def test_packing_4096_sequences_is_quick_and_needs_fewer_micro_batches_than_padding() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(16, 4096) for _ in range(4096)]
    start = time.perf_counter()
    plan = plan_token_budget(lengths, 16384, packed=True)
    elapsed = time.perf_counter() - start
    assert plan.max_load <= 16384
    assert plan.num_micro_batches < plan_token_budget(lengths, 16384).num_micro_batches
    assert elapsed < 2.0  # about 15 ms on an idle CPU


def test_packed_plans_refuse_over_long_sequences_and_non_bool_flags() -> None:
    with pytest.raises(BatchError, match="sequence 3 has 5000 tokens"):
        plan_token_budget([10, 20, 30, 5000], 4096, packed=True)
    with pytest.raises(ConfigError, match="packed must be a bool"):
        plan_token_budget([1], 10, packed="yes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- fixed size


@PROPERTY
@given(st.lists(st.integers(1, 100), min_size=1, max_size=60), st.integers(1, 70))
def test_plan_fixed_is_consecutive_chunks(lengths: list[int], size: int) -> None:
    plan = plan_fixed(lengths, size)
    starts = range(0, len(lengths), size)
    assert plan.groups == tuple(tuple(range(s, min(s + size, len(lengths)))) for s in starts)
    assert plan.padded_tokens == tuple(load(g, lengths) for g in plan.groups)
    assert plan.max_tokens_per_micro_batch is None


def test_plan_fixed_matches_split_fixed() -> None:
    from engine.data.batching import from_token_lists, split_fixed

    lengths = [3, 1, 4, 1, 5, 9, 2]
    batch = from_token_lists([[1] * n for n in lengths])
    expected = tuple(tuple(mb.indices.tolist()) for mb in split_fixed(batch, 3))
    assert plan_fixed(lengths, 3).groups == expected


# ------------------------------------------------------------------------------------- errors


def test_over_long_sequence_error_names_index_length_and_budget() -> None:
    with pytest.raises(BatchError) as raised:
        plan_token_budget([10, 20, 30, 5000, 40, 6000], 4096)
    message = str(raised.value)
    assert "sequence 3 has 5000 tokens" in message
    assert "max_tokens_per_micro_batch=4096" in message
    assert "1 more" in message


def test_more_micro_batches_than_sequences_is_a_clear_error() -> None:
    with pytest.raises(BatchError, match=r"min_num_micro_batches=4 exceeds the 3 sequence"):
        plan_token_budget([5, 6, 7], 100, min_num_micro_batches=4)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "8", None])
def test_budget_and_sizes_must_be_positive_ints(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch must be a positive int"):
        plan_token_budget([1, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="micro_batch_size must be a positive int"):
        plan_fixed([1, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="min_num_micro_batches must be a positive int"):
        plan_token_budget([1, 2], 10, min_num_micro_batches=bad)  # type: ignore[arg-type]
    with pytest.raises(BatchError, match="local_count must be a positive int"):
        agree_on_count(bad, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([], "at least one sequence"),
        ([3, 0, 2], "sequence 1 has length 0"),
        ([3, -1], "sequence 1 has length -1"),
        ([3, 2.5], "sequence 1: length must be an int"),
        ([True], "sequence 0: length must be an int"),
        (torch.ones(2, 2, dtype=torch.long), "1-D integer tensor"),
        (torch.ones(3), "1-D integer tensor"),
    ],
)
def test_bad_lengths_are_batch_errors(lengths: object, match: str) -> None:
    with pytest.raises(BatchError, match=match):
        plan_token_budget(lengths, 100)  # type: ignore[arg-type]


def test_plan_rejects_groups_that_are_not_a_partition() -> None:
    with pytest.raises(BatchError, match="exactly once"):
        MicroBatchPlan(groups=((0, 1), (1,)), tokens=(2, 1), padded_tokens=(2, 1))
    with pytest.raises(BatchError, match="empty"):
        MicroBatchPlan(groups=((0,), ()), tokens=(1, 0), padded_tokens=(1, 0))
    with pytest.raises(BatchError, match="one token count per group"):
        MicroBatchPlan(groups=((0,), (1,)), tokens=(1, 1), padded_tokens=(1,))


@pytest.mark.parametrize("packed", [False, True])
def test_a_count_multiple_rounds_the_count_up(packed: bool) -> None:
    lengths = [20] * 6  # three micro-batches fit the budget, padded or packed
    assert plan_for_data_parallel(lengths, 40, None, packed=packed).num_micro_batches == 3
    plan = plan_for_data_parallel(lengths, 40, None, packed=packed, count_multiple=2)
    assert plan.num_micro_batches == 4
    assert_valid(plan, lengths, 40)
    assert plan_for_data_parallel(lengths, 40, None, packed=packed, count_multiple=3) == (
        plan_for_data_parallel(lengths, 40, None, packed=packed)
    )
    with pytest.raises(BatchError, match=r"need 4 micro-batches .*rounded up to a multiple of 2"):
        plan_for_data_parallel([30, 30, 30], 40, None, packed=packed, count_multiple=2)
    with pytest.raises(ConfigError, match="count_multiple must be a positive int, got 0"):
        plan_for_data_parallel(lengths, 40, None, packed=packed, count_multiple=0)


def test_without_a_group_counts_and_plans_stay_local() -> None:
    assert agree_on_count(5, None) == 5
    lengths = [7, 3, 9, 1]
    assert plan_for_data_parallel(lengths, 10, None) == plan_token_budget(lengths, 10)
    with pytest.raises(BatchError, match="sequence 1 has 500 tokens"):
        plan_for_data_parallel([10, 500], 100, None)


# -------------------------------------------------------------------- data parallel (2 ranks)

# The two ranks finish in a few seconds (mostly imports); the limit only stops a hang.
RANK_TIMEOUT_S = 120


def plan_on_rank(cases_per_rank: list[list[tuple[list[int], int, bool]]]) -> dict[str, Any]:
    """One data-parallel rank (started by ``run_ranks``): agree on counts and plan this rank's
    cases over the world group, then hit the two collective errors."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    rank, group = dist.get_rank(), dist.group.WORLD
    result: dict[str, Any] = {"agreed": agree_on_count(3 + 4 * rank, group), "plans": []}
    for lengths, budget, packed in cases_per_rank[rank]:
        local = plan_token_budget(lengths, budget, packed=packed).num_micro_batches
        plan = plan_for_data_parallel(lengths, budget, group, packed=packed)
        result["plans"].append((local, plan))
    # Rank 1 needs 5 micro-batches, rank 0 has only 2 sequences: both must raise.
    try:
        plan_for_data_parallel([10, 10] if rank == 0 else [100] * 5, 100, group)
        result["error"] = None
    except BatchError as error:
        result["error"] = str(error)
    # Rank 0 has a sequence over the budget: it names it, rank 1 points to it.
    try:
        plan_for_data_parallel([10, 500] if rank == 0 else [10, 20], 100, group)
        result["over_long"] = None
    except BatchError as error:
        result["over_long"] = str(error)
    result["after_error"] = agree_on_count(1 + rank, group)  # nobody was left hanging
    return result


def rank_cases(rank: int) -> list[tuple[list[int], int, bool]]:
    """Different lengths on each rank (so local counts differ), same budgets; every other case
    packed (the budget counts real tokens)."""
    rng = random.Random(1000 + rank)
    cases = []
    for case in range(24):
        budget = rng.choice([256, 512, 1024])
        # Rank 0: many short sequences (few micro-batches); rank 1: fewer, longer ones (more
        # micro-batches, but never more than rank 0 has sequences).
        if rank == 0:
            n, low, high = rng.randint(24, 40), 1, budget // 8
        else:
            n, low, high = rng.randint(8, 20), budget // 8, budget // 2
        cases.append(([rng.randint(low, high) for _ in range(n)], budget, case % 2 == 1))
    return cases


@pytest.mark.multiprocess
def test_data_parallel_ranks_agree_on_the_count_and_keep_their_budget() -> None:

    world = 2
    cases = [rank_cases(rank) for rank in range(world)]
    results = run_ranks(plan_on_rank, world, cases, timeout=RANK_TIMEOUT_S)

    assert [r["agreed"] for r in results] == [7, 7]
    assert [r["after_error"] for r in results] == [2, 2]
    local_counts = [[local for local, _ in r["plans"]] for r in results]
    assert local_counts[0] != local_counts[1]  # the ranks really had to agree
    for rank, result in enumerate(results):
        for (lengths, budget, packed), (_, plan) in zip(cases[rank], result["plans"], strict=True):
            assert_valid(plan, lengths, budget)
            assert plan.packed is packed
    for case, (first, second) in enumerate(zip(*(r["plans"] for r in results), strict=True)):
        agreed = max(local_counts[0][case], local_counts[1][case])
        assert first[1].num_micro_batches == second[1].num_micro_batches == agreed
    for r in results:
        assert r["error"] is not None
        assert "need 5 micro-batches" in r["error"]
        assert "at least 5 sequences" in r["error"]
    assert "sequence 1 has 500 tokens" in results[0]["over_long"]
    assert "another data-parallel rank could not plan" in results[1]["over_long"]
