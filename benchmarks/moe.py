"""Mixture-of-experts step times, as ratios measured in one invocation.

1. One process, steps alternating so machine noise hits all alike: the ``moe`` preset (4
   experts of FFN 64, 2 per token) against ``tiny`` (the dense model of the same active size:
   one FFN of 128); and router replay's extra cost: recording routes in ``infer_batch``, and
   ``train_batch`` on a batch carrying ``routed_experts``.
2. Expert parallel: the same global batch at EP=2 (2 processes, each with half the experts and
   half the batch) against one process (processes launched like torchrun, gloo, one thread).

On a 2-core machine the point is the shape and the overhead, not absolute speed.

    python -m benchmarks.moe [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.measure import median_step_seconds
from tests.multiprocess import run_ranks

SEQUENCES, LENGTH = 16, 64


def _lengths() -> list[int]:
    return [LENGTH - (i * 13) % (LENGTH // 2) for i in range(SEQUENCES)]


def one_process(steps: int) -> dict[str, float]:
    """Median seconds per call of each variant, alternating."""
    from engine import Engine
    from engine.losses import sft_loss
    from tests.factories import random_batch

    def build(model: str, **extra: Any) -> Any:
        config = {"model": model, "micro_batch_size": 4, **extra}
        return Engine.build(head="lm", device="cpu", config=config).initialize()

    dense, moe, replay = build("tiny"), build("moe"), build("moe", router_replay=True)
    batch = random_batch(_lengths(), 128)
    replayed = batch.clone()
    replayed["routed_experts"] = replay.infer_batch(batch)["routed_experts"]
    variants = {
        "dense train_batch": lambda: dense.train_batch(batch, sft_loss),
        "moe train_batch": lambda: moe.train_batch(batch, sft_loss),
        "moe train_batch, routes replayed": lambda: replay.train_batch(replayed, sft_loss),
        "moe infer_batch": lambda: moe.infer_batch(batch),
        "moe infer_batch, routes recorded": lambda: replay.infer_batch(batch),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(steps + 2):
        for name, call in variants.items():
            start = time.perf_counter()
            call()
            if step >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def expert_parallel_step(steps: int) -> tuple[float, int]:
    """On each rank: median train_batch seconds of its half (or all) of the batch."""
    from engine import Engine
    from engine.data.batching import take_rows
    from engine.losses import sft_loss
    from tests.factories import random_batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"model": "moe", "micro_batch_size": 4, "parallel": {"expert_parallel_size": world}}
    engine = Engine.build(head="lm", device="cpu", config=config).initialize()
    rank, size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    lengths = _lengths()
    rows = slice(rank * SEQUENCES // size, (rank + 1) * SEQUENCES // size)
    shard = take_rows(random_batch(lengths, 128), rows)
    with engine.train_mode():
        seconds = median_step_seconds(lambda: engine.train_batch(shard, sft_loss), steps)
    return seconds, sum(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    tokens = sum(_lengths())
    (medians,) = run_ranks(one_process, 1, args.steps, timeout=1800)
    pairs = {
        "moe train_batch": "dense train_batch",
        "moe train_batch, routes replayed": "moe train_batch",
        "moe infer_batch, routes recorded": "moe infer_batch",
    }
    for name, seconds in medians.items():
        base = pairs.get(name)
        ratio = f", ratio to {base}: {seconds / medians[base]:.2f}" if base else ""
        print(f"{name:34s} {seconds * 1e3:7.1f} ms ({tokens / seconds:6.0f} tokens/s){ratio}")
    single = max(r[0] for r in run_ranks(expert_parallel_step, 1, args.steps, timeout=900))
    split = max(r[0] for r in run_ranks(expert_parallel_step, 2, args.steps, timeout=900))
    print(f"EP=1 (1 process) train_batch {single * 1e3:7.1f} ms")
    print(
        f"EP=2 (2 processes) train_batch {split * 1e3:7.1f} ms, ratio to EP=1 {split / single:.2f}"
    )


if __name__ == "__main__":
    main()
