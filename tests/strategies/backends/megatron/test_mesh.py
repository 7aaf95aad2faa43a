"""The process-global megatron mesh: shared by engines of a process, conflicts are errors."""

from __future__ import annotations

import pytest

from engine import Engine
from strategies.backends.megatron import mesh
from tests.factories import random_batch, tiny_model
from tests.multiprocess import RankFailure, run_ranks


def test_engines_of_one_process_share_one_mesh(fresh_mesh: None) -> None:
    config = {"model": tiny_model()}
    actor = Engine.build(head="lm", device="cpu", config=config).initialize()
    critic = Engine.build(head="value", device="cpu", config=config).initialize()
    reference = Engine.build(
        head="lm", device="cpu", config={**config, "forward_only": True}
    ).initialize()
    batch = random_batch([3, 5], 64)
    assert actor.get_data_parallel_size() == critic.get_data_parallel_size() == 1
    assert set(actor.infer_batch(batch).keys()) == {"log_probs"}
    assert set(critic.infer_batch(batch).keys()) == {"values"}
    assert set(reference.infer_batch(batch).keys()) == {"log_probs"}


def second_engine_with_another_layout() -> str:
    Engine.build(head="lm", device="cpu", config={"model": tiny_model()}).initialize()
    try:
        Engine.build(
            head="value",
            device="cpu",
            config={"model": tiny_model(), "parallel": {"tensor_parallel_size": 2}},
        ).initialize()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.multiprocess
def test_a_second_engine_asking_for_another_mesh_gets_a_clear_error() -> None:
    for message in run_ranks(second_engine_with_another_layout, 2, timeout=120):
        assert message.startswith("ConfigError")
        assert "tensor_parallel_size=2 (mesh has 1)" in message


def test_model_parallel_sizes_must_divide_the_world_size() -> None:
    from strategies.part_configs import ParallelConfig

    with pytest.raises(Exception, match=r"= 4 must divide the world size 2"):
        mesh.check_world_size(
            ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2), world_size=2
        )


def failing_rank() -> None:
    raise ValueError("boom on purpose")


def test_run_ranks_reports_the_failing_ranks_error() -> None:
    with pytest.raises(RankFailure, match="boom on purpose"):
        run_ranks(failing_rank, 1, timeout=60)
