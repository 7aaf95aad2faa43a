"""The demo's rollouts: the parity task's prompts and reward, and the shared Hugging Face
generator (:mod:`engine.generation`) receiving the actor's weights through
``Engine.get_per_tensor_param()``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine.generation.sampling import MostLikely, Multinomial, generate
from engine.generation.weights import GeneratorWeights, build_model
from engine.losses.rollout_correction import ROLLOUT_LOG_PROBS
from heads.errors import EngineStateError
from strategies.hf.experts import CheckpointLayout


# -- the task -------------------------------------------------------------------------------------
def make_prompts(
    count: int, length: int, vocab_size: int, seed: int, iteration: int
) -> torch.Tensor:
    """The iteration's ``count`` prompts, each ending in an instruction token 0 or 1 (the same on
    every rank and on a resumed run)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    prompts = torch.randint(0, vocab_size, (count, length), generator=generator)
    prompts[:, -1] %= 2
    return prompts


def in_groups(prompts: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt ``group_size`` times in a row, and each row's group id (its prompt's index)."""
    ids = torch.arange(prompts.shape[0]).repeat_interleave(group_size)
    return prompts.repeat_interleave(group_size, dim=0), ids


def parity_reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Per sequence: the fraction of response tokens with the parity of the prompt's last token."""
    return (responses % 2 == prompts[:, -1:] % 2).float().mean(dim=1)


# -- the generator (rollout engine) ---------------------------------------------------------------
def build_generator(model: Any, device: torch.device) -> torch.nn.Module:
    """A Hugging Face causal LM with the engine model's architecture (weights come later)."""
    from strategies.hf.architecture import hf_config_for

    return build_model(hf_config_for(model), device)


def push_weights(actor: Any, generator: torch.nn.Module) -> int:
    """Copy the actor's weights into the generator, tensor by tensor; returns how many.

    Every rank holds a full generator: under model parallelism the ranks' tensors (each pipeline
    stage yields its own layers) are exchanged first.
    """
    weights = GeneratorWeights(generator, CheckpointLayout.of(actor.config.model), "the actor")
    pairs: Iterator[tuple[str, torch.Tensor]] = actor.get_per_tensor_param()
    if dist.is_initialized() and dist.get_world_size() > 1:
        local = [(name, tensor.cpu()) for name, tensor in pairs]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        pairs = iter(dict(pair for rank in everyone for pair in rank).items())
    sent = set()
    for name, tensor in pairs:
        weights.copy(name, tensor)
        sent.add(name)
    missing = weights.end_sync()
    if missing:
        raise EngineStateError(f"the actor exported no weights for {', '.join(missing[:5])}")
    return len(sent)


def sample(
    generator: torch.nn.Module,
    prompts: torch.Tensor,
    new_tokens: int,
    rng: torch.Generator,
    *,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``new_tokens`` per prompt at temperature 1 (the actor's distribution), or the most
    likely token each time (``greedy``: ReMax's baseline response); returns the tokens
    ``[B, new_tokens]`` and the generator's log-probs of them (what a rollout engine reports,
    for rollout correction)."""
    pick = MostLikely(of_log_probs=True) if greedy else Multinomial(rng)
    generation = generate(generator, prompts, max_tokens=new_tokens, pick=pick)
    return generation.tokens, generation.log_probs


def rollout_batch(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    scores: torch.Tensor,
    response_log_probs: torch.Tensor | None = None,
) -> Any:
    """Padded ``[B, P + R]`` batch; the score is the reward of each sequence's last token. With
    the generator's ``response_log_probs`` ``[B, R]``, also ``rollout_log_probs`` (0 on the
    prompt), aligned like the engine's log-probs."""
    input_ids = torch.cat([prompts, responses], dim=1)
    response_mask = torch.zeros_like(input_ids, dtype=torch.float32)
    response_mask[:, prompts.shape[1] :] = 1.0
    rewards = torch.zeros_like(response_mask)
    rewards[:, -1] = scores
    fields = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "response_mask": response_mask,
        "token_rewards": rewards,
    }
    if response_log_probs is not None:
        rollout = torch.zeros_like(response_mask)
        rollout[:, prompts.shape[1] :] = response_log_probs
        fields[ROLLOUT_LOG_PROBS] = rollout
    return TensorDict(fields, batch_size=[input_ids.shape[0]])
