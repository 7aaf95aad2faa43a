"""verl's RL trainer (``main_ppo``, unmodified) on this engine on CPU, through
``engine.integrations.verl.ppo``: Ray workers, the ``composable_hf`` generator, verl's weight
sync, its checkpoints. A few iterations of the shipped task per case. Skipped without verl."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")

from engine.integrations.verl import task  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[2])
#: verl's per-iteration metrics every case must report.
METRICS = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/entropy",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/update_weights",
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The shipped task: dense and mixture-of-experts models, verl's parquet files."""
    root = tmp_path_factory.mktemp("task")
    paths = task.write(root)
    (root / "moe").mkdir()
    task.write_model(root / "moe", moe=True)
    return {**paths, "moe": str(root / "moe")}


def main_ppo(
    files: dict[str, str], directory: Path, *overrides: str, timeout: int = 600
) -> dict[int, dict[str, float]]:
    """``python -m engine.integrations.verl.ppo`` on the shipped task; the metrics verl's
    console logger printed for each iteration."""
    arguments = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={files['train']}",
        f"data.val_files={files['test']}",
        "data.train_batch_size=4",
        "data.max_prompt_length=16",
        f"data.max_response_length={task.ANSWER_LENGTH}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={files['model']}",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.full_determinism=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        f"reward.custom_reward_function.path={files['reward']}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={directory / 'checkpoints'}",
        *overrides,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "RAY_DEDUP_LOGS": "0",
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    directory.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "engine.integrations.verl.ppo", *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=directory,
    )
    output = result.stdout + result.stderr
    (directory / "main_ppo.log").write_text(output)
    assert result.returncode == 0, output[-6000:]
    steps: dict[int, dict[str, float]] = {}
    for line in re.findall(r"step:(\d+) - (.*)", output):
        metrics = {}
        for item in line[1].split(" - "):
            key, _, value = item.partition(":")
            try:
                metrics[key.strip()] = float(value)
            except ValueError:
                continue
        steps[int(line[0])] = metrics
    return steps


def assert_iterations(steps: dict[int, dict[str, float]], count: int) -> None:
    """Every iteration reports verl's metrics, all finite, and the generator sampled from the
    actor's weights: its log-probs are the actor's (float32 on both sides; a stale or
    mangled sync differs by orders of magnitude more)."""
    assert sorted(steps) == list(range(1, count + 1))
    for step, metrics in steps.items():
        for key in METRICS:
            assert key in metrics, (step, key)
        assert all(math.isfinite(value) for value in metrics.values()), (step, metrics)
        assert metrics["training/rollout_probs_diff_max"] < 1e-4, (step, metrics)


FP32 = (
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
)


@pytest.mark.multiprocess
def test_grpo_on_two_trainer_processes_saves_and_resumes_exactly(
    files: dict[str, str], tmp_path: Path
) -> None:
    """GRPO with the fsdp2 backend on 2 trainer processes and one generator: three iterations,
    a checkpoint after the second; a second run resumed from that checkpoint
    (``resume_mode=auto``) gives the third iteration's numbers of the uninterrupted run."""
    settings = (*FP32, "trainer.n_gpus_per_node=2", "trainer.total_training_steps=3")
    whole = main_ppo(files, tmp_path / "whole", *settings, "trainer.save_freq=2")
    assert_iterations(whole, 3)
    saved = tmp_path / "whole" / "checkpoints"
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(saved / "global_step_2", resumed_dir / "global_step_2")
    (resumed_dir / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = main_ppo(files, tmp_path / "resumed", *settings, "trainer.resume_mode=auto")
    assert sorted(resumed) == [3]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert resumed[3][key] == pytest.approx(whole[3][key], rel=1e-6, abs=1e-7), key
