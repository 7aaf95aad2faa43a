"""What long command-line runs show and keep: a live progress line, metrics as JSON lines, a plot.

On a terminal the progress is a rich bar with the latest metrics (and a plain line every
``print_every`` steps so the history stays on screen); in a log or a pipe it is one plain line
per step. The metrics file is append-only JSON lines, one record per step, flushed as written;
``truncate_after`` drops records a resumed run will redo.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from heads.errors import ConfigError

#: (metric name, label, format spec) shown on a progress line, in order.
Column = tuple[str, str, str]


def format_metrics(values: Mapping[str, Any], columns: Sequence[Column]) -> str:
    """``label value`` pairs for the columns present in ``values``."""
    parts = [
        f"{label} {values[name]:{spec}}"
        for name, label, spec in columns
        if isinstance(values.get(name), (int, float))
    ]
    return "  ".join(parts)


class ProgressReporter:
    """A progress bar (terminal) or one line per step (log), for steps ``start+1 .. total``."""

    def __init__(
        self,
        *,
        label: str,
        total: int,
        columns: Sequence[Column],
        start: int = 0,
        print_every: int = 10,
        console: Console | None = None,
        enabled: bool = True,
    ) -> None:
        self.label, self.total, self.columns = label, total, list(columns)
        self.print_every = print_every
        self.enabled = enabled
        self.console = console or Console(highlight=False)
        self._progress: Progress | None = None
        self._start = start

    def __enter__(self) -> ProgressReporter:
        if self.enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self.label, total=self.total, completed=self._start, stats=""
            )
        return self

    def update(self, step: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        stats = format_metrics(values, self.columns)
        line = f"{self.label} {step:4d}/{self.total}  {stats}"
        if self._progress is None:
            print(line, flush=True, file=self.console.file)
            return
        self._progress.update(self._task, completed=step, stats=stats)
        if step % self.print_every == 0 or step == self.total:
            self._progress.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class MetricsFile:
    """Append-only JSON lines, one record per step; every line is flushed when written."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    def read(self) -> list[dict[str, Any]]:
        """The records so far (a torn last line, from a killed writer, is skipped)."""
        if not self.path.exists():
            return []
        records = []
        lines = self.path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                if number == len(lines):
                    break
                raise ConfigError(f"{self.path}:{number} is not a JSON record: {error}") from None
        return records

    def truncate_after(self, key: str, last: int) -> list[dict[str, Any]]:
        """Keep only records with ``record[key] <= last`` (atomically); return them."""
        kept = [record for record in self.read() if int(record.get(key, 0)) <= last]
        staging = self.path.with_name(self.path.name + ".tmp")
        staging.write_text("".join(json.dumps(record) + "\n" for record in kept))
        os.replace(staging, self.path)
        return kept

    def append(self, record: Mapping[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(json.dumps(_finite(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _finite(record: Mapping[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: such values become null."""
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in record.items()
    }


def plot_metrics(
    records: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    x: str,
    panels: Iterable[tuple[str, Sequence[str]]],
    title: str = "",
) -> None:
    """One panel per ``(title, metric names)`` against ``x``; written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    panels = list(panels)
    figure, axes = pyplot.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    steps = [record[x] for record in records]
    for axis, (panel_title, names) in zip(axes[0], panels, strict=True):
        for name in names:
            points = [
                (step, record[name])
                for step, record in zip(steps, records, strict=True)
                if isinstance(record.get(name), (int, float))
            ]
            if points:
                axis.plot(*zip(*points, strict=True), label=name, linewidth=1.4)
        axis.set_title(panel_title)
        axis.set_xlabel(x)
        axis.grid(alpha=0.3)
        if len(names) > 1:
            axis.legend(fontsize="small")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    target = Path(path)
    staging = target.with_name(f".{target.stem}-{os.getpid()}-{time.monotonic_ns()}.png")
    figure.savefig(staging, dpi=110)
    pyplot.close(figure)
    os.replace(staging, target)
