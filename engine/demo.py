"""``python -m engine demo``: PPO on a rule-rewarded task, on the CPU of a laptop in minutes.

Three engines from the same parts share one mesh: the actor (``lm`` head), the critic
(``value`` head) and the reference (``lm`` head, forward-only). Rollouts come from a separate
generator, a plain Hugging Face causal LM that receives the actor's weights every iteration
through ``Engine.get_per_tensor_param()``, the path a rollout engine such as vLLM takes.

The task ("parity"): a prompt is ``prompt_length - 1`` random tokens and an instruction token,
``0`` ("answer with even tokens") or ``1`` ("odd tokens"); the model answers with
``response_length`` tokens; the reward, given at the last token like a reward model's score, is
the fraction of answer tokens whose parity (token id mod 2) matches the prompt's last token.
A random policy scores 0.5, and so does any policy that ignores the prompt (always even, say):
only reading the instruction scores more.

One iteration: push weights -> sample -> score -> old log-probs (actor), reference log-probs,
values (critic) -> GAE advantages (whitened) and returns -> for each epoch and mini-batch,
``train_batch`` of the actor (:class:`~engine.losses.ActorLoss`: clipped policy loss + KL to
the reference) and of the critic (:class:`~engine.losses.CriticLoss`). Every rank samples the
same global batch (same seeds) and trains on its data-parallel shard; outputs held by output
ranks are shared with all ranks, so the advantage computation is the same everywhere.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine.config import EngineConfig, structure
from engine.progress import Column, MetricsFile, ProgressReporter, plot_metrics
from engine.rl import gae_advantages, whiten
from heads.errors import CheckpointError, ConfigError, EngineStateError
from heads.validation import float_field, int_field, non_negative, of_type, one_of, positive

ROLES = ("actor", "critic", "reference")
HEADS = {"actor": "lm", "critic": "value", "reference": "lm"}

#: Engine settings of every role unless the config file says otherwise.
ENGINE_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "micro_batch_size": 64,
    "scheduler": {"decay_style": "constant"},
}
ROLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "actor": {"optimizer": {"lr": 1e-3}, "head": {"compute_entropy": True}},
    "critic": {"optimizer": {"lr": 3e-3}},
    "reference": {},
}

RUN_FILE, METRICS_FILE, PLOT_FILE, CHECKPOINTS = (
    "run.json",
    "metrics.jsonl",
    "metrics.png",
    "checkpoints",
)

COLUMNS: list[Column] = [
    ("reward", "reward", ".3f"),
    ("pg_loss", "pg_loss", "+.4f"),
    ("vf_loss", "vf_loss", ".4f"),
    ("kl", "kl", ".4f"),
    ("entropy", "entropy", ".3f"),
    ("tokens_per_s", "tokens/s", ".0f"),
]


@attrs.frozen(kw_only=True)
class TaskConfig:
    """The rollout batch: ``prompts`` sequences of ``prompt_length + response_length`` tokens."""

    prompts: int = int_field(64)
    prompt_length: int = int_field(8)
    response_length: int = int_field(8)


@attrs.frozen(kw_only=True)
class PPOConfig:
    epochs: int = int_field(2)
    mini_batches: int = int_field(2)
    gamma: float = float_field(1.0)
    lam: float = float_field(0.95)
    clip_ratio: float = float_field(0.2, positive)
    value_clip: float = float_field(0.5, positive)
    kl_coeff: float = float_field(0.01)
    kl_type: str = attrs.field(default="low_var_kl", validator=one_of("k1", "k2", "low_var_kl"))
    entropy_coeff: float = float_field(0.0)

    def __attrs_post_init__(self) -> None:
        for name in ("gamma", "lam"):
            if getattr(self, name) > 1:
                raise ConfigError(f"PPOConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.clip_ratio >= 1:
            raise ConfigError(f"PPOConfig.clip_ratio must be < 1, got {self.clip_ratio}")


@attrs.frozen(kw_only=True)
class DemoConfig:
    """Everything ``demo`` runs with; a YAML file gives any of it, command-line flags win.

    ``engine`` holds ``EngineConfig`` settings for all three roles; ``actor``, ``critic`` and
    ``reference`` override them per role (``reference`` is always forward-only).
    """

    steps: int = int_field(120)
    seed: int = int_field(0, non_negative)
    device: str = attrs.field(default="auto", validator=of_type(str))
    backend: str = attrs.field(default="megatron", validator=of_type(str))
    output_dir: str = attrs.field(default="demo-output", validator=of_type(str))
    save_every: int = int_field(25)
    keep_checkpoints: int = int_field(2)
    task: TaskConfig = attrs.field(factory=TaskConfig)
    ppo: PPOConfig = attrs.field(factory=PPOConfig)
    engine: dict[str, Any] = attrs.field(factory=dict)
    actor: dict[str, Any] = attrs.field(factory=dict)
    critic: dict[str, Any] = attrs.field(factory=dict)
    reference: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        configs = {role: self.engine_config(role) for role in ROLES}
        model = configs["actor"].model
        if model.max_sequence_length < self.task.prompt_length + self.task.response_length:
            raise ConfigError(
                f"task.prompt_length + task.response_length "
                f"({self.task.prompt_length + self.task.response_length}) exceeds the model's "
                f"max_sequence_length ({model.max_sequence_length})"
            )
        for role in ("critic", "reference"):
            if _shape(configs[role].model) != _shape(model):
                raise ConfigError(
                    f"the {role}'s model must have the actor's shape (the demo starts all three "
                    f"from the same weights); section {role!r} changes it"
                )

    def engine_config(self, role: str) -> EngineConfig:
        """The role's ``EngineConfig``: defaults <- ``engine`` <- the role's section."""
        data = _merge(ENGINE_DEFAULTS, {"seed": self.seed}, ROLE_DEFAULTS[role])
        data = _merge(data, self.engine, getattr(self, role))
        data["total_steps"] = self.steps * self.ppo.epochs * self.ppo.mini_batches
        if role == "reference":
            data["forward_only"] = True
        try:
            return EngineConfig.from_dict(data)
        except ConfigError as error:
            raise ConfigError(
                f"engine settings of the {role} (config sections 'engine' and {role!r}): {error}"
            ) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DemoConfig:
        config: DemoConfig = structure(dict(data), cls)
        return config

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _shape(model: Any) -> tuple[Any, ...]:
    fields = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "hf_path")
    return tuple(getattr(model, name) for name in fields)


def _merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge mappings, later layers winning (nested mappings merge key by key)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
                merged[key] = _merge(merged[key], value)
            else:
                merged[key] = dict(value) if isinstance(value, Mapping) else value
    return merged


def resolve_config(
    file: str | None, overrides: Mapping[str, Any], resume: bool, output_dir: str | None
) -> DemoConfig:
    """Defaults <- the run's saved settings (``--resume``) <- the config file <- flags."""
    import yaml

    layers: list[Mapping[str, Any]] = []
    if resume:
        saved = Path(output_dir or DemoConfig().output_dir) / RUN_FILE
        if saved.exists():
            layers.append(json.loads(saved.read_text()))
    if file:
        try:
            data = yaml.safe_load(Path(file).read_text()) or {}
        except OSError as error:
            raise ConfigError(f"cannot read config file {file}: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {file} is not valid YAML: {error}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {file} must hold a mapping, got {type(data).__name__}")
        layers.append(data)
    layers.append(overrides)
    return DemoConfig.from_dict(_merge(*layers))


# -- the task -------------------------------------------------------------------------------------
def make_prompts(task: TaskConfig, vocab_size: int, seed: int, iteration: int) -> torch.Tensor:
    """The iteration's prompts, each ending in an instruction token 0 or 1 (the same on every
    rank and on a resumed run)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    prompts = torch.randint(0, vocab_size, (task.prompts, task.prompt_length), generator=generator)
    prompts[:, -1] %= 2
    return prompts


def parity_reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Per sequence: the fraction of response tokens with the parity of the prompt's last token."""
    return (responses % 2 == prompts[:, -1:] % 2).float().mean(dim=1)


# -- the generator (rollout engine) ---------------------------------------------------------------
def build_generator(model: Any, device: torch.device) -> torch.nn.Module:
    """A Hugging Face causal LM with the engine model's architecture (weights come later)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if model.hf_path is not None:
        hf_config = AutoConfig.from_pretrained(model.hf_path)
    else:
        if model.add_qkv_bias or model.qk_layernorm or model.rope_scaling_factor:
            raise ConfigError(
                "the demo's generator builds a plain Llama from the model settings; for qkv "
                "bias, qk-norm or RoPE scaling give model.hf_path (a checkpoint directory)"
            )
        hf_config = LlamaConfig(
            vocab_size=model.vocab_size,
            hidden_size=model.hidden_size,
            intermediate_size=model.resolved_ffn_hidden_size,
            num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            head_dim=model.head_dim or model.hidden_size // model.num_attention_heads,
            max_position_embeddings=model.max_sequence_length,
            rms_norm_eps=model.norm_epsilon,
            tie_word_embeddings=model.tie_embeddings,
            attention_bias=False,
            **_rope_settings(LlamaConfig, float(model.rotary_base)),
        )
    generator = AutoModelForCausalLM.from_config(hf_config)
    return generator.to(device=device, dtype=torch.float32).eval()


def _rope_settings(config_class: type, base: float) -> dict[str, Any]:
    # transformers 5 takes ``rope_parameters``; 4.x took ``rope_theta``.
    if "rope_parameters" in inspect.signature(config_class).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": base}}
    return {"rope_theta": base}


def push_weights(actor: Any, generator: torch.nn.Module) -> int:
    """Copy the actor's weights into the generator, tensor by tensor; returns how many.

    Every rank holds a full generator: under model parallelism the ranks' tensors (each pipeline
    stage yields its own layers) are exchanged first.
    """
    params = dict(generator.named_parameters())
    pairs: Iterator[tuple[str, torch.Tensor]] = actor.get_per_tensor_param()
    if dist.is_initialized() and dist.get_world_size() > 1:
        local = [(name, tensor.cpu()) for name, tensor in pairs]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        pairs = iter(dict(pair for rank in everyone for pair in rank).items())
    received = set()
    with torch.no_grad():
        for name, tensor in pairs:
            if name not in params:
                raise EngineStateError(f"the actor exported {name!r}, which the generator lacks")
            params[name].copy_(tensor)
            received.add(name)
    missing = sorted(set(params) - received)
    if missing:
        raise EngineStateError(f"the actor exported no weights for {', '.join(missing[:5])}")
    return len(received)


@torch.no_grad()
def sample(
    generator: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, rng: torch.Generator
) -> torch.Tensor:
    """Sample ``new_tokens`` per prompt at temperature 1 (the actor's distribution)."""
    # transformers 5 calls the KV cache ``cache``; 4.x called it ``past_key_values``.
    cache = (
        "cache" if "cache" in inspect.signature(generator.forward).parameters else "past_key_values"
    )
    output = generator(input_ids=prompts, use_cache=True)
    chosen = []
    for index in range(new_tokens):
        probs = torch.softmax(output.logits[:, -1].float(), dim=-1)
        token = torch.multinomial(probs, 1, generator=rng)
        chosen.append(token)
        if index + 1 < new_tokens:
            output = generator(input_ids=token, use_cache=True, **{cache: output[cache]})
    return torch.cat(chosen, dim=1)


# -- the loop -------------------------------------------------------------------------------------
class StopRequest:
    """First Ctrl-C (or SIGTERM): finish the iteration, save, exit. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (so all ranks stop at the same iteration)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


class Interrupted(Exception):
    """Raised after a requested stop was saved; carries the iteration it stopped at."""

    def __init__(self, iteration: int) -> None:
        super().__init__(iteration)
        self.iteration = iteration


def run(config: DemoConfig, *, resume: bool) -> dict[str, Any]:
    """Train; returns the summary. Raises :class:`Interrupted` after a saved Ctrl-C stop."""
    from engine import Engine

    out = Path(config.output_dir)
    metrics = MetricsFile(out / METRICS_FILE)
    roots = {role: out / CHECKPOINTS / role for role in ("actor", "critic")}
    engines = {
        role: Engine.build(
            head=HEADS[role],
            backend=config.backend,
            device=config.device,
            config=config.engine_config(role),
        )
        for role in ROLES
    }
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
    for engine in engines.values():
        engine.initialize()
    actor = engines["actor"]
    lead = (dist.get_rank() if dist.is_initialized() else 0) == 0
    for role, directory in saved.items():
        engines[role].load_checkpoint(directory)
    if lead and done and metrics.path.exists():
        metrics.truncate_after("iteration", done)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / RUN_FILE, config.to_dict())
    device = actor.device or torch.device("cpu")
    generator = build_generator(actor.config.model, device)
    losses = _losses(config.ppo)
    vocab = actor.config.model.vocab_size
    start = time.perf_counter()
    last_saved = done
    header = (
        f"PPO demo: task parity, model {_describe_model(config)}, {config.task.prompts} prompts "
        f"x {config.task.response_length} tokens per iteration, device "
        f"{actor.platform.name}, backend {actor.backend.name}, "
        f"{dist.get_world_size() if dist.is_initialized() else 1} process(es)"
    )
    with (
        ProgressReporter(
            label="iter", total=config.steps, columns=COLUMNS, start=done, enabled=lead
        ) as progress,
        StopRequest() as stop,
    ):
        progress.message(header + (f"; resumed after iteration {done}" if done else ""))
        iteration = done
        try:
            for iteration in range(done + 1, config.steps + 1):
                record = _iteration(
                    config, iteration, engines, generator, losses, vocab, device, start
                )
                if lead:
                    metrics.append(record)
                progress.update(iteration, record)
                stopping = stop.agreed(device)
                if stopping or iteration % config.save_every == 0 or iteration == config.steps:
                    _save(engines, roots, iteration, config.keep_checkpoints)
                    last_saved = iteration
                if stopping:
                    break
        finally:
            metrics.close()
            if lead:
                _plot(metrics, out / PLOT_FILE)
        progress.message(
            f"checkpoint of iteration {last_saved} in {out / CHECKPOINTS}; metrics in "
            f"{metrics.path}; plot in {out / PLOT_FILE}"
        )
    if stop.requested and iteration < config.steps:
        raise Interrupted(iteration)
    return summarise(metrics.read()) if lead else {}


def _iteration(
    config: DemoConfig,
    iteration: int,
    engines: Mapping[str, Any],
    generator: torch.nn.Module,
    losses: tuple[Any, Any],
    vocab: int,
    device: torch.device,
    start: float,
) -> dict[str, Any]:
    actor, critic, reference = (engines[role] for role in ROLES)
    task, ppo = config.task, config.ppo
    began = time.perf_counter()
    phases: dict[str, float] = {}
    with actor.eval_mode():
        push_weights(actor, generator)
    phases["sync_s"] = time.perf_counter() - began
    prompts = make_prompts(task, vocab, config.seed, iteration).to(device)
    rng = torch.Generator(device=device).manual_seed(config.seed * 1_000_003 + iteration)
    responses = sample(generator, prompts, task.response_length, rng)
    scores = parity_reward(prompts, responses).cpu()
    batch = rollout_batch(prompts.cpu(), responses.cpu(), scores)
    phases["generate_s"] = time.perf_counter() - began - sum(phases.values())

    dp_rank, dp_size = actor.get_data_parallel_rank(), actor.get_data_parallel_size()
    shard = _shard(batch, dp_rank, dp_size)
    with actor.eval_mode():
        batch["old_log_probs"] = _gather_outputs(actor, actor.infer_batch(shard), "log_probs")
    with reference.eval_mode():
        batch["ref_log_probs"] = _gather_outputs(
            reference, reference.infer_batch(shard), "log_probs"
        )
    with critic.eval_mode():
        batch["values"] = _gather_outputs(critic, critic.infer_batch(shard), "values")
    add_advantages(batch, ppo)
    batch["advantages"] = whiten(batch["advantages"], batch["response_mask"])
    phases["score_s"] = time.perf_counter() - began - sum(phases.values())
    actor_loss, critic_loss = losses
    trained: dict[str, list[float]] = {}
    order_rng = torch.Generator().manual_seed(config.seed * 7919 + iteration)
    for _ in range(ppo.epochs):
        order = torch.randperm(task.prompts, generator=order_rng)
        for part in order.chunk(ppo.mini_batches):
            mini = _shard(batch[part], dp_rank, dp_size)
            with actor.train_mode():
                _collect(trained, "actor_", actor.train_batch(mini, actor_loss))
            with critic.train_mode():
                _collect(trained, "critic_", critic.train_batch(mini, critic_loss))
    elapsed = time.perf_counter() - began
    phases["train_s"] = elapsed - sum(phases.values())
    record: dict[str, Any] = {
        "iteration": iteration,
        "reward": float(scores.mean()),
        "reward_std": float(scores.std()),
    }
    record.update({name: sum(values) / len(values) for name, values in trained.items()})
    for short, name in (
        ("pg_loss", "actor_pg_loss"),
        ("vf_loss", "critic_vf_loss"),
        ("kl", "actor_kl"),
        ("entropy", "actor_entropy"),
    ):
        if name in record:
            record[short] = record.pop(name)
    tokens = task.prompts * (task.prompt_length + task.response_length)
    record.update(
        tokens_per_s=tokens / elapsed,
        iteration_s=elapsed,
        elapsed_s=time.perf_counter() - start,
        **phases,
    )
    return record


def rollout_batch(prompts: torch.Tensor, responses: torch.Tensor, scores: torch.Tensor) -> Any:
    """Padded ``[B, P + R]`` batch; the score is the reward of each sequence's last token."""
    input_ids = torch.cat([prompts, responses], dim=1)
    response_mask = torch.zeros_like(input_ids, dtype=torch.float32)
    response_mask[:, prompts.shape[1] :] = 1.0
    rewards = torch.zeros_like(response_mask)
    rewards[:, -1] = scores
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "response_mask": response_mask,
            "token_rewards": rewards,
        },
        batch_size=[input_ids.shape[0]],
    )


def add_advantages(batch: Any, ppo: PPOConfig) -> None:
    """``advantages`` and ``returns`` by GAE over the response tokens."""
    advantages, returns = gae_advantages(
        batch["token_rewards"],
        batch["values"],
        batch["response_mask"],
        gamma=ppo.gamma,
        lam=ppo.lam,
    )
    batch["advantages"], batch["returns"] = advantages, returns


def _losses(ppo: PPOConfig) -> tuple[Any, Any]:
    from engine.losses import ActorLoss, CriticLoss

    actor = ActorLoss(
        clip_ratio_low=ppo.clip_ratio,
        clip_ratio_high=ppo.clip_ratio,
        kl_coeff=ppo.kl_coeff,
        kl_type=ppo.kl_type,
        entropy_coeff=ppo.entropy_coeff,
        mask_key="response_mask",
    )
    return actor, CriticLoss(cliprange_value=ppo.value_clip, mask_key="response_mask")


def _shard(batch: Any, rank: int, size: int) -> Any:
    rows = batch.batch_size[0]
    if rows % size:
        raise ConfigError(
            f"{rows} sequences do not split evenly over {size} data-parallel ranks; make "
            "task.prompts a multiple of ppo.mini_batches x the data-parallel size"
        )
    share = rows // size
    return batch[rank * share : (rank + 1) * share]


def _gather_outputs(engine: Any, outputs: Any, key: str) -> torch.Tensor:
    """The global batch's ``key`` output ``[B, T]`` on every rank, from the output ranks."""
    local = None
    if outputs is not None:
        local = outputs[key].to_padded_tensor(0.0).float().cpu()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        assert local is not None
        return local
    everyone: list[Any] = [None] * dist.get_world_size()
    entry = (engine.get_data_parallel_rank(), local) if local is not None else None
    dist.all_gather_object(everyone, entry)
    shards = dict(item for item in everyone if item is not None)
    return torch.cat([shards[index] for index in sorted(shards)], dim=0)


def _collect(into: dict[str, list[float]], prefix: str, values: Mapping[str, float]) -> None:
    for name in ("loss", "grad_norm", "pg_loss", "pg_clipfrac", "kl", "entropy", "vf_loss"):
        if name in values:
            into.setdefault(prefix + name, []).append(float(values[name]))


def _save(engines: Mapping[str, Any], roots: Mapping[str, Path], iteration: int, keep: int) -> None:
    for role, root in roots.items():
        engines[role].save_checkpoint(root, global_step=iteration, max_ckpt_to_keep=keep)


def _latest_common_checkpoint(roots: Mapping[str, Path]) -> tuple[int, dict[str, str]]:
    """The newest iteration that every role saved, and each role's directory for it."""
    from engine.checkpointing import complete_checkpoints

    found = {role: dict(complete_checkpoints(os.fspath(root))) for role, root in roots.items()}
    common = sorted(set.intersection(*(set(steps) for steps in found.values())))
    if not common:
        raise CheckpointError(
            f"nothing to resume: no iteration saved by both actor and critic under "
            f"{roots['actor'].parent}"
        )
    return common[-1], {role: steps[common[-1]] for role, steps in found.items()}


def _plot(metrics: MetricsFile, path: Path) -> None:
    records = metrics.read()
    if records:
        plot_metrics(
            records,
            path,
            x="iteration",
            panels=[
                ("reward (mean per iteration)", ["reward"]),
                ("losses", ["pg_loss", "vf_loss"]),
                ("KL to the reference", ["kl"]),
            ],
            title="PPO demo (parity task)",
        )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(staging, path)


def _describe_model(config: DemoConfig) -> str:
    model = config.engine_config("actor").model
    return f"{model.num_layers} layers x {model.hidden_size} hidden, vocab {model.vocab_size}"


def summarise(records: list[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """Mean reward of the first and last ``window`` iterations."""
    rewards = [record["reward"] for record in records]
    if not rewards:
        return {"iterations": 0}
    first, last = rewards[:window], rewards[-window:]
    return {
        "iterations": len(rewards),
        "first_reward": sum(first) / len(first),
        "last_reward": sum(last) / len(last),
    }
