"""Router replay's batch field, ``routed_experts``: checked before any compute."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engine.data.batching import ROUTED_EXPERTS, jagged_values
from heads.errors import BatchError
from strategies.part_configs import ModelConfig


def check_routed_experts(batch: TensorDict, model: ModelConfig, *, replay: bool) -> None:
    """A jagged batch's ``routed_experts`` (if any) must be integer expert ids
    ``[B, tokens, num_layers, experts_per_token]`` in ``[0, num_experts)``, distinct per token,
    on an engine built with ``router_replay``; BatchError naming the field otherwise."""
    if ROUTED_EXPERTS not in batch.keys():
        return
    if not replay or model.num_experts is None:
        why = (
            "the model has no experts (ModelConfig.num_experts is None)"
            if model.num_experts is None
            else "this engine was built without EngineConfig.router_replay"
        )
        raise BatchError(f"the batch carries {ROUTED_EXPERTS!r} to replay, but {why}")
    routes = jagged_values(batch[ROUTED_EXPERTS])
    wanted = (model.num_layers, model.experts_per_token)
    if routes.dim() != 3 or tuple(routes.shape[1:]) != wanted:
        raise BatchError(
            f"field {ROUTED_EXPERTS!r} must be [B, tokens, num_layers, experts_per_token] = "
            f"[B, tokens, {wanted[0]}, {wanted[1]}] (one expert id per chosen expert, MoE layer "
            f"and token); got tokens x {list(routes.shape[1:])}"
        )
    if routes.dtype.is_floating_point or routes.dtype in (torch.bool, torch.complex64):
        raise BatchError(
            f"field {ROUTED_EXPERTS!r} must hold integer expert ids, got {routes.dtype}"
        )
    if routes.numel() == 0:
        return
    smallest, largest = (int(bound) for bound in torch.aminmax(routes))
    if smallest < 0 or largest >= model.num_experts:
        bad = smallest if smallest < 0 else largest
        raise BatchError(
            f"field {ROUTED_EXPERTS!r} holds expert id {bad}, outside [0, {model.num_experts}) "
            "(ModelConfig.num_experts)"
        )
    ordered = routes.sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise BatchError(
            f"field {ROUTED_EXPERTS!r} routes a token to the same expert twice in one layer; "
            "each token's experts must be distinct"
        )
