"""Learning curves of the critic-free algorithms on the demo's parity task: ``python -m engine
demo --algorithm NAME`` for each distinct critic-free advantage estimator (the vectorised
aliases compute what ``grpo`` and ``rloo`` do), same seed and settings; prints each run's mean
reward over its first and last 10 iterations, the iteration at which the 10-iteration mean
first passed 0.9, and its wall time against GRPO's (the baseline measured in the same run), and
draws the reward curves in one plot.

    python -m benchmarks.algorithms [--steps 120] [--seed 0] [--plot docs/images/algorithms.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.cli.demo.settings import DemoConfig, algorithm_names

#: Names that compute what another does (verl's vectorised implementations).
ALIASES = {
    "grpo_vectorized": "grpo",
    "rloo_vectorized": "rloo",
    "reinforce_plus_plus_baseline": "reinforce_pp",
}
WINDOW = 10


def first_mean(rewards: list[float]) -> float:
    """The mean reward of a run's first ``WINDOW`` iterations (all of them in a shorter run)."""
    window = rewards[:WINDOW]
    return sum(window) / len(window)


def last_mean(rewards: list[float]) -> float:
    """The mean reward of a run's last ``WINDOW`` iterations (all of them in a shorter run)."""
    window = rewards[-WINDOW:]
    return sum(window) / len(window)


def critic_free() -> list[str]:
    """The demo's critic-free algorithms, one name per computation."""
    names = []
    for name in algorithm_names():
        estimator = DemoConfig.from_dict({"algorithm": name}).estimator()
        if not estimator.needs_values and name not in ALIASES:
            names.append(name)
    return names


def run(
    name: str,
    steps: int,
    seed: int,
    out: Path,
    *,
    extra: tuple[str, ...] = (),
    threads: int | None = None,
) -> tuple[list[float], float]:
    """One demo run of algorithm ``name`` (``extra``: more demo flags; ``threads``: its
    ``OMP_NUM_THREADS``, else this process's): its rewards per iteration and its wall time."""
    command = [
        sys.executable, "-m", "engine", "demo", "--algorithm", name, "--steps", str(steps),
        "--seed", str(seed), "--device", "cpu", "--output-dir", str(out), "--logger", "jsonl",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [float(json.loads(line)["reward"]) for line in lines], wall


def passed(rewards: list[float], level: float = 0.9) -> int | None:
    """The first iteration at which the mean of the last ``WINDOW`` rewards passed ``level``."""
    for end in range(WINDOW, len(rewards) + 1):
        if sum(rewards[end - WINDOW : end]) / WINDOW > level:
            return end
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="algorithms.png")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    curves: dict[str, list[float]] = {}
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in critic_free():
            curves[name], walls[name] = run(name, args.steps, args.seed, Path(scratch) / name)
            rewards = curves[name]
            reached = passed(rewards)
            print(
                f"{name:28s} first {WINDOW} {first_mean(rewards):.3f}  "
                f"last {WINDOW} {last_mean(rewards):.3f}  "
                f"passed 0.9 at {reached if reached is not None else 'never'}  "
                f"wall {walls[name]:.0f} s ({walls[name] / walls[critic_free()[0]]:.2f}x grpo)",
                flush=True,
            )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5))
    styles = ["-", "--", ":"]  # the colour cycle has 10 colours
    for index, (name, rewards) in enumerate(curves.items()):
        smoothed = [
            sum(rewards[max(0, i - WINDOW + 1) : i + 1])
            / len(rewards[max(0, i - WINDOW + 1) : i + 1])
            for i in range(len(rewards))
        ]
        axis.plot(
            range(1, len(rewards) + 1), smoothed, label=name, linestyle=styles[index // 10 % 3]
        )
    axis.set_xlabel("iteration")
    axis.set_ylabel(f"reward ({WINDOW}-iteration mean)")
    axis.set_title(f"critic-free algorithms on the demo's parity task (seed {args.seed})")
    axis.axhline(0.5, color="grey", linewidth=0.5)
    axis.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.plot, dpi=100)
    print(f"plot in {args.plot}")


if __name__ == "__main__":
    main()
