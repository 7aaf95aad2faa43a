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
    model: CausalModel,
    mesh: DeviceMesh,
    dtype: str,
    *,
    weights_dtype: str = "float32",
    reshard_after_forward: bool,
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` each decoder layer, then the root; gradients summed over ranks.

    ``cpu_offload``: FSDP2's ``CPUOffloadPolicy``, the sharded weights, their gradients and the
    optimizer step in host memory, each unit's weights copied to the device for its compute
    (from pinned memory where the device is not the host)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = (
        CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    )
    for layer in model.decoder_layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mixed_precision(dtype, weights_dtype, root=False),
            reshard_after_forward=reshard_after_forward,
            offload_policy=offload,
        )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mixed_precision(dtype, weights_dtype, root=True),
        offload_policy=offload,
    )
    for unit in fsdp_modules(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def mixed_precision(dtype: str, weights_dtype: str = "float32", *, root: bool) -> Any:
    """Compute (``dtype``) and weights both float32: none. Otherwise compute and all-gathers in
    ``dtype``, gradients reduced in float32 (then kept in the weights' dtype), and the root
    returns float32 outputs, as megatron does. bfloat16 compute on float32 weights is mixed
    precision with float32 master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == weights_dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, dtype),
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if root else None,
    )


def on_mesh_device(tensor: Any) -> Any:
    """A DTensor whose shard is on its mesh's device type, for a collective on it: under
    ``cpu_offload`` shards (and gradients) live in host memory, which an accelerator's
    collectives cannot read. The tensor itself where its shard is there already."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local()
    mesh = tensor.device_mesh
    if local.device.type == mesh.device_type:
        return tensor
    return DTensor.from_local(
        local.to(mesh.device_type),
        mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
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
