"""Progress display, metrics file and plot shared by ``train`` and ``demo``."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from engine.cli.progress import MetricsFile, ProgressReporter, plot_metrics

COLUMNS = [("loss", "loss", ".3f"), ("tokens_per_s", "tokens/s", ".0f")]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_in_a_log_every_step_is_one_plain_line_with_its_metrics() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with ProgressReporter(label="step", total=3, columns=COLUMNS, console=console) as progress:
        for step in (1, 2, 3):
            progress.update(step, {"loss": 1.0 / step, "tokens_per_s": 1000.0, "other": "x"})
    assert out.getvalue().splitlines() == [
        "step    1/3  loss 1.000  tokens/s 1000",
        "step    2/3  loss 0.500  tokens/s 1000",
        "step    3/3  loss 0.333  tokens/s 1000",
    ]


def test_on_a_terminal_a_live_bar_shows_the_latest_metrics() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with ProgressReporter(
        label="iter", total=4, columns=COLUMNS, console=console, print_every=2
    ) as progress:
        progress.update(1, {"loss": 0.25, "tokens_per_s": 12.0})
        progress.update(2, {"loss": 0.125, "tokens_per_s": 12.0})
    text = out.getvalue()
    assert "loss 0.125" in text
    assert "2/4" in text
    assert "iter    2/4  loss 0.125" in text  # the every-second-step history line


def test_a_disabled_reporter_prints_nothing() -> None:
    out = io.StringIO()
    with ProgressReporter(
        label="step", total=1, columns=COLUMNS, console=Console(file=out), enabled=False
    ) as progress:
        progress.update(1, {"loss": 1.0})
        progress.message("hello")
    assert out.getvalue() == ""


def test_metrics_round_trip_as_json_lines_with_non_finite_values_as_null(tmp_path: Path) -> None:
    metrics = MetricsFile(tmp_path / "run" / "metrics.jsonl")
    metrics.append({"step": 1, "loss": 0.5})
    metrics.append({"step": 2, "loss": float("nan"), "grad_norm": float("inf")})
    metrics.close()
    lines = metrics.path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == metrics.read()
    assert metrics.read() == [
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": None, "grad_norm": None},
    ]


def test_a_torn_last_line_is_skipped_and_truncation_keeps_earlier_records(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3}\n{"itera')
    metrics = MetricsFile(path)
    assert [record["iteration"] for record in metrics.read()] == [1, 2, 3]
    kept = metrics.truncate_after("iteration", 2)
    assert kept == [{"iteration": 1}, {"iteration": 2}]
    assert path.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'
    metrics.append({"iteration": 3})
    metrics.close()
    assert [record["iteration"] for record in metrics.read()] == [1, 2, 3]


def test_plot_writes_a_png_atomically(tmp_path: Path) -> None:
    records = [{"iteration": i, "reward": i / 10, "loss": 1 / i} for i in range(1, 11)]
    records[3]["loss"] = None  # gaps are skipped, not plotted as zero
    target = tmp_path / "metrics.png"
    plot_metrics(
        records, target, x="iteration", panels=[("reward", ["reward"]), ("loss", ["loss"])]
    )
    assert target.read_bytes().startswith(PNG_MAGIC)
    assert [path.name for path in tmp_path.iterdir()] == ["metrics.png"]
