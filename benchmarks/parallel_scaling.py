"""Step time of ``train_batch`` at DP=1/2 and TP=1/2 against one process, same invocation.

Every layout trains the same global batch (DP ranks each take their half) on processes
launched like torchrun (gloo on 127.0.0.1, OMP_NUM_THREADS=1 per rank). Prints the median step
time of each layout and its ratio to the single-process run measured in the same invocation.
On a 2-core machine the point is the shape and the overhead, not absolute speed.

    python -m benchmarks.parallel_scaling [--model tiny|small] [--steps 8]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.measure import median_step_seconds
from tests.multiprocess import run_ranks

LAYOUTS = {
    "1 process": (1, {}),
    "DP=2": (2, {}),
    "TP=2": (2, {"tensor_parallel_size": 2}),
}


def step_times(
    model: str, parallel: dict[str, Any], steps: int, sequences: int, length: int
) -> Any:
    """On each rank: median train_batch seconds over ``steps`` after two warm-up steps."""
    from engine import Engine
    from engine.data.batching import take_rows
    from engine.losses import sft_loss
    from tests.factories import random_batch

    engine = Engine.build(
        head="lm",
        device="cpu",
        config={"model": model, "parallel": parallel, "micro_batch_size": 4},
    ).initialize()
    rank, size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    vocab = engine.config.model.vocab_size
    lengths = [length - (i * 13) % (length // 2) for i in range(sequences)]
    batch = random_batch(lengths, vocab)
    shard = take_rows(batch, slice(rank * sequences // size, (rank + 1) * sequences // size))
    with engine.train_mode():
        seconds = median_step_seconds(lambda: engine.train_batch(shard, sft_loss), steps)
    return seconds, sum(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["tiny", "small"], action="append")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    for model in args.model or ["tiny", "small"]:
        sequences, length = (16, 64) if model == "tiny" else (8, 128)
        baseline = None
        for name, (world, parallel) in LAYOUTS.items():
            results = run_ranks(
                step_times, world, model, parallel, args.steps, sequences, length, timeout=900
            )
            seconds = max(result[0] for result in results)  # the step ends on the slowest rank
            tokens = results[0][1]
            baseline = baseline or seconds
            print(
                f"model={model:5s} {name:9s} tokens/step={tokens:5d}: step {seconds * 1e3:8.1f} ms,"
                f" {tokens / seconds:8.0f} tokens/s, ratio to 1 process {seconds / baseline:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
