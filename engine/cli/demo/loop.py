"""``python -m engine demo``: RL (PPO, GRPO, RLOO, REINFORCE++) on a rule-rewarded task, on the
CPU of a laptop in minutes.

Engines from the same parts share one mesh: the actor (``lm`` head), the reference (``lm`` head,
forward-only) and, for PPO only, the critic (``value`` head). Rollouts come from a separate
generator, a plain Hugging Face causal LM that receives the actor's weights every iteration
through ``Engine.get_per_tensor_param()``, the path a rollout engine such as vLLM takes.

The task ("parity"): a prompt is ``prompt_length - 1`` random tokens and an instruction token,
``0`` ("answer with even tokens") or ``1`` ("odd tokens"); the model answers with
``response_length`` tokens; the reward, given at the last token like a reward model's score, is
the fraction of answer tokens whose parity (token id mod 2) matches the prompt's last token.
A random policy scores 0.5, and so does any policy that ignores the prompt (always even, say):
only reading the instruction scores more.

One iteration: push weights -> sample ``group_size`` responses to each prompt -> score -> old
log-probs (actor), reference log-probs, values (critic) -> advantages and returns by the
algorithm's estimator (PPO: GAE, whitened; GRPO, RLOO, REINFORCE++-baseline: from the scores of
each prompt's group), after subtracting the KL from the rewards if it is placed there -> for
each epoch and mini-batch, ``train_batch`` of the actor (:class:`~engine.losses.ActorLoss`:
policy loss + KL to the reference; with ``ppo.rollout_correction`` also importance weights
``pi_old / pi_rollout`` from the generator's log-probs of its samples, ``rollout_log_probs``) and of
the critic (:class:`~engine.losses.CriticLoss`).
Every rank samples the same global batch (same seeds) and trains on its data-parallel shard;
outputs held by output ranks are shared with all ranks, so the advantage computation is the
same everywhere.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from engine.cli.demo.parity_task import (
    build_generator,
    in_groups,
    make_prompts,
    parity_reward,
    push_weights,
    rollout_batch,
    sample,
)
from engine.cli.demo.settings import (
    CHECKPOINTS,
    HEADS,
    RUN_FILE,
    DemoConfig,
    PPOConfig,
)
from engine.cli.hf_export import HF_DIR, export_final_model
from engine.cli.loggers import DEFAULT_LOGGERS
from engine.cli.progress import Column, MetricsFile
from engine.cli.run_harness import METRICS_FILE, Checkpoints, Plot, RunHarness
from engine.data.batching import ROUTED_EXPERTS, take_rows
from engine.losses import (
    ActorLoss,
    AdvantageEstimator,
    CriticLoss,
    estimator_inputs,
    kl_controller,
    kl_penalized_rewards,
    masked_mean,
)
from engine.losses.kl_control import KLController
from heads.errors import CheckpointError, ConfigError

#: What the record keeps of each role's ``train_batch`` metrics (mean over the mini-batches).
TRAINING_METRICS = ("loss", "grad_norm", "pg_loss", "pg_clipfrac", "kl", "entropy", "vf_loss")
#: The actor loss's rollout-correction metrics (``rollout_is_mean``, ``rollout_old_kl``, ...):
#: recorded under these names when ``ppo.rollout_correction`` is set.
ROLLOUT_METRICS_PREFIX = "rollout_"
COLUMNS: list[Column] = [
    ("reward", "reward", ".3f"),
    ("pg_loss", "pg_loss", "+.4f"),
    ("vf_loss", "vf_loss", ".4f"),
    ("kl", "kl", ".4f"),
    ("entropy", "entropy", ".3f"),
    ("tokens_per_s", "tokens/s", ".0f"),
]


# -- the loop -------------------------------------------------------------------------------------
class Interrupted(Exception):
    """Raised after a requested stop was saved; carries the iteration it stopped at."""

    def __init__(self, iteration: int) -> None:
        super().__init__(iteration)
        self.iteration = iteration


def run(
    config: DemoConfig, *, resume: bool, loggers: Sequence[str] = DEFAULT_LOGGERS
) -> dict[str, Any]:
    """Train, writing each iteration's record to ``loggers``; returns the summary. Raises
    :class:`Interrupted` after a saved Ctrl-C stop."""
    out = Path(config.output_dir)
    trained = [role for role in config.roles if role != "reference"]
    roots = {role: out / CHECKPOINTS / role for role in trained}
    built = [r for r in config.roles if not (r == "reference" and config.reference_is_actor)]
    engines = _build_engines(config, built)
    done = _start(config, engines, built, roots, resume=resume)
    lead = _is_lead()
    actor = engines["actor"]
    device = actor.device or torch.device("cpu")
    generator = build_generator(actor.config.model, device)
    history = MetricsFile(out / METRICS_FILE).read()  # a resumed run's earlier iterations
    training = Training(
        estimator=config.estimator(),
        actor_loss=_actor_loss(config.ppo),
        critic_loss=_critic_loss(config.ppo) if "critic" in engines else None,
        reward_kl=_reward_kl_controller(config, history, done),
    )
    vocab = actor.config.model.vocab_size
    harness = RunHarness(
        label="iter",
        step_key="iteration",
        total=config.steps,
        columns=COLUMNS,
        loggers=loggers,
        lead=lead,
        output_dir=out,
        run_name=f"demo-{config.algorithm}",
        settings=config.to_dict(),
        plot=_plot(config.algorithm.upper()),
        done=done,
        history=history,
        checkpoints=Checkpoints(
            save=partial(_save, engines, roots, keep=config.keep_checkpoints),
            every=config.save_every,
            directory=out / CHECKPOINTS,
            device=device,
        ),
    )
    with harness:
        resumed = f"; resumed after iteration {done}" if done else ""
        harness.message(_header(config, engines, built) + resumed)
        for iteration in range(done + 1, config.steps + 1):
            record = _iteration(
                config, iteration, engines, generator, training, vocab, device, harness.started
            )
            if harness.record(record):
                break
        harness.finish()
        harness.message(harness.where())
        for role in trained if not harness.interrupted else ():  # a resumed run exports at its end
            harness.message(
                export_final_model(engines[role], out / HF_DIR / role, _role_name(role))
            )
    if harness.interrupted:
        raise Interrupted(harness.last_step)
    return summarise(history) if lead else {}


def _build_engines(config: DemoConfig, built: Sequence[str]) -> dict[str, Any]:
    """The engines of the ``built`` roles (the LoRA actor stands in for the reference)."""
    from engine import Engine

    engines = {
        role: Engine.build(
            head=HEADS[role],
            backend=config.backend,
            device=config.device,
            config=config.engine_config(role),
        )
        for role in built
    }
    if config.reference_is_actor:
        engines["reference"] = engines["actor"]
    return engines


def _start(
    config: DemoConfig,
    engines: Mapping[str, Any],
    built: Sequence[str],
    roots: Mapping[str, Path],
    *,
    resume: bool,
) -> int:
    """Check the output directory against ``resume``, initialize the engines (from the latest
    checkpoint every trained role saved, when resuming), cut the metrics back to it and write
    the run's settings; the iterations done."""
    out = Path(config.output_dir)
    metrics = MetricsFile(out / METRICS_FILE)
    if not resume and (metrics.path.exists() or (out / CHECKPOINTS).exists()):
        raise ConfigError(
            f"{out} already holds a run; pass --resume to continue it, or choose another "
            "--output-dir"
        )
    done, saved = _latest_common_checkpoint(roots) if resume else (0, {})
    if done >= config.steps:
        raise ConfigError(
            f"the run in {out} has already done {done} iterations; ask for more with --steps"
        )
    for role in built:
        engines[role].initialize()
    lead = _is_lead()
    for role, directory in saved.items():
        engines[role].load_checkpoint(directory)
    if lead and done and metrics.path.exists():
        metrics.truncate_after("iteration", done)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / RUN_FILE, config.to_dict())
    return done


def _is_lead() -> bool:
    """Whether this is the rank that writes the run's files and shows its progress."""
    return (dist.get_rank() if dist.is_initialized() else 0) == 0


def _header(config: DemoConfig, engines: Mapping[str, Any], built: Sequence[str]) -> str:
    """The run's opening line: algorithm, task, model, batch, engines, device, processes."""
    actor = engines["actor"]
    return (
        f"{config.algorithm.upper()} demo: task parity, model {_describe_model(config)}, "
        f"{config.prompts} prompts x {config.group_size} "
        f"response{'s' if config.group_size > 1 else ''} x "
        f"{config.task.response_length} tokens per iteration, engines "
        f"{', '.join(_describe_engine(role, engines[role]) for role in built)}"
        f"{' (reference: the LoRA actor, adapters off)' if config.reference_is_actor else ''}, "
        f"device {actor.platform.name}, backend {actor.backend.name}, "
        f"{dist.get_world_size() if dist.is_initialized() else 1} process(es)"
    )


@attrs.frozen(kw_only=True)
class Training:
    """What turns a scored rollout into updates: estimator, losses, KL-in-reward controller."""

    estimator: AdvantageEstimator
    actor_loss: ActorLoss
    critic_loss: CriticLoss | None
    #: The KL coefficient controller when the KL is subtracted from the rewards, else None.
    reward_kl: KLController | None


class _Phases:
    """An iteration's time per phase, each phase ending where the one before it ended."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.times: dict[str, float] = {}

    def end(self, name: str) -> float:
        """End phase ``name``; the time since the iteration began."""
        elapsed = time.perf_counter() - self.began
        self.times[name] = elapsed - sum(self.times.values())
        return elapsed


def _iteration(
    config: DemoConfig,
    iteration: int,
    engines: Mapping[str, Any],
    generator: torch.nn.Module,
    training: Training,
    vocab: int,
    device: torch.device,
    start: float,
) -> dict[str, Any]:
    phases = _Phases()
    needs = estimator_inputs(training.estimator)
    batch, scores, group_ids = _rollout(
        config, iteration, engines["actor"], generator, needs, vocab, device, phases
    )
    _infer(batch, engines, needs)
    record: dict[str, Any] = {
        "iteration": iteration,
        "reward": float(scores.mean()),
        "reward_std": float(scores.std()),
        **add_advantages(batch, training, group_ids, config.ppo.kl_type),
    }
    phases.end("score_s")
    record.update(_train(config, iteration, engines, training, batch))
    elapsed = phases.end("train_s")
    _short_names(record)
    rows = batch.batch_size[0]
    tokens = rows * (config.task.prompt_length + config.task.response_length)
    record.update(
        tokens_per_s=tokens / elapsed,
        iteration_s=elapsed,
        elapsed_s=time.perf_counter() - start,
        **phases.times,
    )
    return record


def _rollout(
    config: DemoConfig,
    iteration: int,
    actor: Any,
    generator: torch.nn.Module,
    needs: Sequence[str],
    vocab: int,
    device: torch.device,
    phases: _Phases,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Push the actor's weights to the generator, sample each prompt's group and score it: the
    batch, the scores and the group ids."""
    task = config.task
    with actor.eval_mode():
        push_weights(actor, generator)
    phases.end("sync_s")
    prompts = make_prompts(config.prompts, task.prompt_length, vocab, config.seed, iteration)
    prompts, group_ids = in_groups(prompts, config.group_size)
    prompts = prompts.to(device)
    rng = torch.Generator(device=device).manual_seed(config.seed * 1_000_003 + iteration)
    responses, rollout_log_probs = sample(generator, prompts, task.response_length, rng)
    scores = parity_reward(prompts, responses).cpu()
    batch = rollout_batch(prompts.cpu(), responses.cpu(), scores, rollout_log_probs.cpu())
    if "reward_baselines" in needs:  # ReMax: each prompt's greedy response, scored
        greedy, _ = sample(generator, prompts, task.response_length, rng, greedy=True)
        batch["reward_baselines"] = parity_reward(prompts, greedy).cpu()
    phases.end("generate_s")
    return batch, scores, group_ids


def _infer(batch: Any, engines: Mapping[str, Any], needs: Sequence[str]) -> None:
    """The actor's old log-probs (and what the estimator or router replay keeps of its pass),
    the reference's log-probs and the critic's values, into ``batch``."""
    actor, reference, critic = engines["actor"], engines["reference"], engines.get("critic")
    shard = _shard(batch, actor.get_data_parallel_rank(), actor.get_data_parallel_size())
    with actor.eval_mode():
        old = actor.infer_batch(shard)
        batch["old_log_probs"] = _gather_outputs(actor, old, "log_probs")
        if "sum_pi_squared" in needs:  # the optimal token baselines' path variance
            batch["sum_pi_squared"] = _gather_outputs(actor, old, "sum_pi_squared")
        if actor.config.router_replay:  # the updates route each token as this pass did
            batch[ROUTED_EXPERTS] = _gather_outputs(actor, old, ROUTED_EXPERTS, torch.long)
    without_adapter = reference.disable_adapter() if reference is actor else nullcontext()
    with reference.eval_mode(), without_adapter:
        batch["ref_log_probs"] = _gather_outputs(
            reference, reference.infer_batch(shard), "log_probs"
        )
    if critic is not None:
        with critic.eval_mode():
            batch["values"] = _gather_outputs(critic, critic.infer_batch(shard), "values")


def _train(
    config: DemoConfig,
    iteration: int,
    engines: Mapping[str, Any],
    training: Training,
    batch: Any,
) -> dict[str, float]:
    """Each epoch's mini-batches through the actor's (and the critic's) ``train_batch``; each
    recorded metric's mean over them, named by role."""
    actor, critic = engines["actor"], engines.get("critic")
    dp_rank, dp_size = actor.get_data_parallel_rank(), actor.get_data_parallel_size()
    ppo = config.ppo
    trained: dict[str, list[float]] = {}
    order_rng = torch.Generator().manual_seed(config.seed * 7919 + iteration)
    rows = batch.batch_size[0]
    for _ in range(ppo.epochs):
        order = torch.randperm(rows, generator=order_rng)
        for part in order.chunk(ppo.mini_batches):
            mini = _shard(take_rows(batch, part), dp_rank, dp_size)
            with actor.train_mode():
                _collect(trained, "actor_", actor.train_batch(mini, training.actor_loss))
            if critic is not None:
                with critic.train_mode():
                    values_batch = mini.exclude(ROUTED_EXPERTS)  # the actor's routes
                    _collect(
                        trained, "critic_", critic.train_batch(values_batch, training.critic_loss)
                    )
    return {name: sum(values) / len(values) for name, values in trained.items()}


def _short_names(record: dict[str, Any]) -> None:
    """The record's names for the actor's rollout-correction and main metrics, moved last."""
    for name in [name for name in record if name.startswith("actor_" + ROLLOUT_METRICS_PREFIX)]:
        record[name.removeprefix("actor_")] = record.pop(name)  # rollout_is_mean, ...
    for short, name in (
        ("pg_loss", "actor_pg_loss"),
        ("vf_loss", "critic_vf_loss"),
        ("kl", "actor_kl"),
        ("entropy", "actor_entropy"),
        ("router_load_max_over_mean", "actor_router_load_max_over_mean"),
    ):
        if name in record:
            record[short] = record.pop(name)


def add_advantages(
    batch: Any, training: Training, group_ids: torch.Tensor, kl_type: str
) -> dict[str, float]:
    """``advantages`` and ``returns`` by the estimator, from the token rewards less the KL when
    it is placed in the reward; returns the metrics: advantage statistics over the response
    tokens, and the KL coefficient and rollout KL when the KL is in the reward."""
    mask = batch["response_mask"]
    rewards = batch["token_rewards"]
    metrics: dict[str, float] = {}
    controller = training.reward_kl
    if controller is not None:
        rewards, kl = kl_penalized_rewards(
            rewards, batch["old_log_probs"], batch["ref_log_probs"], mask, controller.value, kl_type
        )
        rollout_kl = float((kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean())
        metrics.update(kl_coeff=controller.value, rollout_kl=rollout_kl)
        controller.update(rollout_kl, n_steps=len(rewards))
    values = batch["values"] if "values" in batch.keys() else None
    inputs = {name: batch[name] for name in estimator_inputs(training.estimator)}
    advantages, returns = training.estimator(
        rewards, mask, values=values, group_ids=group_ids, **inputs
    )
    batch["advantages"], batch["returns"] = advantages, returns
    chosen = advantages[mask.bool()]
    metrics.update(
        adv_mean=float(masked_mean(advantages, mask)),
        adv_std=float(chosen.std()) if chosen.numel() > 1 else 0.0,
        adv_max=float(chosen.max()) if chosen.numel() else 0.0,
        adv_min=float(chosen.min()) if chosen.numel() else 0.0,
    )
    return metrics


def _actor_loss(ppo: PPOConfig) -> ActorLoss:
    return ActorLoss(
        policy_loss=ppo.policy_loss,
        policy_options=ppo.policy_options,
        clip_ratio_low=ppo.clip_ratio,
        clip_ratio_high=ppo.clip_ratio,
        kl_coeff=ppo.kl_coeff if ppo.kl_placement == "loss" else 0.0,
        kl_type=ppo.kl_type,
        entropy_coeff=ppo.entropy_coeff,
        mask_key="response_mask",
        rollout_correction=ppo.rollout_correction,
    )


def _critic_loss(ppo: PPOConfig) -> CriticLoss:
    return CriticLoss(cliprange_value=ppo.value_clip, mask_key="response_mask")


def _reward_kl_controller(
    config: DemoConfig, records: list[dict[str, Any]], done: int
) -> KLController | None:
    """The KL-in-reward controller, as it was after iteration ``done`` of a resumed run (its
    record holds the coefficient it used and the KL it saw: the update is replayed)."""
    ppo = config.ppo
    if ppo.kl_placement != "reward":
        return None
    last = next((r for r in records if r.get("iteration") == done and "kl_coeff" in r), None)
    if done and last is None:
        raise CheckpointError(
            f"cannot resume the KL controller: metrics.jsonl has no KL record of iteration {done}"
        )
    coeff = last["kl_coeff"] if done and last else ppo.kl_coeff
    controller = kl_controller(
        ppo.kl_controller, coeff, target=ppo.kl_target, horizon=ppo.kl_horizon
    )
    if done and last:
        controller.update(last["rollout_kl"], n_steps=config.prompts * config.group_size)
    return controller


def _shard(batch: Any, rank: int, size: int) -> Any:
    rows = batch.batch_size[0]
    if rows % size:
        raise ConfigError(
            f"{rows} sequences do not split evenly over {size} data-parallel ranks; make "
            "task.prompts x task.group_size a multiple of ppo.mini_batches x the data-parallel "
            "size"
        )
    share = rows // size
    return take_rows(batch, slice(rank * share, (rank + 1) * share))


def _gather_outputs(
    engine: Any, outputs: Any, key: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The global batch's ``key`` output ``[B, T, ...]`` on every rank, from the output ranks."""
    local = None
    if outputs is not None:
        local = outputs[key].to_padded_tensor(0).to(dtype).cpu()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        assert local is not None
        return local
    everyone: list[Any] = [None] * dist.get_world_size()
    entry = (engine.get_data_parallel_rank(), local) if local is not None else None
    dist.all_gather_object(everyone, entry)
    shards = dict(item for item in everyone if item is not None)
    return torch.cat([shards[index] for index in sorted(shards)], dim=0)


def _collect(into: dict[str, list[float]], prefix: str, values: Mapping[str, float]) -> None:
    rollout = [name for name in values if name.startswith(ROLLOUT_METRICS_PREFIX)]
    for name in (*TRAINING_METRICS, *rollout):
        if name in values:
            into.setdefault(prefix + name, []).append(float(values[name]))
    loads = [float(v) for k, v in values.items() if k.endswith("/load_max_over_mean")]
    if loads:  # a mixture of experts: its layers' mean load balance
        into.setdefault(prefix + "router_load_max_over_mean", []).append(sum(loads) / len(loads))


def _save(engines: Mapping[str, Any], roots: Mapping[str, Path], iteration: int, keep: int) -> None:
    for role, root in roots.items():
        engines[role].save_checkpoint(root, global_step=iteration, max_ckpt_to_keep=keep)


def _latest_common_checkpoint(roots: Mapping[str, Path]) -> tuple[int, dict[str, str]]:
    """The newest iteration that every role saved, and each role's directory for it."""
    from engine.checkpointing.retention import complete_checkpoints

    found = {role: dict(complete_checkpoints(os.fspath(root))) for role, root in roots.items()}
    common = sorted(set.intersection(*(set(steps) for steps in found.values())))
    if not common:
        raise CheckpointError(
            f"nothing to resume: no iteration saved by every trained role "
            f"({', '.join(roots)}) under {roots['actor'].parent}"
        )
    return common[-1], {role: steps[common[-1]] for role, steps in found.items()}


def _plot(title: str) -> Plot:
    return Plot(
        panels=[
            ("reward (mean per iteration)", ["reward"]),
            ("losses", ["pg_loss", "vf_loss"]),
            ("advantages over response tokens", ["adv_mean", "adv_max", "adv_min"]),
            ("KL to the reference", ["kl"]),
        ],
        title=f"{title} demo (parity task)",
    )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(staging, path)


def _describe_engine(role: str, engine: Any) -> str:
    """The role, and its adapters' rank where it has LoRA."""
    lora = engine.config.lora
    return role if lora is None else f"{role} (LoRA rank {lora.rank})"


def _role_name(role: str) -> str:
    """The role and its head, as the closing message names a model."""
    return f"{role} ({HEADS[role]} head)"


def _describe_model(config: DemoConfig) -> str:
    model = config.engine_config("actor").model
    shape = f"{model.num_layers} layers x {model.hidden_size} hidden, vocab {model.vocab_size}"
    if model.num_experts is not None:
        shape += f", {model.num_experts} experts (top-{model.experts_per_token})"
    return shape


def summarise(records: list[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """Mean reward of the first and last ``window`` iterations (fewer in a shorter run: the
    ``window`` it reports)."""
    rewards = [record["reward"] for record in records]
    if not rewards:
        return {"iterations": 0}
    window = min(window, len(rewards))
    first, last = rewards[:window], rewards[-window:]
    return {
        "iterations": len(rewards),
        "window": window,
        "first_reward": sum(first) / len(first),
        "last_reward": sum(last) / len(last),
    }
