"""Overhead of ``Engine.train_batch`` over a hand-written megatron-core loop.

Same process, same model, data and seed; steps alternate between the two so that machine
noise hits both alike. Prints the median step time of each, their ratio (target <= 1.03), and
the median of the per-pair ratios (each engine step over the reference step right after it),
which a busy machine moves less.

    python -m benchmarks.engine_overhead [--model tiny|small] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from engine import Engine, EngineConfig
from engine.losses import sft_loss
from tests.factories import random_batch
from tests.megatron_reference import ReferenceLMTrainer


def measure(model: str, steps: int, batch_size: int, length: int, micro_batch_size: int) -> None:
    config = EngineConfig.from_dict(
        {"model": model, "micro_batch_size": micro_batch_size, "optimizer": {"lr": 1e-4}}
    )
    engine = Engine.build(head="lm", device="cpu", config=config).initialize()
    reference = ReferenceLMTrainer(config)
    vocab = config.model.vocab_size
    lengths = [length - (i * 7) % (length // 2) for i in range(batch_size)]
    batches = [random_batch(lengths, vocab, seed=step) for step in range(4)]
    plain = [
        (
            [row.tolist() for row in batch["input_ids"].unbind()],
            [row.tolist() for row in batch["loss_mask"].unbind()],
        )
        for batch in batches
    ]
    engine_times, reference_times = [], []
    with engine.train_mode():
        for step in range(steps + 3):
            batch, (rows, masks) = batches[step % 4], plain[step % 4]
            start = time.perf_counter()
            engine.train_batch(batch, sft_loss)
            middle = time.perf_counter()
            reference.train_step(rows, masks)
            end = time.perf_counter()
            if step >= 3:  # warm-up
                engine_times.append(middle - start)
                reference_times.append(end - middle)
    engine_median = statistics.median(engine_times)
    reference_median = statistics.median(reference_times)
    paired = statistics.median(e / r for e, r in zip(engine_times, reference_times, strict=True))
    tokens = sum(lengths)
    print(
        f"model={model:5s} tokens/step={tokens:5d} micro_batch_size={micro_batch_size} "
        f"steps={steps}: engine {engine_median * 1e3:7.2f} ms, hand-written megatron "
        f"{reference_median * 1e3:7.2f} ms, ratio {engine_median / reference_median:.3f} "
        f"(median per-pair ratio {paired:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["tiny", "small"], action="append")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for model in args.model or ["tiny", "small"]:
        if model == "tiny":
            measure(model, args.steps, batch_size=16, length=64, micro_batch_size=4)
        else:  # ~20M parameters: fewer, shorter sequences keep a step near a second on 2 cores
            measure(model, max(5, args.steps // 3), batch_size=8, length=128, micro_batch_size=4)


if __name__ == "__main__":
    main()
