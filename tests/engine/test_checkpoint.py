"""Engine checkpoints: exact resume, retention, atomic publish, verification before loading,
resharding to another tensor-parallel layout."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from engine.checkpointing.manifest import FORMAT_VERSION, MANIFEST
from engine.checkpointing.retention import complete_checkpoints, resolve_checkpoint
from engine.checkpointing.save import KILL_AT_ENV
from engine.losses import sft_loss, value_regression_loss
from heads.errors import CheckpointError, ConfigError
from tests.factories import random_batch, tiny_model
from tests.multiprocess import RankFailure, run_ranks

LENGTHS = [5, 7, 9, 4]
LOSSES = {"lm": sft_loss, "value": value_regression_loss}


def _config(**backend: Any) -> dict[str, Any]:
    return {
        "model": tiny_model(),
        "micro_batch_size": 2,
        "seed": 5,
        "optimizer": {"lr": 1e-3, "clip_grad": 1.0},
        "backend": backend,
    }


def _engine(head: str = "lm", **config: Any) -> Engine:
    return Engine.build(head=head, device="cpu", config={**_config(), **config}).initialize()


def _train(engine: Engine, head: str, steps: range) -> list[float | None]:
    return [
        engine.train_batch(random_batch(LENGTHS, 64, seed=step), LOSSES[head]).get("loss")
        for step in steps
    ]


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {
        name: param.detach().clone()
        for chunk in engine.backend.modules()
        for name, param in chunk.named_parameters()
    }


def _assert_same_weights(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("head", "distributed_optimizer"),
    [("lm", False), ("value", False), ("lm", True)],
    ids=["lm", "value", "lm-distributed-optimizer"],
)
def test_resuming_from_a_checkpoint_reproduces_training_bit_exactly(
    fresh_mesh: None, tmp_path: Path, head: str, distributed_optimizer: bool
) -> None:
    config = _config(use_distributed_optimizer=distributed_optimizer)
    original = Engine.build(head=head, device="cpu", config=config).initialize()
    _train(original, head, range(2))
    saved = original.save_checkpoint(tmp_path)
    assert saved == str(tmp_path / "global_step_2")
    expected_losses = _train(original, head, range(2, 4))

    resumed = Engine.build(head=head, device="cpu", config=config).initialize()
    assert resumed.load_checkpoint(tmp_path) == saved
    assert resumed.global_step == 2
    assert _train(resumed, head, range(2, 4)) == expected_losses
    _assert_same_weights(_weights(resumed), _weights(original))
    assert resumed.backend.current_lr() == original.backend.current_lr()


@pytest.mark.timeout(180)
def test_a_save_writes_the_weights_and_optimizer_states_without_copying_them(
    fresh_mesh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron keeps weights, gradients and optimizer states as views into flat buffers, and
    its writer clones every view before writing it; the engine's writer writes them from their
    own memory (``staged_dcp.own_storage``): nothing of the model's size is copied during a
    save (the RNG states, a few kB, are), and the checkpoint still resumes bit for bit."""
    engine = _engine()
    _train(engine, "lm", range(1))
    weights = {
        p.untyped_storage().data_ptr()
        for chunk in engine.backend.modules()
        for p in chunk.parameters()
    }
    cloned: list[tuple[int, int]] = []  # (storage, bytes) of each tensor cloned
    clone = torch.Tensor.clone

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cloned.append((tensor.untyped_storage().data_ptr(), tensor.numel() * tensor.element_size()))
        return clone(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counted)
    engine.save_checkpoint(tmp_path)
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    params = sum(
        p.numel() * p.element_size()
        for chunk in engine.backend.modules()
        for p in chunk.parameters()
    )
    assert not weights & {storage for storage, _ in cloned}, "a weight was copied"
    assert sum(size for _, size in cloned) < params, cloned  # the RNG states only
    expected = _train(engine, "lm", range(1, 3))
    resumed = _engine()
    resumed.load_checkpoint(tmp_path)
    assert _train(resumed, "lm", range(1, 3)) == expected


@pytest.mark.timeout(120)
def test_retention_keeps_the_newest_and_latest_skips_incomplete_directories(
    fresh_mesh: None, tmp_path: Path
) -> None:
    engine = _engine()
    for step in (1, 2, 3):
        engine.save_checkpoint(tmp_path, global_step=step, max_ckpt_to_keep=2)
    assert [step for step, _ in complete_checkpoints(str(tmp_path))] == [2, 3]
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_3"]
    (tmp_path / ".tmp-global_step_9-abcd").mkdir()  # a save that died before publishing
    (tmp_path / "global_step_8").mkdir()  # no manifest: not a checkpoint
    assert resolve_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_3")
    assert engine.load_checkpoint(tmp_path) == str(tmp_path / "global_step_3")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        engine.load_checkpoint(tmp_path / "global_step_8")


def _damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _set_manifest(directory: Path, **changes: Any) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest.update(changes)
    (directory / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.timeout(180)
def test_bad_checkpoints_raise_checkpoint_error_and_leave_the_engine_unchanged(
    fresh_mesh: None, tmp_path: Path
) -> None:
    source = _engine()
    _train(source, "lm", range(1))
    good = Path(source.save_checkpoint(tmp_path / "good"))

    target = _engine()
    before, step_before, lr_before = (
        _weights(target),
        target.global_step,
        target.backend.current_lr(),
    )

    def expect(path: Path, match: str) -> None:
        with pytest.raises(CheckpointError, match=match):
            target.load_checkpoint(path)
        _assert_same_weights(_weights(target), before)
        assert (target.global_step, target.backend.current_lr()) == (step_before, lr_before)

    expect(tmp_path / "missing", "does not exist")
    (tmp_path / "empty").mkdir()
    expect(tmp_path / "empty", "no complete checkpoint under")
    for name, damage, match in (
        ("truncated", _damage_truncate, "truncated"),
        ("flipped", _damage_flip, "xxh3_128 mismatch"),
    ):
        broken = Path(source.save_checkpoint(tmp_path / name))
        damage(_largest_file(broken / "dist"))
        expect(broken, match)
    newer = Path(source.save_checkpoint(tmp_path / "newer"))
    _set_manifest(newer, format_version=FORMAT_VERSION + 1)
    expect(newer, "newer than this composable-engine reads")
    target.load_checkpoint(good)  # the good one still loads after all that
    _assert_same_weights(_weights(target), _weights(source))


@pytest.mark.timeout(180)
def test_a_checkpoint_of_another_head_or_model_shape_is_refused_naming_both(
    fresh_mesh: None, tmp_path: Path
) -> None:
    saved = _engine("lm").save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="'lm' head engine; this engine has a 'value' head"):
        _engine("value").load_checkpoint(saved)
    wider = _engine(model=tiny_model(ffn_hidden_size=128))
    with pytest.raises(CheckpointError, match=r"ffn_hidden_size=64\); .* ffn_hidden_size=128"):
        wider.load_checkpoint(saved)


def save_then_die(root: str, stage: str, async_save: bool = False) -> None:
    """Save step 1, train, then die at ``stage`` while saving step 2 (with ``async_save``: in
    the background, while training goes on); the processes this one started by then (the first
    save's included) are listed in ``root/children.json`` first."""
    import psutil

    engine = _engine()
    _train(engine, "lm", range(1))
    engine.save_checkpoint(root, async_save=async_save)
    _train(engine, "lm", range(1, 2))
    engine.wait_for_checkpoint()  # the stage to die at is for the next save only
    children = [child.pid for child in psutil.Process().children(recursive=True)]
    Path(root, "children.json").write_text(json.dumps(children))
    os.environ[KILL_AT_ENV] = stage
    engine.save_checkpoint(root, async_save=async_save)
    if async_save:
        _train(engine, "lm", range(2, 40))
        engine.wait_for_checkpoint()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stage", ["after_state", "before_manifest", "before_rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_as_latest(
    fresh_mesh: None, tmp_path: Path, stage: str, async_save: bool
) -> None:

    with pytest.raises(RankFailure, match="exited -9"):
        run_ranks(
            save_then_die, 1, str(tmp_path), stage, async_save, timeout=180, leave_children=True
        )
    assert [step for step, _ in complete_checkpoints(str(tmp_path))] == [1]
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith(".tmp-global_step_2-")]
    assert leftovers
    # a save starts no process (megatron's writer hands its results over in this process), so
    # nothing can outlive a killed saver
    assert json.loads((tmp_path / "children.json").read_text()) == []
    engine = _engine()
    assert engine.load_checkpoint(tmp_path) == str(tmp_path / "global_step_1")
    assert engine.global_step == 1
    engine.save_checkpoint(tmp_path)  # the next save removes what the killed one left
    assert not any(name in os.listdir(tmp_path) for name in leftovers)


def train_save_and_infer(
    root: str, parallel: dict[str, Any], async_save: bool = False
) -> dict[str, Any]:
    """Train 2 steps and save (or, where there is a checkpoint, load it); infer; train (with
    ``async_save``, while the save is in flight)."""
    engine = _engine(parallel=parallel)
    if os.listdir(root):
        engine.load_checkpoint(root)
    else:
        _train(engine, "lm", range(2))
        engine.save_checkpoint(root, async_save=async_save)
    log_probs = engine.infer_batch(random_batch(LENGTHS, 64, seed=9))
    outputs = None if log_probs is None else log_probs["log_probs"].values().clone()
    losses = _train(engine, "lm", range(2, 4))
    engine.wait_for_checkpoint()
    return {"log_probs": outputs, "losses": losses}


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_a_checkpoint_saved_in_one_process_loads_at_another_layout(
    tmp_path: Path, layout: dict[str, Any]
) -> None:
    root = str(tmp_path)
    (expected,) = run_ranks(train_save_and_infer, 1, root, {}, timeout=180)
    reports = run_ranks(train_save_and_infer, 2, root, layout, timeout=240)
    output = [r for r in reports if r["log_probs"] is not None]
    assert len(output) == 1
    torch.testing.assert_close(output[0]["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    # optimizer state (Adam moments) and LR schedule resharded too: training continues alike
    assert output[0]["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.timeout(400)
@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {}], ids=["tp2", "dp2"])
def test_a_checkpoint_saved_by_two_ranks_resumes_there_and_loads_in_one_process(
    tmp_path: Path, parallel: dict[str, Any]
) -> None:
    root = str(tmp_path)
    saved = run_ranks(train_save_and_infer, 2, root, parallel, timeout=240)
    assert len([name for name in os.listdir(root) if name.startswith("global_step_")]) == 1
    resumed = run_ranks(train_save_and_infer, 2, root, parallel, timeout=240)
    for before, after in zip(saved, resumed, strict=True):
        if before["log_probs"] is not None:
            assert torch.equal(before["log_probs"], after["log_probs"])
            assert before["losses"] == after["losses"]
    (single,) = run_ranks(train_save_and_infer, 1, root, {}, timeout=180)
    (reference,) = [r for r in saved if r["log_probs"] is not None][:1]
    torch.testing.assert_close(single["log_probs"], reference["log_probs"], atol=1e-5, rtol=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_simulated_accelerator_cells_save_and_resume_exactly(
    fresh_mesh: None, tmp_path: Path, head: str, device: str
) -> None:
    from tests.simulation import EventLog, make_platform

    def build() -> Engine:
        platform, _ = make_platform(device, EventLog())
        return Engine.build(head=head, device=platform, config=_config()).initialize()

    engine = build()
    _train(engine, head, range(2))
    engine.save_checkpoint(tmp_path)
    expected = _train(engine, head, range(2, 4))
    resumed = build()
    resumed.load_checkpoint(tmp_path)
    assert _train(resumed, head, range(2, 4)) == expected
    _assert_same_weights(_weights(engine), _weights(resumed))


def _full_state(engine: Engine) -> dict[str, Any]:
    """Everything a checkpoint restores, as plain tensors and numbers."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    backend: Any = engine.backend
    parts = getattr(backend._optimizer, "chained_optimizers", [backend._optimizer])
    moments = {
        f"{part}.{index}.{key}": value.clone()
        for part, chained in enumerate(parts)
        for index, state in enumerate(chained.optimizer.state.values())
        for key, value in state.items()
    }
    assert moments
    return {
        "weights": _weights(engine),
        "optimizer": moments,
        "scheduler_steps": backend._scheduler.num_steps,
        "lr": engine.backend.current_lr(),
        "global_step": engine.global_step,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


@pytest.mark.timeout(180)
def test_loading_into_an_engine_that_trained_gives_the_state_of_a_fresh_load(
    fresh_mesh: None, tmp_path: Path
) -> None:
    warmup = {"scheduler": {"warmup_steps": 6, "decay_style": "cosine"}, "total_steps": 20}
    trained = _engine(**warmup)
    _train(trained, "lm", range(2))
    trained.save_checkpoint(tmp_path)
    _train(trained, "lm", range(2, 5))
    trained.load_checkpoint(tmp_path)
    after_training = _full_state(trained)
    fresh = _engine(**warmup)
    fresh.load_checkpoint(tmp_path)
    after_fresh = _full_state(fresh)
    assert after_training["scheduler_steps"] == after_fresh["scheduler_steps"] == 2
    assert after_training["lr"] == after_fresh["lr"]
    assert after_training["global_step"] == after_fresh["global_step"] == 2
    assert after_training["python_rng"] == after_fresh["python_rng"]
    for part in ("torch_rng", "numpy_rng"):
        assert torch.equal(
            torch.as_tensor(after_training[part]), torch.as_tensor(after_fresh[part])
        )
    for part in ("weights", "optimizer", "tracker"):
        assert after_training[part].keys() == after_fresh[part].keys(), part
        for name, value in after_training[part].items():
            assert torch.equal(value, after_fresh[part][name]), f"{part} {name}"
    assert _train(trained, "lm", range(5, 7)) == _train(fresh, "lm", range(5, 7))


def test_loading_a_root_warns_about_a_newer_incomplete_checkpoint_it_skips(tmp_path: Path) -> None:
    complete = tmp_path / "global_step_3"
    complete.mkdir()
    (complete / MANIFEST).write_text(
        json.dumps({"format_version": FORMAT_VERSION, "global_step": 3, "files": {}})
    )
    (tmp_path / "global_step_5").mkdir()  # no manifest: a save that did not finish
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_checkpoint(str(tmp_path)) == str(complete)
    messages = [str(w.message) for w in caught]
    assert any("global_step_5" in m and "not a complete checkpoint" in m for m in messages)


def test_only_saves_of_dead_processes_on_this_host_and_container_are_cleaned_up(
    tmp_path: Path,
) -> None:
    import socket
    import subprocess
    import sys

    from engine.checkpointing.processes import process_space
    from engine.checkpointing.retention import remove_abandoned_saves

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    here, pid = process_space(), dead.stdout.strip()
    names = {
        "dead": f".tmp-global_step_4-{here}-{pid}-0123abcd",
        "dead-aside": f".tmp-global_step_4-{here}-{pid}-0123abcd-replaced",
        "alive": f".tmp-global_step_5-{here}-{os.getpid()}-0123abcd",
        "other-host": f".tmp-global_step_6-elsewhere@{here.split('@')[1]}-{pid}-0123abcd",
        "other-container": f".tmp-global_step_7-{socket.gethostname()}@1-{pid}-0123abcd",
        "checkpoint": "global_step_3",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    removed = remove_abandoned_saves(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / names[k]) for k in ("dead", "dead-aside"))
    assert sorted(os.listdir(tmp_path)) == sorted(
        names[k] for k in ("alive", "other-host", "other-container", "checkpoint")
    )


@pytest.mark.timeout(180)
def test_a_version_1_checkpoint_with_sha256_checksums_still_loads(
    fresh_mesh: None, tmp_path: Path
) -> None:
    import hashlib

    engine = _engine()
    _train(engine, "lm", range(1))
    saved = Path(engine.save_checkpoint(tmp_path))
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2
    for name, entry in manifest["files"].items():
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((saved / name).read_bytes()).hexdigest()
    manifest["format_version"] = 1
    (saved / MANIFEST).write_text(json.dumps(manifest))
    assert _engine().load_checkpoint(saved) == str(saved)
    _damage_flip(_largest_file(saved))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        _engine().load_checkpoint(saved)


class _WritesOneFile:
    """A ``Checkpointing`` part that writes ``state.bin`` and reports the given entry for it."""

    def __init__(self, entry: dict[str, Any] | None) -> None:
        self.entry = entry

    def save_state(self, directory: str) -> dict[str, dict[str, Any]] | None:
        Path(directory, "state.bin").write_bytes(b"weights")
        return None if self.entry is None else {"state.bin": self.entry}

    def load_state(self, directory: str, *, same_layout: bool) -> None:
        raise AssertionError("not loaded here")


def _description() -> dict[str, Any]:
    from strategies.part_configs import ModelConfig

    return {"head": "lm", "backend": "fake", "model": ModelConfig(**tiny_model()),
            "parallel": {}, "config": {}}  # fmt: skip


def test_a_file_checksummed_while_written_is_not_read_back_and_others_are(tmp_path: Path) -> None:
    from engine.checkpointing.save import save_checkpoint
    from strategies.checkpoint_files.publish import file_checksum

    written = {"size": 7, "xxh3_128": "checksum-of-the-bytes-as-written"}
    saved = Path(save_checkpoint(_WritesOneFile(written), _description(), str(tmp_path), 1, None))
    assert json.loads((saved / MANIFEST).read_text())["files"] == {"state.bin": written}
    saved = Path(save_checkpoint(_WritesOneFile(None), _description(), str(tmp_path), 2, None))
    assert json.loads((saved / MANIFEST).read_text())["files"] == {
        "state.bin": {"size": 7, "xxh3_128": file_checksum(saved / "state.bin")}
    }


def test_a_file_whose_size_on_disk_is_not_what_was_written_fails_the_save(tmp_path: Path) -> None:
    from engine.checkpointing.save import save_checkpoint

    short = {"size": 5, "xxh3_128": "0"}
    with pytest.raises(CheckpointError, match="has 7 bytes on disk, but 5 were written"):
        save_checkpoint(_WritesOneFile(short), _description(), str(tmp_path), 1, None)
    assert complete_checkpoints(str(tmp_path)) == []


@pytest.mark.timeout(120)
def test_megatron_writes_one_model_file_per_rank_with_the_checksum_of_its_bytes(
    fresh_mesh: None, tmp_path: Path
) -> None:
    from strategies.checkpoint_files.publish import file_checksum

    engine = _engine()
    _train(engine, "lm", range(1))
    saved = Path(engine.save_checkpoint(tmp_path))
    files = json.loads((saved / MANIFEST).read_text())["files"]
    assert [name for name in files if name.endswith(".distcp")] == ["dist/__0_0.distcp"]
    for name, entry in files.items():
        assert entry == {"size": (saved / name).stat().st_size,
                         "xxh3_128": file_checksum(saved / name)}, name  # fmt: skip


def gated(monkeypatch: pytest.MonkeyPatch, owner: type, method: str) -> threading.Event:
    """``owner.method`` runs only once the returned event is set."""
    gate = threading.Event()
    original = getattr(owner, method)

    def waiting(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert gate.wait(timeout=60), "the test never opened the gate"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, waiting)
    return gate


@pytest.fixture
def gated_async_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Asynchronous saves write their model files only once the returned event is set."""
    from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy

    return gated(monkeypatch, ChecksummingSaveStrategy, "write_staged")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["plain", "distributed"])
def test_training_goes_on_during_an_async_save_and_resuming_from_it_is_bit_exact(
    fresh_mesh: None,
    tmp_path: Path,
    gated_async_writes: threading.Event,
    distributed_optimizer: bool,
) -> None:
    config = _config(use_distributed_optimizer=distributed_optimizer)
    original = Engine.build(head="lm", device="cpu", config=config).initialize()
    _train(original, "lm", range(2))
    saved = original.save_checkpoint(tmp_path, async_save=True)
    assert saved == str(tmp_path / "global_step_2")
    expected_losses = _train(original, "lm", range(2, 4))  # while the save is in flight
    assert complete_checkpoints(str(tmp_path)) == []  # nothing published before it is written
    gated_async_writes.set()
    assert original.wait_for_checkpoint() == saved
    assert [name for name in os.listdir(tmp_path)] == ["global_step_2"]

    resumed = Engine.build(head="lm", device="cpu", config=config).initialize()
    assert resumed.load_checkpoint(tmp_path) == saved
    assert resumed.global_step == 2
    assert _train(resumed, "lm", range(2, 4)) == expected_losses
    _assert_same_weights(_weights(resumed), _weights(original))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "surfaced_by", ["wait_for_checkpoint", "save_checkpoint", "load_checkpoint"]
)
def test_a_failed_background_write_raises_checkpoint_error_at_the_next_checkpoint_call(
    fresh_mesh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, surfaced_by: str
) -> None:
    from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy

    engine = _engine()
    _train(engine, "lm", range(1))
    engine.save_checkpoint(tmp_path)

    def fail(self: ChecksummingSaveStrategy) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ChecksummingSaveStrategy, "write_staged", fail)
    engine.save_checkpoint(tmp_path, global_step=2, async_save=True)
    _train(engine, "lm", range(1, 2))
    calls = {
        "wait_for_checkpoint": lambda: engine.wait_for_checkpoint(),
        "save_checkpoint": lambda: engine.save_checkpoint(tmp_path, global_step=3),
        "load_checkpoint": lambda: engine.load_checkpoint(tmp_path),
    }
    with pytest.raises(CheckpointError, match=r"rank 0 could not write its files: .*No space left"):
        calls[surfaced_by]()
    assert os.listdir(tmp_path) == ["global_step_1"]  # the failed save's directory is gone
    assert engine.wait_for_checkpoint() is None  # raised once
    monkeypatch.undo()
    assert engine.save_checkpoint(tmp_path, async_save=True) == str(tmp_path / "global_step_2")
    assert engine.load_checkpoint(tmp_path) == str(tmp_path / "global_step_2")


@pytest.mark.timeout(240)
def test_process_exit_waits_for_an_async_save_and_fails_the_process_if_it_failed(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    script = (
        "from tests.engine.test_checkpoint import _engine; import sys; "
        "from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy\n"
        "def fail(self): raise OSError('disk gone')\n"
        "if sys.argv[2] == 'fail': ChecksummingSaveStrategy.write_staged = fail\n"
        "_engine().save_checkpoint(sys.argv[1], global_step=int(sys.argv[3]), async_save=True)\n"
        "print('main returned')"
    )
    root = str(Path(__file__).resolve().parents[2])

    def run(how: str, step: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", script, str(tmp_path), how, str(step)],
                              capture_output=True, text=True, timeout=100, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})  # fmt: skip

    written = run("write", 0)
    assert written.returncode == 0, written.stderr[-2000:]
    assert [step for step, _ in complete_checkpoints(str(tmp_path))] == [0]
    failed = run("fail", 1)
    assert "main returned" in failed.stdout
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert "CheckpointError" in failed.stderr
    assert "rank 0 could not write its files: OSError('disk gone')" in failed.stderr
    assert os.listdir(tmp_path) == ["global_step_0"]


@pytest.mark.timeout(400)
@pytest.mark.multiprocess
def test_an_async_save_by_two_ranks_is_published_whole_and_resumes_bit_exactly(
    tmp_path: Path,
) -> None:
    root, parallel = str(tmp_path), {"tensor_parallel_size": 2}
    saved = run_ranks(train_save_and_infer, 2, root, parallel, True, timeout=240)
    assert os.listdir(root) == ["global_step_2"]
    files = json.loads((tmp_path / "global_step_2" / MANIFEST).read_text())["files"]
    assert sorted(name for name in files if name.endswith(".distcp")) == [
        "dist/__0_0.distcp", "dist/__1_0.distcp"
    ]  # fmt: skip
    resumed = run_ranks(train_save_and_infer, 2, root, parallel, timeout=240)
    for before, after in zip(saved, resumed, strict=True):
        assert before["losses"] == after["losses"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("writer", ["engine", "megatron"])
def test_the_mapped_reader_restores_what_torchs_reader_does_from_either_writer(
    fresh_mesh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    from strategies.backends.megatron import checkpoint_reader, checkpoint_writer

    class _MegatronWriter(TorchDistSaveShardedStrategy):
        """megatron's own writer, as older checkpoints were written (nothing checksummed)."""

        staged = False
        checksums: dict[str, Any] = {}  # noqa: RUF012 (never written)

        def __init__(self) -> None:
            super().__init__("torch_dist", 1)

    if writer == "megatron":
        monkeypatch.setattr(checkpoint_writer, "ChecksummingSaveStrategy", _MegatronWriter)
    config = _config(use_distributed_optimizer=True)
    trained = Engine.build(head="lm", device="cpu", config=config).initialize()
    _train(trained, "lm", range(2))
    trained.save_checkpoint(tmp_path)

    def loaded() -> dict[str, Any]:
        engine = Engine.build(head="lm", device="cpu", config=config).initialize()
        engine.load_checkpoint(tmp_path)
        return _full_state(engine)

    mapped = loaded()
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_reader, "MappedLoadStrategy", TorchDistLoadShardedStrategy)
        by_torch = loaded()
    with monkeypatch.context() as patch:  # every item through torch.load, as for odd items

        def not_plain(*_: Any) -> Any:
            raise checkpoint_reader._NotPlain

        patch.setattr(checkpoint_reader, "_stored_tensor", not_plain)
        fallback = loaded()
    with monkeypatch.context() as patch:  # typed views of the mapping, as when resharding
        patch.setattr(checkpoint_reader, "_takes_bytes", lambda *_: False)
        typed = loaded()
    for part in ("weights", "optimizer"):
        for name, value in by_torch[part].items():
            for other in (mapped, fallback, typed):
                assert torch.equal(value, other[part][name]), f"{part} {name}"
    _assert_same_weights(_weights(trained), mapped["weights"])


def _no_space(*_: Any) -> Any:
    raise OSError(28, "No space left on device")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_that_cannot_write_raises_checkpoint_error_and_leaves_only_the_latest(
    fresh_mesh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    from strategies.backends.megatron import checkpoint
    from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy

    engine = _engine()
    root = tmp_path / "root"
    engine.save_checkpoint(root)
    (tmp_path / "a-file").write_text("not a directory")
    for where in (tmp_path / "a-file", tmp_path / "a-file" / "below"):
        with pytest.raises(CheckpointError, match=f"cannot write a checkpoint under {where}"):
            engine.save_checkpoint(where, async_save=async_save)
    assert (tmp_path / "a-file").read_text() == "not a directory"
    for part in ((checkpoint, "_rng_states"), (ChecksummingSaveStrategy, "_write_buckets")):
        with monkeypatch.context() as patch:
            patch.setattr(*part, _no_space)
            with pytest.raises(CheckpointError, match=r"rank 0 could not write its files: .*No sp"):
                engine.save_checkpoint(root, global_step=1, async_save=async_save)
                engine.wait_for_checkpoint()
        assert os.listdir(root) == ["global_step_0"]  # no temporary directory left behind
    assert engine.save_checkpoint(root, global_step=1, async_save=async_save) == str(
        root / "global_step_1"
    )
    engine.wait_for_checkpoint()
    assert [step for step, _ in complete_checkpoints(str(root))] == [0, 1]


def save_where_one_rank_fails(root: str) -> list[Any]:
    """On two ranks: save into a file (rank 0 cannot create the directory), then fail rank 1's
    part of a synchronous and of an asynchronous save; the errors each rank saw, then (on
    rank 0, which removes the failed saves' directories) the root's listing."""
    from strategies.backends.megatron import checkpoint
    from strategies.parallel.collectives import rank

    engine = _engine()
    engine.save_checkpoint(root)
    Path(root, "a-file").write_text("not a directory")
    errors: list[Any] = []
    try:
        engine.save_checkpoint(os.path.join(root, "a-file"))
    except CheckpointError as error:
        errors.append(str(error))
    if rank() == 1:
        checkpoint._rng_states = _no_space  # type: ignore[assignment]
    for async_save in (False, True):
        try:
            engine.save_checkpoint(root, global_step=1, async_save=async_save)
            engine.wait_for_checkpoint()
        except CheckpointError as error:
            errors.append(str(error))
    return [*errors, sorted(os.listdir(root)) if rank() == 0 else None]


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_a_save_that_fails_on_one_rank_raises_checkpoint_error_on_every_rank(
    tmp_path: Path,
) -> None:
    reports = run_ranks(save_where_one_rank_fails, 2, str(tmp_path), timeout=150)
    for report in reports:
        assert len(report) == 4, report
        assert "cannot write a checkpoint under" in report[0]
        assert all("rank 1 could not write its files" in error for error in report[1:3])
    assert reports[0][3] == ["a-file", "global_step_0"]


def fsdp2_save_where_one_rank_cannot_write(root: str) -> list[Any]:
    """On two fsdp2 ranks: rank 1 cannot write its DCP file in a synchronous save; the error
    each rank saw, then (rank 0) the root's listing."""
    from strategies.checkpoint_files import staged_dcp
    from strategies.parallel.collectives import rank

    engine = Engine.build(head="lm", backend="fsdp2", device="cpu", config=_config()).initialize()
    engine.save_checkpoint(root)
    if rank() == 1:
        staged_dcp.write_checksummed = _no_space  # type: ignore[assignment]
    errors: list[Any] = []
    try:
        engine.save_checkpoint(root, global_step=1)
    except CheckpointError as error:
        errors.append(str(error))
    return [*errors, sorted(os.listdir(root)) if rank() == 0 else None]


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_an_fsdp2_save_that_one_rank_cannot_write_fails_on_every_rank(tmp_path: Path) -> None:
    """The fsdp2 backend writes its DCP files itself (``staged_dcp.save_dcp``): a rank whose
    write fails tells the others, which raise too instead of waiting for it."""
    reports = run_ranks(fsdp2_save_where_one_rank_cannot_write, 2, str(tmp_path), timeout=150)
    for report in reports:
        assert len(report) == 2, report
        assert "rank 1 could not write its files" in report[0], report
    assert reports[0][1] == ["global_step_0"]


class _StagesOneFile(_WritesOneFile):
    """An ``AsyncCheckpointing`` part whose background write takes ``seconds``."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(None)
        self.seconds = seconds

    def stage_state(self, directory: str) -> Any:
        part = self

        class Staged:
            def write(self) -> tuple[dict[str, Any], Any]:
                time.sleep(part.seconds)
                part.save_state(directory)
                return {}, None

            def finish(self, parts: Any) -> None:
                pass

        return Staged()


@pytest.mark.timeout(60)
def test_an_async_save_waits_for_a_missing_peer_no_longer_than_the_collective_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import subprocess
    import sys

    from engine.checkpointing import async_save
    from engine.checkpointing.processes import process_space

    monkeypatch.setattr(async_save, "collective_timeout", lambda: 1.0)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    this_host, here = socket.gethostname(), process_space()
    for peer, expected, seconds in (
        ((f"{this_host}/another-namespace", 1), "did not finish writing its files within 1 s",
         (1, 10)),
        ((here, int(ended.stdout)), "ended before writing its files", (0, 0.9)),
    ):  # fmt: skip
        staging = tmp_path / f".tmp-global_step_1-{this_host}-{os.getpid()}-0123abcd"
        staging.mkdir()
        started = time.monotonic()
        save = async_save.AsyncSave(
            _StagesOneFile().stage_state(str(staging)), str(staging),
            str(tmp_path / "global_step_1"), _description(), None,
            [(here, os.getpid()), peer],
        )  # fmt: skip
        error = save.wait()
        assert seconds[0] <= time.monotonic() - started < seconds[1]
        assert error is not None
        assert f"rank 1{' (process' if peer[0] == here else ''}" in error
        assert expected in error
        assert os.listdir(tmp_path) == []


def end_rank_1_during_an_async_save(root: str) -> None:
    """On two ranks: rank 1 ends before it writes its files of an asynchronous save; rank 0
    writes how long waiting for the save took and what it raised to ``root/rank0.txt``."""
    from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy
    from strategies.parallel.collectives import rank

    engine = _engine()
    if rank() == 1:
        ChecksummingSaveStrategy.write_staged = lambda self: time.sleep(100)  # type: ignore[method-assign]
    engine.save_checkpoint(root, async_save=True)
    if rank() == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        engine.wait_for_checkpoint()
        outcome = "no error"
    except CheckpointError as error:
        outcome = str(error)
    Path(root, "rank0.txt").write_text(f"{time.monotonic() - started:.1f}\n{outcome}")


@pytest.mark.timeout(200)
@pytest.mark.multiprocess
def test_when_a_rank_ends_during_an_async_save_rank_0_fails_it_at_once(tmp_path: Path) -> None:
    with pytest.raises(RankFailure, match="rank 1: exited 0 with no result") as failure:
        run_ranks(end_rank_1_during_an_async_save, 2, str(tmp_path), timeout=120)
    assert "rank 0" not in str(failure.value)
    seconds, outcome = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert float(seconds) < 30
    assert "rank 1 (process" in outcome
    assert "ended before writing its files" in outcome
    assert sorted(os.listdir(tmp_path)) == ["rank0.txt"]


def test_a_save_with_a_step_that_is_not_a_non_negative_integer_is_refused(tmp_path: Path) -> None:
    from engine.checkpointing.async_save import start_async_save
    from engine.checkpointing.save import save_checkpoint

    for step, keep in ((-1, None), (1.5, None), (True, None), ("3", None), (1, True), (1, 0)):
        with pytest.raises(ConfigError, match=r"global_step|max_ckpt_to_keep"):
            save_checkpoint(_WritesOneFile(None), _description(), str(tmp_path), step, keep)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"global_step|max_ckpt_to_keep"):
            start_async_save(_StagesOneFile(), _description(), str(tmp_path), step, keep)  # type: ignore[arg-type]
    assert not tmp_path.exists() or os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["no files", "files not a mapping", "entry without size"])
def test_a_malformed_manifest_is_refused_with_checkpoint_error(tmp_path: Path, damage: str) -> None:
    from engine.checkpointing.load import load_checkpoint
    from engine.checkpointing.manifest import describe

    directory = tmp_path / "global_step_1"
    directory.mkdir()
    (directory / "state.bin").write_bytes(b"weights")
    files: Any = {
        "no files": None,
        "files not a mapping": ["state.bin"],
        "entry without size": {"state.bin": {"xxh3_128": "0"}},
    }[damage]
    manifest = describe(_description(), 1)
    if files is not None:
        manifest["files"] = files
    (directory / MANIFEST).write_text(json.dumps(manifest, default=str))
    with pytest.raises(CheckpointError, match="malformed"):
        load_checkpoint(_WritesOneFile(None), _description(), str(tmp_path))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("dtype", "distributed_optimizer"),
    [("float32", False), ("bfloat16", False), ("bfloat16", True)],
    ids=["fp32", "bf16", "bf16-distributed-optimizer"],
)
def test_a_forward_only_checkpoint_loads_into_a_trained_engine_as_into_a_fresh_one(
    fresh_mesh: None, tmp_path: Path, dtype: str, distributed_optimizer: bool
) -> None:
    warmup = {"scheduler": {"warmup_steps": 6, "decay_style": "cosine"}, "total_steps": 20}
    config = {**_config(use_distributed_optimizer=distributed_optimizer), **warmup, "dtype": dtype}
    reference = _engine(**{**config, "forward_only": True, "seed": 11})
    saved = reference.save_checkpoint(tmp_path)
    trained, fresh = _engine(**config), _engine(**config)
    _train(trained, "lm", range(3))
    for engine in (trained, fresh):
        assert engine.load_checkpoint(tmp_path) == saved
        _assert_same_weights(_weights(engine), _weights(reference))
        assert engine.global_step == 0
    assert trained.backend.current_lr() == fresh.backend.current_lr()
    assert _train(trained, "lm", range(3, 5)) == _train(fresh, "lm", range(3, 5))
    _assert_same_weights(_weights(trained), _weights(fresh))
    for name, loaded in _weights(reference).items():  # two small steps from the loaded weights
        trained_weight = _weights(trained)[name].float()
        torch.testing.assert_close(trained_weight, loaded.float(), atol=3e-3, rtol=1e-2)


@pytest.mark.timeout(240)
def test_a_checkpoint_of_another_dtype_or_optimizer_is_refused_and_the_engine_is_unchanged(
    fresh_mesh: None, tmp_path: Path
) -> None:
    fp32, bf16 = _engine(), _engine(dtype="bfloat16")
    for engine, name in ((fp32, "fp32"), (bf16, "bf16")):
        _train(engine, "lm", range(1))
        engine.save_checkpoint(tmp_path / name)
    for saved, config in (
        ("fp32", {"dtype": "bfloat16"}),
        ("bf16", {}),
        ("fp32", {"backend": {"use_distributed_optimizer": True}}),
    ):
        target = _engine(**config, seed=7)
        _train(target, "lm", range(2))
        before = _full_state(target)
        with pytest.raises(CheckpointError, match="does not hold this engine's state"):
            target.load_checkpoint(tmp_path / saved)
        after = _full_state(target)
        for part in ("weights", "optimizer"):
            for name, value in before[part].items():
                assert torch.equal(value, after[part][name]), f"{saved} {config} {part} {name}"
        assert (after["global_step"], after["lr"]) == (before["global_step"], before["lr"])
    reference = _engine(forward_only=True)  # a checkpoint may hold more than is asked of it
    reference.load_checkpoint(tmp_path / "fp32")
    _assert_same_weights(_weights(reference), _weights(fp32))
