"""FSDP2 checkpoints inside the engine's publish scheme: exact resume, resharding between
data-parallel sizes, a killed save (synchronous or asynchronous) leaves the previous checkpoint
latest, training goes on during an asynchronous save, damaged checkpoints are refused with the
engine unchanged, and a checkpoint of the other backend is refused naming both backends."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from engine.checkpointing.manifest import MANIFEST
from engine.checkpointing.retention import complete_checkpoints
from engine.checkpointing.save import KILL_AT_ENV
from engine.data.batching import take_rows
from engine.losses import sft_loss, value_regression_loss
from heads.errors import CheckpointError
from tests.factories import random_batch, tiny_model
from tests.multiprocess import RankFailure, run_ranks

LENGTHS = [5, 7, 9, 4]
LOSSES = {"lm": sft_loss, "value": value_regression_loss}


def _engine(
    head: str = "lm",
    backend: str = "fsdp2",
    backend_options: dict[str, Any] | None = None,
    **config: Any,
) -> Engine:
    settings = {
        "backend": backend_options or {},
        "model": tiny_model(),
        "micro_batch_size": 2,
        "seed": 5,
        "optimizer": {"lr": 1e-3, "clip_grad": 1.0},
        "scheduler": {"warmup_steps": 2, "decay_style": "cosine"},
        "total_steps": 10,
        **config,
    }
    return Engine.build(head=head, backend=backend, device="cpu", config=settings).initialize()


def _train(engine: Engine, head: str, steps: range) -> list[float]:
    """Each step trains on this rank's data-parallel shard of the step's batch."""
    rank, size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    share = len(LENGTHS) // size
    return [
        engine.train_batch(
            take_rows(
                random_batch(LENGTHS, 64, seed=step), slice(rank * share, (rank + 1) * share)
            ),
            LOSSES[head],
        )["loss"]
        for step in steps
    ]


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return dict(engine.get_per_tensor_param())


def _assert_same_weights(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("head", "options"),
    [
        ("lm", {}),
        ("value", {}),
        ("lm", {"cpu_offload": True, "weights_dtype": "bfloat16"}),  # host memory, bf16 weights
    ],
)
def test_resuming_from_a_checkpoint_reproduces_training_bit_exactly(
    tmp_path: Path, head: str, options: dict[str, Any]
) -> None:
    original = _engine(head, backend_options=options)
    _train(original, head, range(2))
    saved = original.save_checkpoint(tmp_path)
    assert sorted(os.listdir(saved)) == ["dcp", "manifest.json", "rng", "scheduler.json"]
    expected = _train(original, head, range(2, 4))

    resumed = _engine(head, backend_options=options)
    assert resumed.load_checkpoint(tmp_path) == saved
    assert resumed.global_step == 2
    assert _train(resumed, head, range(2, 4)) == expected
    _assert_same_weights(_weights(resumed), _weights(original))
    assert resumed.backend.current_lr() == original.backend.current_lr()


@pytest.mark.timeout(180)
def test_a_tied_embedding_is_written_once_and_resumes_bit_exactly(tmp_path: Path) -> None:
    """A model whose output layer is its embedding (``tie_embeddings``) holds one parameter under
    two names; the checkpoint stores it once (not two copies of the largest tensor) and a resume
    sets it under both, training on bit for bit."""
    from torch.distributed.checkpoint import FileSystemReader

    model = tiny_model(tie_embeddings=True)
    original = _engine(model=model)
    module = original.backend.modules()[0]
    parameters = len(list(module.parameters()))  # each parameter once
    names = len(list(module.named_parameters(remove_duplicate=False)))
    assert names == parameters + 1, "the case is a model with one weight under two names"
    _train(original, "lm", range(2))
    saved = original.save_checkpoint(tmp_path)
    stored = FileSystemReader(os.path.join(saved, "dcp")).read_metadata().state_dict_metadata
    assert len([key for key in stored if key.startswith("model.")]) == parameters
    expected = _train(original, "lm", range(2, 4))

    resumed = _engine(model=model)
    resumed.load_checkpoint(tmp_path)
    assert _train(resumed, "lm", range(2, 4)) == expected
    _assert_same_weights(_weights(resumed), _weights(original))


def test_saving_an_untrained_engine_does_not_change_how_it_trains(tmp_path: Path) -> None:
    plain, saving = _engine(), _engine()
    saving.save_checkpoint(tmp_path)
    assert _train(saving, "lm", range(2)) == _train(plain, "lm", range(2))


def test_a_forward_only_checkpoint_holds_the_weights_only(tmp_path: Path) -> None:
    trained = _engine()
    _train(trained, "lm", range(1))
    reference = _engine(forward_only=True)
    reference.load_checkpoint(trained.save_checkpoint(tmp_path / "trained"))
    _assert_same_weights(_weights(reference), _weights(trained))
    saved = reference.save_checkpoint(tmp_path / "reference")
    assert "scheduler.json" not in os.listdir(saved)
    fresh = _engine()
    fresh.load_checkpoint(saved)
    _assert_same_weights(_weights(fresh), _weights(trained))


@pytest.mark.timeout(180)
def test_a_forward_only_checkpoint_loads_into_a_trained_engine_as_into_a_fresh_one(
    tmp_path: Path,
) -> None:
    saved = _engine(forward_only=True, seed=11).save_checkpoint(tmp_path)
    trained, fresh = _engine(), _engine()
    _train(trained, "lm", range(3))
    for engine in (trained, fresh):
        assert engine.load_checkpoint(saved) == saved
        assert engine.global_step == 0
    assert trained.backend.current_lr() == fresh.backend.current_lr()
    assert _train(trained, "lm", range(3, 5)) == _train(fresh, "lm", range(3, 5))
    _assert_same_weights(_weights(trained), _weights(fresh))


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[-7:]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.timeout(180)
def test_damaged_checkpoints_are_refused_and_the_engine_is_unchanged(tmp_path: Path) -> None:
    source = _engine()
    _train(source, "lm", range(1))
    good = source.save_checkpoint(tmp_path / "good")
    target = _engine()
    before, lr = _weights(target), target.backend.current_lr()
    for how, match in (("truncated", "truncated"), ("flipped", "xxh3_128 mismatch")):
        broken = Path(source.save_checkpoint(tmp_path / how))
        largest = max((broken / "dcp").rglob("*.distcp"), key=lambda p: p.stat().st_size)
        _damage(largest, how)
        with pytest.raises(CheckpointError, match=match):
            target.load_checkpoint(broken)
        _assert_same_weights(_weights(target), before)
        assert (target.global_step, target.backend.current_lr()) == (0, lr)
    target.load_checkpoint(good)
    _assert_same_weights(_weights(target), _weights(source))


@pytest.mark.timeout(180)
def test_a_checkpoint_of_the_other_backend_is_refused_naming_both(
    fresh_mesh: None, tmp_path: Path
) -> None:
    from_megatron = _engine(backend="megatron").save_checkpoint(tmp_path / "megatron")
    from_fsdp2 = _engine().save_checkpoint(tmp_path / "fsdp2")
    with pytest.raises(CheckpointError, match="'megatron' backend; this engine runs the 'fsdp2'"):
        _engine().load_checkpoint(from_megatron)
    with pytest.raises(CheckpointError, match="'fsdp2' backend; this engine runs the 'megatron'"):
        _engine(backend="megatron").load_checkpoint(from_fsdp2)


def save_then_die(root: str, stage: str, async_save: bool = False) -> None:
    """Save step 1 normally, train, then die at ``stage`` while saving step 2 (with
    ``async_save``: in the background, while training goes on)."""
    engine = _engine()
    _train(engine, "lm", range(1))
    engine.save_checkpoint(root)
    _train(engine, "lm", range(1, 2))
    os.environ[KILL_AT_ENV] = stage
    engine.save_checkpoint(root, async_save=async_save)
    if async_save:
        _train(engine, "lm", range(2, 40))
        engine.wait_for_checkpoint()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stage", ["after_state", "before_manifest", "before_rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_as_latest(
    tmp_path: Path, stage: str, async_save: bool
) -> None:
    with pytest.raises(RankFailure, match="exited -9"):
        run_ranks(save_then_die, 1, str(tmp_path), stage, async_save, timeout=180)
    assert [step for step, _ in complete_checkpoints(str(tmp_path))] == [1]
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith(".tmp-global_step_2-")]
    assert leftovers
    engine = _engine()
    assert engine.load_checkpoint(tmp_path) == str(tmp_path / "global_step_1")
    assert engine.global_step == 1
    engine.save_checkpoint(tmp_path)  # the next save removes what the killed one left
    assert not any(name in os.listdir(tmp_path) for name in leftovers)


@pytest.fixture
def gated_async_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Asynchronous saves write their DCP files only once the returned event is set."""
    from strategies.checkpoint_files.staged_dcp import StagedDcpSave
    from tests.engine.test_checkpoint import gated

    return gated(monkeypatch, StagedDcpSave, "write")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("head", ["lm", "value"])
def test_training_goes_on_during_an_async_save_and_resuming_from_it_is_bit_exact(
    tmp_path: Path, gated_async_writes: threading.Event, head: str
) -> None:
    original = _engine(head)
    _train(original, head, range(2))
    saved = original.save_checkpoint(tmp_path, async_save=True)
    assert saved == str(tmp_path / "global_step_2")
    expected = _train(original, head, range(2, 4))  # while the save is in flight
    assert complete_checkpoints(str(tmp_path)) == []  # nothing published before it is written
    gated_async_writes.set()
    assert original.wait_for_checkpoint() == saved
    assert os.listdir(tmp_path) == ["global_step_2"]
    files = json.loads((tmp_path / "global_step_2" / MANIFEST).read_text())["files"]
    assert sorted(files) == [
        "dcp/.metadata", "dcp/__0_0.distcp", "rng/rank_0.pt", "scheduler.json"
    ]  # fmt: skip

    resumed = _engine(head)
    assert resumed.load_checkpoint(tmp_path) == saved
    assert resumed.global_step == 2
    assert _train(resumed, head, range(2, 4)) == expected
    _assert_same_weights(_weights(resumed), _weights(original))


@pytest.mark.timeout(180)
def test_a_failed_background_write_raises_checkpoint_error_and_leaves_only_the_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from strategies.checkpoint_files.staged_dcp import StagedDcpSave

    engine = _engine()
    _train(engine, "lm", range(1))
    engine.save_checkpoint(tmp_path)

    def fail(self: StagedDcpSave) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StagedDcpSave, "write", fail)
    engine.save_checkpoint(tmp_path, global_step=2, async_save=True)
    _train(engine, "lm", range(1, 2))
    with pytest.raises(CheckpointError, match=r"rank 0 could not write its files: .*No space left"):
        engine.wait_for_checkpoint()
    assert os.listdir(tmp_path) == ["global_step_1"]  # the failed save's directory is gone
    assert engine.wait_for_checkpoint() is None  # raised once
    monkeypatch.undo()
    assert engine.save_checkpoint(tmp_path, async_save=True) == str(tmp_path / "global_step_2")
    assert engine.load_checkpoint(tmp_path) == str(tmp_path / "global_step_2")


def train_save_and_infer(root: str, async_save: bool = False) -> dict[str, Any]:
    """Train 2 steps and save (with ``async_save``: in the background while inferring), or,
    where there is a checkpoint, load it; infer; train 2 more."""
    engine = _engine()
    if os.listdir(root):
        engine.load_checkpoint(root)
    else:
        _train(engine, "lm", range(2))
        engine.save_checkpoint(root, async_save=async_save)
    outputs = engine.infer_batch(random_batch(LENGTHS, 64, seed=9))
    engine.wait_for_checkpoint()
    return {
        "log_probs": outputs["log_probs"].values().clone(),
        "losses": _train(engine, "lm", range(2, 4)),
        "weights": _weights(engine),
    }


@pytest.mark.timeout(400)
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("saved_by", "loaded_by", "async_save"),
    [(2, 1, False), (1, 2, False), (2, 1, True)],
    ids=["dp2-to-1", "1-to-dp2", "async-dp2-to-1"],
)
def test_a_checkpoint_reshards_between_data_parallel_sizes(
    tmp_path: Path, saved_by: int, loaded_by: int, async_save: bool
) -> None:
    root = str(tmp_path)
    saved = run_ranks(train_save_and_infer, saved_by, root, async_save, timeout=240)
    if async_save:  # every rank's file, under rank 0's metadata, published whole
        files = json.loads(next(tmp_path.glob("global_step_*/manifest.json")).read_text())
        assert sorted(name for name in files["files"] if name.startswith("dcp/")) == [
            "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"
        ]  # fmt: skip
    loaded = run_ranks(train_save_and_infer, loaded_by, root, timeout=240)
    for report in loaded:
        # weights, Adam moments and the LR schedule resharded: training continues alike
        torch.testing.assert_close(report["log_probs"], saved[0]["log_probs"], atol=1e-5, rtol=0)
        assert report["losses"] == pytest.approx(saved[0]["losses"], rel=1e-5, abs=1e-6)
        for name, tensor in report["weights"].items():
            torch.testing.assert_close(tensor, saved[0]["weights"][name], atol=1e-5, rtol=1e-5)
