"""Command line: ``python -m engine train`` trains a model on synthetic data, a line per step."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from heads.errors import EngineError

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
    train.add_argument("--lr", type=float, help="peak learning rate")
    train.add_argument("--seed", type=int, help="random seed")
    train.add_argument(
        "--tensor-parallel-size", type=_positive_int, help="under torchrun: tensor parallel size"
    )
    train.add_argument(
        "--pipeline-parallel-size",
        type=_positive_int,
        help="under torchrun: pipeline parallel size (data parallel takes the remaining ranks)",
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


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
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, flag) is not None:
            data["parallel"] = {**data["parallel"], flag: getattr(args, flag)}
    if args.lr is not None:
        data["optimizer"] = {**data["optimizer"], "lr": args.lr}
    elif not args.config:
        data["optimizer"] = {**data["optimizer"], "lr": 3e-3}
    return EngineConfig.from_dict(data)


def train(args: argparse.Namespace) -> int:
    from engine import Engine, losses

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
    engine.initialize()
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    shard = args.batch_size // dp_size
    # One rank reports: the first data-parallel replica's output rank (TP 0, last stage).
    show = engine.is_mp_src_rank_with_outputs() and dp_rank == 0
    if show:
        parallel = config.parallel
        print(
            f"training head={engine.head.name} backend={engine.backend.name} "
            f"device={engine.platform.name} model={args.model or 'config'} steps={args.steps} "
            f"tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size} dp={dp_size}",
            flush=True,
        )
    generator = torch.Generator().manual_seed(config.seed)
    start = time.perf_counter()
    with engine.train_mode():
        for step in range(1, args.steps + 1):
            batch = synthetic_batch(
                args.head, config.model.vocab_size, args.batch_size, args.max_length, generator
            )[dp_rank * shard : (dp_rank + 1) * shard]
            metrics = engine.train_batch(batch, loss_fn)
            if show:
                print(
                    f"step {step:4d}/{args.steps}  loss {metrics['loss']:.4f}  "
                    f"grad_norm {metrics['grad_norm']:.3f}  lr {metrics['lr']:.2e}  "
                    f"tokens/s {metrics['tokens_per_s']:.0f}",
                    flush=True,
                )
    if show:
        print(f"done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


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
    try:
        if args.command == "train":
            return train(args)
        if args.command == "matrix":
            return show_matrix(args.json)
    except EngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1
