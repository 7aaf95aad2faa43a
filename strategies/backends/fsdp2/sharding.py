"""The data-parallel device mesh and ``fully_shard``: each decoder layer its own FSDP unit, the
rest (embedding, final norm, output layer) the root's.

Gradients are *summed* over data-parallel ranks, as megatron sums them: losses are normalised by
global counts by the loss function (``engine.losses.contract``), so FSDP's default averaging
would divide them a second time. Only sum reductions are used (gloo has no pre-multiplied sum).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from strategies.backends.fsdp2.model import CausalModel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Meshes by (device type, replicate size, world size): engines of one process share them, so a
#: hybrid (replicate x shard) mesh's process groups are created once.
_MESHES: dict[tuple[str, int, int], DeviceMesh] = {}
SHARD, REPLICATE = "shard", "replicate"


def device_mesh(device_type: str, replicate_size: int) -> DeviceMesh:
    """All ranks: 1-D (``shard``) for FSDP, or ``replicate x shard`` for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    key = (device_type, replicate_size, world)
    if key not in _MESHES:
        if replicate_size == 1:
            _MESHES[key] = init_device_mesh(device_type, (world,), mesh_dim_names=(SHARD,))
        else:
            _MESHES[key] = init_device_mesh(
                device_type,
                (replicate_size, world // replicate_size),
                mesh_dim_names=(REPLICATE, SHARD),
            )
    return _MESHES[key]


def shard_model(
    model: CausalModel, mesh: DeviceMesh, dtype: str, *, reshard_after_forward: bool
) -> None:
    """``fully_shard`` each decoder layer, then the root; gradients summed over ranks."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.decoder_layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mixed_precision(dtype, root=False),
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision(dtype, root=True))
    for unit in fsdp_modules(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def mixed_precision(dtype: str, *, root: bool) -> Any:
    """float32: none. bfloat16: bf16 compute and all-gathers, float32 gradient reduction and
    sharded (master) parameters; the root returns float32 outputs, as megatron does."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype != "bfloat16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if root else None,
    )


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    """The model's FSDP units (the root and each decoder layer)."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def drop_unreduced_gradients(model: torch.nn.Module) -> None:
    """Forget gradients accumulated without a reduce-scatter (micro-batches before the last).

    After a step that failed midway they would otherwise be added to the next step's. FSDP2
    has no public call for it; this clears the two places ``FSDPParam`` keeps them.
    """
    for unit in fsdp_modules(model):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
