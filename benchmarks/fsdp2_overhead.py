"""The fsdp2 backend: overhead of ``Engine.train_batch`` over a hand-written FSDP2 loop, and
step time and peak memory against the megatron backend, on the same model, data and seed.

Same process; steps alternate between the two being compared so that machine noise hits both
alike. Prints the median step time of each and their ratio (fsdp2 engine / hand-written FSDP2:
target <= 1.03), then fsdp2 / megatron step time, and the peak memory of building the engine and
training two steps (every allocation torch makes, from the profiler) of each and their ratio.

    python -m benchmarks.fsdp2_overhead [--model tiny|small] [--steps 30]
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
from engine import Engine, EngineConfig
from engine.losses import sft_loss
from tests.factories import random_batch
from tests.fsdp2_reference import ReferenceFsdp2Trainer

#: model -> (sequences per batch, longest sequence, micro-batch size, steps divisor)
SHAPES = {"tiny": (16, 64, 4, 1), "small": (8, 128, 4, 3)}


def batches(config: EngineConfig, model: str) -> list[Any]:
    sequences, length, _, _ = SHAPES[model]
    lengths = [length - (i * 7) % (length // 2) for i in range(sequences)]
    return [random_batch(lengths, config.model.vocab_size, seed=step) for step in range(4)]


def alternate(steps: int, first: Callable[[int], Any], second: Callable[[int], Any]) -> Any:
    """Median seconds of ``first(step)`` and ``second(step)``, alternating, after 3 warm-ups."""
    times: tuple[list[float], list[float]] = ([], [])
    for step in range(steps + 3):
        for run, into in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            run(step)
            if step >= 3:
                into.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def overhead(model: str, steps: int) -> None:
    """fsdp2 Engine vs the hand-written FSDP2 loop."""
    config = EngineConfig.from_dict(
        {"model": model, "micro_batch_size": SHAPES[model][2], "optimizer": {"lr": 1e-4}}
    )
    engine = Engine.build(head="lm", backend="fsdp2", device="cpu", config=config).initialize()
    reference = ReferenceFsdp2Trainer(config)
    data = batches(config, model)
    plain = [
        (
            [row.tolist() for row in batch["input_ids"].unbind()],
            [row.tolist() for row in batch["loss_mask"].unbind()],
        )
        for batch in data
    ]
    with engine.train_mode():
        ours, theirs = alternate(
            steps,
            lambda step: engine.train_batch(data[step % 4], sft_loss),
            lambda step: reference.train_step(*plain[step % 4]),
        )
    print(
        f"model={model:5s} steps={steps}: fsdp2 engine {ours * 1e3:8.2f} ms, hand-written "
        f"FSDP2 {theirs * 1e3:8.2f} ms, ratio {ours / theirs:.3f}"
    )


def versus_megatron(model: str, steps: int) -> None:
    """fsdp2 vs megatron engines: step time (alternating) and peak memory."""
    config = EngineConfig.from_dict(
        {"model": model, "micro_batch_size": SHAPES[model][2], "optimizer": {"lr": 1e-4}}
    )
    data = batches(config, model)

    def build(backend: str) -> Engine:
        return Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()

    def build_and_train(backend: str) -> None:
        engine = build(backend)
        for batch in data[:2]:
            engine.train_batch(batch, sft_loss)

    peaks = {
        backend: peak_allocated(lambda b=backend: build_and_train(b))
        for backend in ("fsdp2", "megatron")
    }
    fsdp2, megatron = build("fsdp2"), build("megatron")
    fsdp2_time, megatron_time = alternate(
        steps,
        lambda step: fsdp2.train_batch(data[step % 4], sft_loss),
        lambda step: megatron.train_batch(data[step % 4], sft_loss),
    )
    print(
        f"model={model:5s} steps={steps}: step time fsdp2 {fsdp2_time * 1e3:8.2f} ms, megatron "
        f"{megatron_time * 1e3:8.2f} ms, ratio {fsdp2_time / megatron_time:.3f}; peak memory "
        f"fsdp2 {peaks['fsdp2'] / 2**20:7.1f} MiB, megatron {peaks['megatron'] / 2**20:7.1f} MiB, "
        f"ratio {peaks['fsdp2'] / peaks['megatron']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=list(SHAPES), action="append")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for model in args.model or list(SHAPES):
        steps = max(5, args.steps // SHAPES[model][3])
        overhead(model, steps)
        versus_megatron(model, steps)


if __name__ == "__main__":
    main()
