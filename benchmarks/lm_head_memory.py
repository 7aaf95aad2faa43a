"""Memory and time of ``heads.vocab_parallel.log_probs_and_entropy`` vs the naive LM-head math.

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

    python -m benchmarks.lm_head_memory [--tokens 4096] [--vocab 32768] [--rounds 7]
        [--no-entropy] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.measure import peak_allocated
from heads.vocab_parallel import log_probs_and_entropy

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-entropy", action="store_true", help="log-probabilities only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    measure(args.tokens, args.vocab, args.rounds, not args.no_entropy, args.seed)


if __name__ == "__main__":
    main()
