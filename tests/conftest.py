"""Shared fixtures: a fresh megatron mesh per test, hook recording, small batches."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray keeps every worker's lines (verl's RL trainer cases read each worker's console metrics);
# set for the whole run, as Ray reads it at import, so that their launcher forks from the
# tests' zygote (tests/rank_zygote.py) like every other child.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
torch.set_num_threads(1)


@pytest.fixture
def fresh_mesh() -> Iterator[None]:
    """No megatron mesh and no applied MindSpeed repatch before or after the test."""
    from strategies.backends.megatron.mesh import destroy_mesh
    from tests.simulation import forget_applied_repatches

    destroy_mesh()
    forget_applied_repatches()
    yield
    destroy_mesh()
    forget_applied_repatches()
    gc.collect()  # destroyed process groups stop their gloo threads once collected


@pytest.fixture
def event_log(monkeypatch: pytest.MonkeyPatch, fresh_mesh: None) -> Any:
    """A log that also records megatron's ``initialize_model_parallel`` calls, in order."""
    from megatron.core import parallel_state

    from tests.simulation import EventLog

    log = EventLog()
    original = parallel_state.initialize_model_parallel

    def recording(*args: Any, **kwargs: Any) -> None:
        log.append(("initialize_model_parallel", kwargs))
        original(*args, **kwargs)

    monkeypatch.setattr(parallel_state, "initialize_model_parallel", recording)
    return log
