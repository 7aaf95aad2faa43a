"""The process-global megatron mesh (``parallel_state``), shared by every engine of a process.

Actor, critic and reference engines in one process share one mesh; an engine asking for a
different layout gets a ConfigError instead of silently running on the existing one.
"""

from __future__ import annotations

import torch.distributed as dist

from heads.errors import ConfigError
from strategies.part_configs import ParallelConfig

_LAYOUT_FIELDS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "virtual_pipeline_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
)


def _layout(parallel: ParallelConfig) -> dict[str, int | None]:
    return {name: getattr(parallel, name) for name in _LAYOUT_FIELDS}


def _current_layout() -> dict[str, int | None]:
    from megatron.core import parallel_state as ps

    return {
        "tensor_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_parallel_size": ps.get_expert_model_parallel_world_size(),
    }


def init_mesh(parallel: ParallelConfig) -> None:
    """Initialise ``parallel_state`` with ``parallel``'s layout, or check the existing one."""
    from megatron.core import parallel_state as ps

    wanted = _layout(parallel)
    if ps.model_parallel_is_initialized():
        current = _current_layout()
        if current != wanted:
            differing = ", ".join(
                f"{name}={wanted[name]} (mesh has {current[name]})"
                for name in _LAYOUT_FIELDS
                if wanted[name] != current[name]
            )
            raise ConfigError(
                f"this process's megatron mesh is already initialised with another layout; this "
                f"engine asks for {differing}. Engines of one process share one mesh: give them "
                "the same parallel config"
            )
        return
    check_world_size(parallel, dist.get_world_size())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_parallel_size,
    )


def check_world_size(parallel: ParallelConfig, world_size: int) -> None:
    """The model-parallel sizes must tile the world; the error names the numbers."""
    model_parallel = parallel.model_parallel_size
    if world_size % model_parallel:
        raise ConfigError(
            f"tensor ({parallel.tensor_parallel_size}) x pipeline "
            f"({parallel.pipeline_parallel_size}) x context ({parallel.context_parallel_size}) "
            f"parallel size = {model_parallel} must divide the world size {world_size}"
        )


def destroy_mesh() -> None:
    """Tear the mesh down (tests, and processes that re-layout between phases), its process
    groups included: megatron forgets most of them without destroying them, and each gloo
    group keeps its threads and sockets for the life of the process."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return
    groups = _megatron_groups(ps)
    ps.destroy_model_parallel()
    alive = dist.distributed_c10d._world.pg_map
    for group in groups:
        if group in alive and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _megatron_groups(module: object) -> list[dist.ProcessGroup]:
    """The process groups ``parallel_state`` holds in its globals (alone or in lists)."""
    found: dict[int, dist.ProcessGroup] = {}
    for value in vars(module).values():
        candidates = value if isinstance(value, (list, tuple)) else [value]
        for candidate in candidates:
            if isinstance(candidate, dist.ProcessGroup):
                found[id(candidate)] = candidate
    return list(found.values())
