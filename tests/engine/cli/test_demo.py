"""``python -m engine demo``: PPO and the critic-free algorithms end to end, their files,
resume, Ctrl-C and bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from engine.cli import main
from engine.cli.demo.parity_task import (
    build_generator,
    in_groups,
    make_prompts,
    parity_reward,
    push_weights,
    rollout_batch,
    sample,
)
from engine.cli.demo.settings import ROLES, DemoConfig, resolve_config
from engine.generation.weights import GeneratorWeights
from engine.losses import GRPO
from heads.errors import ConfigError
from strategies.hf.experts import CheckpointLayout
from tests.engine.cli.test_cli import ROOT, run
from tests.multiprocess import TORCHRUN_TWO_RANKS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: A short run: small batches, a checkpoint every second iteration.
SHORT = "task:\n  prompts: 8\n  prompt_length: 4\n  response_length: 4\nsave_every: 2\n"
#: A short critic-free run: 4 prompts x 2 responses.
SHORT_GROUPS = (
    "task:\n  prompts: 4\n  group_size: 2\n  prompt_length: 4\n  response_length: 4\n"
    "save_every: 2\n"
)
ADVANTAGE_STATS = ("adv_mean", "adv_std", "adv_max", "adv_min")


def short_config(tmp_path: Path, extra: str = "") -> str:
    path = tmp_path / "demo.yaml"
    path.write_text(SHORT + extra)
    return str(path)


def records(output_dir: Path) -> list[dict[str, Any]]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def checkpoint_steps(output_dir: Path, role: str) -> list[int]:
    root = output_dir / "checkpoints" / role
    return sorted(int(path.name.split("_")[-1]) for path in root.glob("global_step_*"))


def test_the_main_job_learns_the_task(tmp_path: Path) -> None:
    """The README's main job with its defaults (PPO, seed 0, 120 iterations), one thread.

    Measured over seeds 0-9 with 1 and 2 threads on both backends (benchmarks.demo_seeds,
    docs/cli.md), every run's last 10 iterations average 0.99 or more. A run on another CPU is
    another trajectory (sampling amplifies float32 rounding), a draw from the same spread, so
    the margin asserted is the task's, not this machine's figure: from a random policy's 0.5 to
    0.9, which no run measured fell short of."""
    out = tmp_path / "run"
    result = run("demo", "--device", "cpu", "--logger", "jsonl", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [record["reward"] for record in records(out)]
    assert len(rewards) == 120
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.6 < 0.9 <= last, (first, last)


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_demo_runs_ppo_and_writes_metrics_plot_and_checkpoints(
    tmp_path: Path, backend: str
) -> None:
    out = tmp_path / "run"
    config = short_config(tmp_path)
    result = run(
        "demo", "--config", config, "--steps", "3", "--output-dir", str(out), "--backend", backend
    )
    assert result.returncode == 0, result.stderr[-3000:]

    iterations = records(out)
    assert [record["iteration"] for record in iterations] == [1, 2, 3]
    for record in iterations:
        keys = ("reward", "pg_loss", "vf_loss", "kl", "entropy", "tokens_per_s", "train_s")
        for key in keys:
            assert isinstance(record[key], float) and math.isfinite(record[key]), key
        assert 0.0 <= record["reward"] <= 1.0
        phases = ("sync_s", "generate_s", "score_s", "train_s")
        assert sum(record[p] for p in phases) == pytest.approx(record["iteration_s"])
    assert (out / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    assert checkpoint_steps(out, "actor") == checkpoint_steps(out, "critic") == [2, 3]
    assert json.loads((out / "run.json").read_text())["task"]["prompts"] == 8
    assert "iter    3/3  reward" in result.stdout
    assert f"backend {backend}," in result.stdout
    assert "mean reward: first 3 iterations " in result.stdout  # the 3 it ran, not 10
    assert ", last 3 " in result.stdout
    # the last lines say where each trained model went as a Hugging Face directory, or why not
    actor, critic, _ = result.stdout.splitlines()[-3:]
    assert actor.startswith("actor (lm head) ") and critic.startswith("critic (value head) ")


def test_the_demo_ends_with_the_trained_actor_as_a_hugging_face_directory(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engine.data.test_text import tiny_chat_model

    model = tiny_chat_model(tmp_path / "qwen2")
    out = tmp_path / "run"
    config = short_config(tmp_path)
    result = run(
        "demo", "--config", config, "--steps", "1", "--model", str(model), "--output-dir",
        str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    exported = out / "huggingface" / "actor"
    assert f"actor (lm head) as a Hugging Face directory in {exported}" in result.stdout
    critic = next(line for line in result.stdout.splitlines() if line.startswith("critic "))
    exported_critic = f"critic (value head) as a Hugging Face directory in {exported.parent}"
    assert critic.startswith((exported_critic, "critic (value head) not exported"))
    trained = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert not torch.equal(trained["model.norm.weight"], initial["model.norm.weight"])
    assert AutoTokenizer.from_pretrained(exported).eos_token == "<|im_end|>"


def test_demo_grpo_trains_the_actor_without_a_critic_and_records_advantage_statistics(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    config = tmp_path / "grpo.yaml"
    config.write_text(SHORT_GROUPS)
    result = run(
        "demo", "--algorithm", "grpo", "--config", str(config), "--steps", "3",
        "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]

    assert "GRPO demo" in result.stdout and "4 prompts x 2 responses" in result.stdout
    assert "engines actor, reference," in result.stdout
    iterations = records(out)
    assert [record["iteration"] for record in iterations] == [1, 2, 3]
    for record in iterations:
        for key in ("reward", "pg_loss", "kl", *ADVANTAGE_STATS):
            assert isinstance(record[key], float) and math.isfinite(record[key]), key
        assert record["adv_min"] <= record["adv_mean"] <= record["adv_max"]
        assert "vf_loss" not in record and not any(key.startswith("critic_") for key in record)
        assert not any(key.startswith("rollout_is") for key in record)  # no correction asked
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["actor"]
    assert checkpoint_steps(out, "actor") == [2, 3]
    assert json.loads((out / "run.json").read_text())["algorithm"] == "grpo"


def test_a_moe_actor_with_router_replay_runs_grpo_and_reports_its_routers(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    config = tmp_path / "grpo.yaml"
    config.write_text(SHORT_GROUPS)
    result = run(
        "demo", "--algorithm", "grpo", "--model", "moe", "--router-replay",
        "--config", str(config), "--steps", "2", "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 experts (top-2)" in result.stdout
    saved = json.loads((out / "run.json").read_text())
    assert saved["engine"]["model"] == "moe" and saved["actor"]["router_replay"] is True
    for record in records(out):
        assert 1.0 <= record["router_load_max_over_mean"] <= 4.0


def test_a_critic_free_run_resumes_from_the_actor_alone_with_its_kl_controller(
    tmp_path: Path,
) -> None:
    kl_in_reward = (
        "ppo:\n  kl_placement: reward\n  kl_controller: adaptive\n  kl_coeff: 0.05\n"
        "  kl_target: 0.001\n  kl_horizon: 100\n"
    )
    config = tmp_path / "rloo.yaml"
    config.write_text(SHORT_GROUPS + kl_in_reward)
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    common = ("demo", "--algorithm", "rloo", "--config", str(config))
    first = run(*common, "--steps", "2", "--output-dir", str(resumed))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run("demo", "--resume", "--steps", "3", "--output-dir", str(resumed))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "RLOO demo" in second.stdout and "resumed after iteration 2" in second.stdout
    whole = run(*common, "--steps", "3", "--output-dir", str(straight))
    assert whole.returncode == 0, whole.stderr[-3000:]

    continued, reference = records(resumed), records(straight)
    coefficients = [record["kl_coeff"] for record in reference]
    assert coefficients[0] == 0.05 and len(set(coefficients)) == 3  # adapted every iteration
    for key in ("reward", "pg_loss", "kl", "kl_coeff", "rollout_kl", *ADVANTAGE_STATS):
        assert [r[key] for r in continued] == pytest.approx([r[key] for r in reference], abs=1e-6)
    assert not (resumed / "checkpoints" / "critic").exists()


def test_resume_continues_the_iterations_and_matches_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    config = short_config(tmp_path)
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    first = run("demo", "--config", config, "--steps", "2", "--output-dir", str(resumed))
    assert first.returncode == 0, first.stderr[-3000:]
    # No --config: a resumed run takes the settings saved in run.json.
    second = run("demo", "--resume", "--steps", "4", "--output-dir", str(resumed))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed after iteration 2" in second.stdout
    whole = run("demo", "--config", config, "--steps", "4", "--output-dir", str(straight))
    assert whole.returncode == 0, whole.stderr[-3000:]

    continued, reference = records(resumed), records(straight)
    assert [record["iteration"] for record in continued] == [1, 2, 3, 4]
    for key in ("reward", "pg_loss", "vf_loss", "kl"):
        assert [r[key] for r in continued] == pytest.approx([r[key] for r in reference], abs=1e-6)
    assert checkpoint_steps(resumed, "actor") == [2, 4]


def test_ctrl_c_saves_the_finished_iteration_and_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = short_config(tmp_path, "save_every: 1000\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "engine", "demo", "--config", config, "--steps", "1000"]
    process = subprocess.Popen(
        [*command, "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the demo wrote no metrics in time"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr[-3000:]
    last = records(out)[-1]["iteration"]
    assert f"interrupted after iteration {last} (saved)" in stderr
    assert checkpoint_steps(out, "actor") == checkpoint_steps(out, "critic") == [last]
    assert (out / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    assert "Traceback" not in stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2"), ()],
    ids=["tp2", "pp2", "dp2"],
)
def test_demo_runs_under_torchrun(tmp_path: Path, layout: tuple[str, ...]) -> None:
    out = tmp_path / "run"
    result = run(
        "demo", "--config", short_config(tmp_path), "--steps", "2", "--output-dir", str(out),
        *layout, launcher=TORCHRUN_TWO_RANKS,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    assert [record["iteration"] for record in records(out)] == [1, 2]
    assert checkpoint_steps(out, "critic") == [2]


@pytest.mark.parametrize(
    ("arguments", "config", "message"),
    [
        (("--steps", "0"), "", "must be a positive integer"),
        (("--seed", "-1"), "", "must be a non-negative integer"),
        (("--rollout-correction", "tokens"), "", "invalid choice: 'tokens'"),
        (("--rollout-correction-upper", "-1"), "", "RolloutCorrection.upper must be > 0"),
        (("--device", "gpu"), "", "unknown device 'gpu'"),
        (("--device", "npu"), "", "torch_npu"),
        ((), "ppo:\n  clip: 0.1\n", "clip"),
        ((), "ppo:\n  gamma: 2\n", "PPOConfig.gamma must be in [0, 1]"),
        ((), "task:\n  prompts: -3\n", "TaskConfig.prompts must be > 0"),
        ((), "engine:\n  optimizer:\n    learning_rate: 1\n", "learning_rate"),
        ((), "critic:\n  micro_batch_size: 0\n", "sections 'engine' and 'critic'"),
        ((), "stepz: 3\n", "stepz"),
        ((), "task:\n  prompt_length: 200\n  response_length: 100\n", "max_sequence_length"),
        ((), "- a list\n", "must hold a mapping"),
        ((), "loggers: console,nope\n", "DemoConfig.loggers must name one or more of"),
        ((), "loggers: []\n", "DemoConfig.loggers must name one or more of"),
    ],
)
def test_bad_arguments_and_config_files_exit_non_zero_naming_the_problem(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arguments: tuple[str, ...],
    config: str,
    message: str,
) -> None:
    args = ["demo", "--output-dir", str(tmp_path / "run"), *arguments]
    if config:
        path = tmp_path / "bad.yaml"
        path.write_text(config)
        args += ["--config", str(path)]
    try:
        status = main(args)
    except SystemExit as exit_:  # argparse
        status = int(exit_.code or 0)
    assert status != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_resume_without_a_checkpoint_and_a_fresh_run_over_an_old_one_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    (out / "checkpoints" / "actor" / "global_step_3").mkdir(parents=True)  # no manifest
    assert main(["demo", "--resume", "--device", "cpu", "--output-dir", str(out)]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert main(["demo", "--device", "cpu", "--output-dir", str(out)]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err


def test_settings_layer_defaults_then_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(
        "seed: 5\nsteps: 7\nengine:\n  micro_batch_size: 8\ncritic:\n  optimizer:\n"
        "    lr: 0.5\nreference:\n  micro_batch_size: 2\n"
    )
    config = resolve_config(str(path), {"steps": 9}, resume=False, output_dir=None)
    assert (config.seed, config.steps) == (5, 9)
    actor, critic, reference = (config.engine_config(role) for role in ROLES)
    assert actor.micro_batch_size == critic.micro_batch_size == 8
    assert reference.micro_batch_size == 2
    assert critic.optimizer.lr == 0.5
    assert actor.optimizer.lr == DemoConfig().engine_config("actor").optimizer.lr
    assert (actor.forward_only, critic.forward_only, reference.forward_only) == (
        False,
        False,
        True,
    )
    assert actor.seed == critic.seed == reference.seed == 5
    assert actor.model == critic.model == reference.model


def test_roles_must_share_the_actors_model() -> None:
    with pytest.raises(ConfigError, match="the critic's model must have the actor's shape"):
        DemoConfig(critic={"model": "small"})


def test_the_reward_is_the_share_of_answer_tokens_with_the_instructed_parity() -> None:
    prompts = torch.tensor([[9, 0], [9, 1], [4, 1]])
    responses = torch.tensor([[2, 4, 5, 7], [1, 3, 5, 7], [2, 4, 6, 8]])
    assert parity_reward(prompts, responses).tolist() == [0.5, 1.0, 0.0]
    made = make_prompts(64, 8, vocab_size=128, seed=0, iteration=3)
    assert set(made[:, -1].tolist()) == {0, 1}
    assert torch.equal(made, make_prompts(64, 8, 128, 0, 3))


@pytest.mark.parametrize(
    "model",
    [
        {"rotary_base": 500000},
        {"tie_embeddings": True, "num_query_groups": 4},
        {"num_experts": 4, "expert_ffn_hidden_size": 32},  # Mixtral: experts fused in memory
        {"num_experts": 4, "expert_ffn_hidden_size": 32, "qk_layernorm": True},  # Qwen3-MoE
    ],
    ids=["rope-base", "tied", "mixtral", "qwen3-moe"],
)
def test_the_generator_gets_the_actors_weights_and_samples_its_distribution(
    fresh_mesh: None, model: dict[str, Any]
) -> None:
    from engine import Engine

    preset = attrs.asdict(DemoConfig().engine_config("actor").model)
    config = DemoConfig(engine={"model": {**preset, **model}})
    actor = Engine.build(head="lm", device="cpu", config=config.engine_config("actor"))
    actor.initialize()
    generator = build_generator(actor.config.model, torch.device("cpu"))
    # one per checkpoint tensor: transformers may hold several (experts) in one parameter
    layout = CheckpointLayout.of(actor.config.model)
    expected = GeneratorWeights(generator, layout, "the actor").checkpoint_names
    assert push_weights(actor, generator) == len(expected)
    vocab = actor.config.model.vocab_size
    prompts = make_prompts(config.prompts, config.task.prompt_length, vocab, seed=0, iteration=1)
    responses, rollout_log_probs = sample(generator, prompts, 6, torch.Generator().manual_seed(0))
    batch = rollout_batch(prompts, responses, parity_reward(prompts, responses), rollout_log_probs)
    engine_log_probs = actor.infer_batch(batch)["log_probs"].to_padded_tensor(0.0)
    # the generator's log-probs of what it sampled are the rollout's, aligned like the engine's
    prompt_length = prompts.shape[1]
    assert bool(batch["rollout_log_probs"][:, :prompt_length].eq(0).all())
    torch.testing.assert_close(
        batch["rollout_log_probs"][:, prompt_length:],
        engine_log_probs[:, prompt_length:],
        atol=1e-5,
        rtol=1e-5,
    )
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = generator(input_ids=ids).logits.float()
    hf_log_probs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(engine_log_probs[:, 1:], hf_log_probs, atol=1e-5, rtol=1e-5)


def test_the_documented_config_file_is_a_valid_demo_config(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    example = page.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    path = tmp_path / "documented.yaml"
    path.write_text(example)
    config = resolve_config(str(path), {}, resume=False, output_dir=None)
    assert config.steps == 200
    assert config.engine_config("critic").optimizer.lr == 3.0e-3


@pytest.mark.parametrize(
    ("algorithm", "roles", "prompts", "group_size"),
    [
        ("ppo", ("actor", "critic", "reference"), 64, 1),
        ("grpo", ("actor", "reference"), 8, 8),
        ("rloo", ("actor", "reference"), 8, 8),
        ("reinforce_pp", ("actor", "reference"), 8, 8),
        ("grpo_passk", ("actor", "reference"), 16, 4),  # its own default
    ],
)
def test_the_algorithm_decides_the_roles_and_by_default_the_group_size(
    algorithm: str, roles: tuple[str, ...], prompts: int, group_size: int
) -> None:
    config = DemoConfig.from_dict({"algorithm": algorithm})
    assert config.roles == roles
    assert (config.prompts, config.group_size) == (prompts, group_size)
    assert config.estimator().needs_values == ("critic" in roles)
    chosen = DemoConfig.from_dict({"algorithm": algorithm, "task": {"group_size": 4}})
    assert (chosen.prompts, chosen.group_size) == (16, 4)


def test_an_algorithms_own_defaults_sit_under_the_config_file_and_flags(tmp_path: Path) -> None:
    """pass@k GRPO's own defaults (a higher lr, groups of 4) replace the demo's for it alone,
    and a config file or flag still wins."""
    assert DemoConfig.from_dict({"algorithm": "grpo"}).engine_config("actor").optimizer.lr == 1e-3
    passk = DemoConfig.from_dict({"algorithm": "grpo_passk"})
    assert (passk.engine_config("actor").optimizer.lr, passk.group_size) == (2e-3, 4)
    assert passk.engine_config("reference").optimizer.lr != 2e-3  # the actor's section only
    path = tmp_path / "demo.yaml"
    path.write_text("algorithm: grpo_passk\nactor:\n  optimizer:\n    lr: 5.0e-4\n")
    config = resolve_config(str(path), {"task": {"group_size": 8}}, resume=False, output_dir=None)
    assert (config.engine_config("actor").optimizer.lr, config.group_size) == (5e-4, 8)


def test_estimator_options_reach_the_estimator_and_bad_ones_are_refused() -> None:
    config = DemoConfig.from_dict(
        {"algorithm": "grpo", "ppo": {"estimator_options": {"scale_by_std": False}}}
    )
    assert config.estimator() == GRPO(scale_by_std=False)
    with pytest.raises(ConfigError, match="scale_by_sdt"):
        DemoConfig.from_dict(
            {"algorithm": "grpo", "ppo": {"estimator_options": {"scale_by_sdt": 0}}}
        )


def test_rollout_correction_flags_weight_the_actor_loss_and_report_its_metrics(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    config = tmp_path / "grpo.yaml"
    config.write_text(SHORT_GROUPS + "ppo:\n  rollout_correction:\n    upper: 3.0\n")
    result = run(
        "demo", "--algorithm", "grpo", "--config", str(config), "--steps", "2",
        "--output-dir", str(out), "--rollout-correction", "sequence",
        "--rollout-correction-mode", "mask", "--rollout-correction-lower", "0.5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((out / "run.json").read_text())["ppo"]["rollout_correction"]
    assert saved == {"level": "sequence", "mode": "mask", "upper": 3.0, "lower": 0.5}
    iterations = records(out)
    assert [record["iteration"] for record in iterations] == [1, 2]
    for record in iterations:
        # the generator holds the actor's weights in float32: the weights are 1 up to rounding
        assert record["rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["rollout_is_max"] == pytest.approx(1.0, abs=1e-4)
        assert record["rollout_is_dropped"] == record["rollout_is_seq_dropped"] == 0.0
        assert abs(record["rollout_old_kl"]) < 1e-5 and abs(record["rollout_old_k3_kl"]) < 1e-8
        assert not any(key.startswith("actor_rollout") for key in record)


def test_rollout_correction_settings_reach_the_actor_loss_and_bad_ones_are_refused() -> None:
    from engine.cli.demo.loop import _actor_loss
    from engine.losses import RolloutCorrection

    assert _actor_loss(DemoConfig().ppo).rollout_correction is None
    config = DemoConfig.from_dict(
        {"ppo": {"rollout_correction": {"level": "geometric", "mode": "mask", "upper": 1.5}}}
    )
    expected = RolloutCorrection(level="geometric", mode="mask", upper=1.5)
    assert _actor_loss(config.ppo).rollout_correction == expected
    assert "rollout_log_probs" in _actor_loss(config.ppo).required_fields
    with pytest.raises(ConfigError, match=r"RolloutCorrection\.mode must be one of"):
        DemoConfig.from_dict({"ppo": {"rollout_correction": {"mode": "clip"}}})
    with pytest.raises(ConfigError, match=r"RolloutCorrection\.lower applies to mode='mask'"):
        DemoConfig.from_dict({"ppo": {"rollout_correction": {"lower": 0.5}}})


def test_critic_free_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"task\.group_size must be >= 2, got 1"):
        DemoConfig.from_dict({"algorithm": "grpo", "task": {"group_size": 1}})
    with pytest.raises(ConfigError, match="unknown algorithm 'dpo'; known: ppo, grpo"):
        DemoConfig.from_dict({"algorithm": "dpo"})
    with pytest.raises(ConfigError, match=r"policy_loss: .*did you mean 'cispo'"):
        DemoConfig.from_dict({"ppo": {"policy_loss": "cipso"}})


def test_an_adaptive_kl_horizon_too_short_for_one_update_is_refused_up_front() -> None:
    adaptive = {"kl_placement": "reward", "kl_controller": "adaptive", "kl_horizon": 12}
    # 8 prompts x 8 responses = 64 samples per update; 0.2 x 64 >= 12
    with pytest.raises(ConfigError, match=r"ppo\.kl_horizon \(12\) must exceed 0\.2 x .*\(64\)"):
        DemoConfig.from_dict({"algorithm": "grpo", "ppo": adaptive})
    assert DemoConfig.from_dict({"algorithm": "grpo", "ppo": {**adaptive, "kl_horizon": 13}})
    # only the adaptive controller on the reward uses the horizon
    assert DemoConfig.from_dict({"algorithm": "grpo", "ppo": {**adaptive, "kl_placement": "loss"}})


def test_each_prompt_is_repeated_group_size_times_with_its_group_id() -> None:
    prompts = torch.tensor([[5, 0], [7, 1]])
    rows, group_ids = in_groups(prompts, 3)
    assert rows.tolist() == [[5, 0]] * 3 + [[7, 1]] * 3
    assert group_ids.tolist() == [0, 0, 0, 1, 1, 1]


def test_a_lora_actor_is_its_own_reference_with_the_adapters_off(
    tmp_path: Path, fresh_mesh: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``--lora-rank``: one engine; each iteration's reference log-probs are the actor's inside
    ``disable_adapter()`` (the base weights never move, so the reference stays the start)."""
    from engine import Engine

    built: list[Engine] = []
    disabled: list[int] = []
    original_init, original_disable = Engine.__init__, Engine.disable_adapter

    def counting_init(self: Engine, **kwargs: Any) -> None:
        original_init(self, **kwargs)
        built.append(self)

    def counting_disable(self: Engine) -> Any:
        disabled.append(1)
        return original_disable(self)

    monkeypatch.setattr(Engine, "__init__", counting_init)
    monkeypatch.setattr(Engine, "disable_adapter", counting_disable)
    config = tmp_path / "grpo.yaml"
    config.write_text(SHORT_GROUPS)
    out = tmp_path / "run"
    code = main([
        "demo", "--algorithm", "grpo", "--config", str(config), "--steps", "2", "--device", "cpu",
        "--output-dir", str(out), "--lora-rank", "4", "--lora-alpha", "8",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    assert "reference: the LoRA actor, adapters off" in capsys.readouterr().out
    assert len(built) == 1 and built[0].config.lora is not None
    assert (built[0].config.lora.rank, built[0].config.lora.alpha) == (4, 8.0)
    assert len(disabled) == 2  # once per iteration
    second = records(out)[1]
    assert math.isfinite(second["kl"]) and second["kl"] > 0  # the actor left its reference


def test_lora_rank_gives_ppo_a_lora_critic_too(
    tmp_path: Path, fresh_mesh: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``--lora-rank`` with PPO: the critic is a LoRA engine too (adapters and its value layer
    train); two engines, no reference engine."""
    from engine import Engine

    built: list[Engine] = []
    original_init = Engine.__init__

    def counting_init(self: Engine, **kwargs: Any) -> None:
        original_init(self, **kwargs)
        built.append(self)

    monkeypatch.setattr(Engine, "__init__", counting_init)
    out = tmp_path / "run"
    code = main([
        "demo", "--config", short_config(tmp_path), "--steps", "1", "--device", "cpu",
        "--output-dir", str(out), "--lora-rank", "4",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    assert sorted(engine.head.name for engine in built) == ["lm", "value"]
    assert all(engine.config.lora is not None for engine in built)
    assert all(engine.config.lora.rank == 4 for engine in built)  # type: ignore[union-attr]
    assert math.isfinite(records(out)[0]["vf_loss"])
    assert (
        "engines actor (LoRA rank 4), critic (LoRA rank 4) (reference:" in capsys.readouterr().out
    )


def test_lora_alpha_without_rank_and_a_reference_section_with_a_lora_actor_are_refused(
    tmp_path: Path,
) -> None:
    assert main(["demo", "--lora-alpha", "8", "--output-dir", str(tmp_path)]) == 2
    with pytest.raises(ConfigError, match="section 'reference' is unused"):
        DemoConfig.from_dict({"actor": {"lora": {"rank": 4}}, "reference": {"seed": 1}})


def critic_free_algorithms() -> list[str]:
    from engine.cli.demo.settings import algorithm_names

    return [
        name
        for name in algorithm_names()
        if not DemoConfig.from_dict({"algorithm": name}).estimator().needs_values
    ]


def test_every_critic_free_algorithm_and_every_policy_loss_runs_an_iteration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fresh_mesh: None
) -> None:
    """Each critic-free ``--algorithm`` (the demo's names and every estimator's, ReMax's greedy
    baseline and the optimal token baselines' ``sum_pi_squared`` included), each paired with a
    ``--policy-loss`` (all of them used), runs an iteration in process with finite numbers."""
    from engine.losses import POLICY_LOSSES

    algorithms = critic_free_algorithms()
    losses = POLICY_LOSSES.names()
    options = {"dro": "ppo:\n  policy_options:\n    dro_beta: 0.1\n"}
    assert {"remax", "optimal_token_baseline", "gdpo", "grpo_passk"} <= set(algorithms)
    for index in range(max(len(algorithms), len(losses))):
        algorithm, loss = algorithms[index % len(algorithms)], losses[index % len(losses)]
        config = tmp_path / f"{index}.yaml"
        config.write_text(SHORT_GROUPS + options.get(loss, ""))
        out = tmp_path / f"run{index}"
        arguments = ["--algorithm", algorithm, "--policy-loss", loss, "--steps", "1"]
        status = main(["demo", "--device", "cpu", "--config", str(config), "--output-dir", str(out),
                       "--logger", "jsonl", *arguments])  # fmt: skip
        assert status == 0, (algorithm, loss, capsys.readouterr().err[-2000:])
        (record,) = records(out)
        for key in ("reward", "pg_loss", "kl", *ADVANTAGE_STATS):
            assert math.isfinite(record[key]), (algorithm, loss, key)
        saved = json.loads((out / "run.json").read_text())
        assert (saved["algorithm"], saved["ppo"]["policy_loss"]) == (algorithm, loss)


def test_an_unknown_algorithm_or_policy_loss_is_refused_listing_the_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "run")
    assert main(["demo", "--algorithm", "grpo_pass", "--output-dir", out]) == 2
    error = capsys.readouterr().err
    assert "unknown algorithm 'grpo_pass'" in error
    assert all(name in error for name in critic_free_algorithms())
    assert main(["demo", "--policy-loss", "sappo", "--output-dir", out]) == 2
    assert "did you mean 'sapo'" in capsys.readouterr().err
    assert main(["demo", "--policy-loss", "dro", "--output-dir", out]) == 2  # dro_beta
    assert "PPOConfig.policy_options" in capsys.readouterr().err
