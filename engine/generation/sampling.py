"""The sampling loop: left-padded rows through a Hugging Face causal LM with a KV cache, one
token per row per forward, each with the log-probability it was drawn with."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch

from engine.generation.routes import RouteRecorder


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model`` takes and returns its KV cache: transformers 5's
    ``cache``, or ``past_key_values`` for a model of an older release (the one place the two
    are told apart)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def keeps_last_logits(model: torch.nn.Module) -> bool:
    """Whether ``model`` can compute the logits of the last position only
    (``logits_to_keep``): a prompt's other positions would cost the output layer once each."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@attrs.frozen
class Warp:
    """The logits a token is drawn from, as vLLM shapes them: divided by the temperature (0: as
    they are, for the most likely token), then top-k, then top-p."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.temperature > 0 and self.temperature != 1:
            logits = logits / self.temperature
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(logits, dim=-1, descending=True)
            mass = ordered.softmax(-1).cumsum(-1)
            # drop a token once the mass before it reaches top_p (the first token always stays)
            drop = (mass - ordered.softmax(-1)) >= self.top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return logits


class TokenPicker(Protocol):
    """How each row's next token ``[B]`` is chosen from the warped logits and their log-probs
    ``[B, V]``."""

    def __call__(self, logits: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor: ...


@attrs.frozen
class Multinomial:
    """A draw from the probabilities, the batch's rows from one random stream (the demo's)."""

    rng: torch.Generator

    def __call__(self, logits: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(log_probs.exp(), 1, generator=self.rng)[:, 0]


@attrs.frozen
class GumbelMax:
    """A draw from softmax(logits) as argmax(logits + Gumbel noise), each row's noise from its
    own stream, drawn in row order (rows may share one stream: verl's)."""

    streams: Sequence[torch.Generator]

    def __call__(self, logits: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        noise = torch.empty(logits.shape, dtype=torch.float32)
        start = 0
        # consecutive rows of one stream in one call: the same numbers as a call per row
        for _, run in itertools.groupby(self.streams, key=id):
            rows = list(run)
            block = noise[start : start + len(rows)]
            torch.rand(block.shape, generator=rows[0], out=block)
            start += len(rows)
        # -log(-log(u)), in place (a vocabulary-wide temporary less per operation)
        gumbel = noise.clamp_(min=1e-20).log_().neg_().log_().neg_()
        return gumbel.add_(logits).argmax(-1)


@attrs.frozen
class MostLikely:
    """The most likely token: the argmax of the logits, or of their log-probs (the demo's; the
    two differ only where log_softmax's rounding ties two logits a few ulps apart)."""

    of_log_probs: bool = False

    def __call__(self, logits: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        return (log_probs if self.of_log_probs else logits).argmax(-1)


@attrs.frozen
class Generation:
    """A batch's generated tokens ``[B, S]`` and their log-probs ``[B, S]`` (``S`` forwards
    were run); a row's tokens are its first ``lengths[row]``, up to and with its stop token."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    lengths: torch.Tensor
    #: Each row's routes (:meth:`RouteRecorder.rows`), when they were recorded.
    routes: list[torch.Tensor] | None = None
    #: Stopped by the caller (``stop_early``) before every row had finished.
    aborted: bool = False


def left_padded(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as ``input_ids`` ``[B, longest]`` padded on the left with
    ``pad``, and the ``attention_mask`` (0 on the padding)."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_tokens: int,
    pick: TokenPicker,
    warp: Warp = Warp(),
    attention_mask: torch.Tensor | None = None,
    stop_ids: Sequence[int] = (),
    routes: RouteRecorder | None = None,
    stop_early: Callable[[], bool] | None = None,
) -> Generation:
    """Up to ``max_tokens`` tokens for each row of ``input_ids`` (left-padded where
    ``attention_mask`` is given; without one, rows of one length and no mask or positions
    passed). A row stops after one of ``stop_ids``; the loop, once every row has stopped, or
    before a step where ``stop_early()`` is true (an abort: what was generated is returned,
    possibly nothing, with ``aborted`` set)."""
    cache = cache_argument(model)
    last_logits = {"logits_to_keep": 1} if keeps_last_logits(model) else {}
    rows, device = input_ids.shape[0], input_ids.device
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    tokens: list[torch.Tensor] = []
    log_probs: list[torch.Tensor] = []
    mask, step_ids, past = attention_mask, input_ids, None
    if routes is not None:
        prompts = [input_ids.shape[1]] * rows if mask is None else mask.sum(-1).tolist()
        routes.start(prompts)
    # each row's positions: from 0 at its first prompt token, then one more per step
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    aborted = False
    for step in range(max_tokens):
        if stop_early is not None and stop_early():
            aborted = True
            break
        output = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{cache: past},
            **last_logits,
        )
        past = output[cache]
        if routes is not None:
            routes.keep(step_ids.shape[1], first=step == 0, finished=finished.tolist())
        logits = warp(output.logits[:, -1])
        step_log_probs = logits.log_softmax(-1)
        token = pick(logits, step_log_probs)
        tokens.append(token)
        log_probs.append(step_log_probs.gather(-1, token[:, None])[:, 0])
        lengths += ~finished
        if len(stop):
            finished |= torch.isin(token, stop)
            if bool(finished.all()):
                break
        if step + 1 == max_tokens:
            break
        step_ids = token[:, None]
        if mask is not None and positions is not None:
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
    if not tokens:  # aborted before the first step
        nothing = torch.zeros((rows, 0), dtype=torch.long, device=device)
        return Generation(nothing, nothing.float(), lengths, None, aborted)
    return Generation(
        tokens=torch.stack(tokens, dim=1),
        log_probs=torch.stack(log_probs, dim=1),
        lengths=lengths,
        routes=None if routes is None else routes.rows(lengths.tolist()),
        aborted=aborted,
    )
