"""Where a command-line run's metrics go (``--logger console,jsonl,tensorboard,wandb``).

Every sink receives the same records, one per step, and writes the same metrics under the same
names at the same step: the console's progress line, the JSON-lines file (which a resumed demo
reads back), TensorBoard event files (torch's ``SummaryWriter``, under ``tensorboard/`` of the
output directory) and Weights & Biases (offline, under the output directory, unless
``WANDB_MODE`` or ``WANDB_API_KEY`` configure it).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from engine.cli.progress import MetricsFile, ProgressReporter
from heads.errors import ConfigError

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
DEFAULT_LOGGERS = ("console", "jsonl")
#: The loggers that write files, so need an output directory.
FILE_LOGGERS = ("jsonl", "tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
WANDB_PROJECT = "composable-engine"


def logger_names(text: str) -> tuple[str, ...]:
    """``--logger``'s comma-separated names, checked (an ``argparse`` type)."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in LOGGERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown logger(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {', '.join(LOGGERS)}, comma-separated"
        )
    return names


def logger_flag(parser: argparse.ArgumentParser, *, default: str) -> None:
    """``--logger``; ``default`` says what the command does without it."""
    parser.add_argument(
        "--logger",
        type=logger_names,
        help=f"where metrics go, comma-separated: {', '.join(LOGGERS)} (default {default}); "
        "wandb runs offline unless WANDB_MODE or WANDB_API_KEY is set",
    )


def check_loggers(names: Sequence[str], output_dir: str | os.PathLike[str] | None) -> None:
    """Refuse, before anything is built, loggers that cannot work here."""
    if output_dir is None:
        needing = [name for name in names if name in FILE_LOGGERS]
        if needing:
            raise ConfigError(f"--logger {','.join(needing)} writes files: give --output-dir")
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--logger wandb needs the wandb package: pip install wandb")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class MetricsLogger(Protocol):
    """A sink for a run's metrics: one record per step."""

    #: Where its records go, for the run's closing message (None: nowhere to name).
    where: str | None

    def log(self, step: int, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class ConsoleLogger:
    """The progress line (or bar, on a terminal)."""

    def __init__(self, progress: ProgressReporter) -> None:
        self.progress = progress
        self.where: str | None = None

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        self.progress.update(step, record)

    def close(self) -> None:
        """The progress display is closed by its own context."""


class JsonlLogger:
    """One JSON line per step (non-finite numbers as null)."""

    def __init__(self, metrics: MetricsFile) -> None:
        self.metrics = metrics
        self.where: str | None = f"metrics in {metrics.path}"

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        self.metrics.append(record)

    def close(self) -> None:
        self.metrics.close()


class TensorBoardLogger:
    """Every numeric metric as a scalar of its own name, at the step. ``first_step``: a resumed
    run's first step; the events an earlier run logged from it on (after its last checkpoint,
    which the resumed run repeats) are purged, as the JSONL file is cut back."""

    def __init__(self, directory: Path, step_key: str, first_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.step_key = step_key
        self.writer = SummaryWriter(log_dir=os.fspath(directory), purge_step=first_step)
        self.where: str | None = f"TensorBoard events in {directory}"

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for name, value in record.items():
            if name != self.step_key and is_number(value):
                self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in the output directory, offline unless the environment says."""

    def __init__(
        self, directory: Path, step_key: str, name: str, settings: Mapping[str, Any]
    ) -> None:
        import wandb

        configured = "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ
        self.step_key = step_key
        self.where: str | None = f"Weights & Biases run in {directory / 'wandb'}"
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
            name=name,
            dir=os.fspath(directory),
            config=dict(settings),
            mode=None if configured else "offline",
        )

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        values = {
            name: value
            for name, value in record.items()
            if name != self.step_key and is_number(value) and math.isfinite(value)
        }
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """The chosen sinks, fed the same records; ``step_key`` names the record's step."""

    def __init__(self, sinks: Sequence[MetricsLogger], step_key: str) -> None:
        self.sinks, self.step_key = list(sinks), step_key

    def log(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(int(record[self.step_key]), record)

    def destinations(self) -> list[str]:
        return [sink.where for sink in self.sinks if sink.where is not None]

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def resolve_loggers(
    given: Sequence[str] | None, output_dir: str | os.PathLike[str] | None
) -> tuple[str, ...]:
    """``--logger``'s names, checked; unset, the default (its files only with an output
    directory)."""
    if given is None:
        return tuple(n for n in DEFAULT_LOGGERS if output_dir is not None or n == "console")
    check_loggers(given, output_dir)
    return tuple(given)


def open_loggers(
    names: Sequence[str],
    *,
    step_key: str,
    progress: ProgressReporter,
    metrics: MetricsFile | None,
    output_dir: Path | None,
    run_name: str,
    settings: Mapping[str, Any],
    first_step: int | None = None,
) -> Loggers:
    """The sinks ``names`` (from :func:`resolve_loggers`) asks for; ``first_step``: a resumed
    run's first step (see :class:`TensorBoardLogger`)."""
    check_loggers(names, output_dir)
    sinks: list[MetricsLogger] = []
    for name in names:
        if name == "console":
            sinks.append(ConsoleLogger(progress))
            continue
        assert output_dir is not None  # check_loggers refused file loggers without one
        if name == "jsonl":
            assert metrics is not None  # the run's metrics file, given with an output directory
            sinks.append(JsonlLogger(metrics))
        elif name == "tensorboard":
            sinks.append(TensorBoardLogger(output_dir / TENSORBOARD_DIR, step_key, first_step))
        elif name == "wandb":
            sinks.append(WandbLogger(output_dir, step_key, run_name, settings))
    return Loggers(sinks, step_key)
