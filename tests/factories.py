"""Small batches, model configs and loss functions the tests share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from engine.data.batching import from_token_lists
from engine.engine import Engine
from engine.losses.aggregation import scored_mask, token_mean
from engine.losses.contract import SEQUENCES, LossContext


def random_batch(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> TensorDict:
    """Jagged batch with random tokens, ``returns`` and a ``loss_mask`` that skips token 0."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]
    returns = [torch.rand(n, generator=generator).tolist() for n in lengths]
    masks = [[0.0] + [1.0] * (n - 1) for n in lengths]
    return from_token_lists(tokens, returns=returns, loss_mask=masks)


def raise_outputs_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """Minus the global mean of the summed outputs (token mean for per-token outputs, sequence
    mean for per-sequence ones): any head can lower it with a small enough step (it is linear
    in the outputs), so training must reduce it."""
    mask, key = scored_mask(batch)
    per_token = [output.float() for output in outputs.values() if output.dim() == 2]
    per_sequence = [output.float() for output in outputs.values() if output.dim() == 1]
    loss = torch.zeros(())
    if per_token:
        loss = loss - token_mean(torch.stack(per_token).sum(0), mask, ctx.global_count(key))
    for scores in per_sequence:
        loss = loss - scores.sum() / ctx.global_count(SEQUENCES)
    return loss, {"raise_outputs": float(loss.detach())}


def tiny_model(**overrides: Any) -> dict[str, Any]:
    model = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 64,
        "max_sequence_length": 64,
    }
    model.update(overrides)
    return model


def snapshot(engine: Engine) -> list[torch.Tensor]:
    """Every parameter, every optimizer state tensor (Adam moments, step counts) and the LR."""
    tensors = [p.detach().clone() for m in engine.backend.modules() for p in m.parameters()]
    optimizer: Any = getattr(engine.backend, "_optimizer", None)
    for inner in optimizer.chained_optimizers if optimizer is not None else []:
        for state in inner.optimizer.state.values():
            tensors += [torch.as_tensor(state[key]).clone() for key in sorted(state)]
    if optimizer is not None:
        tensors.append(torch.tensor(engine.backend.current_lr()))
    return tensors


def unchanged(before: list[torch.Tensor], engine: Engine) -> bool:
    """``engine`` holds what ``snapshot`` took, bit for bit (a NaN learning rate equals itself)."""
    after = snapshot(engine)
    if len(before) != len(after):
        return False
    pairs = zip(before, after, strict=True)
    return all(torch.equal(a, b) or bool((a.isnan() & b.isnan()).all()) for a, b in pairs)


#: One rank's copy of a parameter: (tensor, tensor-parallel?, partition_dim, partition_stride).
Shard = tuple[torch.Tensor, bool, int, int]


def join_shards(by_name: Mapping[str, Mapping[int, Shard]]) -> dict[str, torch.Tensor]:
    """Full tensors from each parameter's shards by tensor-parallel rank."""
    from strategies.backends.megatron.weight_init import unshard

    full = {}
    for name, shards in by_name.items():
        tensor, parallel, dim, stride = shards[min(shards)]
        if parallel and len(shards) > 1:
            tensor = unshard([shards[r][0] for r in sorted(shards)], dim, stride)
        full[name] = tensor
    return full
