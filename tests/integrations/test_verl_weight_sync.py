"""verl's shard and delta weight sync on this engine, through verl's own ``TrainingWorker``:
``get_per_tensor_param_shard`` placed by verl's spec helpers rebuilds ``get_per_tensor_param``;
the seed sync ``delta_sharded`` sends (``get_per_tensor_param()``), then
``prime_delta_snapshots`` and each step's ``get_per_tensor_param_delta_shard`` gathered with
verl's own sparse gather over each entry's group, keep a receiver equal to the export after
every step, bit for bit: both backends, one and two processes, dense, mixture-of-experts and
LoRA. And a checkpoint engine the host cannot run is refused by name before Ray starts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl")

from verl.checkpoint_engine.delta_sync.sparse_gather import (  # noqa: E402
    gather_slot_entries_to_rank0,
)
from verl.workers.engine.spec import translate_flat_indices  # noqa: E402

from heads.errors import ConfigError, EngineStateError  # noqa: E402
from tests.integrations.test_verl import (  # noqa: E402, F401
    RESPONSES,
    _rollout,
    _verl_batch,
    _worker,
    distributed,
    qwen3,
    qwen3_moe,
)
from tests.multiprocess import run_ranks  # noqa: E402

STEPS = 3
LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
#: (strategy, model, LoRA settings)
CASES = [
    ("fsdp2", "dense", {}),
    ("fsdp2", "moe", {}),
    ("fsdp2", "dense", LORA),
    ("megatron", "dense", {}),
    ("megatron", "moe", {}),
    ("megatron", "dense", LORA),
]


def sync_worker(strategy: str, path: str, lora: dict[str, Any], parallel: dict[str, int]) -> Any:
    """verl's TrainingWorker on this engine: fsdp2, or megatron through verl's own megatron
    config at the ``parallel`` sizes (without sequence parallelism, which LoRA cannot run)."""
    if strategy == "fsdp2":
        return _worker("language_model", path, "fsdp2", model_settings=lora)
    settings = {"sequence_parallel": False, **parallel}
    return _worker("language_model", path, "megatron", model_settings=lora, **settings)


def placed_shards(engine: Any) -> list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]:
    """This rank's contributing shards as (name, shape, flat positions placed by verl's
    ``translate_flat_indices`` from each spec's placement, values)."""
    shards, _ = engine.get_per_tensor_param_shard()
    placed = []
    for name, flat, spec in shards:
        assert spec.place is not None and spec.gather_group is not None
        if spec.contributes and flat.numel():
            positions = translate_flat_indices(torch.arange(flat.numel()), spec.place)
            placed.append((name, tuple(spec.full_shape), positions, flat.clone()))
    return placed


def receive(held: dict[str, torch.Tensor], entries: Any, rank: int) -> int:
    """verl's delta engine's part: each entry's changes gathered to the group's first rank with
    verl's sparse gather; rank 0 writes them (a tensor it lacks starts as zeros). The number of
    elements written."""
    written = 0
    for slots, dtype, counts, positions, values, group in entries:
        assert positions.dtype == torch.int32 and counts.numel() == len(slots)
        gathered = gather_slot_entries_to_rank0(positions, values, counts, group=group)
        if rank != 0:
            continue
        for (name, shape), (where, what) in zip(slots, gathered, strict=True):
            full = held.setdefault(name, torch.zeros(shape, dtype=getattr(torch, dtype)))
            full.view(-1)[where.long()] = what
            written += where.numel()
    return written


def sync_through_verl(
    cases: list[tuple[str, str, dict[str, Any]]],
    paths: dict[str, str],
    parallel: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """On every rank, per case: the placed shards and the export they must rebuild, and whether
    the receiver equalled the export after each step (checked on rank 0)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    rows = _rollout()
    results = []
    for strategy, model, lora in cases:
        worker = sync_worker(strategy, paths[model], lora, parallel or {})
        engine = worker.engine
        with pytest.raises(EngineStateError, match="prime_delta_snapshots"):
            list(engine.get_per_tensor_param_delta_shard()[0])

        def export(base_sync_done: bool = bool(lora)) -> dict[str, torch.Tensor]:
            """Every rank's export (each pipeline stage's own layers), the adapters apart with
            LoRA once the base is synced, as verl's."""
            weights, _ = engine.get_per_tensor_param(base_sync_done=base_sync_done)  # noqa: B023
            everyone: list[Any] = [None] * size
            dist.all_gather_object(everyone, {name: tensor.clone() for name, tensor in weights})
            return {name: tensor for tensors in everyone for name, tensor in tensors.items()}

        result: dict[str, Any] = {"export": export(), "shards": placed_shards(engine), "steps": []}
        # what this rank yields is the whole model, whatever the layout (verl sends rank 0's)
        result["own"] = sorted(name for name, _ in engine.get_per_tensor_param()[0])
        held = export(base_sync_done=False)  # verl's delta seed: its full sync
        engine.prime_delta_snapshots()
        dp = engine.get_data_parallel_size()
        mine = engine.get_data_parallel_rank()
        per_rank = len(RESPONSES) // dp
        shard = {
            key: values[mine * per_rank : (mine + 1) * per_rank] for key, values in rows.items()
        }
        for _ in range(STEPS):
            worker.train_batch(_verl_batch(shard, global_batch_size=len(RESPONSES)))
            written = receive(held, engine.get_per_tensor_param_delta_shard()[0], rank)
            expected = export()
            equal = [
                name for name in expected if rank == 0 and torch.equal(held[name], expected[name])
            ]
            result["steps"].append({"written": written, "equal": len(equal), "of": len(expected)})
        results.append(result)
    return results


def check(per_rank: list[list[dict[str, Any]]], cases: list[Any]) -> None:
    for index, case in enumerate(cases):
        results = [ranks[index] for ranks in per_rank]
        expected = results[0]["export"]
        rebuilt = {
            name: torch.full(t.shape, float("nan"), dtype=t.dtype) for name, t in expected.items()
        }
        for result in results:
            for name, shape, positions, values in result["shards"]:
                assert shape == tuple(expected[name].shape), (case, name)
                rebuilt[name].view(-1)[positions] = values
        for name, tensor in expected.items():
            assert torch.equal(rebuilt[name], tensor), (case, name)
        seed = {name for name in expected if "lora_" not in name and "score" not in name}
        for result in results:
            assert seed <= {name.replace(".base_layer", "") for name in result["own"]}, case
        for step in results[0]["steps"]:
            assert step["written"] > 0, case
            assert step["equal"] == step["of"], (case, step)


@pytest.fixture(scope="module")
def paths(qwen3: str, qwen3_moe: str) -> dict[str, str]:  # noqa: F811
    return {"dense": qwen3, "moe": qwen3_moe}


@pytest.mark.parametrize(
    "case", CASES, ids=["-".join((c[0], c[1], "lora" * bool(c[2]))) for c in CASES]
)
def test_shards_and_deltas_through_verls_worker_equal_the_export(
    paths: dict[str, str],
    distributed: None,  # noqa: F811
    case: tuple[str, str, dict[str, Any]],
) -> None:
    check([sync_through_verl([case], paths)], [case])


#: The two-rank cases: fsdp2 data parallel, and megatron at TP=2, PP=2 and EP=2.
TWO_RANKS = [
    (None, [case for case in CASES if case[0] == "fsdp2"]),
    ({"tensor_model_parallel_size": 2}, [("megatron", "dense", {}), ("megatron", "dense", LORA)]),
    ({"pipeline_model_parallel_size": 2}, [("megatron", "dense", {})]),
    ({"expert_model_parallel_size": 2}, [("megatron", "moe", {})]),
]


def sync_over_two_ranks(paths: dict[str, str]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from strategies.backends.megatron.mesh import destroy_mesh

    dist.init_process_group("gloo")  # verl's own initialisation is refused on CPU
    results = []
    for parallel, cases in TWO_RANKS:
        destroy_mesh()  # megatron's mesh is one per process: each layout lays its own
        results += sync_through_verl(cases, paths, parallel)
    return results


@pytest.mark.multiprocess
def test_shards_and_deltas_over_two_ranks_equal_the_export(paths: dict[str, str]) -> None:
    """fsdp2 over two data-parallel ranks (dense, MoE, LoRA) and megatron at TP=2 (dense, LoRA),
    PP=2 and EP=2 (MoE): the shards placed by verl's helpers rebuild the export, and the deltas
    gathered over their groups keep rank 0's receiver equal to it."""
    cases = [case for _, layout in TWO_RANKS for case in layout]
    check(run_ranks(sync_over_two_ranks, 2, paths, timeout=400), cases)


@pytest.mark.parametrize(
    ("rollout", "backend", "expected"),
    [
        ("composable_hf", "delta_sharded", "this host cannot run it"),
        ("composable_hf", "nccl", "this host cannot run it"),
        ("vllm", "no_such_engine", "this host cannot run it"),
        ("composable_hf", "naive", None),
        ("composable_hf", "composable_gloo", None),
    ],
)
def test_a_checkpoint_engine_the_host_cannot_run_is_refused_by_name(
    rollout: str, backend: str, expected: str | None
) -> None:
    from omegaconf import OmegaConf

    from engine.integrations.verl.ppo import check_checkpoint_engine

    settings = OmegaConf.create({"name": rollout, "checkpoint_engine": {"backend": backend}})
    if expected is None:
        check_checkpoint_engine(settings)
        return
    with pytest.raises(ConfigError, match=f"checkpoint_engine.backend={backend}: {expected}"):
        check_checkpoint_engine(settings)


@pytest.mark.parametrize(
    ("rollout", "settings", "expected"),
    [
        ("composable_hf", {"delta": True, "timeout_s": 60}, None),
        ("vllm", {"delta": True}, "delta=True: only the composable_hf generator applies"),
        ("composable_hf", {"delta": "yes"}, r"delta='yes': true or false"),
        ("composable_hf", {"deltas": True}, r"unknown \['deltas'\]; it takes timeout_s, host"),
    ],
)
def test_the_gloo_checkpoint_engines_settings_are_checked_before_ray_starts(
    rollout: str, settings: dict[str, Any], expected: str | None
) -> None:
    from omegaconf import OmegaConf

    from engine.integrations.verl.ppo import check_gloo_engine_kwargs

    config = OmegaConf.create(
        {
            "name": rollout,
            "checkpoint_engine": {
                "backend": "composable_gloo",
                "engine_kwargs": {"composable_gloo": settings},
            },
        }
    )
    if expected is None:
        check_gloo_engine_kwargs(config)
        return
    with pytest.raises(ConfigError, match=expected):
        check_gloo_engine_kwargs(config)


@pytest.mark.parametrize(
    "mode, backend, strategy, expected",
    [
        ("sync", "naive", "fsdp", None),
        ("colocate_async", "naive", "fsdp", None),
        ("separate_async", "composable_gloo", "fsdp2", None),
        ("separate_async", "composable_gloo", "megatron", "pin_memory needs an accelerator"),
        ("separate_async", "naive", "fsdp2", "checkpoint engine other than 'naive'"),
        ("separate_async", "composable_gloo", "fsdp", "use actor_rollout_ref.actor.strategy"),
        ("overlapped", "naive", "fsdp", "verl's modes are sync, colocate_async, separate_async"),
    ],
)
def test_a_trainer_mode_the_host_cannot_run_is_refused_by_name(
    mode: str, backend: str, strategy: str, expected: str | None
) -> None:
    from omegaconf import OmegaConf

    from engine.integrations.verl.ppo import check_trainer_mode

    config = OmegaConf.create(
        {
            "trainer": {"use_v1": True, "v1": {"trainer_mode": mode}},
            "actor_rollout_ref": {
                "actor": {"strategy": strategy},
                "rollout": {"checkpoint_engine": {"backend": backend}},
            },
        }
    )
    if expected is None:
        check_trainer_mode(config)
        return
    with pytest.raises(ConfigError, match=f"trainer.v1.trainer_mode={mode}: .*{expected}"):
        check_trainer_mode(config)


@pytest.mark.parametrize("delta", [False, True], ids=["whole", "delta"])
def test_the_gloo_checkpoint_engine_carries_every_tensor_bit_for_bit(delta: bool) -> None:
    """verl's checkpoint-engine protocol as its ``CheckpointEngineManager`` drives it, two syncs
    in a row (the group is built for each): prepare on every worker, the topology from their
    metadata, the process group, the trainer's ranks sending (rank 1 only walks the weights),
    two rollout workers receiving; a tensor larger than a bucket goes in chunks, a transposed
    one and bf16 ones too. Between the syncs a few elements change (a NaN and a -0.0 among
    them), and all of one tensor. Each receiver ends each sync with the sender's tensors bit for
    bit: with ``delta`` the second sync carries the changed tensors only, patches of the few
    elements and the tensor that changed whole. Threads stand for the
    processes (gloo over TCP either way)."""
    import asyncio
    import threading

    from verl.checkpoint_engine import CheckpointEngineRegistry

    from engine.integrations.verl.cells import CHECKPOINT_ENGINE
    from engine.integrations.verl.checkpoint_engine import GlooCheckpointEngine
    from engine.weight_sync import WeightPatch

    assert CheckpointEngineRegistry.get(CHECKPOINT_ENGINE) is GlooCheckpointEngine
    bucket = 1 << 10
    source = torch.Generator().manual_seed(0)
    weights = {
        "embed.weight": torch.randn(40, 16, generator=source),  # 2560 bytes: 3 chunks
        "proj.weight": torch.randn(8, 6, generator=source).t(),  # not contiguous
        "norm.weight": torch.randn(16, generator=source).to(torch.bfloat16),
        "scale": torch.tensor(3.5, dtype=torch.bfloat16),
    }
    trainers = [
        GlooCheckpointEngine(bucket, is_master=rank == 0, host="127.0.0.1", delta=delta)
        for rank in (0, 1)
    ]
    rollouts = [GlooCheckpointEngine(bucket, host="127.0.0.1", delta=delta) for _ in range(2)]
    walked: list[int] = []

    def stream() -> Any:
        for name, tensor in weights.items():
            walked.append(1)
            yield name, tensor

    received: dict[int, dict[str, Any]] = {}
    held: dict[int, dict[str, torch.Tensor]] = {0: {}, 1: {}}
    errors: list[BaseException] = []

    def run(work: Any) -> None:
        try:
            asyncio.run(work())
        except BaseException as error:  # reported by the test's thread
            errors.append(error)

    def sender(engine: GlooCheckpointEngine, topology: dict[str, Any]) -> Any:
        async def work() -> None:
            engine.init_process_group(**topology)
            await engine.send_weights(stream())

        return work

    def receiver(i: int, topology: dict[str, Any]) -> Any:
        async def work() -> None:
            rollouts[i].init_process_group(**topology)
            received[i] = {n: t async for n, t in rollouts[i].receive_weights()}
            for name, sent in received[i].items():
                if isinstance(sent, WeightPatch):
                    sent.apply(held[i][name])
                else:
                    held[i][name] = sent.clone()

        return work

    for sync in range(2):
        if sync == 1:
            weights["embed.weight"][3, 5] = float("nan")
            weights["embed.weight"][39, 15] = -0.0
            weights["proj.weight"][1, 7] += 1  # the transposed one
            weights["norm.weight"].neg_()  # all of it: sent whole, smaller than a patch
            weights["scale"].fill_(-1.0)
        metadata = [engine.prepare() for engine in (*trainers, *rollouts)]
        to_trainers, to_rollouts = GlooCheckpointEngine.build_topology(2, 2, metadata)
        assert to_trainers["rank"] == [0, -1] and to_rollouts["rank"] == [1, 2]

        def part(topology: dict[str, list[Any]], i: int) -> dict[str, Any]:
            return {key: values[i] for key, values in topology.items()}

        threads = [
            threading.Thread(target=run, args=(sender(trainers[i], part(to_trainers, i)),))
            for i in range(2)
        ]
        threads += [
            threading.Thread(target=run, args=(receiver(i, part(to_rollouts, i)),))
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads)
        for engine in (*trainers, *rollouts):
            engine.finalize()
        for i, got in received.items():
            changed = ["embed.weight", "proj.weight", "norm.weight", "scale"]
            assert list(got) == (changed if delta and sync == 1 else list(weights))
            assert all(isinstance(sent, WeightPatch) for sent in got.values()) is (
                delta and sync == 1
            )
            assert list(held[i]) == list(weights)
            for name, tensor in weights.items():
                mine = held[i][name]
                assert mine.dtype == tensor.dtype and mine.shape == tensor.shape
                assert torch.equal(mine.view(-1).view(torch.uint8), _bytes(tensor)), name
        if delta and sync == 1:
            assert got["embed.weight"].positions.tolist() == [3 * 16 + 5, 39 * 16 + 15]
            assert got["norm.weight"].positions is None
    assert len(walked) == 2 * 2 * len(weights)  # both trainer ranks walk the weights, twice


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in row-major order (NaN and -0.0 compared as they are stored)."""
    return tensor.contiguous().view(-1).view(torch.uint8)
