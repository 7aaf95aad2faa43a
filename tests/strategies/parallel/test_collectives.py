"""The shared collectives: a world of one needs no process group; tensors go where the group's
backend reduces them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from strategies.parallel import collectives


def test_a_world_of_one_reduces_nothing_and_needs_no_process_group() -> None:
    assert collectives.all_reduce_values([1.5, 2]) == [1.5, 2.0]
    assert collectives.from_rank_zero({"a": 1}) == {"a": 1}
    assert collectives.merged_dicts({"x": 1}) == {"x": 1}
    assert collectives.rank() == 0


@pytest.mark.parametrize(
    ("backend", "accelerator", "expected"),
    [("gloo", "cuda", "cpu"), ("nccl", "cuda", "cuda:0"), ("hccl", "xpu", "xpu:0")],
)
def test_collectives_run_on_the_device_the_backend_reduces(
    monkeypatch: pytest.MonkeyPatch, backend: str, accelerator: str, expected: str
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device(accelerator))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    assert str(collectives.collective_device()) == expected


def time_out_after(seconds: float) -> float:
    """In a rank: the collective timeout once the process group is made with ``seconds``."""
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=seconds))
    return collectives.collective_timeout()


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_the_collective_timeout_is_the_one_the_process_group_was_made_with() -> None:
    from tests.multiprocess import run_ranks

    assert run_ranks(time_out_after, 1, 42.0, timeout=90) == [42.0]
    assert collectives.collective_timeout() > 0
