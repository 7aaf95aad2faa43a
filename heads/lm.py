"""Language-model head: token log-probabilities (and entropy, sum of squared probabilities) from
vocabulary logits."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import ClassVar

import attrs
import torch

from heads.base import (
    PER_TOKEN,
    Granularity,
    HeadContext,
    LossOf,
    OutputSpec,
    next_tokens,
    shift_to_scored_token,
)
from heads.errors import ConfigError
from heads.kernels.fused_output import (
    fused_log_probs_and_entropy,
    fused_log_probs_with_gradient,
    fused_sum_pi_squared,
)
from heads.kernels.vocab_parallel import log_probs_and_entropy, sum_pi_squared
from heads.validation import bool_field, float_field, int_field, non_negative, positive

FUSED_MIN_LOGITS = 1 << 21
"""``LMHead.fused_min_logits``'s default: micro-batches with fewer logits compute them whole."""


@attrs.frozen(kw_only=True)
class LMHead:
    """Actor / reference head: ``log_probs[t] = log p(x_t | x_<t)`` at ``temperature``.

    ``temperature`` is a finite number > 0 (the sampler's; greedy decoding has no log-probs to
    match). Under tensor parallelism the results are computed vocab-parallel; the full
    vocabulary is never gathered. ``fused`` (the default): the backend hands over the final hidden
    states and the output weight, and the output layer runs fused with the head's math in token
    chunks (``heads.kernels.fused_output``), so the ``[tokens, vocab]`` logits never exist; the
    results equal the unfused path's up to float rounding. A micro-batch with fewer than
    ``fused_min_logits`` logits (tokens x this rank's vocabulary rows; default ``2**21``, 8 MiB
    in float32) computes them whole from the same hidden states and weight instead: logits that
    small take no more memory than one of the fused path's work tiles, and computing them whole
    saves the loop's fourth matmul and its many small operations (0 always fuses).

    ``gradient_in_forward`` (the default): when training with a token-separable loss
    (``engine.losses.token_separable``: PPO's, CISPO's, the KL and entropy terms, SFT), the
    fused path computes the loss's gradients w.r.t. the hidden states and the output weight in
    its forward pass, chunk by chunk while each chunk's logits exist
    (``heads.kernels.fused_output.fused_log_probs_with_gradient``), so the backward recomputes
    nothing: three matmuls, as the unfused layer, instead of four. Other losses (GSPO's sequence
    ratio, a custom loss that does not declare itself separable) take the recomputing path.

    ``compute_sum_pi_squared``: also ``sum_pi_squared[t] = sum_v p(v | x_<t) ** 2`` at
    ``temperature``, what verl's optimal-token-baseline advantage estimators read. It has no
    gradient, and the other results and their gradients are the same bit for bit with it on:
    it is computed apart from them (on the fused paths, one more pass over the tiles).
    """

    name: ClassVar[str] = "lm"

    temperature: float = float_field(1.0, positive)
    compute_entropy: bool = bool_field(False)
    compute_sum_pi_squared: bool = bool_field(False)
    fused: bool = bool_field(True)
    fused_min_logits: int = int_field(FUSED_MIN_LOGITS, non_negative)
    gradient_in_forward: bool = bool_field(True)

    @property
    def outputs(self) -> dict[str, Granularity]:
        keys = ["log_probs"]
        if self.compute_entropy:
            keys.append("entropy")
        if self.compute_sum_pi_squared:
            keys.append("sum_pi_squared")
        return dict.fromkeys(keys, PER_TOKEN)

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="vocab", allow_tied_embeddings=True, fused=self.fused)

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        ctx = attrs.evolve(ctx, output_weight=None)  # raw is the logits
        return self.place(self.per_position(raw, next_tokens(input_ids), ctx), ctx)

    def postprocess_hidden(
        self, hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        ctx = attrs.evolve(ctx, output_weight=weight)
        return self.place(self.per_position(hidden, next_tokens(input_ids), ctx), ctx)

    def per_position(
        self, raw: torch.Tensor, next_tokens: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        """The log-prob of the next token at each position (and the entropy, the sum of squared
        probabilities), from the logits or, with ``ctx.output_weight``, the hidden states."""
        compute: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = log_probs_and_entropy
        compute_squares: Callable[..., torch.Tensor] = sum_pi_squared
        weight = ctx.output_weight
        if weight is not None and raw.shape[:-1].numel() * weight.shape[0] < self.fused_min_logits:
            raw = torch.matmul(raw.to(weight.dtype), weight.t())
        elif weight is not None:
            compute = functools.partial(fused_log_probs_and_entropy, weight=weight)
            compute_squares = functools.partial(fused_sum_pi_squared, weight=weight)
        log_probs, entropy = compute(
            raw,
            targets=next_tokens,
            temperature=self.temperature,
            compute_entropy=self.compute_entropy,
            group=ctx.tensor_parallel_group,
            vocab_start=ctx.vocab_start,
        )
        values = {"log_probs": log_probs, "entropy": entropy}
        values["sum_pi_squared"] = self._sum_pi_squared(compute_squares, raw, ctx)
        return {name: value for name, value in values.items() if value is not None}

    def place(
        self, per_position: Mapping[str, torch.Tensor], ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        """Per-position values moved to the token they score."""
        return {name: shift_to_scored_token(value, ctx) for name, value in per_position.items()}

    def postprocess_hidden_with_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        input_ids: torch.Tensor,
        ctx: HeadContext,
        loss_of: LossOf,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        logits = hidden.shape[:-1].numel() * weight.shape[0]
        if not self.gradient_in_forward or logits < self.fused_min_logits:
            return self.postprocess_hidden(hidden, weight, input_ids, ctx), None
        shape, n_tokens = hidden.shape[:-1], hidden.shape[:-1].numel()
        squares = self._sum_pi_squared(
            functools.partial(fused_sum_pi_squared, weight=weight), hidden, ctx
        )
        # the gradients each chunk was given, to check the loss's declaration afterwards
        given = torch.zeros(
            2 if self.compute_entropy else 1, n_tokens, dtype=torch.float32, device=hidden.device
        )
        chunks: list[int] = []

        def upstream_of(
            start: int, end: int, log_probs: torch.Tensor, entropy: torch.Tensor | None
        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            # the chunk's values in place, zeros elsewhere: a token-separable loss's gradient
            # at the chunk's tokens does not depend on the others
            chunks.append(start)
            grads = self._loss_gradients(
                [log_probs, entropy], start, n_tokens - end, shape, ctx, loss_of, squares
            )
            for row, grad in enumerate(grads):
                if grad is not None:
                    given[row, start:end] = grad
            return grads[0], grads[1]

        log_probs, entropy, anchor = fused_log_probs_with_gradient(
            hidden,
            weight,
            next_tokens(input_ids),
            upstream_of,
            temperature=self.temperature,
            compute_entropy=self.compute_entropy,
            group=ctx.tensor_parallel_group,
            vocab_start=ctx.vocab_start,
        )
        if len(chunks) > 1:
            self._check_separable(log_probs, entropy, squares, given, ctx, loss_of)
        return self._results(log_probs, entropy, squares, ctx), anchor

    def _loss_gradients(
        self,
        values: list[torch.Tensor | None],
        before: int,
        after: int,
        shape: torch.Size,
        ctx: HeadContext,
        loss_of: LossOf,
        squares: torch.Tensor | None,
    ) -> list[torch.Tensor | None]:
        """The gradient of ``loss_of`` w.r.t. ``values`` (flat log-probs and entropy or None)
        laid out with ``before`` and ``after`` zeros around them, in the model's layout;
        ``squares``: the whole micro-batch's sum of squared probabilities (no gradient) or
        None."""
        leaves = [v.detach().requires_grad_() for v in values if v is not None]
        with torch.enable_grad():
            laid_out = [
                torch.nn.functional.pad(leaf, (before, after)).view(shape) for leaf in leaves
            ]
            entropy = laid_out[1] if len(laid_out) > 1 else None
            results = self._results(laid_out[0], entropy, squares, ctx)
            grads = torch.autograd.grad(loss_of(results), leaves, allow_unused=True)
        return [grads[0], grads[1] if len(grads) > 1 else None]

    def _check_separable(
        self,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        squares: torch.Tensor | None,
        given: torch.Tensor,
        ctx: HeadContext,
        loss_of: LossOf,
    ) -> None:
        """The loss's gradient with every token real equals what each chunk was given (up to
        1e-5 of the largest; NaN and infinities are the non-finite guard's), else the loss is
        not token-separable: ConfigError, deferred to the end of the step where the engine
        collects the checks (``ctx.deferred_checks``)."""
        values = [log_probs.reshape(-1), None if entropy is None else entropy.reshape(-1)]
        full = self._loss_gradients(values, 0, 0, log_probs.shape, ctx, loss_of, squares)
        violated = torch.zeros((), dtype=torch.bool, device=given.device)
        for row, grad in enumerate(full[: given.shape[0]]):
            expected = torch.zeros_like(given[row]) if grad is None else grad.detach()
            scale = torch.nan_to_num(expected, nan=0.0, posinf=0.0, neginf=0.0).abs().amax()
            violated |= ((given[row] - expected).abs() > 1e-5 * scale).any()
        message = (
            "the loss declares itself token-separable (engine.losses.token_separable), but "
            "its gradient at some tokens changed with the values of other tokens when the fused "
            "LM head asked for it chunk by chunk: it is not separable, and its gradients would be "
            "wrong (this error comes before any optimizer step). Remove the declaration (the "
            "head then recomputes in backward), or set the head option gradient_in_forward: "
            "false"
        )
        if ctx.deferred_checks is not None:
            ctx.deferred_checks.append((violated, message))
        elif bool(violated):
            raise ConfigError(message)

    def _sum_pi_squared(
        self, compute: Callable[..., torch.Tensor], raw: torch.Tensor, ctx: HeadContext
    ) -> torch.Tensor | None:
        """``compute(raw, ...)`` per position when the option is on, else None."""
        if not self.compute_sum_pi_squared:
            return None
        return compute(raw, temperature=self.temperature, group=ctx.tensor_parallel_group)

    def _results(
        self,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        squares: torch.Tensor | None,
        ctx: HeadContext,
    ) -> dict[str, torch.Tensor]:
        """Per-position values moved to the token they score."""
        values = {"log_probs": log_probs, "entropy": entropy, "sum_pi_squared": squares}
        return self.place({k: v for k, v in values.items() if v is not None}, ctx)
