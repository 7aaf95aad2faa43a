"""Per-token log-probabilities and entropy (and, apart, the sum of squared probabilities) from
LM-head logits, memory-bounded and vocab-parallel.

Why this exists: the naive ``log_softmax(logits / T).gather(...)`` plus ``-(p * logp).sum(-1)``
materialises several float32 tensors the size of the logits (log-probs, probs, their product) and
autograd keeps some of them alive for backward. With 4k tokens x 128k vocabulary each one is 2 GiB.
Here the work is done in chunks of tokens, and backward recomputes the softmax from the logits
(which are alive anyway) plus at most three float32 numbers per token, so nothing logits-sized
besides the logits and the returned gradient is ever stored.

The same code handles vocabulary-parallel logits: with a tensor-parallel ``group`` each rank holds
the columns ``[vocab_start, vocab_start + V_local)`` of the logits, and the full vocabulary is never
gathered. Ranks exchange only per-token numbers: one all-reduce (MAX) of the row maxima, and one
all-reduce (SUM) of the sum of exponentials, the target logit (0 on ranks not holding the target)
and the entropy term. Backward needs no communication because every rank then holds the global
per-token statistics; it assumes (as usual for tensor parallelism) that the loss is computed
redundantly on every rank, so the upstream gradients are identical across the group.

Memory strategy (``V`` = local vocabulary, ``C`` = chunk size in tokens, ``N`` = tokens):

* forward: two float32 ``[C, V]`` work buffers (one without entropy) plus ``O(N)`` statistics;
* saved for backward: the logits themselves (no copy), each target's local column (and whether
  another rank holds it) and 2-3 float32 per token;
* backward: the gradient (one logits-sized tensor in the logits' dtype, which autograd needs
  anyway; for float32 logits the work is done in its storage) plus one float32 ``[C, V]``
  buffer for the probabilities when the entropy has a gradient, and one more when the logits
  are not float32.

The softmax is recomputed in backward (one extra exp per element) instead of saving a copy.
The backward itself is not differentiable (no double backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "DEFAULT_CPU_CHUNK_ELEMENTS",
    "MIN_TEMPERATURE",
    "UpstreamGradients",
    "all_reduce_over",
    "check_targets",
    "chunk_gradient",
    "chunk_power_sums",
    "chunk_statistics",
    "finish_power_sums",
    "finish_statistics",
    "log_probs_and_entropy",
    "sum_pi_squared",
    "target_columns",
    "work_view",
]
"""The per-chunk pieces (statistics, their combination, the gradient) are shared with
``heads.kernels.fused_output``, which computes the logits chunk by chunk itself."""

MIN_TEMPERATURE = 1e-8
"""Temperatures below this (including 0 and negatives) are clamped to it."""

DEFAULT_CHUNK_ELEMENTS = 1 << 24
"""With ``chunk_size=None`` on an accelerator a chunk holds about this many logits (64 MiB per
float32 buffer): big enough that kernel launches are negligible next to the memory traffic."""

DEFAULT_CPU_CHUNK_ELEMENTS = 1 << 20
"""The same on CPU (4 MiB per buffer): chunks that stay in cache run the several elementwise
passes markedly faster there (4096 x 32768 logits: 0.65 s with 64 MiB buffers, 0.4 s with 8 MiB)."""

# log-probabilities are clamped from below to this value. exp() of anything below about -104 is
# exactly 0 in float32, so the clamp changes no probability; it only keeps `p * log p` at 0 (not
# NaN) for logits of -inf, e.g. masked vocabulary padding.
_LOG_FLOOR = -1.0e4


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target token and entropy of each token's distribution.

    Args:
        logits: ``[..., V_local]`` floating-point logits (any float dtype; math is float32).
            Without ``group`` this is the full vocabulary.
        targets: ``[...]`` int64 token ids in the full vocabulary. Ids outside ``[0, V)`` are
            allowed (e.g. an ignore index) and get a target logit of 0; mask them out yourself.
        temperature: the logits are divided by ``max(temperature, 1e-8)``.
        compute_entropy: when False the entropy is neither computed nor returned (``None``).
        group: tensor-parallel process group over which the vocabulary is split, or ``None``
            for full-vocabulary logits and no communication.
        vocab_start: first vocabulary index held by this rank (must be 0 when ``group`` is None).
        chunk_size: tokens processed at a time; ``None`` picks about ``DEFAULT_CHUNK_ELEMENTS``
            logits per chunk (``DEFAULT_CPU_CHUNK_ELEMENTS`` on CPU). Bounds the float32 work
            buffers to ``chunk_size x V_local``.

    Returns:
        ``(log_probs, entropy)``, both float32 of shape ``[...]`` (entropy ``None`` when not
        computed). Both are differentiable w.r.t. ``logits``; the gradient has the logits' dtype.
    """
    _check_logits(logits)
    check_targets(targets, logits.shape[:-1], "logits", group, vocab_start)
    chunk = _chunk_tokens(chunk_size, logits)
    temp = max(float(temperature), MIN_TEMPERATURE)
    apply: Callable[..., Any] = _LogProbsAndEntropy.apply
    outputs = apply(logits, targets, temp, compute_entropy, group, vocab_start, chunk)
    if compute_entropy:
        log_probs, entropy = outputs
        return log_probs, entropy
    return outputs, None


@torch.no_grad()
def sum_pi_squared(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``sum_v softmax(logits / T)_v ** 2`` per token, float32 ``[...]``, without gradient.

    verl's optimal-token-baseline advantage estimators read it (its ``calculate_sum_pi_squared``).
    With ``s = (x - M) / T``: ``S = sum exp(s)``, ``S2 = sum exp(s) ** 2`` and the result is
    ``S2 / S ** 2``; under ``group`` the ranks combine them as the log-sum-exp is combined in
    :func:`log_probs_and_entropy` (all-reduce MAX of ``M``, then SUM of ``S`` and ``S2``).
    ``temperature`` and ``chunk_size``: as there; one float32 ``[chunk_size, V_local]`` work
    buffer.
    """
    _check_logits(logits)
    chunk = _chunk_tokens(chunk_size, logits)
    temp = max(float(temperature), MIN_TEMPERATURE)
    vocab_local = logits.shape[-1]
    flat = logits.detach().reshape(-1, vocab_local)
    n_tokens = flat.shape[0]
    row_max = flat.amax(dim=-1).to(torch.float32)
    all_reduce_over(row_max, dist.ReduceOp.MAX, group)
    sums = torch.empty(2, n_tokens, dtype=torch.float32, device=logits.device)
    shifted_buf = torch.empty(
        min(chunk, n_tokens), vocab_local, dtype=torch.float32, device=logits.device
    )
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        chunk_power_sums(flat[start:end], row_max[start:end], temp, sums[:, start:end], shifted_buf)
    all_reduce_over(sums, dist.ReduceOp.SUM, group)
    return finish_power_sums(sums).view(logits.shape[:-1])


def _check_logits(logits: torch.Tensor) -> None:
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits need a non-empty last (vocabulary) dimension, got {logits.shape}")


def check_targets(
    targets: torch.Tensor,
    leading: torch.Size,
    of: str,
    group: dist.ProcessGroup | None,
    vocab_start: int,
) -> None:
    """int64 ``targets`` of shape ``leading`` (the leading dims of the input named ``of``), and
    ``vocab_start`` 0 without a group; ValueError or TypeError otherwise."""
    if targets.shape != leading:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal {of}.shape[:-1] {tuple(leading)}"
        )
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64, got {targets.dtype}")
    if group is None and vocab_start != 0:
        raise ValueError("vocab_start must be 0 when group is None (full vocabulary)")


def _chunk_tokens(chunk_size: int | None, logits: torch.Tensor) -> int:
    """``chunk_size`` (ValueError unless positive), or for None about
    ``DEFAULT_CHUNK_ELEMENTS`` logits' worth of tokens (``DEFAULT_CPU_CHUNK_ELEMENTS`` on CPU)."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return chunk_size
    budget = DEFAULT_CPU_CHUNK_ELEMENTS if logits.device.type == "cpu" else DEFAULT_CHUNK_ELEMENTS
    return max(1, budget // logits.shape[-1])


def all_reduce_over(tensor: torch.Tensor, op: Any, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def target_columns(
    targets: torch.Tensor, vocab_start: int, vocab_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each target (clamped into range) and whether another rank holds it."""
    local = targets - vocab_start if vocab_start else targets
    column = local.clamp(0, vocab_local - 1)
    return column, column != local


def work_view(buffer: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A contiguous ``[rows, columns]`` view of the start of a (contiguous) work buffer."""
    return buffer.view(-1)[: rows * columns].view(rows, columns)


def chunk_statistics(
    logits: torch.Tensor,
    row_max: torch.Tensor,
    temp: float,
    sums: torch.Tensor,
    entropy_terms: torch.Tensor | None,
    shifted_buf: torch.Tensor,
    exp_buf: torch.Tensor | None,
) -> None:
    """Per token of a chunk of logits ``[C, V_local]``: ``sums = sum exp(s)`` and (when
    ``entropy_terms`` is given) ``entropy_terms = sum exp(s) s`` with ``s = (x - row_max) / T``.
    ``shifted_buf`` / ``exp_buf`` are float32 ``[>= C, >= V_local]`` work buffers (``exp_buf`` only
    with the entropy). The log-probabilities come out the same with and without the entropy:
    ``exp`` of the clamped values is the same 0."""
    shifted = _scaled_shift(logits, row_max, temp, shifted_buf)
    if entropy_terms is None or exp_buf is None:
        torch.sum(shifted.exp_(), dim=-1, out=sums)
        return
    shifted.clamp_min_(_LOG_FLOOR)
    exps = torch.exp(shifted, out=work_view(exp_buf, *logits.shape))
    torch.sum(exps, dim=-1, out=sums)
    torch.sum(exps.mul_(shifted), dim=-1, out=entropy_terms)


def chunk_power_sums(
    logits: torch.Tensor,
    row_max: torch.Tensor,
    temp: float,
    sums: torch.Tensor,
    shifted_buf: torch.Tensor,
) -> None:
    """Per token of a chunk of logits ``[C, V_local]``: ``sums[0] = sum exp(s)`` and ``sums[1]
    = sum exp(s) ** 2`` (``sums``: float32 ``[2, C]``), with ``s = (x - row_max) / T``;
    ``shifted_buf``: a float32 ``[>= C, >= V_local]`` work buffer."""
    exps = _scaled_shift(logits, row_max, temp, shifted_buf).exp_()
    torch.sum(exps, dim=-1, out=sums[0])
    torch.sum(exps.square_(), dim=-1, out=sums[1])


def finish_power_sums(sums: torch.Tensor) -> torch.Tensor:
    """``sum p ** 2 = S2 / S ** 2`` from the global per-token ``sums`` (rows ``S``, ``S2``)."""
    return sums[1] / sums[0].square()


def _scaled_shift(
    logits: torch.Tensor, row_max: torch.Tensor, temp: float, buf: torch.Tensor
) -> torch.Tensor:
    """``(x - row_max) / T`` of a chunk of logits ``[C, V]`` in float32, in ``buf``."""
    # float32 subtraction also upcasts low-precision logits exactly
    shifted = torch.sub(logits, row_max[:, None], out=work_view(buf, *logits.shape))
    if temp != 1.0:
        shifted.div_(temp)
    return shifted


def finish_statistics(
    stats: torch.Tensor, row_max: torch.Tensor, temp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(log_probs, log_sum, entropy)`` from the global per-token statistics ``stats`` (rows:
    ``S``, target logit, and ``W`` when the entropy is computed; consumed in place) and the
    global ``row_max``."""
    log_sum = stats[0].log()
    log_probs = stats[1].sub_(row_max)
    if temp != 1.0:
        log_probs.div_(temp)
    log_probs.sub_(log_sum)
    entropy = log_sum - stats[2] / stats[0] if stats.shape[0] == 3 else None
    return log_probs, log_sum, entropy


def save_and_shape(
    ctx: Any,
    saved: list[torch.Tensor],
    log_probs: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor | None,
    shape: torch.Size,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The end of both forwards: save ``saved`` + the row maxima's ``log_sum`` (+ entropy) for
    backward and return the per-token results in the input's leading ``shape``."""
    saved = [*saved, log_sum]
    if entropy is not None:
        saved.append(entropy)
    ctx.save_for_backward(*saved)
    ctx.set_materialize_grads(False)
    if entropy is None:
        return log_probs.view(shape)
    return log_probs.view(shape), entropy.view(shape)


class UpstreamGradients:
    """The per-token coefficients of the logits' gradient for upstream gradients ``g_lp``
    (log-probs) and ``g_h`` (entropy): ``dx = p * (base + slope * log p) + onehot(t) * g_lp / T``
    with ``base = -(g_lp + g_h H) / T`` and ``slope = -g_h / T`` (``None`` without ``g_h``)."""

    def __init__(
        self,
        grads: tuple[torch.Tensor | None, ...],
        entropy: torch.Tensor | None,
        elsewhere: torch.Tensor,
        temp: float,
    ) -> None:
        f32 = torch.float32
        n_tokens = elsewhere.shape[0]
        if grads[0] is None:
            g_lp = torch.zeros(n_tokens, dtype=f32, device=elsewhere.device)
        else:
            g_lp = grads[0].reshape(-1).to(f32)
        g_h = None if len(grads) < 2 or grads[1] is None else grads[1].reshape(-1).to(f32)
        self.base = torch.div(g_lp, -temp)
        self.slope: torch.Tensor | None = None
        if g_h is not None:
            assert entropy is not None
            self.base.sub_(g_h * entropy / temp)
            self.slope = -g_h / temp
        # The one-hot term, added in float32 before any rounding to the logits' dtype
        # (p_t * base ~ -g_lp / T cancels it when p_t ~ 1); 0 where another rank holds t.
        self.target_grad = (g_lp / temp).masked_fill_(elsewhere, 0).unsqueeze(1)


def chunk_gradient(
    logits: torch.Tensor,
    rows: slice,
    upstream: UpstreamGradients,
    row_max: torch.Tensor,
    neg_log_sum: torch.Tensor,
    col: torch.Tensor,
    target_grad: torch.Tensor,
    temp: float,
    out: torch.Tensor,
    work_buf: torch.Tensor | None,
    prob_buf: torch.Tensor | None,
) -> None:
    """The gradient w.r.t. a chunk of logits ``[C, V_chunk]`` (tokens ``rows`` of the per-token
    arrays) into ``out`` (``[C, V_chunk]``, any float dtype; may be ``logits`` itself).
    ``col``: each token's target column in the chunk ``[C, 1]``, and ``target_grad`` its one-hot
    term ``[C, 1]`` (0 where the chunk does not hold the target). ``work_buf``: float32 work
    space ``[>= C, V_chunk]``, or None to work in ``out`` (float32); ``prob_buf``: the same for
    the probabilities, needed when the entropy has a gradient."""
    work = out if work_buf is None else work_view(work_buf, *logits.shape)
    log_p = torch.sub(logits, row_max[rows, None], out=work)
    log_p = torch.add(neg_log_sum[rows, None], log_p, alpha=1.0 / temp, out=work)
    base, slope = upstream.base[rows, None], upstream.slope
    if slope is None:
        probs, coef = log_p.exp_(), base
        coef_at_target = coef
    else:
        assert prob_buf is not None
        log_p.clamp_min_(_LOG_FLOOR)
        probs = torch.exp(log_p, out=work_view(prob_buf, *logits.shape))
        coef = torch.addcmul(base, slope[rows, None], log_p, out=work)
        coef_at_target = coef.gather(1, col)
    if work_buf is None:  # float32: the product is not rounded, add the term in place
        torch.mul(probs, coef, out=out).scatter_add_(1, col, target_grad)
        return
    fixed = probs.gather(1, col).mul_(coef_at_target).add_(target_grad)
    torch.mul(probs, coef, out=out).scatter_(1, col, fixed.to(out.dtype))


class _LogProbsAndEntropy(torch.autograd.Function):
    """Saves the logits (no copy) and per-token ``max``, ``log(sum exp)``, entropy.

    With ``x`` the raw logits, ``M = max x`` and ``s = (x - M) / T``: ``S = sum exp(s)``,
    ``W = sum exp(s) s``, ``log p = s - log S`` and ``H = log S - W / S``.
    Gradients w.r.t. ``x``: ``d log p_t = (onehot(t) - p) / T`` and ``dH = -p (log p + H) / T``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temp: float,
        compute_entropy: bool,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        chunk: int,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)
        n_tokens = flat.shape[0]
        device = logits.device
        f32 = torch.float32

        # Global max of the raw logits per token (dividing by T > 0 keeps the argmax).
        row_max = flat.amax(dim=-1).to(f32)
        all_reduce_over(row_max, dist.ReduceOp.MAX, group)

        # stats rows: S, target logit x_t (0 when another rank holds it), W
        stats = torch.empty(3 if compute_entropy else 2, n_tokens, dtype=f32, device=device)
        idx, elsewhere = target_columns(targets.reshape(-1), vocab_start, vocab_local)
        stats[1] = flat.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill_(elsewhere, 0)

        rows = min(chunk, n_tokens)
        shifted_buf = torch.empty(rows, vocab_local, dtype=f32, device=device)
        exp_buf = torch.empty_like(shifted_buf) if compute_entropy else None
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            chunk_statistics(
                flat[start:end],
                row_max[start:end],
                temp,
                stats[0, start:end],
                stats[2, start:end] if compute_entropy else None,
                shifted_buf,
                exp_buf,
            )
        del shifted_buf, exp_buf
        all_reduce_over(stats, dist.ReduceOp.SUM, group)
        log_probs, log_sum, entropy = finish_statistics(stats, row_max, temp)

        ctx.temp = temp
        ctx.chunk = chunk
        saved = [logits, idx, elsewhere, row_max]
        return save_and_shape(ctx, saved, log_probs, log_sum, entropy, logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        logits, idx, elsewhere, row_max, log_sum, *rest = ctx.saved_tensors
        no_grads = (None,) * 6
        if all(g is None for g in grads):
            return (None, *no_grads)
        temp: float = ctx.temp
        chunk: int = ctx.chunk
        f32 = torch.float32
        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)
        n_tokens = flat.shape[0]
        device = logits.device
        upstream = UpstreamGradients(grads, rest[0] if rest else None, elsewhere, temp)
        neg_log_sum = -log_sum

        grad = torch.empty(flat.shape, dtype=logits.dtype, device=device)
        rows = min(chunk, n_tokens)
        # float32 logits: compute straight into the gradient's storage
        buf_shape = (rows, vocab_local)
        work_buf = None if logits.dtype == f32 else torch.empty(buf_shape, dtype=f32, device=device)
        prob_buf = (
            None if upstream.slope is None else torch.empty(buf_shape, dtype=f32, device=device)
        )
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            chunk_gradient(
                flat[start:end],
                slice(start, end),
                upstream,
                row_max,
                neg_log_sum,
                idx[start:end, None],
                upstream.target_grad[start:end],
                temp,
                grad[start:end],
                work_buf,
                prob_buf,
            )
        return (grad.view(logits.shape), *no_grads)
