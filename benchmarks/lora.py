"""LoRA: what the adapters save against full fine-tuning, and what the reference as the
disabled adapter saves against a second engine.

Same process, same model (``small`` by default), data and seed; every number is a ratio to a
baseline measured in the same run:

1. LoRA (rank 8, all seven linears) vs full fine-tuning: trainable parameters, optimizer-state
   bytes (Adam moments, and any optimizer-owned parameter copies) after one step, and the median
   ``train_batch`` time (steps alternate between the two engines, so machine noise hits both).
2. Actor + reference, peak memory (every allocation torch makes, from the profiler) of building
   them and running one RL round (reference log-probs, one training step): one LoRA engine whose
   reference is ``disable_adapter()``, against a LoRA actor plus a forward-only reference engine,
   and against a fully trained actor plus a reference engine.

    python -m benchmarks.lora [--model tiny|small] [--backend megatron|fsdp2] [--steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.measure import peak_allocated
from engine import Engine
from engine.losses import sft_loss
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch

LORA = {"rank": 8, "alpha": 16}
#: model -> (sequences per batch, longest sequence, micro-batch size)
SHAPES = {"tiny": (16, 64, 4), "small": (8, 128, 4)}


def config(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "micro_batch_size": SHAPES[model][2],
        "optimizer": {"lr": 1e-4},
        **extra,
    }


def batches(model: str, vocab: int) -> list[Any]:
    sequences, length, _ = SHAPES[model]
    lengths = [length - (i * 7) % (length // 2) for i in range(sequences)]
    return [random_batch(lengths, vocab, seed=step) for step in range(4)]


def optimizer_state_bytes(engine: Engine) -> int:
    """Bytes of the optimizer's state tensors and of any parameter copies it owns."""
    optimizer = engine.backend._optimizer  # type: ignore[attr-defined]
    inner = [
        getattr(part, "optimizer", part)
        for part in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    model_params = {id(p) for module in engine.backend.modules() for p in module.parameters()}
    total = 0
    for torch_optimizer in inner:
        for state in torch_optimizer.state.values():
            total += sum(
                v.numel() * v.element_size()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim()
            )
        for group in torch_optimizer.param_groups:
            total += sum(
                p.numel() * p.element_size() for p in group["params"] if id(p) not in model_params
            )
    return total


def trainable(engine: Engine) -> int:
    return sum(
        p.numel()
        for module in engine.backend.modules()
        for p in module.parameters()
        if p.requires_grad
    )


def versus_full(model: str, backend: str, steps: int) -> None:
    destroy_mesh()
    engines = {
        name: Engine.build(head="lm", backend=backend, device="cpu", config=config(model, **extra))
        for name, extra in (("lora", {"lora": LORA}), ("full", {}))
    }
    for engine in engines.values():
        engine.initialize()
    data = batches(model, engines["full"].config.model.vocab_size)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(steps + 2):  # two warm-up steps
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.train_batch(data[step % 4], sft_loss)
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    lora, full = engines["lora"], engines["full"]
    state = {name: optimizer_state_bytes(engine) for name, engine in engines.items()}
    step_time = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"model={model} backend={backend} LoRA rank {LORA['rank']} vs full fine-tuning: "
        f"trainable {trainable(lora):,} vs {trainable(full):,} "
        f"(ratio {trainable(lora) / trainable(full):.4f}); optimizer state "
        f"{state['lora'] / 2**20:.2f} MiB vs {state['full'] / 2**20:.1f} MiB "
        f"(ratio {state['lora'] / state['full']:.4f}); step time "
        f"{step_time['lora'] * 1e3:.1f} ms vs {step_time['full'] * 1e3:.1f} ms "
        f"(ratio {step_time['lora'] / step_time['full']:.3f}, median of {steps})"
    )


def actor_and_reference(model: str, backend: str) -> None:
    """Peak memory of building the actor and its reference and running one RL round."""

    def round_trip(actor_extra: dict[str, Any], separate_reference: bool) -> None:
        actor = Engine.build(
            head="lm", backend=backend, device="cpu", config=config(model, **actor_extra)
        ).initialize()
        reference = (
            Engine.build(
                head="lm", backend=backend, device="cpu", config=config(model, forward_only=True)
            ).initialize()
            if separate_reference
            else actor
        )
        batch = batches(model, actor.config.model.vocab_size)[0]
        off = contextlib.nullcontext() if separate_reference else actor.disable_adapter()
        with off:
            reference.infer_batch(batch)
        actor.train_batch(batch, sft_loss)

    peaks = {}
    for name, actor_extra, separate in (
        ("one LoRA engine", {"lora": LORA}, False),
        ("LoRA actor + reference engine", {"lora": LORA}, True),
        ("full actor + reference engine", {}, True),
    ):
        destroy_mesh()
        gc.collect()  # the last round's engines are gone before this one is measured
        peaks[name] = peak_allocated(lambda a=actor_extra, s=separate: round_trip(a, s))
    baseline = peaks["one LoRA engine"]
    print(
        f"model={model} backend={backend} actor + reference, peak memory: "
        + "; ".join(
            f"{name} {peak / 2**20:.1f} MiB (x{peak / baseline:.2f})"
            for name, peak in peaks.items()
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=list(SHAPES), default="small")
    parser.add_argument("--backend", choices=["megatron", "fsdp2"], default="megatron")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    versus_full(args.model, args.backend, args.steps)
    actor_and_reference(args.model, args.backend)


if __name__ == "__main__":
    main()
