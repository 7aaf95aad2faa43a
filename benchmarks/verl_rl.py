"""verl's RL trainer on CPU, on this engine: learning curves of GRPO and of PPO with a critic on
the shipped *repeat* task (``python -m engine.integrations.verl.ppo``, the ``composable_hf``
generator), the time of one iteration split as verl's own timing metrics split it, and the cost
of one weight sync (engine export -> generator) against ``load_state_dict`` of the same tensors
already in memory, per backend, dense and mixture-of-experts.

Prints each run's mean reward over its first and last 10 iterations, its wall time, and each
phase's share of an iteration (median over iterations after the first); draws the reward curves.
Over several seeds (``--seeds``: verl's data order and rollout seed) and trainer modes
(``--modes``: verl's ``trainer.v1.trainer_mode``), a summary per algorithm and mode: the spread
of the gain (last 10 minus first 10), how many seeds gained 0.3 or more, and the median time of
an iteration against ``sync`` on the same seed.

    python -m benchmarks.verl_rl [--steps 60] [--seeds 0 1 2] [--modes sync colocate_async]
        [--runs GRPO] [--plot docs/images/verl-rl.png] [--skip-runs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.algorithms import WINDOW, first_mean, last_mean

#: verl's timing metrics, in the order an iteration runs them.
PHASES = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "update_weights",
)


def learning_settings(files: dict[str, str], steps: int) -> list[str]:
    return [
        f"data.train_files={files['train']}",
        f"data.val_files={files['test']}",
        "data.train_batch_size=16",
        "data.max_prompt_length=16",
        "data.max_response_length=4",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={files['model']}",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64",
        f"reward.custom_reward_function.path={files['reward']}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
    ]


RUNS: dict[str, list[str]] = {
    "GRPO": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True"],
    "PPO + critic": [
        "algorithm.adv_estimator=gae",
        "critic.model.path={model}",
        "critic.optim.lr=2e-3",
        "critic.ppo_micro_batch_size_per_gpu=64",
    ],
}


#: The gain (last 10 iterations' mean reward minus the first 10's) a run must show.
GAIN = 0.3


def run(
    name: str, files: dict[str, str], steps: int, out: Path, seed: int = 0, mode: str = "sync"
) -> tuple[dict, float]:
    """One ``main_ppo`` run: verl's metrics per iteration and the run's wall time."""
    from engine.integrations.verl.ppo import console_metrics

    command = [
        sys.executable,
        "-m",
        "engine.integrations.verl.ppo",
        *learning_settings(files, steps),
        *(setting.format(model=files["model"]) for setting in RUNS[name]),
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"trainer.v1.trainer_mode={mode}",
        # separate_async: weights to the replica apart after every mini-batch (one an iteration)
        *(["trainer.v1.separate_async.parameter_sync_step=1"] if mode == "separate_async" else []),
        f"trainer.default_local_dir={out / 'checkpoints'}",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=out)
    wall = time.perf_counter() - start
    (out / "main_ppo.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return console_metrics(result.stdout + result.stderr), wall


def sync_costs(root: Path) -> list[tuple[str, float, float]]:
    """(case, seconds of one sync through the adapter's buckets, seconds of load_state_dict of
    the same tensors in memory), per backend, dense and mixture-of-experts; medians of 5."""
    import torch
    import torch.distributed as dist
    from verl.workers.config import HFModelConfig, RolloutConfig

    from engine import Engine
    from engine.integrations.verl import task
    from engine.integrations.verl.rollout import NAME, HFGenerator, _buckets
    from strategies.backends.megatron.mesh import destroy_mesh

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    results = []
    for moe in (False, True):
        path = root / ("moe" if moe else "dense")
        path.mkdir(parents=True, exist_ok=True)
        task.write_model(path, moe=moe)
        config = RolloutConfig(name=NAME, tensor_model_parallel_size=1, prompt_length=16)
        for backend in ("fsdp2", "megatron"):
            engine = Engine.build(
                head="lm", backend=backend, device="cpu", config={"model": str(path)}
            ).initialize()
            generator = HFGenerator(config, HFModelConfig(path=str(path)), replica_rank=0)
            limit = int(config.checkpoint_engine.update_weights_bucket_megabytes) << 20
            syncs, loads = [], []
            for _ in range(5):
                start = time.perf_counter()
                generator.sleep()
                generator.resume(["weights"])
                for bucket, last in _buckets(engine.get_per_tensor_param(), limit):
                    generator.update_weights(bucket, last)
                syncs.append(time.perf_counter() - start)
                state = {k: v.clone() for k, v in generator.model.state_dict().items()}
                start = time.perf_counter()
                generator.model.load_state_dict(state)
                loads.append(time.perf_counter() - start)
            results.append(
                (
                    f"{backend} {'MoE' if moe else 'dense'}",
                    statistics.median(syncs),
                    statistics.median(loads),
                )
            )
            if backend == "megatron":
                destroy_mesh()
            del engine
            asyncio.run(asyncio.sleep(0))
            torch.manual_seed(0)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plot", default=None, help="where to draw the reward curves")
    parser.add_argument("--skip-runs", action="store_true", help="the sync costs only")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", default=["sync"], help="verl's trainer modes")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--skip-sync-costs", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from engine.integrations.verl import task

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        if not args.skip_sync_costs:
            print(
                "weight sync (engine export -> generator) vs load_state_dict of the same tensors:"
            )
            for case, sync, load in sync_costs(root / "sync"):
                print(
                    f"  {case:15s} sync {sync * 1e3:7.2f} ms   load_state_dict "
                    f"{load * 1e3:6.2f} ms   ratio {sync / load:5.1f}x"
                )
        if args.skip_runs:
            return
        files = task.write(root / "task")
        curves: dict[str, list[float]] = {}
        #: (algorithm, mode) -> per seed (gain, median seconds of an iteration, run's wall)
        results: dict[tuple[str, str], dict[int, tuple[float, float, float]]] = {}
        for name in args.runs:
            for mode in args.modes:
                for seed in args.seeds:
                    label = f"{name}, {mode}, seed {seed}"
                    out = root / "".join(c if c.isalnum() else "_" for c in label)
                    out.mkdir()
                    steps, wall = run(name, files, args.steps, out, seed, mode)
                    rewards = [steps[i]["critic/score/mean"] for i in sorted(steps)]
                    curves[label] = rewards
                    first, last = first_mean(rewards), last_mean(rewards)
                    print(
                        f"{label}: {len(rewards)} iterations in {wall:.0f} s; mean reward first "
                        f"{WINDOW} {first:.3f}, last {WINDOW} {last:.3f} (+{last - first:.3f})",
                        flush=True,
                    )
                    total = _phase_split(steps)
                    results.setdefault((name, mode), {})[seed] = (last - first, total, wall)
        _summary(results, len(args.seeds))
    if args.plot:
        plot(curves, Path(args.plot))


def _phase_split(steps: dict[int, dict[str, float]]) -> float:
    """Print each phase's share of an iteration (medians over the iterations after the first);
    the median seconds of an iteration."""
    later = [steps[i] for i in sorted(steps)[1:]] or list(steps.values())
    total = statistics.median(m["timing_s/step"] for m in later)
    split = []
    for phase in PHASES:
        values = [m[f"timing_s/{phase}"] for m in later if f"timing_s/{phase}" in m]
        if values:
            split.append(f"{phase} {statistics.median(values) / total:.0%}")
    print(f"  one iteration {total:.2f} s: " + ", ".join(split), flush=True)
    return total


def _summary(
    results: dict[tuple[str, str], dict[int, tuple[float, float, float]]], seeds: int
) -> None:
    """Per algorithm and mode over the seeds: the gain's spread, the seeds that gained
    :data:`GAIN`, and against ``sync`` on the same seed the run's wall time and verl's
    ``timing_s/step`` (which in the asynchronous modes leaves out the generation that overlaps
    training, and the wait for it)."""
    if seeds < 2 and len({mode for _, mode in results}) < 2:
        return
    print(f"over {seeds} seed(s): gain (last {WINDOW} - first {WINDOW}) min / median / max")
    for (name, mode), runs in results.items():
        gains = sorted(gain for gain, _, _ in runs.values())
        line = (
            f"  {name:12s} {mode:15s} {gains[0]:+.3f} / {statistics.median(gains):+.3f} / "
            f"{gains[-1]:+.3f}; {sum(g >= GAIN for g in gains)}/{len(gains)} gained {GAIN}"
        )
        baseline = results.get((name, "sync"))
        if mode != "sync" and baseline:
            same = [(run, baseline[seed]) for seed, run in runs.items() if seed in baseline]
            if same:
                wall = statistics.median(run[2] / base[2] for run, base in same)
                step = statistics.median(run[1] / base[1] for run, base in same)
                line += f"; against sync: the run's wall {wall:.2f}x, timing_s/step {step:.2f}x"
        print(line)


def plot(curves: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for name, rewards in curves.items():
        axes.plot(range(1, len(rewards) + 1), rewards, label=name)
    axes.set_xlabel("iteration")
    axes.set_ylabel("mean reward")
    axes.set_title("verl main_ppo on CPU (composable_hf rollout), repeat task")
    axes.set_ylim(0, 1)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
