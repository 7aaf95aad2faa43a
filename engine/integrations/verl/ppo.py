"""verl's RL trainer (``verl.trainer.main_ppo``) on this engine where verl's own entry point
cannot start (CPU hosts).

    python -m engine.integrations.verl.ppo <the overrides of python -m verl.trainer.main_ppo>

It takes verl's hydra config ``ppo_trainer`` and does what ``main_ppo.main`` does (validate the
config, start Ray, run verl's ``TaskRunnerV1`` unmodified). On a host without an accelerator
it first sets what the command line leaves unset of :data:`CPU_DEFAULTS` (the ``composable_hf``
rollout, one helper process per role, one rollout replica for all trainer processes), and
gets past three places where verl blocks a CPU run:

- Ray is told the trainer's process count as ``num_gpus`` unless the overrides say otherwise
  (``ray_kwargs.ray_init.num_gpus``): verl's resource-pool check counts Ray's ``GPU`` /
  ``NPU`` resources even where its platform places workers by ``CPU``
  (verl/single_controller/ray/base.py:223, ``_check_resource_available``). Nothing runs on a
  GPU: workers ask Ray for CPUs (the plug-in's platform).
- Ray gets logical CPUs enough for verl's workers (``ray_kwargs.ray_init.num_cpus``, default
  :data:`RAY_CPUS`): verl's reward-loop and agent-loop workers each take one, and with fewer
  than they need the trainer waits forever without a word.
- Each Ray worker process names the CPU's process-group backend once: verl's workers ask torch
  for ``"cpu:gloo,cpu:gloo"`` (verl/workers/engine_workers.py:89 ->
  verl/utils/distributed.py:144), which torch refuses (a device type named twice). Ray's
  ``worker_process_setup_hook`` (:func:`setup_worker`) gives that call the backend string
  with each device type once, as :mod:`engine.integrations.verl.sft` does for SFT.

On a host with an accelerator nothing is changed: the overrides go to verl as they are.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import hydra

from engine.integrations.verl.cells import AGENT_LOOP, CHECKPOINT_ENGINE, ROLLOUT
from heads.errors import ConfigError

#: Ray's logical CPUs when the overrides do not say (scheduling slots, not cores).
RAY_CPUS = 32


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: verl's process-group initialisation in this worker
    process gets a backend string that names each device type once."""
    import sys

    import verl.utils.distributed as distributed

    from engine.integrations.verl.platform import process_group_backend

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_names_each_device_once", False):
        return

    @functools.wraps(original)
    def initialize(timeout_second: Any = None, backend: str | None = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or process_group_backend())

    initialize._names_each_device_once = True  # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize
    workers = sys.modules.get("verl.workers.engine_workers")
    if workers is not None:
        workers.initialize_global_process_group_ray = initialize  # type: ignore[attr-defined]


#: verl's settings the launcher sets on a CPU host when the command line leaves them unset:
#: the rollout (vLLM cannot run), verl's single-turn agent loop with requests named by their
#: sample (reproducible under ``full_determinism`` whatever the batch,
#: :mod:`engine.integrations.verl.agent_loop`) and one process per helper role (verl's defaults
#: start 8 agent-loop, 8 reward and 8 storage processes, each importing torch: minutes of a
#: small host's CPU before the first step).
CPU_DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref.rollout.name": ROLLOUT,
    "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_LOOP,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.agent.num_workers": 1,
    "reward.num_workers": 1,
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
}


def _given(overrides: list[str]) -> set[str]:
    """The keys the command line sets (``key=value``, ``+key=value``, ``++key=value``)."""
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


def prepare(config: Any, overrides: list[str] | None = None) -> None:
    """The CPU settings above, where the host has no accelerator and the command line
    (``overrides``) leaves them unset."""
    from omegaconf import OmegaConf, open_dict

    from engine.integrations.verl.platform import accelerator_present

    if accelerator_present():
        return
    given = _given(overrides or [])
    trainer = config.trainer
    processes = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    with open_dict(config):
        for key, value in CPU_DEFAULTS.items():
            if key not in given:
                OmegaConf.update(config, key, value, force_add=True)
        rollout = config.actor_rollout_ref.rollout
        if "actor_rollout_ref.rollout.data_parallel_size" not in given:
            # one replica serves every trainer process (the rollout cannot split over them)
            rollout.data_parallel_size = processes
        if "trainer.device" not in given:
            trainer.device = "cpu"
        apart = 0  # processes of rollout replicas apart from the trainer (separate_async)
        if trainer_mode(config) == "separate_async":
            for key, value in (
                ("checkpoint_engine.backend", CHECKPOINT_ENGINE),
                ("nnodes", 1),
                ("n_gpus_per_node", int(rollout.data_parallel_size)),  # one replica
            ):
                if f"actor_rollout_ref.rollout.{key}" not in given:
                    OmegaConf.update(rollout, key, value)
            apart = int(rollout.nnodes) * int(rollout.n_gpus_per_node)
            actor = config.actor_rollout_ref.actor
            if actor.strategy == "fsdp" and "actor_rollout_ref.actor.strategy" not in given:
                # the engine serves both with FSDP2; verl keeps the old policy with the helpers
                # of the strategy it is told (FSDP1's fail on FSDP2's parameters)
                actor.strategy = "fsdp2"
        ray_init = config.ray_kwargs.setdefault("ray_init", {})
        if ray_init.get("address") is None:  # Ray's resources are set where it starts
            if ray_init.get("num_gpus") is None:
                ray_init["num_gpus"] = processes + apart
            if ray_init.get("num_cpus") is None:
                ray_init["num_cpus"] = RAY_CPUS
        runtime_env = ray_init.setdefault("runtime_env", {})
        runtime_env.setdefault(
            "worker_process_setup_hook", "engine.integrations.verl.ppo.setup_worker"
        )


def console_metrics(output: str) -> dict[int, dict[str, float]]:
    """The numeric metrics of each iteration in the output of verl's console logger
    (``step:N - key:value - ...``, numpy scalars as ``np.int64(1)`` too), by iteration."""
    import re

    steps: dict[int, dict[str, float]] = {}
    for step, line in re.findall(r"step:(\d+) - (.*)", output):
        metrics = {}
        for item in line.split(" - "):
            key, _, value = item.partition(":")
            # numpy scalars print as their repr under numpy 2 (np.float64(1.0))
            value = re.sub(r"^\s*np\.\w+\((.*)\)\s*$", r"\1", value)
            with contextlib.suppress(ValueError):
                metrics[key.strip()] = float(value)
        steps[int(step)] = metrics
    return steps


def check(config: Any) -> None:
    """Refuse before Ray starts what a worker would refuse minutes later: rollout settings the
    ``composable_hf`` generator cannot honour, local models of a family the engine does not
    read (actor, critic), each by name, a checkpoint engine this host cannot run, a trainer
    mode it cannot run, and a
    custom reward function verl cannot load (its file or function missing, or the file failing
    to import), as verl's reward workers load it."""
    from pathlib import Path

    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import need_critic

    from strategies.hf.config_json import model_config_from_hf

    rollout = config.actor_rollout_ref.rollout
    if rollout.name == ROLLOUT:
        from engine.integrations.verl.rollout import check_settings

        check_settings(rollout)
    check_checkpoint_engine(rollout)
    check_trainer_mode(config)
    paths = {"actor_rollout_ref.model.path": config.actor_rollout_ref.model.path}
    if need_critic(config):
        paths["critic.model.path"] = config.critic.model.path
    for key, path in paths.items():
        if path and Path(str(path)).expanduser().is_dir():
            try:
                model_config_from_hf(Path(str(path)).expanduser())
            except ConfigError as error:
                raise ConfigError(f"{key}={path}: {error}") from error
    try:
        get_custom_reward_fn(config)
    except (OSError, RuntimeError, AttributeError, ImportError, SyntaxError) as error:
        settings = config.reward.get("custom_reward_function") or {}
        raise ConfigError(
            f"reward.custom_reward_function (path={settings.get('path')}, name="
            f"{settings.get('name')}): verl cannot load it: {error}"
        ) from error


def check_checkpoint_engine(rollout: Any) -> None:
    """``rollout.checkpoint_engine.backend`` must be one this host registers (verl registers
    each backend whose transport imports: on a host without an accelerator only ``naive``, and
    the plug-in ``composable_gloo``), and the ``composable_hf`` generator takes weights through
    ``naive`` (verl's in-process sync) or ``composable_gloo``."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    settings = rollout.checkpoint_engine
    backend = settings.backend
    key = "actor_rollout_ref.rollout.checkpoint_engine.backend"
    import_external_libs(settings.get("custom_backend_module") or None)
    try:
        CheckpointEngineRegistry.get(backend)
    except ValueError as error:
        raise ConfigError(f"{key}={backend}: this host cannot run it: {error}") from error
    if rollout.name == ROLLOUT and backend not in ("naive", CHECKPOINT_ENGINE):
        raise ConfigError(
            f"{key}={backend}: the {ROLLOUT} generator takes weights through verl's in-process "
            f"'naive' sync, or from a trainer apart through {CHECKPOINT_ENGINE!r}"
        )
    if backend == CHECKPOINT_ENGINE:
        check_gloo_engine_kwargs(rollout)


def check_gloo_engine_kwargs(rollout: Any) -> None:
    """``checkpoint_engine.engine_kwargs.composable_gloo``: the settings the gloo checkpoint
    engine takes, and its ``delta`` only towards the ``composable_hf`` generator (which applies
    its patches)."""
    from engine.integrations.verl.checkpoint_engine import GlooCheckpointEngine

    key = f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{CHECKPOINT_ENGINE}"
    settings = dict(
        (rollout.checkpoint_engine.get("engine_kwargs") or {}).get(CHECKPOINT_ENGINE) or {}
    )
    unknown = sorted(set(settings) - set(GlooCheckpointEngine.SETTINGS))
    if unknown:
        raise ConfigError(
            f"{key}: unknown {unknown}; it takes {', '.join(GlooCheckpointEngine.SETTINGS)}"
        )
    delta = settings.get("delta", False)
    if not isinstance(delta, bool):
        raise ConfigError(f"{key}.delta={delta!r}: true or false")
    if delta and rollout.name != ROLLOUT:
        raise ConfigError(
            f"{key}.delta=True: only the {ROLLOUT} generator applies its patches; "
            f"rollout.name={rollout.name} takes whole tensors (or verl's delta_sharded)"
        )


#: verl's v1 trainer modes (``trainer.v1.trainer_mode``).
TRAINER_MODES = ("sync", "colocate_async", "separate_async")


def trainer_mode(config: Any) -> str | None:
    """verl's ``trainer.v1.trainer_mode`` (None where the config runs verl's classic trainer,
    ``trainer.use_v1=False``)."""
    trainer = config.trainer
    if not trainer.get("use_v1", True):
        return None
    return str((trainer.get("v1") or {}).get("trainer_mode", "sync"))


def check_trainer_mode(config: Any) -> None:
    """``trainer.v1.trainer_mode`` must be one of verl's; ``separate_async`` (trainer and
    rollout on separate resources) sends weights through a checkpoint engine other than
    ``naive``, which verl asserts only once its workers started (on a CPU host the launcher
    picks ``composable_gloo`` unless the command line names one)."""
    mode = trainer_mode(config)
    key = "trainer.v1.trainer_mode"
    if mode is not None and mode not in TRAINER_MODES:
        raise ConfigError(f"{key}={mode}: verl's modes are {', '.join(TRAINER_MODES)}")
    if mode != "separate_async":
        return
    from engine.integrations.verl.platform import accelerator_present

    backend = config.actor_rollout_ref.rollout.checkpoint_engine.backend
    strategy = config.actor_rollout_ref.actor.get("strategy")
    ours = not accelerator_present()  # the plug-in serves every strategy (verl has no CPU engine)
    if strategy == "fsdp" and ours:
        raise ConfigError(
            f"{key}=separate_async: verl keeps the old policy with FSDP1's helpers for "
            "actor_rollout_ref.actor.strategy=fsdp, and this engine serves 'fsdp' with FSDP2; "
            "use actor_rollout_ref.actor.strategy=fsdp2 (the launcher's default here)"
        )
    bypass = ((config.get("algorithm") or {}).get("rollout_correction") or {}).get("bypass_mode")
    if strategy == "megatron" and not bypass and ours:
        raise ConfigError(
            f"{key}=separate_async: with actor_rollout_ref.actor.strategy=megatron verl "
            "keeps the old policy with copy_megatron_model_to_cpu, which pins host memory "
            "(pin_memory needs an accelerator); on this host use the fsdp2 strategy, or "
            "algorithm.rollout_correction.bypass_mode=True (the rollout's log-probs as the "
            "old policy's: nothing is kept)"
        )
    if backend == "naive":
        raise ConfigError(
            f"{key}=separate_async: verl sends the weights to rollout replicas apart from the "
            "trainer through a checkpoint engine other than 'naive' "
            "(actor_rollout_ref.rollout.checkpoint_engine.backend): "
            f"{CHECKPOINT_ENGINE} on a host without an accelerator"
        )


def run(config: Any, overrides: list[str] | None = None) -> None:
    """What verl's ``main_ppo.main`` does, after :func:`prepare` and :func:`check`."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    prepare(config, overrides)
    check(config)
    auto_set_device(config)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=need_critic(config),
    )
    run_ppo(config, task_runner_class=TaskRunnerV1)


@hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
def main(config: Any) -> None:
    from hydra.core.hydra_config import HydraConfig

    run(config, list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
