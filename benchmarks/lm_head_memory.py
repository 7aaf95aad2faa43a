"""Memory and time of the LM head: the output layer fused with the head's math
(``heads.kernels.fused_output``) vs materialised logits; and (``--head-only``) the head op
``heads.kernels.vocab_parallel.log_probs_and_entropy`` vs the naive LM-head math on given logits.

Output layer + head (default). materialised: ``logits = hidden @ W.T`` then
``log_probs_and_entropy(logits, targets)`` (the unfused engine path); fused:
``fused_log_probs_and_entropy(hidden, W, targets)`` (default chunking; backward recomputes the
logits); in-forward: ``fused_log_probs_with_gradient`` (the gradient computed in forward, for a
token-separable loss, asked for each chunk as the engine asks the loss). ``hidden [T, H]`` and
``W [V, H]`` require grad; one step = forward, then backward with fixed random upstream
gradients for the log-probs and the entropy (gradients land in ``hidden.grad``/``W.grad``, freed
after the step). Peak extra memory: the most allocated during the step beyond what was live
before it (CUDA: ``torch.cuda.max_memory_allocated``; CPU: profiler events as below), shown with
and without the gradients of ``hidden`` and ``W`` (both methods produce them; the logits exist
only in the materialised one). Time: median of ``--rounds`` steps after a warm-up, the methods
alternating (CUDA: synchronised before and after). Default sizes: on CUDA V in {32K, 152K} x
T in {4K, 16K}, hidden 4096, bfloat16; on CPU (and with ``--small``) a matrix that runs in
seconds. Target: fused/materialised peak extra memory <= 0.1x at <= 1.1x time.

    python -m benchmarks.lm_head_memory [--device cpu|cuda] [--small] [--dtype float32|bfloat16]
        [--hidden H] [--tokens T ...] [--vocab V ...] [--rounds 5] [--no-entropy] [--seed 0]

Whole engines (``--engine``): megatron engines on a model preset (default ``small``, 8192
vocabulary) whose LM heads take each path (``in-forward``, the default with a token-separable
loss; ``fused`` with ``gradient_in_forward: false``; ``materialised`` with ``fused: false``):
time and peak extra memory of ``forward_backward_batch`` with PPO's ``ActorLoss`` (entropy
bonus) on ``--sequences`` x ``--length`` tokens in two micro-batches.

    python -m benchmarks.lm_head_memory --engine [--model small] [--sequences 8]
        [--length 512] [--rounds 3] [--device cpu|cuda]

Head only (``--head-only``):

naive: ``logp = log_softmax(logits, -1)``; ``log_probs = logp.gather(-1, targets)``;
``entropy = -(logp.exp() * logp).sum(-1)``. Ours: ``log_probs_and_entropy(logits, targets)``
(default chunking). Both on the same float32 ``[tokens, vocab]`` logits (default 4096 x 32768,
512 MiB) with ``requires_grad``, in the same process; one step = forward, then backward with
fixed random upstream gradients for the log-probabilities and the entropy, the gradient landing
in ``logits.grad`` (freed after the step).

* peak extra memory: one step per method under ``torch.profiler`` with ``profile_memory=True``;
  the running sum of the sizes of its allocation/free events (``[memory]`` events, in time
  order) gives the live bytes allocated during the step, and its maximum is the peak. The
  logits, the targets and the upstream gradients exist before the step, so they are not
  counted; the logits' gradient (as big as the logits, produced by both methods) is, and is
  shown separately.
* time: median wall time of a step over ``--rounds`` rounds after one warm-up step each, the
  two methods alternating (which goes first alternates too).

Ratios are ours / naive; the issue's target is <= 0.5x peak extra memory at <= 1.1x time.
Also printed: the largest differences between the two methods' results and gradients on the
first 256 tokens. Never pass/fail.

    python -m benchmarks.lm_head_memory --head-only [--tokens 4096] [--vocab 32768]
        [--rounds 7] [--no-entropy] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.measure import peak_allocated
from heads.kernels.fused_output import (
    default_tile,
    fused_log_probs_and_entropy,
    fused_log_probs_with_gradient,
)
from heads.kernels.vocab_parallel import log_probs_and_entropy

Outputs = tuple[torch.Tensor, torch.Tensor | None]
Method = Callable[[torch.Tensor, torch.Tensor, bool], Outputs]


def naive(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> Outputs:
    log_p = torch.log_softmax(logits, dim=-1)
    log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return log_probs, entropy


def ours(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> Outputs:
    return log_probs_and_entropy(logits, targets, compute_entropy=with_entropy)


METHODS: dict[str, Method] = {"ours": ours, "naive": naive}


def step(
    method: Method,
    logits: torch.Tensor,
    targets: torch.Tensor,
    upstream: tuple[torch.Tensor, torch.Tensor | None],
) -> None:
    """Forward and backward; the gradient is left in ``logits.grad``."""
    log_probs, entropy = method(logits, targets, upstream[1] is not None)
    outputs, grads = [log_probs], [upstream[0]]
    if entropy is not None and upstream[1] is not None:
        outputs.append(entropy)
        grads.append(upstream[1])
    torch.autograd.backward(outputs, grads)


def check(methods: dict[str, Method], with_entropy: bool, vocab: int, seed: int) -> str:
    """Largest differences between the methods' results and gradients on 256 tokens."""
    generator = torch.Generator().manual_seed(seed + 1)
    logits = torch.empty(256, vocab).normal_(0, 3, generator=generator)
    targets = torch.randint(0, vocab, (256,), generator=generator)
    upstream = (torch.randn(256, generator=generator), torch.randn(256, generator=generator))
    results = []
    for method in methods.values():
        leaf = logits.clone().requires_grad_(True)
        log_probs, entropy = method(leaf, targets, with_entropy)
        loss = (log_probs * upstream[0]).sum()
        if entropy is not None:
            loss = loss + (entropy * upstream[1]).sum()
        loss.backward()
        results.append(
            (log_probs.detach(), None if entropy is None else entropy.detach(), leaf.grad)
        )
    (lp_a, h_a, g_a), (lp_b, h_b, g_b) = results
    text = f"max |diff| log_probs {float((lp_a - lp_b).abs().max()):.1e}"
    if h_a is not None and h_b is not None:
        text += f", entropy {float((h_a - h_b).abs().max()):.1e}"
    assert g_a is not None and g_b is not None
    return text + f", grad {float((g_a - g_b).abs().max()):.1e}"


def measure(tokens: int, vocab: int, rounds: int, with_entropy: bool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, vocab).normal_(0, 3, generator=generator).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream = (
        torch.randn(tokens, generator=generator),
        torch.randn(tokens, generator=generator) if with_entropy else None,
    )

    def run(name: str) -> Callable[[], None]:
        def once() -> None:
            step(METHODS[name], logits, targets, upstream)
            logits.grad = None

        return once

    peaks = {name: peak_allocated(run(name)) for name in METHODS}
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for name in METHODS:  # warm-up
        run(name)()
    for index in range(rounds):
        order = list(METHODS) if index % 2 == 0 else list(reversed(METHODS))
        for name in order:
            start = time.perf_counter()
            run(name)()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    grad_mib = tokens * vocab * logits.element_size() / 2**20
    print(
        f"tokens={tokens} vocab={vocab} float32 entropy={with_entropy} rounds={rounds} "
        f"threads={torch.get_num_threads()} (logits {grad_mib:.0f} MiB; "
        f"{check(METHODS, with_entropy, vocab, seed)})"
    )
    for name in METHODS:
        print(
            f"  {name:5s}: fwd+bwd peak extra memory {peaks[name] / 2**20:7.1f} MiB (incl. the "
            f"{grad_mib:.0f} MiB logits gradient), median time {medians[name]:.3f} s"
        )
    print(
        f"  ours/naive: peak extra memory ratio {peaks['ours'] / peaks['naive']:.2f} "
        f"(target <= 0.5), time ratio {medians['ours'] / medians['naive']:.2f} (target <= 1.1)"
    )


LayerStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], bool], Outputs]
"""``(hidden, weight, targets, upstream, with_entropy) -> (log_probs, entropy)``: forward, and
backward with the upstream gradients ``[g_log_probs, g_entropy]``; the gradients land in
``hidden.grad`` and ``weight.grad``."""


def _backward(outputs: Outputs, upstream: list[torch.Tensor]) -> Outputs:
    log_probs, entropy = outputs
    tensors, grads = [log_probs], [upstream[0]]
    if entropy is not None:
        tensors.append(entropy)
        grads.append(upstream[1])
    torch.autograd.backward(tensors, grads)
    return outputs


def materialised(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    upstream: list[torch.Tensor],
    with_entropy: bool,
) -> Outputs:
    logits = hidden @ weight.t()
    return _backward(log_probs_and_entropy(logits, targets, compute_entropy=with_entropy), upstream)


def fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    upstream: list[torch.Tensor],
    with_entropy: bool,
) -> Outputs:
    outputs = fused_log_probs_and_entropy(hidden, weight, targets, compute_entropy=with_entropy)
    return _backward(outputs, upstream)


def in_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    upstream: list[torch.Tensor],
    with_entropy: bool,
) -> Outputs:
    """Gradient in forward, asking a loss for each chunk's upstream gradients as the engine
    does: the loss ``sum(g_lp log_probs + g_h entropy)`` over the whole micro-batch's width,
    the chunk's values real and zeros elsewhere, differentiated by autograd."""
    n_tokens = targets.numel()

    def upstream_of(
        start: int, end: int, log_probs: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        leaves = [v.detach().requires_grad_() for v in (log_probs, entropy) if v is not None]
        with torch.enable_grad():
            loss = torch.stack(
                [
                    (torch.nn.functional.pad(leaf, (start, n_tokens - end)) * grad).sum()
                    for leaf, grad in zip(leaves, upstream, strict=False)
                ]
            ).sum()
            grads = torch.autograd.grad(loss, leaves)
        return grads[0], grads[1] if len(grads) > 1 else None

    log_probs, entropy, anchor = fused_log_probs_with_gradient(
        hidden, weight, targets, upstream_of, compute_entropy=with_entropy
    )
    anchor.backward()
    return log_probs, entropy


LAYER_METHODS: dict[str, LayerStep] = {
    "fused": fused,
    "in-forward": in_forward,
    "materialised": materialised,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra(fn: Callable[[], None], device: torch.device) -> int:
    """Most bytes allocated by ``fn`` beyond what was live before it."""
    if device.type != "cuda":
        return peak_allocated(fn)
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def alternating_medians(
    runs: dict[str, Callable[[], None]], rounds: int, device: torch.device
) -> dict[str, float]:
    """Median seconds of each run over ``rounds`` after one warm-up call each, the runs
    alternating (which goes first alternates too); synchronised on CUDA."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(rounds):
        order = list(runs) if index % 2 == 0 else list(reversed(runs))
        for name in order:
            synchronize(device)
            start = time.perf_counter()
            runs[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def layer_differences(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> str:
    """Largest differences of each fused method from the materialised one on the first 256
    tokens (float32 copies)."""
    h = hidden[:256].detach().float()
    w = weight.detach().float()
    t = targets[:256]
    generator = torch.Generator().manual_seed(1)
    upstream = [torch.randn(len(t), generator=generator).to(h.device) for _ in range(2)]
    found = {}
    for name, method in LAYER_METHODS.items():
        leaf_h, leaf_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        log_probs, _ = method(leaf_h, leaf_w, t, upstream, with_entropy)
        assert leaf_h.grad is not None and leaf_w.grad is not None
        found[name] = (log_probs.detach(), leaf_h.grad, leaf_w.grad)
    reference = found.pop("materialised")
    texts = []
    for name, results in found.items():
        diffs = [float((a - b).abs().max()) for a, b in zip(results, reference, strict=True)]
        texts.append("{}: log_probs {:.1e}, grad hidden {:.1e}, grad W {:.1e}".format(name, *diffs))
    return "max |diff| f32 " + "; ".join(texts)


def measure_layer(
    tokens: int,
    vocab: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    rounds: int,
    with_entropy: bool,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    scale = hidden_size**-0.5 * 3
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(device, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * scale).to(device, dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    upstream = [torch.randn(tokens, generator=generator).to(device) for _ in range(2)]

    def run(name: str) -> Callable[[], None]:
        def once() -> None:
            LAYER_METHODS[name](hidden, weight, targets, upstream, with_entropy)
            hidden.grad = weight.grad = None

        return once

    peaks = {name: peak_extra(run(name), device) for name in LAYER_METHODS}
    medians = alternating_medians({name: run(name) for name in LAYER_METHODS}, rounds, device)
    size = torch.tensor([], dtype=dtype).element_size()
    logits_mib = tokens * vocab * size / 2**20
    grads_mib = (tokens + vocab) * hidden_size * size / 2**20
    chunk, block = default_tile(tokens, vocab, device)
    print(
        f"T={tokens} V={vocab} hidden={hidden_size} {str(dtype)[6:]} {device.type} "
        f"entropy={with_entropy} rounds={rounds} tile={chunk}x{block} (logits "
        f"{logits_mib:.0f} MiB, grads of hidden+W {grads_mib:.0f} MiB; "
        f"{layer_differences(hidden, weight, targets, with_entropy)})"
    )
    for name in LAYER_METHODS:
        print(
            f"  {name:12s}: peak extra {peaks[name] / 2**20:8.1f} MiB "
            f"({peaks[name] / 2**20 - grads_mib:8.1f} beyond the grads), "
            f"median time {medians[name]:.4f} s"
        )
    beyond = {name: max(peak / 2**20 - grads_mib, 1e-9) for name, peak in peaks.items()}
    for name in ("fused", "in-forward"):
        print(
            f"  {name}/materialised: peak extra {peaks[name] / peaks['materialised']:.3f} "
            f"({beyond[name] / beyond['materialised']:.3f} beyond the grads; target <= 0.1), "
            f"time {medians[name] / medians['materialised']:.2f} (target <= 1.1)"
        )


#: ``--engine``: the head options of each engine compared.
ENGINE_HEADS = {
    "in-forward": {"fused": True},
    "fused": {"fused": True, "gradient_in_forward": False},
    "materialised": {"fused": False},
}


def measure_engine(
    model: str, device: torch.device, rounds: int, sequences: int, length: int, seed: int
) -> None:
    """One megatron engine per :data:`ENGINE_HEADS` entry (same seed): the time and peak extra
    memory of ``forward_backward_batch`` with PPO's loss (entropy bonus, token-separable) on
    one batch, the engines alternating."""
    from engine import Engine
    from engine.data.batching import jagged
    from engine.losses import ActorLoss

    generator = torch.Generator().manual_seed(seed)
    engines = {
        name: Engine.build(
            head="lm",
            backend="megatron",
            device=device.type,
            config={
                "model": model,
                "seed": seed,
                "micro_batch_size": max(1, sequences // 2),
                "head": {"compute_entropy": True, **options},
            },
        ).initialize()
        for name, options in ENGINE_HEADS.items()
    }
    vocab = next(iter(engines.values())).config.model.vocab_size
    lengths = [length] * sequences
    batch = random_batch_of(lengths, vocab, generator)
    batch["old_log_probs"] = jagged([-torch.rand(n, generator=generator) for n in lengths])
    batch["advantages"] = jagged([torch.randn(n, generator=generator) for n in lengths])
    batch["response_mask"] = jagged([(torch.arange(n) >= n // 4).float() for n in lengths])
    loss = ActorLoss(entropy_coeff=0.01)

    def run(name: str) -> Callable[[], None]:
        engine = engines[name]

        def once() -> None:
            with engine.train_mode():
                engine.forward_backward_batch(batch, loss, return_outputs=False)
                engine.optimizer_zero_grad()

        return once

    for name in engines:  # warm-up: lazy state is built on first use
        run(name)()
    peaks = {name: peak_extra(run(name), device) for name in engines}
    medians = alternating_medians({name: run(name) for name in engines}, rounds, device)
    per_micro_batch = max(1, sequences // 2) * length * vocab
    print(
        f"engine: megatron {model} (vocab {vocab}) on {device.type}, {sequences} x {length} "
        f"tokens, 2 micro-batches of {per_micro_batch / 2**20:.1f}M logits, ActorLoss with "
        f"entropy bonus, forward_backward_batch, rounds={rounds}"
    )
    for name in engines:
        print(
            f"  {name:12s}: peak extra {peaks[name] / 2**20:8.1f} MiB, median time "
            f"{medians[name]:.3f} s ({medians[name] / medians['materialised']:.2f}x "
            "materialised)"
        )


def random_batch_of(lengths: list[int], vocab: int, generator: torch.Generator) -> Any:
    from engine.data.batching import from_token_lists

    return from_token_lists(
        [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--head-only", action="store_true", help="the head op on given logits")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--small", action="store_true", help="the CPU-sized matrix")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--vocab", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-entropy", action="store_true", help="log-probabilities only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", action="store_true", help="whole engines, PPO's loss")
    parser.add_argument("--model", default="small", help="--engine: the model preset")
    parser.add_argument("--sequences", type=int, default=8, help="--engine: batch rows")
    parser.add_argument("--length", type=int, default=512, help="--engine: tokens per row")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    with_entropy = not args.no_entropy
    if args.engine:
        device = torch.device(args.device)
        measure_engine(args.model, device, args.rounds or 3, args.sequences, args.length, args.seed)
        return
    if args.head_only:
        tokens, vocab = (args.tokens or [4096])[0], (args.vocab or [32768])[0]
        measure(tokens, vocab, args.rounds or 7, with_entropy, args.seed)
        return
    device = torch.device(args.device)
    small = args.small or device.type == "cpu"
    dtype = DTYPES[args.dtype or ("float32" if small else "bfloat16")]
    hidden_size = args.hidden or (128 if small else 4096)
    for vocab in args.vocab or ([8192, 32768] if small else [32768, 151936]):
        for tokens in args.tokens or ([2048] if small else [4096, 16384]):
            measure_layer(
                tokens,
                vocab,
                hidden_size,
                dtype,
                device,
                args.rounds or (3 if small else 5),
                with_entropy,
                args.seed,
            )


if __name__ == "__main__":
    main()
