"""One long sequence split over ranks: peak memory per rank and step time at N = 1, 2, 4; or
the longest sequence that fits a memory budget per rank.

megatron's context parallelism (``context_parallel_size``; ``megatron-ring``: with its ring
attention, ``context_parallel_attention="ring"``; ``megatron-tp2``: CP x TP=2 with sequence
parallelism, N counting the CP ranks) and fsdp2's Ulysses sequence parallelism
(``ulysses_size``) each split the sequence over N ranks, launched like torchrun (gloo on
127.0.0.1, OMP_NUM_THREADS=1 per rank). For each layout it prints the peak memory a forward +
backward of the sequence allocates beyond what was live before it (the profiler's allocation
events, on the rank that allocates most; activations and gradients) and the median
``train_batch`` step time, each as a ratio to N = 1 measured in the same invocation. On a
2-core machine N = 4 oversubscribes the cores: read its time as the communication's shape, not
speed.

With ``--budget-mib B`` it searches instead, for each layout and N, the longest sequence whose
forward + backward allocates at most ``B`` MiB on every rank (measured peaks, not a formula):
lengths double from ``--length`` until one does not fit, then bisect to ``--granularity``
tokens; it prints the longest and its ratio to N = 1.

    python -m benchmarks.long_sequences [--model small] [--length 4096] [--steps 3]
    python -m benchmarks.long_sequences --budget-mib 256 --length 512 [--sizes 1 2 4]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from benchmarks.measure import median_step_seconds, peak_allocated
from tests.multiprocess import run_ranks

#: Each layout: (backend, its settings for N ranks splitting the sequence, ranks per N).
LAYOUTS: dict[str, tuple[str, Callable[[int], dict[str, Any]], int]] = {
    "megatron": ("megatron", lambda size: {"parallel": {"context_parallel_size": size}}, 1),
    "megatron-ring": (
        "megatron",
        lambda size: {
            "parallel": {"context_parallel_size": size},
            "backend": {"context_parallel_attention": "ring"},
        },
        1,
    ),
    "megatron-tp2": (
        "megatron",
        lambda size: {
            "parallel": {
                "context_parallel_size": size,
                "tensor_parallel_size": 2,
                "sequence_parallel": True,
            }
        },
        2,
    ),
    "fsdp2": ("fsdp2", lambda size: {"backend": {"ulysses_size": size}}, 1),
}
DEFAULT_LAYOUTS = ("fsdp2", "megatron")


def _engine(layout: str, model: str, size: int, longest: int) -> Any:
    import attrs

    from engine import Engine
    from strategies.part_configs import MODEL_PRESETS

    backend, settings_for, _ = LAYOUTS[layout]
    settings = attrs.asdict(MODEL_PRESETS[model])
    settings["max_sequence_length"] = longest
    config = {"model": settings, "micro_batch_size": 1, **settings_for(size)}
    return Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()


def measure(layout: str, model: str, size: int, length: int, steps: int) -> tuple[int, float]:
    """On each rank: the peak bytes one forward + backward of the sequence allocates, and the
    median train_batch seconds."""
    from engine.losses import sft_loss
    from tests.factories import random_batch

    engine = _engine(layout, model, size, length)
    vocab = engine.config.model.vocab_size
    with engine.train_mode():
        engine.train_batch(random_batch([64], vocab), sft_loss)  # warm-up: optimizer state
        batch = random_batch([length], vocab, seed=1)
        peak = peak_allocated(lambda: engine.forward_backward_batch(batch, sft_loss))
        seconds = median_step_seconds(lambda: engine.train_batch(batch, sft_loss), steps)
    return peak, seconds


def longest_that_fits(
    layout: str, model: str, size: int, start: int, budget: int, granularity: int
) -> tuple[int, list[tuple[int, int]]]:
    """On each rank: the longest sequence whose forward + backward allocates at most ``budget``
    bytes on every rank (the ranks agree on each probe's largest peak), and the probes
    (length, peak)."""
    import torch
    import torch.distributed as dist

    from engine.losses import sft_loss
    from tests.factories import random_batch

    limit = 1 << 20
    engine = _engine(layout, model, size, limit)
    vocab = engine.config.model.vocab_size
    probes: list[tuple[int, int]] = []

    def fits(length: int) -> bool:
        batch = random_batch([length], vocab, seed=1)
        peak = torch.tensor(peak_allocated(lambda: engine.forward_backward_batch(batch, sft_loss)))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        probes.append((length, int(peak)))
        return int(peak) <= budget

    with engine.train_mode():
        engine.train_batch(random_batch([64], vocab), sft_loss)  # warm-up: optimizer state
        low, high = 0, start
        while high <= limit and fits(high):
            low, high = high, 2 * high
        while high - low > granularity:
            middle = (low + high) // 2 // granularity * granularity
            if middle in (low, high):
                break
            low, high = (middle, high) if fits(middle) else (low, middle)
    return low, probes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--backend", "--layout", choices=sorted(LAYOUTS), action="append")
    parser.add_argument("--budget-mib", type=float, help="search the longest that fits")
    parser.add_argument("--granularity", type=int, default=256)
    args = parser.parse_args()
    for layout in args.backend or DEFAULT_LAYOUTS:
        if args.budget_mib is not None:
            search(layout, args)
            continue
        base: tuple[int, float] | None = None
        for size in args.sizes:
            results: list[Any] = run_ranks(
                measure,
                size * LAYOUTS[layout][2],
                layout,
                args.model,
                size,
                args.length,
                args.steps,
                timeout=1800,
            )
            peak = max(result[0] for result in results)
            seconds = max(result[1] for result in results)  # the step ends on the slowest rank
            base = base or (peak, seconds)
            print(
                f"{layout:13s} N={size} {args.model} {args.length} tokens: peak "
                f"{peak / 2**20:8.1f} MiB ({peak / base[0]:.2f}x N=1), step "
                f"{seconds * 1e3:8.0f} ms ({seconds / base[1]:.2f}x N=1)",
                flush=True,
            )


def search(layout: str, args: argparse.Namespace) -> None:
    """The longest sequence within the budget for each N, and its ratio to N = 1."""
    budget = int(args.budget_mib * 2**20)
    base = None
    for size in args.sizes:
        (longest, probes), *_ = run_ranks(
            longest_that_fits,
            size * LAYOUTS[layout][2],
            layout,
            args.model,
            size,
            args.length,
            budget,
            args.granularity,
            timeout=3600,
        )
        base = base or longest
        tried = ", ".join(f"{length}: {peak / 2**20:.0f}" for length, peak in probes)
        ratio = f"{longest / base:.2f}x N=1" if base else "n/a"
        print(
            f"{layout:13s} N={size} {args.model} budget {args.budget_mib:.0f} MiB: longest "
            f"{longest} tokens ({ratio}); probes (tokens: MiB) {tried}",
            flush=True,
        )


if __name__ == "__main__":
    main()
