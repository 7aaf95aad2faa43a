"""Command line: ``python -m engine demo | train | matrix`` (see ``--help`` of each)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from heads.errors import BatchError, ConfigError, EngineError

TASKS = {"lm": "sft_loss", "value": "value_regression_loss"}


def synthetic_batch(
    head: str, vocab_size: int, batch_size: int, max_length: int, generator: torch.Generator
) -> TensorDict:
    """A batch a tiny model can visibly learn from.

    LM head: each sequence counts up by one modulo the vocabulary from a random start, so the
    next token is predictable. Value head: the target at each token is the fraction of even
    tokens before it.
    """
    from engine.batching import from_token_lists

    lengths = torch.randint(
        max(2, max_length // 4), max_length + 1, (batch_size,), generator=generator
    )
    token_lists, returns = [], []
    for length in lengths.tolist():
        if head == "lm":
            start = int(torch.randint(0, vocab_size, (1,), generator=generator))
            tokens = [(start + i) % vocab_size for i in range(length)]
        else:
            tokens = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        even = torch.tensor([token % 2 == 0 for token in tokens], dtype=torch.float32)
        seen = torch.cat([torch.zeros(1), even.cumsum(0)[:-1]])
        returns.append((seen / torch.arange(1, length + 1)).tolist())
        token_lists.append(tokens)
    masks = [[0.0] + [1.0] * (len(tokens) - 1) for tokens in token_lists]
    return from_token_lists(token_lists, returns=returns, loss_mask=masks)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    matrix = commands.add_parser(
        "matrix", help="list every head x backend x device cell and whether it runs here"
    )
    matrix.add_argument("--json", action="store_true", help="machine-readable output")
    demo = commands.add_parser(
        "demo",
        help="PPO with an actor, a critic and a reference model on a rule-rewarded task",
        description="PPO on the parity task (see engine/demo.py); writes metrics.jsonl, "
        "metrics.png and checkpoints to --output-dir. Ctrl-C saves and exits; --resume goes on.",
    )
    demo.add_argument("--config", help="YAML file with demo and engine settings (flags win)")
    demo.add_argument("--device", help="cpu, cuda, npu or auto (default auto)")
    demo.add_argument("--backend", help="backend name (default megatron)")
    demo.add_argument("--steps", type=_positive_int, help="PPO iterations (default 120)")
    demo.add_argument("--seed", type=_non_negative_int, help="random seed (default 0)")
    demo.add_argument(
        "--output-dir", help="where metrics, plot and checkpoints go (default demo-output)"
    )
    demo.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its checkpoint"
    )
    _parallel_flags(demo)
    train = commands.add_parser("train", help="train a model on synthetic data")
    train.add_argument("--head", default="lm", help="head name (lm, value, or a plugin's)")
    train.add_argument("--backend", default="megatron", help="backend name")
    train.add_argument("--device", default="auto", help="cpu, cuda, npu or auto")
    train.add_argument("--config", help="YAML file with EngineConfig settings")
    train.add_argument("--model", help="model preset (tiny, small); overrides the config file")
    train.add_argument("--steps", type=_positive_int, default=20)
    train.add_argument("--batch-size", type=_positive_int, default=16, help="sequences per step")
    train.add_argument("--max-length", type=_positive_int, default=64, help="longest sequence")
    train.add_argument("--micro-batch-size", type=_positive_int)
    train.add_argument(
        "--data", help="JSON lines: input_ids (+ returns for --head value, optional loss_mask)"
    )
    train.add_argument("--output-dir", help="write metrics.jsonl and metrics.png here")
    train.add_argument("--lr", type=float, help="peak learning rate")
    train.add_argument("--seed", type=int, help="random seed")
    _parallel_flags(train)
    return parser


def _parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size", type=_positive_int, help="under torchrun: tensor parallel size"
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=_positive_int,
        help="under torchrun: pipeline parallel size (data parallel takes the remaining ranks)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _parallel_overrides(args: argparse.Namespace) -> dict[str, int]:
    flags = ("tensor_parallel_size", "pipeline_parallel_size")
    return {flag: getattr(args, flag) for flag in flags if getattr(args, flag) is not None}


def engine_config(args: argparse.Namespace) -> Any:
    """The config file (if any) with command-line values on top."""
    from engine.config import EngineConfig

    config = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    changes: dict[str, Any] = {"total_steps": args.steps}
    if args.model:
        changes["model"] = args.model
    if args.micro_batch_size:
        changes["micro_batch_size"] = args.micro_batch_size
    if args.seed is not None:
        changes["seed"] = args.seed
    data = config.to_dict()
    data.update(changes)
    data["parallel"] = {**data["parallel"], **_parallel_overrides(args)}
    if args.lr is not None:
        data["optimizer"] = {**data["optimizer"], "lr": args.lr}
    elif not args.config:
        data["optimizer"] = {**data["optimizer"], "lr": 3e-3}
    return EngineConfig.from_dict(data)


TRAIN_COLUMNS = [
    ("loss", "loss", ".4f"),
    ("grad_norm", "grad_norm", ".3f"),
    ("lr", "lr", ".2e"),
    ("tokens_per_s", "tokens/s", ".0f"),
]


def read_sequences(path: str, head: str) -> list[dict[str, list[Any]]]:
    """Training records from a JSON-lines file: ``input_ids`` (and ``returns`` for the value
    head; optional ``loss_mask``), every per-token list as long as ``input_ids``."""
    wanted = ["input_ids"] + (["returns"] if head == "value" else [])
    records = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read --data {path}: {error.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise BatchError(f"{where} is not JSON: {error}") from None
        if not isinstance(record, dict):
            raise BatchError(f"{where} must be a JSON object, got {type(record).__name__}")
        for name in wanted:
            if name not in record:
                raise BatchError(f"{where} lacks {name!r} (records need {', '.join(wanted)})")
        kept = {name: record[name] for name in (*wanted, "loss_mask") if name in record}
        for name, values in kept.items():
            if not isinstance(values, list) or len(values) != len(kept["input_ids"]):
                raise BatchError(f"{where}: {name!r} must be a list as long as 'input_ids'")
        if len(kept["input_ids"]) < 2:
            raise BatchError(f"{where}: a sequence needs at least 2 tokens")
        records.append(kept)
    if not records:
        raise BatchError(f"--data {path} holds no records")
    return records


def data_batches(
    records: list[dict[str, list[Any]]], batch_size: int, generator: torch.Generator
) -> Iterator[TensorDict]:
    """Endless batches of ``batch_size`` records, reshuffled every pass over the file."""
    from engine.batching import from_token_lists

    while True:
        order = torch.randperm(len(records), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            chosen = [records[index] for index in order[start : start + batch_size]]
            per_token = {"loss_mask": [r.get("loss_mask") or _default_mask(r) for r in chosen]}
            if "returns" in chosen[0]:
                per_token["returns"] = [record["returns"] for record in chosen]
            yield from_token_lists([record["input_ids"] for record in chosen], **per_token)


def _default_mask(record: dict[str, list[Any]]) -> list[float]:
    return [0.0] + [1.0] * (len(record["input_ids"]) - 1)


def train(args: argparse.Namespace) -> int:
    from engine import Engine, losses
    from engine.progress import MetricsFile, ProgressReporter, plot_metrics

    config = engine_config(args)
    engine = Engine.build(head=args.head, backend=args.backend, device=args.device, config=config)
    if args.head not in TASKS:
        raise EngineError(
            f"`train` has synthetic tasks for heads {', '.join(TASKS)}, not {args.head!r}"
        )
    loss_fn = getattr(losses, TASKS[args.head])
    if args.max_length > config.model.max_sequence_length:
        raise EngineError(
            f"--max-length {args.max_length} exceeds the model's max_sequence_length "
            f"({config.model.max_sequence_length})"
        )
    if args.batch_size % int(os.environ.get("WORLD_SIZE", "1")):
        raise EngineError(f"--batch-size {args.batch_size} must divide by the number of ranks")
    records = read_sequences(args.data, args.head) if args.data else None
    if records is not None and len(records) < args.batch_size:
        raise BatchError(f"--data holds {len(records)} records, fewer than --batch-size")
    metrics = MetricsFile(Path(args.output_dir) / "metrics.jsonl") if args.output_dir else None
    if metrics is not None and metrics.path.exists():
        raise ConfigError(f"{metrics.path} exists (an earlier run's); choose another --output-dir")
    engine.initialize()
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    shard = args.batch_size // dp_size
    # One rank reports: the first data-parallel replica's output rank (TP 0, last stage).
    show = engine.is_mp_src_rank_with_outputs() and dp_rank == 0
    generator = torch.Generator().manual_seed(config.seed)
    batches = (
        data_batches(records, args.batch_size, generator)
        if records is not None
        else iter(
            lambda: synthetic_batch(
                args.head, config.model.vocab_size, args.batch_size, args.max_length, generator
            ),
            None,
        )
    )
    parallel = config.parallel
    start = time.perf_counter()
    with (
        ProgressReporter(
            label="step", total=args.steps, columns=TRAIN_COLUMNS, enabled=show
        ) as progress,
        engine.train_mode(),
    ):
        progress.message(
            f"training head={engine.head.name} backend={engine.backend.name} "
            f"device={engine.platform.name} model={args.model or 'config'} steps={args.steps} "
            f"tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size} dp={dp_size}"
            f" data={args.data or 'synthetic'}"
        )
        for step in range(1, args.steps + 1):
            batch = next(batches)[dp_rank * shard : (dp_rank + 1) * shard]
            result = engine.train_batch(batch, loss_fn)
            progress.update(step, result)
            if show and metrics is not None:
                metrics.append({"step": step, **result})
        progress.message(f"done in {time.perf_counter() - start:.1f} s")
    if show and metrics is not None:
        metrics.close()
        plot_metrics(
            metrics.read(),
            metrics.path.with_suffix(".png"),
            x="step",
            panels=[("loss", ["loss"]), ("grad norm", ["grad_norm"])],
            title=f"train --head {engine.head.name}",
        )
    return 0


def demo(args: argparse.Namespace) -> int:
    from engine import demo as ppo_demo

    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in ("device", "backend", "steps", "seed", "output_dir")
        if getattr(args, key) is not None
    }
    parallel = _parallel_overrides(args)
    if parallel:
        overrides["engine"] = {"parallel": parallel}
    config = ppo_demo.resolve_config(args.config, overrides, args.resume, args.output_dir)
    try:
        summary = ppo_demo.run(config, resume=args.resume)
    except ppo_demo.Interrupted as stopped:
        print(
            f"interrupted after iteration {stopped.iteration} (saved); continue with: "
            f"python -m engine demo --resume --output-dir {config.output_dir}",
            file=sys.stderr,
        )
        return 130
    if summary.get("iterations") and _is_lead_rank():
        print(
            f"mean reward: first 10 iterations {summary['first_reward']:.3f}, "
            f"last 10 {summary['last_reward']:.3f}",
            flush=True,
        )
    return 0


def _is_lead_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def show_matrix(as_json: bool) -> int:
    from engine.matrix import cells, versions

    rows, installed = cells(), versions()
    if as_json:
        print(json.dumps({"cells": rows, "versions": installed}, indent=2))
        return 0
    for row in rows:
        status = "runs here" if row["runs_here"] else "unavailable"
        cell = f"{row['head']} x {row['backend']} x {row['device']}"
        print(f"{cell:32s} {status}")
        for reason in row["reasons"]:
            print(f"    {reason}")
    print("versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in installed.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # megatron-core warns about GPU-only libraries (Apex, TransformerEngine) it falls back from.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        if args.command == "train":
            return train(args)
        if args.command == "demo":
            return demo(args)
        if args.command == "matrix":
            return show_matrix(args.json)
    except EngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1
