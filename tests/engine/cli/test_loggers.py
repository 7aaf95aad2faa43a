"""``--logger``: every sink gets the JSONL's metrics under the same names and steps; bad choices
are refused by name before anything is built."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.cli import main
from engine.cli.loggers import Loggers, WandbLogger
from tests.engine.cli.test_cli import run
from tests.engine.cli.test_demo import short_config


def jsonl_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files under ``directory``: tag -> step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: {event.step: event.value for event in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
    }


def numeric_metrics(records: list[dict[str, Any]], step_key: str) -> dict[str, dict[int, float]]:
    """The records' numbers as TensorBoard stores them (float32), tag -> step -> value."""
    metrics: dict[str, dict[int, float]] = {}
    for record in records:
        for name, value in record.items():
            if name != step_key and isinstance(value, int | float):
                metrics.setdefault(name, {})[record[step_key]] = float(np.float32(value))
    return metrics


def test_a_demo_run_writes_tensorboard_scalars_equal_to_its_jsonl_records(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run(
        "demo", "--config", short_config(tmp_path), "--steps", "2", "--output-dir", str(out),
        "--logger", "console,jsonl,tensorboard",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = jsonl_records(out / "metrics.jsonl")
    assert [record["iteration"] for record in records] == [1, 2]
    expected = numeric_metrics(records, "iteration")
    assert {"reward", "pg_loss", "vf_loss", "kl", "entropy", "train_s"} <= expected.keys()
    assert tensorboard_scalars(out / "tensorboard") == expected
    assert "TensorBoard events in" in result.stdout


def test_a_resumed_demo_keeps_the_original_loggers_unless_given_new_ones(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = ("demo", "--output-dir", str(out))
    first = run(
        *common, "--config", short_config(tmp_path), "--steps", "1",
        "--logger", "jsonl,tensorboard",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    # No --logger: the saved choice (no console, TensorBoard on) holds.
    second = run(*common, "--resume", "--steps", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed after iteration" not in second.stdout  # the console logger stays off
    records = jsonl_records(out / "metrics.jsonl")
    assert [record["iteration"] for record in records] == [1, 2]
    assert tensorboard_scalars(out / "tensorboard") == numeric_metrics(records, "iteration")
    # A new --logger wins, and is what the next resume remembers.
    third = run(*common, "--resume", "--steps", "3", "--logger", "console,jsonl")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed after iteration 2" in third.stdout
    assert json.loads((out / "run.json").read_text())["loggers"] == ["console", "jsonl"]
    assert [record["iteration"] for record in jsonl_records(out / "metrics.jsonl")] == [1, 2, 3]
    assert max(tensorboard_scalars(out / "tensorboard")["reward"]) == 2


def test_a_resumed_demo_replaces_the_tensorboard_steps_after_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    """A crashed run logged an iteration its checkpoint does not hold; the resumed run logs it
    again, and TensorBoard reads it once (the resumed run's), as metrics.jsonl has it."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.engine.cli.test_demo import checkpoint_steps

    out = tmp_path / "run"
    common = ("demo", "--output-dir", str(out))
    first = run(
        *common, "--config", short_config(tmp_path), "--steps", "3",
        "--logger", "jsonl,tensorboard",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoint_steps(out, "actor") == [2, 3]
    for role in ("actor", "critic"):  # a crash before iteration 3's checkpoint
        shutil.rmtree(out / "checkpoints" / role / "global_step_3")
    second = run(*common, "--resume", "--steps", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    records = jsonl_records(out / "metrics.jsonl")
    assert [record["iteration"] for record in records] == [1, 2, 3]

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    expected = numeric_metrics(records, "iteration")
    assert set(events.Tags()["scalars"]) == expected.keys()
    for tag, values in expected.items():
        scalars = events.Scalars(tag)
        assert [event.step for event in scalars] == [1, 2, 3], tag
        assert {event.step: event.value for event in scalars} == values, tag


def test_train_writes_only_the_chosen_loggers(tmp_path: Path) -> None:
    result = run(
        "train", "--device", "cpu", "--steps", "3", "--output-dir", str(tmp_path),
        "--logger", "tensorboard",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl not chosen
    assert "step    1/3" not in result.stdout  # nor the console
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss"].keys() == {1, 2, 3}
    assert {"grad_norm", "lr", "tokens_per_s"} <= scalars.keys()


def test_train_writes_the_same_numbers_to_jsonl_and_tensorboard(tmp_path: Path) -> None:
    result = run(
        "train", "--device", "cpu", "--steps", "2", "--output-dir", str(tmp_path),
        "--logger", "jsonl,tensorboard,console", "--backend", "fsdp2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step    2/2" in result.stdout
    expected = numeric_metrics(jsonl_records(tmp_path / "metrics.jsonl"), "step")
    assert tensorboard_scalars(tmp_path / "tensorboard") == expected


BAD_CHOICES = [
    ("train", ["--logger", "console,tensorbord"], "unknown logger(s) 'tensorbord'; choose from"),
    ("demo", ["--logger", "wandb,jsonl,x"], "unknown logger(s) 'x'; choose from"),
    ("train", ["--logger", ","], "choose from console, jsonl, tensorboard, wandb"),
    ("train", ["--logger", "tensorboard"], "--logger tensorboard writes files: give --output-dir"),
    ("train", ["--logger", "console,jsonl"], "--logger jsonl writes files: give --output-dir"),
]


@pytest.mark.parametrize(("command", "arguments", "message"), BAD_CHOICES)
def test_a_bad_logger_choice_exits_with_status_2_naming_it(
    command: str, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main([command, *arguments])
    except SystemExit as exit_:  # argparse refuses an unknown name
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_wandb_without_the_package_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    for command in ("train", "demo"):
        assert main([command, "--logger", "wandb", "--output-dir", str(tmp_path)]) == 2
        assert (
            "--logger wandb needs the wandb package: pip install wandb" in capsys.readouterr().err
        )
    assert list(tmp_path.iterdir()) == []  # refused before anything was built or written


class FakeWandb(types.ModuleType):
    """Records what a run is given, as the wandb package would receive it."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.init_kwargs: dict[str, Any] = {}
        self.logged: list[tuple[dict[str, Any], int]] = []
        self.finished = False

    def init(self, **kwargs: Any) -> FakeWandb:
        self.init_kwargs = kwargs
        return self

    def log(self, values: dict[str, Any], step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished = True


@pytest.mark.parametrize(
    ("environment", "mode"),
    [({}, "offline"), ({"WANDB_MODE": "online"}, None), ({"WANDB_API_KEY": "x"}, None)],
)
def test_wandb_runs_offline_unless_configured_and_logs_the_jsonl_names_at_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], mode: str | None
) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    loggers = Loggers([WandbLogger(tmp_path, "step", "run", {"seed": 0})], step_key="step")
    loggers.log({"step": 3, "loss": 0.5, "lr": 1e-3, "skip_reason": "", "grad_norm": 2})
    loggers.close()
    assert fake.init_kwargs["mode"] == mode
    assert fake.init_kwargs["dir"] == str(tmp_path)
    assert fake.init_kwargs["config"] == {"seed": 0}
    assert fake.logged == [({"loss": 0.5, "lr": 1e-3, "grad_norm": 2}, 3)]
    assert fake.finished
