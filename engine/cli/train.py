"""``python -m engine train``: one engine trained on synthetic data or a JSON-lines file
(tokenized, text or chat records), saved at the end as a Hugging Face directory."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from engine.cli.options import parallel_overrides
from heads.errors import BatchError, ConfigError, EngineError

TASKS = {"lm": "sft_loss", "value": "value_regression_loss"}
#: The peak learning rate without --lr or a config file (tiny models learn visibly in steps).
DEFAULT_LR = 3e-3


def synthetic_batch(
    head: str, vocab_size: int, batch_size: int, max_length: int, generator: torch.Generator
) -> TensorDict:
    """A batch a tiny model can visibly learn from.

    LM head: each sequence counts up by one modulo the vocabulary from a random start, so the
    next token is predictable. Value head: the target at each token is the fraction of even
    tokens before it.
    """
    from engine.data.batching import from_token_lists

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


def engine_config(args: argparse.Namespace) -> Any:
    """The config file (if any) with command-line values on top."""
    from engine.config import EngineConfig

    config = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    changes: dict[str, Any] = {"total_steps": args.steps}
    if args.model:
        changes["model"] = args.model
    if args.micro_batch_size:
        changes["micro_batch_size"] = args.micro_batch_size
    if args.max_tokens_per_micro_batch:
        changes["max_tokens_per_micro_batch"] = args.max_tokens_per_micro_batch
    if args.packing:
        changes["packing"] = True
    if args.seed is not None:
        changes["seed"] = args.seed
    data = config.to_dict()
    data.update(changes)
    data["parallel"] = {**data["parallel"], **parallel_overrides(args)}
    if args.lr is not None:
        data["optimizer"] = {**data["optimizer"], "lr": args.lr}
    elif not args.config:
        data["optimizer"] = {**data["optimizer"], "lr": DEFAULT_LR}
    return EngineConfig.from_dict(data)


TRAIN_COLUMNS = [
    ("loss", "loss", ".4f"),
    ("grad_norm", "grad_norm", ".3f"),
    ("lr", "lr", ".2e"),
    ("tokens_per_s", "tokens/s", ".0f"),
]


def length_limits(config: Any) -> list[tuple[int, str]]:
    """The longest sequence a step takes, and who says so (one sequence cannot be split across
    micro-batches, so a token budget bounds it too)."""
    limits = [(config.model.max_sequence_length, "the model's max_sequence_length")]
    if config.max_tokens_per_micro_batch is not None:
        limits.append((config.max_tokens_per_micro_batch, "max_tokens_per_micro_batch"))
    return limits


def read_sequences(path: str, head: str, config: Any) -> list[dict[str, list[Any]]]:
    """Training records from a JSON-lines file of one kind: tokenized (``input_ids``, and
    ``returns`` for the value head; optional ``loss_mask``, every per-token list as long as
    ``input_ids``), or, for the LM head, text, prompt/response or chat records tokenized by the
    model directory's tokenizer (:mod:`engine.data.text`).

    Each record is checked here, naming its line: token ids are ints and the other values
    numbers (what JSON holds, before tensors blur ``true`` into 1), then all records at once as
    the engine checks a batch (:func:`~engine.data.batching.validated`, against ``config``, an
    ``EngineConfig``): ids in the vocabulary, ``loss_mask`` 0 or 1, no sequence longer than
    :func:`length_limits` allows. Checked only when drawn into a batch, a bad record would stop
    a run at whichever step first drew it."""
    from engine.data.batching import validated
    from engine.data.text import TOKENS, OneKind, load_tokenizer, tokenize_record

    kinds, tokenizer, records, lines = OneKind(), None, [], []
    for number, record in _json_objects(path):
        with _located(f"{path}:{number}"):
            kind = kinds.check(record, f"line {number}")
            if kind == TOKENS:
                kept = _tokenized_record(record, head)
            elif head != "lm":
                raise BatchError(
                    f"{kind} records train an LM head (SFT); --head {head} needs tokenized "
                    "records with 'input_ids' and 'returns'"
                )
            else:
                if tokenizer is None:
                    tokenizer = load_tokenizer(config.model.hf_path)
                kept = tokenize_record(record, tokenizer)
            _check_json_values(kept)
        records.append(kept)
        lines.append(f"{path}:{number}")
    if not records:
        raise BatchError(f"--data {path} holds no records")
    validated(
        _batch_of(records),
        vocab_size=config.model.vocab_size,
        length_limits=length_limits(config),
        row_names=lines,
    )
    return records


def _json_objects(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each non-blank line of ``path`` with its number, parsed and checked to be an object."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read --data {path}: {error.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise BatchError(f"{path}:{number} is not JSON: {error}") from None
        if not isinstance(record, dict):
            kind = type(record).__name__
            raise BatchError(f"{path}:{number} must be a JSON object, got {kind}")
        yield number, record


@contextmanager
def _located(where: str) -> Iterator[None]:
    """One record's errors, prefixed with where it is."""
    try:
        yield
    except (BatchError, ConfigError) as error:
        raise type(error)(f"{where}: {error}") from None


def _tokenized_record(record: dict[str, Any], head: str) -> dict[str, list[Any]]:
    wanted = ["input_ids"] + (["returns"] if head == "value" else [])
    for name in wanted:
        if name not in record:
            raise BatchError(f"lacks {name!r} (tokenized records need {', '.join(wanted)})")
    kept = {name: record[name] for name in (*wanted, "loss_mask") if name in record}
    for name, values in kept.items():
        if not isinstance(values, list) or len(values) != len(kept["input_ids"]):
            raise BatchError(f"{name!r} must be a list as long as 'input_ids'")
    return kept


def _check_json_values(record: dict[str, list[Any]]) -> None:
    """What a tensor would no longer show: token ids that are JSON ints (not bools, not
    floats), other values numbers; and a sequence with a token to train."""
    if len(record["input_ids"]) < 2:
        raise BatchError("a sequence needs at least 2 tokens")
    for name, values in record.items():
        ids = name == "input_ids"
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int if ids else int | float):
                kind = "token ids are ints" if ids else "each value must be a number"
                raise BatchError(f"{name!r} holds {value!r}; {kind}")


def data_batches(
    records: list[dict[str, list[Any]]], batch_size: int, generator: torch.Generator
) -> Iterator[TensorDict]:
    """Endless batches of ``batch_size`` records, reshuffled every pass over the file."""
    while True:
        order = torch.randperm(len(records), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield _batch_of([records[index] for index in order[start : start + batch_size]])


def _batch_of(records: list[dict[str, list[Any]]]) -> TensorDict:
    """One jagged batch of ``records`` (a missing ``loss_mask`` trains all but the first)."""
    from engine.data.batching import from_token_lists

    per_token = {"loss_mask": [r.get("loss_mask") or _default_mask(r) for r in records]}
    if "returns" in records[0]:
        per_token["returns"] = [record["returns"] for record in records]
    return from_token_lists([record["input_ids"] for record in records], **per_token)


def _default_mask(record: dict[str, list[Any]]) -> list[float]:
    return [0.0] + [1.0] * (len(record["input_ids"]) - 1)


def _checked_data(args: argparse.Namespace, config: Any) -> list[dict[str, list[Any]]] | None:
    """The run's data checked before the engine starts: the data file's records (None:
    synthetic data, its ``--max-length`` within :func:`length_limits`), as many as a batch
    takes at least, a batch dividing over the ranks."""
    for limit, name in length_limits(config) if not args.data else ():  # synthetic data
        if args.max_length > limit:
            raise EngineError(f"--max-length {args.max_length} exceeds {name} ({limit})")
    if args.batch_size % int(os.environ.get("WORLD_SIZE", "1")):
        raise EngineError(f"--batch-size {args.batch_size} must divide by the number of ranks")
    records = read_sequences(args.data, args.head, config) if args.data else None
    if records is not None and len(records) < args.batch_size:
        raise BatchError(f"--data holds {len(records)} records, fewer than --batch-size")
    return records


def _batches(
    args: argparse.Namespace,
    config: Any,
    records: list[dict[str, list[Any]]] | None,
    generator: torch.Generator,
) -> Iterator[TensorDict]:
    """The run's whole batches: the data file's records, reshuffled every pass, or synthetic."""
    if records is not None:
        return data_batches(records, args.batch_size, generator)
    return iter(
        lambda: synthetic_batch(
            args.head, config.model.vocab_size, args.batch_size, args.max_length, generator
        ),
        None,
    )


def train(args: argparse.Namespace) -> int:
    from engine import Engine, losses
    from engine.cli.hf_export import HF_DIR, export_final_model
    from engine.cli.loggers import resolve_loggers
    from engine.cli.run_harness import METRICS_FILE, Plot, RunHarness
    from engine.data.batching import take_rows

    logger_names = resolve_loggers(args.logger, args.output_dir)
    config = engine_config(args)
    engine = Engine.build(head=args.head, backend=args.backend, device=args.device, config=config)
    if args.head not in TASKS:
        raise EngineError(
            f"`train` has synthetic tasks for heads {', '.join(TASKS)}, not {args.head!r}"
        )
    loss_fn = getattr(losses, TASKS[args.head])
    records = _checked_data(args, config)
    output_dir = Path(args.output_dir) if args.output_dir else None
    if output_dir is not None and (output_dir / METRICS_FILE).exists():
        raise ConfigError(
            f"{output_dir / METRICS_FILE} exists (an earlier run's); choose another --output-dir"
        )
    engine.initialize()
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    shard = args.batch_size // dp_size
    batches = _batches(args, config, records, torch.Generator().manual_seed(config.seed))
    parallel = config.parallel
    harness = RunHarness(
        label="step",
        step_key="step",
        total=args.steps,
        columns=TRAIN_COLUMNS,
        loggers=logger_names,
        # One rank reports: the first data-parallel replica's output rank (TP 0, last stage).
        lead=engine.holds_outputs() and dp_rank == 0,
        output_dir=output_dir,
        run_name=f"train-{engine.head.name}-{engine.backend.name}",
        settings=config.to_dict(),
        plot=Plot(
            panels=[("loss", ["loss"]), ("grad norm", ["grad_norm"])],
            title=f"train --head {engine.head.name}",
        ),
    )
    with harness, engine.train_mode():
        harness.message(
            f"training head={engine.head.name} backend={engine.backend.name} "
            f"device={engine.platform.name} model={args.model or 'config'} steps={args.steps} "
            f"tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size} dp={dp_size}"
            f" data={args.data or 'synthetic'}"
        )
        for step in range(1, args.steps + 1):
            batch = take_rows(next(batches), slice(dp_rank * shard, (dp_rank + 1) * shard))
            harness.record({"step": step, **engine.train_batch(batch, loss_fn)})
        done = f"done in {time.perf_counter() - harness.started:.1f} s"
        if output_dir is None:
            harness.message(f"{done}; nothing saved (give --output-dir for the model and metrics)")
        else:
            model = export_final_model(engine, output_dir / HF_DIR, f"model ({args.head} head)")
            harness.message(harness.where(before=[done], after=[model]))
    return 0
