"""One long sequence split over ranks: peak memory per rank and step time at N = 1, 2, 4.

megatron's context parallelism (``context_parallel_size``) and fsdp2's Ulysses sequence
parallelism (``ulysses_size``) each split the sequence over N ranks, launched like torchrun
(gloo on 127.0.0.1, OMP_NUM_THREADS=1 per rank). For each layout it prints the peak memory a
forward + backward of the sequence allocates beyond what was live before it (the profiler's
allocation events, on the rank that allocates most; activations and gradients) and the median
``train_batch`` step time, each as a ratio to N = 1 measured in the same invocation. On a
2-core machine N = 4 oversubscribes the cores: read its time as the communication's shape, not
speed.

    python -m benchmarks.long_sequences [--model small] [--length 4096] [--steps 3]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.measure import median_step_seconds, peak_allocated
from tests.multiprocess import run_ranks

BACKENDS = {
    "megatron": lambda size: {"parallel": {"context_parallel_size": size}},
    "fsdp2": lambda size: {"backend": {"ulysses_size": size}},
}


def measure(backend: str, model: str, size: int, length: int, steps: int) -> tuple[int, float]:
    """On each rank: the peak bytes one forward + backward of the sequence allocates, and the
    median train_batch seconds."""
    import attrs

    from engine import Engine
    from engine.losses import sft_loss
    from strategies.part_configs import MODEL_PRESETS
    from tests.factories import random_batch

    settings = attrs.asdict(MODEL_PRESETS[model])
    settings["max_sequence_length"] = length
    config = {"model": settings, "micro_batch_size": 1, **BACKENDS[backend](size)}
    engine = Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()
    vocab = engine.config.model.vocab_size
    with engine.train_mode():
        engine.train_batch(random_batch([64], vocab), sft_loss)  # warm-up: optimizer state
        batch = random_batch([length], vocab, seed=1)
        peak = peak_allocated(lambda: engine.forward_backward_batch(batch, sft_loss))
        seconds = median_step_seconds(lambda: engine.train_batch(batch, sft_loss), steps)
    return peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--backend", choices=sorted(BACKENDS), action="append")
    args = parser.parse_args()
    for backend in args.backend or sorted(BACKENDS):
        base: tuple[int, float] | None = None
        for size in args.sizes:
            results: list[Any] = run_ranks(
                measure, size, backend, args.model, size, args.length, args.steps, timeout=1800
            )
            peak = max(result[0] for result in results)
            seconds = max(result[1] for result in results)  # the step ends on the slowest rank
            base = base or (peak, seconds)
            print(
                f"{backend:8s} N={size} {args.model} {args.length} tokens: peak "
                f"{peak / 2**20:8.1f} MiB ({peak / base[0]:.2f}x N=1), step "
                f"{seconds * 1e3:8.0f} ms ({seconds / base[1]:.2f}x N=1)",
                flush=True,
            )


if __name__ == "__main__":
    main()
