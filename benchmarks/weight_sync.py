"""Weight sync at a real size: the full stream (``Engine.get_per_tensor_param``), the shard
stream (``Engine.get_per_tensor_param_shard``) and the delta after one training step
(``engine.weight_sync.DeltaExport``), each written into a receiver, against a plain
``load_state_dict`` of the same tensors already in memory.

One process, on CPU, random weights (nothing downloaded). The default model has the shape of
Qwen2-0.5B (hidden 896, 24 layers, 14 heads, 2 KV groups, FFN 4864, vocabulary 151936, tied
embeddings, qkv bias: 494M parameters, 1.98 GB in float32); ``--model tiny`` is a Qwen2-shaped
toy to try the script in seconds. For each backend, weight dtype (``float32``; ``bfloat16``:
fsdp2 ``weights_dtype="bfloat16"``, AdamW's moments in bf16 and no float32 copy; megatron
``dtype="bfloat16"``, bf16 parameters with the optimizer's float32 master copy) and learning
rate, a fresh engine (same seed, so the same weights) is built and:

1. the receiver: a dict of preallocated Hugging Face tensors filled once from a first full
   export (contiguous, the export's dtype), registered as the parameters of an ``nn.Module``
   tree under their Hugging Face names (sharing storage, ``requires_grad=False``).
2. Three variants alternate ``--repeats`` times (the order rotates every repeat so that drift
   hits all alike; medians printed, ratios the median of each repeat's time over the same
   repeat's baseline):

   * baseline: ``receiver_module.load_state_dict(source)``, ``source`` a copy of the receiver's
     tensors made once beforehand (the same tensors already in memory: one ``copy_`` each);
   * full: ``for name, t in engine.get_per_tensor_param(): receiver[name].copy_(t)``;
   * shard: ``for block in engine.get_per_tensor_param_shard(): block.place(receiver[name])``
     (in one process every block is the whole tensor).

   Each pass also records the peak resident memory above the resident memory at its start
   (Linux: ``/proc/self/clear_refs`` resets ``VmHWM``; elsewhere a thread samples the RSS
   every millisecond): a second full copy of the model would show as growth near the model's
   size. The figure printed is the largest over the repeats.
3. The delta: ``--delta-repeats`` exporters (bf16 weights; float32 takes one, each base
   costing the model's bytes) primed on the shard stream (the receiver holds the same weights),
   one ``train_batch`` (``sft_loss``, ``--sequences`` x ``--tokens`` random tokens), then each
   exporter's pass, timed: ``for delta in exporter.deltas(engine.get_per_tensor_param_shard())``:
   ``receiver[name].view(-1)[delta.positions] = delta.values``, each next to a full stream pass
   (alternately before and after; the first delta lands on the receiver of the weights before
   the step and is checked before anything else writes it; the later ones write the same values
   again). Printed: the median seconds (and the part spent applying), the median ratio to the
   adjacent full stream pass, the bytes shipped (``sum(delta.nbytes)``: int32 positions +
   values) as a fraction of the full model's bytes, the share of elements that changed, the
   peak RSS growth; and whether the receiver then equals a fresh full export bit for bit.

Ratios are measured / baseline and delta / full stream, never pass/fail. The goals the numbers
are read against: full stream <= 1.5x the baseline; delta < 10% of the model's bytes at lr 1e-6
with bf16 weights. Between engines the freed heap is handed back (``malloc_trim``), so each
starts from the same resident memory.

Memory, default model: the float32 engines hold about 8 GB after the step (weights, AdamW's
moments, megatron's gradient buffer) plus the receiver and the delta's base (2 GB each); their
delta pass adds about 5.4 GB more for a moment (every element of the 136M-element embedding
changes, and ``DeltaExport.deltas`` works its positions out in int64), so the process peaks near
16 GB (fsdp2) and 18 GB (megatron). ``--dtype bfloat16`` alone stays under 14 GB.

    python -m benchmarks.weight_sync [--backend megatron|fsdp2|both] [--model qwen2-0.5b|tiny]
        [--repeats 5] [--delta-repeats 3] [--lr 1e-6 --lr 1e-5]
        [--dtype float32 --dtype bfloat16] [--sequences 2] [--tokens 32]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import psutil
import torch

from benchmarks.measure import high_water_mark
from engine import Engine
from engine.losses import sft_loss
from engine.weight_sync import DeltaExport
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch

MODELS: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "num_layers": 24,
        "num_attention_heads": 14,
        "num_query_groups": 2,
        "ffn_hidden_size": 4864,
        "max_sequence_length": 32768,
        "rotary_base": 1000000,
        "norm_epsilon": 1e-6,
        "tie_embeddings": True,
        "add_qkv_bias": True,
    },
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 128,
        "max_sequence_length": 256,
        "tie_embeddings": True,
        "add_qkv_bias": True,
    },
}
VARIANTS = ("baseline", "full", "shard")
#: Integer dtypes of each element size, to compare floats bit for bit.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MB = 1e6
CLEAR_REFS = "/proc/self/clear_refs"


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


def release_freed_memory() -> None:
    """Collect garbage and hand the heap glibc keeps after frees back to the system, so each
    engine starts from the same resident memory (no-op elsewhere)."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _can_reset_peak() -> bool:
    try:
        with open(CLEAR_REFS, "w") as refs:
            refs.write("5")
        high_water_mark()
    except (OSError, RuntimeError):
        return False
    return True


@contextmanager
def peak_rss_growth(into: dict[str, int]) -> Iterator[None]:
    """``into["start"]``: the RSS at the start; ``into["growth"]``: the peak RSS during the
    block above it."""
    start = rss()
    into["start"] = start
    if _can_reset_peak():  # VmHWM is the current RSS from here on
        yield
        into["growth"] = high_water_mark() - start
        return
    peak, done = [start], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        into["growth"] = max(peak[0], rss()) - start


def engine_config(model: str, dtype: str, lr: float, backend: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": MODELS[model],
        "dtype": dtype,
        "seed": 0,
        "micro_batch_size": 2,
        "optimizer": {"lr": lr},
    }
    if backend == "fsdp2" and dtype == "bfloat16":
        config["backend"] = {"weights_dtype": "bfloat16"}
    return config


def receiver_module(receiver: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An ``nn.Module`` tree whose parameters are the receiver's tensors (shared storage),
    under their Hugging Face names."""
    root = torch.nn.Module()
    for name, tensor in receiver.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = BITS[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def mismatches(engine: Engine, receiver: dict[str, torch.Tensor]) -> list[str]:
    """The tensors where the receiver differs from a fresh full export (names missing on
    either side included)."""
    seen, wrong = set(), []
    for name, tensor in engine.get_per_tensor_param():
        seen.add(name)
        if name not in receiver or not same_bits(receiver[name], tensor):
            wrong.append(name)
    return wrong + sorted(set(receiver) - seen)


def full_stream(engine: Engine, receiver: dict[str, torch.Tensor]) -> int:
    """Every full tensor copied into the receiver; the bytes streamed."""
    total = 0
    for name, tensor in engine.get_per_tensor_param():
        receiver[name].copy_(tensor)
        total += tensor.nbytes
    return total


def shard_stream(engine: Engine, receiver: dict[str, torch.Tensor]) -> int:
    """Every block placed into the receiver; the bytes streamed."""
    total = 0
    for block in engine.get_per_tensor_param_shard():
        if block.contributes:
            block.place(receiver[block.name])
            total += block.tensor.nbytes
    return total


def stream_rounds(
    engine: Engine, receiver: dict[str, torch.Tensor], repeats: int
) -> dict[str, dict[str, float]]:
    """Baseline, full and shard passes alternated ``repeats`` times: median seconds, median
    ratio to the same repeat's baseline, largest RSS growth, RSS at the start, bytes."""
    module = receiver_module(receiver)
    source = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    model_bytes = sum(t.nbytes for t in receiver.values())
    passes: dict[str, Callable[[], object]] = {
        "baseline": functools.partial(module.load_state_dict, source),
        "full": functools.partial(full_stream, engine, receiver),
        "shard": functools.partial(shard_stream, engine, receiver),
    }
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for repeat in range(repeats):
        turn = repeat % len(VARIANTS)
        for variant in VARIANTS[turn:] + VARIANTS[:turn]:
            memory: dict[str, int] = {}
            with peak_rss_growth(memory):
                start = time.perf_counter()
                moved = passes[variant]()
                seconds = time.perf_counter() - start
            size = moved if isinstance(moved, int) else model_bytes
            runs[variant].append({"seconds": seconds, "bytes": size, **memory})
    del passes, module, source
    release_freed_memory()
    baseline_s = [run["seconds"] for run in runs["baseline"]]
    return {
        variant: {
            "seconds": statistics.median(run["seconds"] for run in runs[variant]),
            "ratio": statistics.median(
                run["seconds"] / base for run, base in zip(runs[variant], baseline_s, strict=True)
            ),
            "growth": max(run["growth"] for run in runs[variant]),
            "start": statistics.median(run["start"] for run in runs[variant]),
            "bytes": runs[variant][-1]["bytes"],
        }
        for variant in VARIANTS
    }


def delta_pass(
    engine: Engine, exporter: DeltaExport, receiver: dict[str, torch.Tensor]
) -> dict[str, float]:
    """One timed ``deltas()`` + apply: seconds, of which applying, bytes shipped, elements
    changed, RSS at the start and peak growth."""
    shipped = changed = 0
    apply_s = 0.0
    memory: dict[str, int] = {}
    with peak_rss_growth(memory):
        start = time.perf_counter()
        for delta in exporter.deltas(engine.get_per_tensor_param_shard()):
            applied = time.perf_counter()
            receiver[delta.name].view(-1)[delta.positions] = delta.values
            apply_s += time.perf_counter() - applied
            shipped += delta.nbytes
            changed += delta.positions.numel()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "apply_s": apply_s, "bytes": shipped, "changed": changed, **memory}


def delta_round(
    engine: Engine,
    receiver: dict[str, torch.Tensor],
    repeats: int,
    sequences: int,
    tokens: int,
) -> dict[str, Any]:
    """``repeats`` exporters primed on the same weights, one training step, then each
    exporter's delta applied, alternating with a full stream pass (the first delta lands on
    the receiver of the weights before the step and is checked against a fresh full export
    before anything else writes it; the later ones write the same values again)."""
    start = time.perf_counter()
    exporters = [DeltaExport() for _ in range(repeats)]
    for exporter in exporters:
        exporter.prime(engine.get_per_tensor_param_shard())
    prime_s = (time.perf_counter() - start) / repeats
    batch = random_batch([tokens] * sequences, engine.config.model.vocab_size, seed=0)
    start = time.perf_counter()
    with engine.train_mode():
        engine.train_batch(batch, sft_loss)
    step_s = time.perf_counter() - start
    engine.optimizer_zero_grad()  # what the next step does first; frees fsdp2's gradients
    release_freed_memory()
    deltas, fulls, wrong = [], [], None
    for index, exporter in enumerate(exporters):
        full_first = index % 2 == 1
        if full_first:
            start = time.perf_counter()
            full_stream(engine, receiver)
            fulls.append(time.perf_counter() - start)
        deltas.append(delta_pass(engine, exporter, receiver))
        if wrong is None:
            wrong = mismatches(engine, receiver)
        if not full_first:
            start = time.perf_counter()
            full_stream(engine, receiver)
            fulls.append(time.perf_counter() - start)
        exporters[index] = DeltaExport()  # its base freed
        release_freed_memory()
    return {
        "seconds": statistics.median(d["seconds"] for d in deltas),
        "apply_s": statistics.median(d["apply_s"] for d in deltas),
        "ratio": statistics.median(d["seconds"] / f for d, f in zip(deltas, fulls, strict=True)),
        "full_s": statistics.median(fulls),
        "bytes": deltas[0]["bytes"],
        "changed": deltas[0]["changed"],
        "same": all(d["bytes"] == deltas[0]["bytes"] for d in deltas),
        "growth": max(d["growth"] for d in deltas),
        "start": deltas[0]["start"],
        "prime_s": prime_s,
        "step_s": step_s,
        "wrong": wrong or [],
    }


def measure(backend: str, dtype: str, lr: float, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    config = engine_config(args.model, dtype, lr, backend)
    engine = Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()
    build_s = time.perf_counter() - start
    receiver = {
        name: torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        for name, tensor in engine.get_per_tensor_param()
    }
    elements = sum(t.numel() for t in receiver.values())
    model_bytes = sum(t.nbytes for t in receiver.values())
    export_dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in receiver.values()})
    label = f"{backend:8s} {dtype:8s} lr={lr:.0e}"
    print(
        f"{label} model {elements / 1e6:.1f}M elements in {len(receiver)} tensors, "
        f"{model_bytes / MB:.1f} MB ({'/'.join(export_dtypes)}); engine built in {build_s:.1f} s",
        flush=True,
    )
    streams = stream_rounds(engine, receiver, args.repeats)
    base, full, shard = streams["baseline"], streams["full"], streams["shard"]
    print(
        f"{label} stream (medians of {args.repeats}; ratio: median of each repeat's time / its "
        f"baseline's): baseline load_state_dict {base['seconds']:.3f} s; full "
        f"{full['seconds']:.3f} s ({full['bytes'] / MB:.1f} MB, {full['ratio']:.2f}x); shard "
        f"{shard['seconds']:.3f} s ({shard['bytes'] / MB:.1f} MB, {shard['ratio']:.2f}x)",
        flush=True,
    )
    print(
        f"{label} peak RSS growth (largest of {args.repeats}) above "
        f"{statistics.median(s['start'] for s in streams.values()) / MB:.0f} MB held (engine + "
        f"receiver + the baseline's source): baseline {base['growth'] / MB:.1f} MB, full "
        f"{full['growth'] / MB:.1f} MB, shard {shard['growth'] / MB:.1f} MB "
        f"(the model: {model_bytes / MB:.0f} MB; its largest tensor "
        f"{max(t.nbytes for t in receiver.values()) / MB:.0f} MB)",
        flush=True,
    )
    repeats = args.delta_repeats if dtype == "bfloat16" else 1
    delta = delta_round(engine, receiver, repeats, args.sequences, args.tokens)
    verdict = (
        "yes, bit for bit"
        if not delta["wrong"]
        else f"NO: {len(delta['wrong'])} tensors differ, e.g. {delta['wrong'][:3]}"
    )
    print(
        f"{label} delta after one step (median of {repeats}, each next to a full stream pass): "
        f"{delta['seconds']:.3f} s (apply {delta['apply_s']:.3f} s) vs full stream "
        f"{delta['full_s']:.3f} s: {delta['ratio']:.2f}x; {delta['bytes'] / MB:.2f} MB shipped = "
        f"{delta['bytes'] / model_bytes:.2%} of the model's bytes"
        f"{'' if delta['same'] else ' (NOT the same in every repeat)'}, "
        f"{delta['changed'] / elements:.2%} of the elements changed; peak RSS growth "
        f"{delta['growth'] / MB:.0f} MB above {delta['start'] / MB:.0f} MB; receiver == fresh "
        f"full export: {verdict} [prime {delta['prime_s']:.2f} s, step {delta['step_s']:.1f} s, "
        "not counted]",
        flush=True,
    )
    del engine, receiver
    if backend == "megatron":
        destroy_mesh()
    release_freed_memory()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["megatron", "fsdp2", "both"], default="both")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2-0.5b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--lr", type=float, action="append", help="learning rates (default 1e-6 and 1e-5)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        action="append",
        help="weight dtypes (default both)",
    )
    parser.add_argument(
        "--delta-repeats",
        type=int,
        default=3,
        help="delta measurements with bf16 weights (each primes one more base: the model's "
        "bytes); float32 takes 1",
    )
    parser.add_argument("--sequences", type=int, default=2, help="sequences in the step's batch")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    backends = ["megatron", "fsdp2"] if args.backend == "both" else [args.backend]
    print(
        f"model {args.model}, {torch.get_num_threads()} threads, peak RSS by "
        f"{'VmHWM reset' if _can_reset_peak() else 'a sampling thread'}",
        flush=True,
    )
    for backend in backends:
        for dtype in args.dtype or ["float32", "bfloat16"]:
            for lr in args.lr or [1e-6, 1e-5]:
                measure(backend, dtype, lr, args)


if __name__ == "__main__":
    main()
