"""Does the demo learn on every seed and thread count? ``python -m engine demo`` for each
algorithm (PPO on each backend, each critic-free algorithm), seed and ``OMP_NUM_THREADS``;
prints each run as it ends, then per algorithm and backend the spread over runs of the mean
reward of the last 10 iterations (min, median, max), how many runs reached 0.95, and the worst
run. Sampling amplifies rounding, so a run's outcome may differ between thread counts and
CPUs: the spread, not one run, is what the demo promises.

    python -m benchmarks.demo_seeds [--algorithms ppo,grpo] [--backends megatron,fsdp2]
        [--seeds 0-9] [--threads 1,2] [--jobs 2] [--steps 120] [--config FILE] [--json FILE]

``--algorithms all`` is PPO and every critic-free algorithm (benchmarks.algorithms);
``--jobs`` runs that many demos at once (each with its own thread count: keep jobs x threads
within the cores, or the runs time each other out of nothing but their wall times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from benchmarks.algorithms import WINDOW, critic_free, last_mean, run

#: The last-10 mean reward a run must reach to count as learned.
LEARNED = 0.95


def numbers(text: str) -> list[int]:
    """``0-9`` or ``0,3,5`` as a list of ints."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default="ppo")
    parser.add_argument("--backends", default="megatron")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--config", help="a demo YAML file every run reads")
    parser.add_argument("--json", help="also write every run's result here")
    args = parser.parse_args()
    names = ["ppo", *critic_free()] if args.algorithms == "all" else args.algorithms.split(",")
    cases = [
        (name, backend, seed, threads)
        for name in names
        for backend in args.backends.split(",")
        for seed in numbers(args.seeds)
        for threads in numbers(args.threads)
    ]
    extra = ("--config", args.config) if args.config else ()
    #: each case's rewards per iteration and wall time
    results: dict[tuple[str, str, int, int], tuple[list[float], float]] = {}
    print(f"{len(cases)} runs, {args.jobs} at a time, {args.steps} iterations each", flush=True)
    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            pool.submit(
                run,
                name,
                args.steps,
                seed,
                Path(scratch) / f"{name}-{backend}-{seed}-{threads}",
                extra=("--backend", backend, *extra),
                threads=threads,
            ): (name, backend, seed, threads)
            for name, backend, seed, threads in cases
        }
        for done, future in enumerate(as_completed(futures), 1):
            case = futures[future]
            rewards, wall = results[case] = future.result()
            print(
                f"[{done}/{len(cases)}] {case[0]} {case[1]} seed {case[2]} threads {case[3]}: "
                f"last {WINDOW} {last_mean(rewards):.3f}  wall {wall:.0f} s",
                flush=True,
            )
    print(f"\nlast-{WINDOW} mean reward over seeds {args.seeds} x threads {args.threads}:")
    for name in names:
        for backend in args.backends.split(","):
            runs = {
                case: last_mean(rewards)
                for case, (rewards, _) in results.items()
                if case[:2] == (name, backend)
            }
            finals = list(runs.values())
            worst = min(runs, key=runs.__getitem__)
            print(
                f"{name:28s} {backend:9s} min {min(finals):.3f}  median "
                f"{statistics.median(finals):.3f}  max {max(finals):.3f}  "
                f">= {LEARNED}: {sum(final >= LEARNED for final in finals)}/{len(finals)}  "
                f"worst: seed {worst[2]} threads {worst[3]}"
            )
    if args.json:
        rows = [
            {"algorithm": n, "backend": b, "seed": s, "threads": t, "last": last_mean(r)}
            | {"wall_s": w, "rewards": r}
            for (n, b, s, t), (r, w) in sorted(results.items())
        ]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
