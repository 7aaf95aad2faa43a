"""Mixture-of-experts engines across processes match one process: expert, pipeline and
sequence parallel layouts train to the same losses and weights (1e-5 after 3 steps, aux and z losses
on), record the same routes and replay them, and a checkpoint saved at EP=2 loads at EP=1.

Each step records the routes of the rank's shard (``infer_batch``) and trains on them replayed,
so every layout trains through identical routing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.factories import Shard, join_shards
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
LENGTHS = [6, 11, 3, 9, 14, 5, 8, 12]
VOCAB = 64


def _config(
    parallel: dict[str, Any], backend: dict[str, Any], layers: int = 2, **model: Any
) -> dict[str, Any]:
    """Every layout uses megatron's distributed optimizer (checkpoints of one optimizer kind
    load only into the same kind)."""
    from tests.factories import tiny_model

    settings = {
        "num_layers": layers,
        "num_experts": 4,
        "experts_per_token": 2,
        "expert_ffn_hidden_size": 32,
        "router_aux_loss_coeff": 0.01,
        "router_z_loss_coeff": 0.001,
    }
    model = tiny_model(**{**settings, **model})
    return {
        "model": model,
        "parallel": parallel,
        "backend": {"use_distributed_optimizer": True, **backend},
        "micro_batch_size": 2,
        "seed": 11,
        "optimizer": {"lr": 1e-3},
        "router_replay": True,
    }


def _parameters(engine: Any) -> dict[str, Shard]:
    from strategies.backends.megatron.weight_init import global_parameters

    return {
        name: (
            param.detach().clone(),
            bool(getattr(param, "tensor_model_parallel", False)),
            int(getattr(param, "partition_dim", 0)),
            int(getattr(param, "partition_stride", 1)),
        )
        for chunk in engine.backend.modules()
        for name, param in global_parameters(chunk)
    }


def train_moe(
    parallel: dict[str, Any],
    backend: dict[str, Any],
    save_to: str | None,
    load_from: str | None,
    layers: int = 2,
) -> dict[str, Any]:
    """On every rank: record routes, train on them replayed, report losses, routes, weights;
    save a checkpoint to ``save_to``; load ``load_from`` into a fresh engine and report its
    weights before and after one more step."""
    from megatron.core import parallel_state as ps

    from engine import Engine
    from engine.data.batching import take_rows
    from engine.losses import sft_loss
    from tests.factories import random_batch

    config = _config(parallel, backend, layers)
    engine = Engine.build(head="lm", device="cpu", config=config).initialize()
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    shard = len(LENGTHS) // dp_size
    losses, routes = [], []

    def step(engine: Any, seed: int) -> None:
        rows = take_rows(
            random_batch(LENGTHS, VOCAB, seed=seed), slice(dp_rank * shard, (dp_rank + 1) * shard)
        )
        recorded = engine.infer_batch(rows)
        if recorded is not None:
            routes.append(recorded["routed_experts"].values().clone())
        # every rank of the replica forces the routes its output rank was handed
        rows["routed_experts"] = from_output_rank(recorded)["routed_experts"]
        losses.append(engine.train_batch(rows, sft_loss).get("loss"))

    for seed in range(STEPS):
        step(engine, seed)
    report: dict[str, Any] = {
        "losses": losses,
        "routes": routes,
        "params": _parameters(engine),
        "tp": ps.get_tensor_model_parallel_rank(),
        "dp": dp_rank,
        "ep": ps.get_expert_model_parallel_rank(),
        "output_rank": engine.holds_outputs(),
    }
    if save_to is not None:
        engine.save_checkpoint(save_to, global_step=STEPS)
    if load_from is not None:
        fresh = Engine.build(head="lm", device="cpu", config=config)
        fresh.initialize().load_checkpoint(load_from)
        report["loaded"] = _parameters(fresh)
        step(fresh, STEPS)  # resumes from the loaded weights and Adam state
        report["continued"] = _parameters(fresh)
    return report


def from_output_rank(value: Any) -> Any:
    """The one non-None ``value`` of this rank's model-parallel group (its output rank's)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    (found,) = [item for item in gathered if item is not None]
    return found


def full_parameters(reports: list[dict[str, Any]], key: str = "params") -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards: experts from every expert-parallel rank (under
    their global numbers), tensor-parallel shards joined; replicas must agree."""
    by_name: dict[str, dict[int, Shard]] = {}
    for report in reports:
        for name, entry in report[key].items():
            held = by_name.setdefault(name, {})
            if report["tp"] in held:  # another data-parallel replica of the same shard
                assert torch.equal(held[report["tp"]][0], entry[0]), name
            held[report["tp"]] = entry
    return join_shards(by_name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-checkpoints")


@pytest.fixture(scope="module")
def single_process(checkpoints: Path) -> dict[str, Any]:
    directory = str(checkpoints / "ep1")
    (report,) = run_ranks(train_moe, 1, {}, {}, directory, directory, timeout=180)
    return report


def _assert_matches(reports: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    outputs = [r for r in reports if r["output_rank"]]
    assert outputs, "no rank reported outputs"
    for report in outputs:
        want = expected["losses"][:STEPS]  # (then the one process resumed for a step)
        assert report["losses"][:STEPS] == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the output ranks' routes, in data-parallel order, are the one process's routes
    by_dp = sorted({r["dp"]: r for r in outputs}.items())
    for step in range(STEPS):
        joined = torch.cat([r["routes"][step] for _, r in by_dp])
        assert torch.equal(joined, expected["routes"][step]), f"routes of step {step}"
    got, want = full_parameters(reports), full_parameters([expected])
    assert set(got) == set(want)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.timeout(420)
def test_expert_parallel_matches_one_process_and_checkpoints_reshard_both_ways(
    single_process: dict[str, Any], checkpoints: Path
) -> None:
    reports = run_ranks(
        train_moe,
        2,
        {"expert_parallel_size": 2},
        {},
        str(checkpoints / "ep2"),
        str(checkpoints / "ep1"),
        timeout=300,
    )
    _assert_matches(reports, single_process)
    assert {r["ep"] for r in reports} == {0, 1}
    # EP=1 -> EP=2: the one process's checkpoint loads into the expert-parallel engines
    # and the next step (Adam state resharded) is the one process's next step
    for key, exact in (("loaded", True), ("continued", False)):
        got, want = full_parameters(reports, key), full_parameters([single_process], key)
        for name, tensor in got.items():
            if exact:
                assert torch.equal(tensor, want[name]), f"{key} {name}"
            else:
                torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-5, msg=name)
    # EP=2 -> EP=1: the expert-parallel checkpoint loads in one process, and trains on alike
    (back,) = run_ranks(train_moe, 1, {}, {}, None, str(checkpoints / "ep2"), timeout=180)
    trained_at_ep2 = full_parameters(reports)
    for name, tensor in full_parameters([back], "loaded").items():
        assert torch.equal(tensor, trained_at_ep2[name]), name
    want = full_parameters([single_process], "continued")
    for name, tensor in full_parameters([back], "continued").items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.timeout(300)
def test_pipeline_parallel_moe_matches_one_process(single_process: dict[str, Any]) -> None:
    """The routes of both stages' layers reach the output rank (the last stage)."""
    parallel = {"pipeline_parallel_size": 2}
    _assert_matches(run_ranks(train_moe, 2, parallel, {}, None, None, timeout=240), single_process)


@pytest.mark.timeout(400)
def test_virtual_pipeline_stages_match_one_process() -> None:
    """PP=2 x 2 virtual stages (4 layers, each rank two chunks): every chunk forces and records
    the routes of its own layers."""
    (expected,) = run_ranks(train_moe, 1, {}, {}, None, None, 4, timeout=180)
    parallel = {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}
    _assert_matches(run_ranks(train_moe, 2, parallel, {}, None, None, 4, timeout=240), expected)


def train_on_drawn_routes(parallel: dict[str, Any], packing: bool = False) -> dict[str, Any]:
    """On every rank (a model with query / key norms): record the router's own routes of a
    batch, then train on routes drawn at random (never the router's), each step's the same on
    every rank; report the recorded routes, the losses and the weights."""
    from megatron.core import parallel_state as ps

    from engine import Engine
    from engine.data.batching import jagged
    from engine.losses import sft_loss
    from tests.factories import random_batch

    config = {**_config(parallel, {}, qk_layernorm=True), "packing": packing}
    engine = Engine.build(head="lm", device="cpu", config=config).initialize()
    recorded = engine.infer_batch(random_batch(LENGTHS, VOCAB, seed=0))
    losses = []
    for seed in range(STEPS):
        rows = random_batch(LENGTHS, VOCAB, seed=seed)
        draw = torch.Generator().manual_seed(seed)
        rows["routed_experts"] = jagged(  # every token of every layer: 2 distinct experts of 4
            [torch.rand(length, 2, 4, generator=draw).argsort(-1)[..., :2] for length in LENGTHS]
        )
        result = engine.train_batch(rows, sft_loss)
        losses.append(result.get("loss"))
    # each layer's expert load of the last step (the routes drawn: counts are exact)
    load = {key: value for key, value in result.items() if key.endswith("load_max_over_mean")}
    return {
        "load": load,
        "recorded": None if recorded is None else recorded["routed_experts"].values(),
        "losses": losses,
        "params": _parameters(engine),
        "tp": ps.get_tensor_model_parallel_rank(),
        "dp": engine.get_data_parallel_rank(),
        "output_rank": engine.holds_outputs(),
    }


@pytest.fixture(scope="module")
def drawn_routes_reference() -> dict[str, Any]:
    (report,) = run_ranks(train_on_drawn_routes, 1, {}, timeout=180)
    return report


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("parallel", "packing"),
    [
        ({"tensor_parallel_size": 2, "sequence_parallel": True}, False),
        ({"context_parallel_size": 2}, False),
        ({"context_parallel_size": 2}, True),
    ],
    ids=["tp2-sp", "cp2", "cp2-packed"],
)
def test_split_sequences_force_and_record_each_ranks_part_of_the_routes(
    drawn_routes_reference: dict[str, Any], parallel: dict[str, Any], packing: bool
) -> None:
    """Each rank routes part of every sequence (TP=2 with sequence parallelism; CP=2 padded and
    packed), aux and z losses on. The routes it records join into the one process's, and
    training on drawn routes (a wrong part forced anywhere changes the loss) gives the one
    process's losses and weights."""
    expected = drawn_routes_reference
    reports = run_ranks(train_on_drawn_routes, 2, parallel, packing, timeout=240)
    outputs = [report for report in reports if report["output_rank"]]
    assert outputs, "no rank reported outputs"
    for report in outputs:
        assert torch.equal(report["recorded"], expected["recorded"])
        assert report["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
    # every rank counts the tokens of its part; the load is over all of them
    assert expected["load"] and all(report["load"] == expected["load"] for report in reports)
    got, want = full_parameters(reports), full_parameters([expected])
    assert set(got) == set(want)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=1e-5, msg=name)
