"""Tensor (with and without sequence parallelism), pipeline, context and data parallel engines
across processes match one process.

Each layout runs as real processes (gloo on 127.0.0.1, OMP_NUM_THREADS=1, a timeout on every
process) on the same global batch and seed as a single-process run; for both heads, the losses
of every step and the final weights are compared (float32 tolerance 1e-5), and data-parallel
replicas must hold bit-identical parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.factories import Shard, join_shards
from tests.multiprocess import RankFailure, run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
LENGTHS = [6, 11, 3, 9, 14, 5, 8, 12]


def _config(parallel: dict[str, Any], **extra: Any) -> dict[str, Any]:
    from tests.factories import tiny_model

    return {
        "model": tiny_model(num_layers=2, vocab_size=64, hidden_size=32),
        "parallel": parallel,
        "micro_batch_size": 2,
        "seed": 11,
        "optimizer": {"lr": 1e-3, "clip_grad": 1.0},
        **extra,
    }


def train_both_heads(parallel: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """On every rank: train an LM and a value engine on this rank's data-parallel shard."""
    from megatron.core import parallel_state as ps

    from engine import Engine
    from engine.data.batching import take_rows
    from engine.losses import sft_loss, value_regression_loss
    from strategies.backends.megatron.weight_init import global_parameters
    from tests.factories import random_batch

    report: dict[str, Any] = {
        "tp": ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0,
    }
    for head, loss in (("lm", sft_loss), ("value", value_regression_loss)):
        engine = Engine.build(head=head, device="cpu", config=_config(parallel, **extra))
        engine.initialize()
        dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
        shard = len(LENGTHS) // dp_size
        losses = []
        with engine.train_mode():
            for step in range(STEPS):
                batch = take_rows(
                    random_batch(LENGTHS, 64, seed=step),
                    slice(dp_rank * shard, (dp_rank + 1) * shard),
                )
                losses.append(engine.train_batch(batch, loss).get("loss"))
        # the trained model's per-token outputs of this rank's shard (output ranks only)
        result = engine.infer_batch(batch)
        field = "log_probs" if head == "lm" else "values"
        outputs = None if result is None else result[field].values().clone()
        params = {}
        for name, param in (
            entry for chunk in engine.backend.modules() for entry in global_parameters(chunk)
        ):
            params[name] = (
                param.detach().clone(),
                bool(getattr(param, "tensor_model_parallel", False)),
                int(getattr(param, "partition_dim", 0)),
                int(getattr(param, "partition_stride", 1)),
            )
        report[head] = {"losses": losses, "params": params, "outputs": outputs}
    report.update(
        tp=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        output_rank=engine.holds_outputs(),
    )
    return report


def full_parameters(reports: list[dict[str, Any]], head: str) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from the ranks of data-parallel replica 0."""
    by_name: dict[str, dict[int, Shard]] = {}
    for report in reports:
        if report["dp"] != 0:
            continue
        for name, entry in report[head]["params"].items():
            by_name.setdefault(name, {})[report["tp"]] = entry
    return join_shards(by_name)


@pytest.fixture(scope="module")
def single_process() -> dict[str, Any]:
    (report,) = run_ranks(train_both_heads, 1, {}, {}, timeout=180)
    return report


DISTRIBUTED_OPTIMIZER = {
    "optimizer": {"lr": 1e-3, "clip_grad": 1.0},
    "backend": {"use_distributed_optimizer": True},
}


@pytest.mark.parametrize(
    ("world", "parallel", "extra"),
    [
        (2, {"tensor_parallel_size": 2}, {}),
        (2, {"pipeline_parallel_size": 2}, {}),
        (2, {}, {}),  # data parallel 2
        (2, {}, DISTRIBUTED_OPTIMIZER),
        (4, {"tensor_parallel_size": 2}, DISTRIBUTED_OPTIMIZER),  # x data parallel 2
        (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {}),
        (2, {"tensor_parallel_size": 2, "sequence_parallel": True}, {"packing": True}),
        (2, {"context_parallel_size": 2}, {}),
        (
            2,
            {"context_parallel_size": 2},
            {"packing": True, "backend": {"context_parallel_attention": "ring"}},
        ),
        (
            4,
            {"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True},
            {"packing": True},
        ),
    ],
    ids=[
        "tp2",
        "pp2",
        "dp2",
        "dp2-distributed-optimizer",
        "tp2xdp2",
        "tp2xpp2",
        "tp2-sp-packed",
        "cp2",
        "cp2-ring-packed",
        "cp2xtp2-sp-packed",
    ],
)
def test_parallel_layouts_match_one_process(
    single_process: dict[str, Any], world: int, parallel: dict[str, Any], extra: dict[str, Any]
) -> None:
    reports = run_ranks(train_both_heads, world, parallel, extra, timeout=300)
    for head in ("lm", "value"):
        outputs = [r[head]["losses"] for r in reports if r["output_rank"]]
        assert outputs, "no rank reported outputs"
        for losses in outputs:
            assert losses == pytest.approx(single_process[head]["losses"], rel=1e-5, abs=1e-6)
        # the last step's log-probs / values, the output ranks' shards in data-parallel order
        shards = sorted({r["dp"]: r[head]["outputs"] for r in reports if r["output_rank"]}.items())
        torch.testing.assert_close(
            torch.cat([shard for _, shard in shards]),
            single_process[head]["outputs"],
            atol=1e-5,
            rtol=1e-5,
        )
        expected = single_process[head]["params"]
        got = full_parameters(reports, head)
        assert set(got) == set(expected)
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, expected[name][0], atol=1e-5, rtol=1e-5, msg=name)
        for tp in (0, 1):  # data parallel: replicas hold bit-identical parameters
            replicas = [r for r in reports if r["tp"] == tp and r["pp"] == 0]
            if len(replicas) > 1:
                first, second = (r[head]["params"] for r in replicas[:2])
                assert all(torch.equal(first[n][0], second[n][0]) for n in first)
    non_output = [r for r in reports if not r["output_rank"]]
    assert all(r["lm"]["losses"] == [None] * STEPS for r in non_output)


def fail_on_rank_one() -> None:
    import os

    from engine import Engine
    from engine.losses import sft_loss
    from tests.factories import random_batch

    engine = Engine.build(head="lm", device="cpu", config=_config({})).initialize()

    def loss(outputs: Any, batch: Any, ctx: Any) -> Any:
        if os.environ["RANK"] == "1":
            raise RuntimeError("loss exploded on rank 1")
        return sft_loss(outputs, batch, ctx)

    engine.train_batch(random_batch([4, 6], 64), loss)


def test_a_failing_rank_makes_every_rank_fail_instead_of_hanging() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(fail_on_rank_one, 2, timeout=120)
    message = str(caught.value)
    assert "loss exploded on rank 1" in message
    assert "still running" not in message


def refuse_a_batch_on_rank_one() -> dict[str, Any]:
    """Rank 1's batch holds a sequence over max_sequence_length; each rank catches what it is
    told and trains on, with fixed-size and token-budget (packed) micro-batches."""
    import os

    import torch

    from engine import Engine
    from engine.data.batching import jagged
    from engine.losses import sft_loss
    from heads.errors import BatchError
    from tests.factories import random_batch

    rank = int(os.environ["RANK"])
    report: dict[str, Any] = {}
    for name, layout in (
        ("fixed", {}),
        ("budget", {"packing": True, "max_tokens_per_micro_batch": 100}),
    ):
        engine = Engine.build(head="lm", device="cpu", config=_config({}, **layout)).initialize()
        refused = random_batch([4, 70 if rank == 1 else 6, 9], 64, seed=rank)
        if rank == 1:  # a field the other rank's batch lacks: the count vectors still pair
            refused["extra_mask"] = jagged([torch.ones(n) for n in (4, 70, 9)])
        try:
            engine.train_batch(refused, sft_loss)
            report[name] = "trained"
        except BatchError as error:
            report[name] = str(error)
        different = random_batch([4, 6, 9], 64, seed=rank)
        if rank == 1:  # both valid, but the ranks' mask fields differ
            different["extra_mask"] = jagged([torch.ones(n) for n in (4, 6, 9)])
        try:
            engine.train_batch(different, sft_loss)
            report[f"{name}.fields"] = "trained"
        except BatchError as error:
            report[f"{name}.fields"] = str(error)
        report[f"{name}.loss"] = engine.train_batch(random_batch([4, 6, 9], 64), sft_loss)["loss"]
    return report


def test_a_batch_refused_on_one_rank_is_refused_on_every_rank_and_both_train_on() -> None:
    """Otherwise the other rank runs the step and pairs its collectives with the refusing
    rank's next step (silently averaging gradients of different steps). The refusing rank's
    batch has a field the other's lacks, and the step's one count all-reduce still pairs; ranks
    whose valid batches have different mask fields are refused together, naming why."""
    first, second = run_ranks(refuse_a_batch_on_rank_one, 2, timeout=180)
    for name in ("fixed", "budget"):
        assert "another data-parallel rank's batch was refused" in first[name]
        assert "row 1 has 70 tokens" in second[name]
        for report in (first, second):
            assert "batches have different per-token *mask fields" in report[f"{name}.fields"]
        assert first[f"{name}.loss"] == second[f"{name}.loss"]


def simulated_cell_at_tp2(device: str) -> dict[str, Any]:
    """Train both heads on a simulated platform at TP=2; report the hook order seen here."""
    from megatron.core import parallel_state

    from engine import Engine
    from tests.factories import raise_outputs_loss, random_batch
    from tests.simulation import EventLog, make_platform

    log = EventLog()
    original = parallel_state.initialize_model_parallel

    def recording(*args: Any, **kwargs: Any) -> None:
        log.append(("initialize_model_parallel", kwargs))
        original(*args, **kwargs)

    parallel_state.initialize_model_parallel = recording
    losses = {}
    platform, simulated = make_platform(device, log)  # one device runtime, one MindSpeed module
    assert simulated
    for head in ("lm", "value"):
        engine = Engine.build(
            head=head, device=platform, config=_config({"tensor_parallel_size": 2})
        ).initialize()
        with engine.train_mode():
            batch = random_batch(LENGTHS, 64)
            losses[head] = [
                engine.train_batch(batch, raise_outputs_loss).get("loss") for _ in range(3)
            ]
    return {"events": log.names(), "losses": losses, "pg": platform.backend_for_process_group}


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_simulated_accelerator_cells_run_at_tensor_parallel_2(device: str) -> None:
    if torch.cuda.is_available() and device == "cuda":
        pytest.skip("a real CUDA device is present; the real cell is tested instead")
    for report in run_ranks(simulated_cell_at_tp2, 2, device, timeout=240):
        events = report["events"]
        assert events.count("initialize_model_parallel") == 1  # one mesh for both engines
        if device == "npu":
            assert events.count("repatch") == 1
            assert events.index("repatch") < events.index("initialize_model_parallel")
        else:
            assert "repatch" not in events
        for losses in report["losses"].values():
            if losses[0] is not None:
                assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("world", "parallel", "model", "message"),
    [
        (3, {"tensor_parallel_size": 2}, {}, r"= 2 must divide the world size 3"),
        (4, {"tensor_parallel_size": 4}, {}, r"num_query_groups \(2\) must be divisible by"),
        (
            2,
            {"tensor_parallel_size": 2},
            {"vocab_size": 63},
            r"vocab_size \(63\) must be divisible",
        ),
        (
            2,
            {"pipeline_parallel_size": 2},
            {"num_layers": 3},
            r"num_layers \(3\) must be divisible",
        ),
        (3, {"context_parallel_size": 2}, {}, r"x context \(2\) parallel size = 2 must divide"),
        (2, {"expert_parallel_size": 2}, {}, r"expert_parallel_size=2 needs a mixture-of-experts"),
    ],
)
def test_parallel_configs_are_checked_before_any_process_group_is_touched(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    parallel: dict[str, Any],
    model: dict[str, Any],
    message: str,
) -> None:
    from engine import Engine
    from heads.errors import ConfigError
    from tests.factories import tiny_model

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(
        "torch.distributed.init_process_group",
        lambda *a, **k: pytest.fail("a process group was created"),
    )
    with pytest.raises(ConfigError, match=message):
        Engine.build(
            head="lm", device="cpu", config={"model": tiny_model(**model), "parallel": parallel}
        )


def test_virtual_pipeline_stages_match_one_process() -> None:
    from tests.factories import tiny_model

    four_layers = {"model": tiny_model(num_layers=4, vocab_size=64, hidden_size=32)}
    (expected,) = run_ranks(train_both_heads, 1, {}, four_layers, timeout=180)
    layout = {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}
    reports = run_ranks(train_both_heads, 2, layout, four_layers, timeout=300)
    for head in ("lm", "value"):
        (losses,) = [r[head]["losses"] for r in reports if r["output_rank"]]
        assert losses == pytest.approx(expected[head]["losses"], rel=1e-5, abs=1e-6)
        got = full_parameters(reports, head)
        for name, tensor in expected[head]["params"].items():
            torch.testing.assert_close(got[name], tensor[0], atol=1e-5, rtol=1e-5, msg=name)
