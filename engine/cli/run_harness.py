"""One command-line training run (``demo``, ``train``): its progress display and loggers, the
records kept for the closing plot, a signal-safe stop, checkpoints every N steps and the
closing line that says where everything went."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch
import torch.distributed as dist

from engine.cli.loggers import open_loggers
from engine.cli.progress import Column, MetricsFile, ProgressReporter, plot_metrics

#: Under the run's output directory.
METRICS_FILE, PLOT_FILE = "metrics.jsonl", "metrics.png"


class StopRequest:
    """First Ctrl-C (or SIGTERM): finish the step, save, exit. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (so all ranks stop at the same step)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


@attrs.frozen(kw_only=True)
class Checkpoints:
    """Saving a run: ``save(step)`` every ``every`` steps, at the last and at a requested stop
    (agreed over the ranks on ``device``); the closing line names ``directory``."""

    save: Callable[[int], None]
    every: int
    directory: Path
    device: torch.device


@attrs.frozen(kw_only=True)
class Plot:
    """The closing plot: ``panels`` against the record's step."""

    panels: list[tuple[str, list[str]]]
    title: str


class RunHarness:
    """Steps ``done + 1 .. total`` of a run: each step's record goes to the ``loggers`` (on the
    ``lead`` rank) and to ``history``; leaving the context (however) closes the loggers and
    plots ``history`` into the output directory. With ``checkpoints``, a Ctrl-C inside the
    context finishes the step under way, saves it and ends the run (without, nothing is saved
    and Ctrl-C interrupts as usual)."""

    def __init__(
        self,
        *,
        label: str,
        step_key: str,
        total: int,
        columns: Sequence[Column],
        loggers: Sequence[str],
        lead: bool,
        output_dir: Path | None,
        run_name: str,
        settings: Mapping[str, Any],
        plot: Plot,
        done: int = 0,
        history: list[dict[str, Any]] | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        self.step_key, self.total, self.lead = step_key, total, lead
        self.output_dir, self.plot = output_dir, plot
        self.metrics = MetricsFile(output_dir / METRICS_FILE) if output_dir else None
        self.history = history if history is not None else []
        self.checkpoints = checkpoints
        self.last_step = self.last_saved = done
        #: When the run began (``time.perf_counter``), for its elapsed times.
        self.started = time.perf_counter()
        self.progress = ProgressReporter(
            label=label,
            total=total,
            columns=columns,
            start=done,
            enabled=lead and "console" in loggers,
        )
        self.sinks = open_loggers(
            loggers if lead else (),
            step_key=step_key,
            progress=self.progress,
            metrics=self.metrics,
            output_dir=output_dir,
            run_name=run_name,
            settings=settings,
            first_step=done + 1 if done else None,
        )
        self.stop = StopRequest() if checkpoints is not None else None
        self._contexts = ExitStack()
        self._finished = False

    def __enter__(self) -> RunHarness:
        self._contexts.enter_context(self.progress)
        if self.stop is not None:
            self._contexts.enter_context(self.stop)
        self._contexts.callback(self.finish)  # before the display and the signals are restored
        return self

    def __exit__(self, *exc: object) -> None:
        self._contexts.close()

    def message(self, text: str) -> None:
        self.progress.message(text)

    def record(self, record: dict[str, Any]) -> bool:
        """Log a finished step's record, save when due; whether the run is to stop here."""
        self.sinks.log(record)
        self.history.append(record)
        self.last_step = step = int(record[self.step_key])
        if self.checkpoints is None or self.stop is None:
            return False
        stopping = self.stop.agreed(self.checkpoints.device)
        if stopping or step % self.checkpoints.every == 0 or step == self.total:
            self.checkpoints.save(step)
            self.last_saved = step
        return stopping

    @property
    def interrupted(self) -> bool:
        """Whether a requested stop ended the run before its last step."""
        return self.stop is not None and self.stop.requested and self.last_step < self.total

    def finish(self) -> None:
        """Close the loggers and, on the lead rank, plot the records (once)."""
        if self._finished:
            return
        self._finished = True
        self.sinks.close()
        if self.lead and self.output_dir is not None and self.history:
            plot_metrics(
                self.history,
                self.output_dir / PLOT_FILE,
                x=self.step_key,
                panels=self.plot.panels,
                title=self.plot.title,
            )

    def where(self, before: Sequence[str] = (), after: Sequence[str] = ()) -> str:
        """The closing line: ``before``, the checkpoint, the loggers' files, the plot,
        ``after``."""
        saved = []
        if self.checkpoints is not None:
            saved.append(
                f"checkpoint of {self.step_key} {self.last_saved} in {self.checkpoints.directory}"
            )
        plot = [f"plot in {self.output_dir / PLOT_FILE}"] if self.output_dir is not None else []
        return "; ".join([*before, *saved, *self.sinks.destinations(), *plot, *after])
