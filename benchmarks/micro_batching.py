"""Packed and token-budget micro-batching vs padding every micro-batch to the longest sequence.

An RL-like batch: prompts uniform in 32-512 tokens, responses log-normal (median 160 tokens,
sigma 1.0) clipped to 8-1024, each sequence = prompt + response clipped to the model's
``max_sequence_length`` (the ``tiny`` / ``small`` presets with it raised to 1536 so that every
sequence fits), random token ids, ``loss_mask`` 1 on the response tokens. One fixed batch per
model (seeded), reused for every step; loss ``sft_loss``.

* baseline: every sequence right-padded with real pad tokens (id 0) to the batch's longest
  sequence, ``loss_mask`` 0 on the padding, ``micro_batch_size`` sequences per micro-batch --
  what a trainer that pads the batch once and cuts it into fixed-size micro-batches computes.
  The padding is computed like tokens (the model is causal, so the real tokens' outputs and the
  loss are unchanged).
* dynamic: the unpadded batch with ``max_tokens_per_micro_batch = micro_batch_size x longest``
  (exactly what one baseline micro-batch holds); the engine packs sequences of similar length
  together, each micro-batch right-padded to its own longest.
* packed: the unpadded batch with the same budget counted in real tokens and ``packing: true``:
  each micro-batch is one row holding its sequences back to back, no padding computed.

Three engines in one process, same seed (same initial weights); after one short warm-up step
each (``micro_batch_size`` sequences of 64 tokens) the measured steps rotate between them, which
one goes first rotating too. Reported, per engine: real (non-pad) tokens / s of
``train_batch`` (all measured steps' real tokens over their summed wall time) and the peak extra
memory of a step: each measured step runs under ``torch.profiler`` with ``profile_memory=True``
(its overhead is below the run-to-run noise), and the running sum of the sizes of the step's
allocation/free events (``[memory]`` events, in time order) gives the bytes allocated during the
step and still live; its maximum is the peak (model, gradient buffers and optimizer state that
exist before the step are not counted). Tensor bytes, not resident memory: deterministic, and
at least what an accelerator's caching allocator would have to hold.
Ratios: dynamic / baseline (the first issue's target >= 2x tokens/s) and packed / dynamic
(target >= 1.2x on ``small``; padding alone limits it to computed / real tokens of the dynamic
plan). Never pass/fail.

Either backend: megatron (default) or fsdp2 (``--backend fsdp2``: transformers models, whose
packed rows attend sequence by sequence).

    python -m benchmarks.micro_batching [--model tiny|small] [--backend megatron|fsdp2]
        [--batch-size N] [--steps N] [--micro-batch-size 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import attrs
import torch
from tensordict import TensorDict

from benchmarks.measure import peak_allocated
from engine import Engine
from engine.data.batching import from_token_lists
from engine.losses import sft_loss
from strategies.part_configs import model_preset

MAX_SEQUENCE_LENGTH = 1536
PROMPT_RANGE = (32, 512)
RESPONSE_RANGE = (8, 1024)
RESPONSE_MEDIAN, RESPONSE_SIGMA = 160.0, 1.0
PAD_ID = 0


def sample_lengths(count: int, seed: int) -> list[tuple[int, int]]:
    """``(prompt, response)`` lengths; their sum is clipped to ``MAX_SEQUENCE_LENGTH``."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        prompt = rng.randint(*PROMPT_RANGE)
        response = round(rng.lognormvariate(math.log(RESPONSE_MEDIAN), RESPONSE_SIGMA))
        response = min(max(response, RESPONSE_RANGE[0]), RESPONSE_RANGE[1])
        response = min(response, MAX_SEQUENCE_LENGTH - prompt)
        pairs.append((prompt, response))
    return pairs


def make_batches(
    pairs: list[tuple[int, int]], vocab_size: int, seed: int
) -> tuple[TensorDict, TensorDict, int, int]:
    """The unpadded batch, the same batch padded to its longest, its real tokens and longest."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(prompt + response for prompt, response in pairs)
    tokens, masks, padded_tokens, padded_masks = [], [], [], []
    for prompt, response in pairs:
        length = prompt + response
        # ids 1.. so that the pad id 0 never appears as a real token
        row = torch.randint(1, vocab_size, (length,), generator=generator).tolist()
        mask = [0.0] * prompt + [1.0] * response
        tokens.append(row)
        masks.append(mask)
        padded_tokens.append(row + [PAD_ID] * (longest - length))
        padded_masks.append(mask + [0.0] * (longest - length))
    real = sum(prompt + response for prompt, response in pairs)
    return (
        from_token_lists(tokens, loss_mask=masks),
        from_token_lists(padded_tokens, loss_mask=padded_masks),
        real,
        longest,
    )


def build_engine(
    model: str, backend: str, micro_batch_size: int, budget: int | None, packing: bool = False
) -> Engine:
    fields: dict[str, Any] = attrs.asdict(model_preset(model))
    config: dict[str, Any] = {
        "model": {**fields, "max_sequence_length": MAX_SEQUENCE_LENGTH},
        "micro_batch_size": micro_batch_size,
        "optimizer": {"lr": 1e-4},
        "packing": packing,
    }
    if budget is not None:
        config["max_tokens_per_micro_batch"] = budget
    return Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()


def timed_step(engine: Engine, batch: TensorDict) -> tuple[float, int, float]:
    """One ``train_batch``: wall seconds, peak extra allocated bytes, loss."""
    seen: dict[str, float] = {}

    def step() -> None:
        start = time.perf_counter()
        seen["loss"] = engine.train_batch(batch, sft_loss)["loss"]
        seen["elapsed"] = time.perf_counter() - start

    peak = peak_allocated(step)
    return seen["elapsed"], peak, seen["loss"]


def measure(
    model: str, backend: str, batch_size: int, steps: int, micro_batch_size: int, seed: int
) -> None:
    vocab = model_preset(model).vocab_size
    pairs = sample_lengths(batch_size, seed)
    batch, padded, real_tokens, longest = make_batches(pairs, vocab, seed)
    budget = micro_batch_size * longest
    engines = {
        "baseline": build_engine(model, backend, micro_batch_size, None),
        "dynamic": build_engine(model, backend, micro_batch_size, budget),
        "packed": build_engine(model, backend, micro_batch_size, budget, packing=True),
    }
    batches = {"baseline": padded, "dynamic": batch, "packed": batch}
    plans = {name: engines[name].plan_micro_batches(batches[name]) for name in engines}
    times: dict[str, list[float]] = {name: [] for name in engines}
    peaks: dict[str, list[int]] = {name: [] for name in engines}
    losses: dict[str, list[float]] = {name: [] for name in engines}
    warm_up, warm_up_padded, _, _ = make_batches([(32, 32)] * micro_batch_size, vocab, seed)
    names = list(engines)
    for name, engine in engines.items():
        with engine.train_mode():
            engine.train_batch(warm_up_padded if name == "baseline" else warm_up, sft_loss)
    for step in range(steps):
        for name in names[step % 3 :] + names[: step % 3]:
            with engines[name].train_mode():
                elapsed, peak, loss = timed_step(engines[name], batches[name])
                times[name].append(elapsed)
                peaks[name].append(peak)
                losses[name].append(loss)
    speed = {name: real_tokens * len(times[name]) / sum(times[name]) for name in engines}
    peak_mib = {name: max(peaks[name]) / 2**20 for name in engines}
    loss_gap = max(
        abs(a - b)
        for other in ("dynamic", "packed")
        for a, b in zip(losses["baseline"], losses[other], strict=True)
    )
    responses = sorted(response for _, response in pairs)
    print(
        f"model={model:5s} backend={backend} seqs={batch_size} real_tokens={real_tokens} "
        f"longest={longest} "
        f"median_response={responses[len(responses) // 2]} micro_batch_size={micro_batch_size} "
        f"budget={budget} steps={steps} |loss diff|<={loss_gap:.1e}"
    )
    for name in engines:
        plan = plans[name]
        print(
            f"  {name:8s}: {plan.num_micro_batches:2d} micro-batches, "
            f"{sum(plan.loads):6d} tokens computed, "
            f"{speed[name]:8.0f} real tokens/s, "
            f"peak extra memory {peak_mib[name]:7.1f} MiB"
        )
    for name, base, target in (("dynamic", "baseline", 2.0), ("packed", "dynamic", 1.2)):
        print(
            f"  {name}/{base}: tokens/s ratio {speed[name] / speed[base]:.2f} "
            f"(target >= {target:g}), peak extra memory ratio "
            f"{peak_mib[name] / peak_mib[base]:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "small"], action="append")
    parser.add_argument("--batch-size", type=int, help="sequences (default: tiny 32, small 16)")
    parser.add_argument("--steps", type=int, help="measured steps (default: tiny 5, small 1)")
    parser.add_argument("--backend", choices=["megatron", "fsdp2"], default="megatron")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for model in args.model or ["tiny", "small"]:
        batch_size = args.batch_size or (32 if model == "tiny" else 16)
        # defaults sized so that the whole script runs in about 3 minutes on one CPU thread
        steps = args.steps or (5 if model == "tiny" else 1)
        measure(model, args.backend, batch_size, steps, args.micro_batch_size, args.seed)


if __name__ == "__main__":
    main()
