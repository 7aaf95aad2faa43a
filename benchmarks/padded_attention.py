"""Padded micro-batches: the engine's SDPA core attention vs megatron's local one.

One megatron engine (``small``, LM head); the same right-padded batch trains with the engine's
core attention (``strategies/backends/megatron/attention.py``: one causal SDPA call per
micro-batch) and with megatron's own local ``DotProductAttention.forward`` (the
``[rows, heads, seq, seq]`` scores and their softmax), switched in place on the same module, the
two alternating step by step. Prints the median step time and the peak memory allocated during
a step of each, and their ratios (SDPA / local). The losses of the two are printed too: equal up
to float rounding.

    python -m benchmarks.padded_attention [--model small] [--length 1024] [--rows 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.measure import peak_allocated

T = TypeVar("T")


@contextmanager
def local_attention() -> Iterator[None]:
    """Megatron's local core attention in place of the engine's, for every layer."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from strategies.backends.megatron.attention import packed_dot_product_attention

    cls = packed_dot_product_attention()
    engine_forward = cls.forward
    cls.forward = DotProductAttention.forward
    try:
        yield
    finally:
        cls.forward = engine_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--length", type=int, default=1024, help="the longest sequence")
    parser.add_argument("--rows", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from engine import Engine
    from engine.losses import sft_loss
    from tests.factories import random_batch

    engine = Engine.build(
        head="lm",
        backend="megatron",
        device="cpu",
        config={"model": args.model, "micro_batch_size": args.rows},
    ).initialize()
    vocab = engine.config.model.vocab_size
    lengths = [args.length - (i * args.length) // (2 * args.rows) for i in range(args.rows)]
    batch = random_batch(lengths, vocab)

    def step() -> None:
        engine.train_batch(batch, sft_loss)

    variants: dict[str, Callable[[], None]] = {
        "sdpa": step,
        "local": lambda: _under_local(step),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with engine.train_mode():
        # each one's forward loss on the same weights, then a warm-up step each
        losses = {name: _loss(engine, batch, local=name == "local") for name in variants}
        for run in variants.values():
            run()
        for index in range(args.steps):
            order = list(variants) if index % 2 == 0 else list(reversed(variants))
            for name in order:
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        peaks = {name: peak_allocated(run) for name, run in variants.items()}
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"model={args.model} rows={args.rows} lengths {min(lengths)}..{max(lengths)} "
        f"(padded to {max(lengths)}), {args.steps} steps each, alternating"
    )
    for name in variants:
        print(
            f"  {name:5s}: step {median[name] * 1e3:8.1f} ms, peak allocated "
            f"{peaks[name] / 2**20:8.1f} MiB, loss {losses[name]:.6f}"
        )
    print(
        f"  sdpa / local: time {median['sdpa'] / median['local']:.2f}x, peak memory "
        f"{peaks['sdpa'] / peaks['local']:.2f}x"
    )


def _under_local(fn: Callable[[], T]) -> T:
    with local_attention():
        return fn()


def _loss(engine: Any, batch: Any, *, local: bool) -> float:
    """The forward-only loss of ``batch`` on the current weights, with megatron's local core
    attention when ``local``."""
    from engine.losses import sft_loss

    def forward() -> float:
        return float(sum(engine.forward_backward_batch(batch, sft_loss, True)["loss"]))

    return _under_local(forward) if local else forward()


if __name__ == "__main__":
    main()
