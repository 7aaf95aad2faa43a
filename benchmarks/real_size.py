"""A real-size training step on the CPU: one step of a Qwen2-0.5B-shaped model (494M
parameters, vocabulary 151936, random weights, nothing downloaded; ``--model tiny`` for a quick
check) on each backend against a hand-written ``transformers`` loop, and a checkpoint of that
model saved and loaded against ``torch.save`` + fsync / ``torch.load``.

Every variant runs in a fresh process of its own, so that its peak resident memory is its own:

* ``transformers``: ``Qwen2ForCausalLM`` built from the same shape (``hf_config_for``), float32,
  ``torch.optim.AdamW`` with the engine's defaults (lr, betas, eps, weight decay 0.01), global
  gradient-norm clipping at 1.0; a step is ``model(input_ids).logits``, the token mean of the
  next-token negative log-likelihood over the same masked tokens, backward, clip, step.
* ``megatron`` / ``fsdp2``: ``Engine.build(head="lm", backend=..., device="cpu")`` with the same
  model, float32, one micro-batch of all the rows, ``train_batch(batch, sft_loss)``.

The same data everywhere: ``--rows`` sequences of ``--tokens`` random token ids (seed 0), the
first token of each unscored. Each process trains ``1 + --steps`` steps (the first is a warm-up,
not timed) and reports its median step time, the loss of its first step (each variant draws its
own random weights, so the losses agree only roughly: about ln(vocabulary), which shows that all
three compute the same thing) and its peak resident memory (``VmHWM``: building included, as a
user sees it). Rounds alternate the order of the variants so drift hits each alike; the ratios
are engine / transformers in the same round, medians over rounds printed last.

Then, in each engine's process after its steps (``--checkpoint-repeats``, 0 to skip): the
engine's ``save_checkpoint`` / ``load_checkpoint`` against ``torch.save`` of the model's and
optimizer's state dicts with an fsync, and ``torch.load`` + ``load_state_dict``, alternated
after one untimed round of each (``benchmarks.checkpoint_io``'s rounds), ratios of the
medians.

    python -m benchmarks.real_size [--model qwen2-0.5b|tiny] [--backends megatron,fsdp2]
        [--rounds 2] [--steps 2] [--rows 4] [--tokens 400] [--threads 2]
        [--checkpoint-repeats 2] [--dir DIR]

Needs about 17 GiB of memory at the 0.5B size (one variant at a time) and twice the model's
training state (~12 GB) of free disk for the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("transformers", "megatron", "fsdp2")
GIB = 1024**3


def model_settings(model: str) -> dict[str, Any]:
    from benchmarks.weight_sync import MODELS

    return MODELS[model]


def data(args: argparse.Namespace, vocab_size: int) -> Any:
    from tests.factories import random_batch

    return random_batch([args.tokens] * args.rows, vocab_size, seed=0)


def transformers_steps(args: argparse.Namespace) -> tuple[list[float], float]:
    """The hand-written loop: step seconds (warm-up first) and the first step's loss."""
    import torch
    import transformers

    from engine import EngineConfig
    from strategies.hf.architecture import hf_config_for
    from strategies.part_configs import OptimizerConfig

    settings = model_settings(args.model)
    hf_config = hf_config_for(EngineConfig.from_dict({"model": settings}).model)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    model.train()
    defaults = OptimizerConfig()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(defaults.adam_beta1, defaults.adam_beta2),
        eps=defaults.adam_eps,
        weight_decay=defaults.weight_decay,
    )
    batch = data(args, settings["vocab_size"])
    ids = batch["input_ids"].to_padded_tensor(padding=0)
    mask = batch["loss_mask"].to_padded_tensor(padding=0.0)
    times, first_loss = [], float("nan")
    for step in range(1 + args.steps):
        start = time.perf_counter()
        logits = model(input_ids=ids).logits
        # token t's log-probability comes from position t - 1 (the engine's LM head contract)
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
        scored = mask[:, 1:]
        loss = -(picked * scored).sum() / scored.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), defaults.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if step == 0:
            first_loss = float(loss)
        del logits, log_probs, picked, loss
    return times, first_loss


def engine_steps(args: argparse.Namespace, backend: str) -> tuple[Any, list[float], float]:
    """The engine's loop: the engine, step seconds (warm-up first) and the first step's loss."""
    from engine import Engine
    from engine.losses import sft_loss

    settings = model_settings(args.model)
    engine = Engine.build(
        head="lm",
        backend=backend,
        device="cpu",
        config={
            "model": settings,
            "dtype": "float32",
            "seed": 0,
            "micro_batch_size": args.rows,
            "optimizer": {"lr": args.lr},
        },
    ).initialize()
    batch = data(args, settings["vocab_size"])
    times, first_loss = [], float("nan")
    for step in range(1 + args.steps):
        start = time.perf_counter()
        result = engine.train_batch(batch, sft_loss)
        times.append(time.perf_counter() - start)
        if step == 0:
            first_loss = float(result["sft_loss"])
    return engine, times, first_loss


def checkpoint_rounds(engine: Any, args: argparse.Namespace) -> dict[str, float]:
    """The engine's save / load against torch.save + fsync / torch.load, alternated; medians."""
    from benchmarks.checkpoint_io import engine_round, torch_round

    runs: dict[str, list[dict[str, float]]] = {"engine": [], "torch": []}
    with tempfile.TemporaryDirectory(prefix="real_size_", dir=args.dir) as parent:
        # one round of each first, not counted, as checkpoint_io: a process's first save pays
        # one-off costs (reported as first_save_s)
        first = engine_round(engine, Path(parent) / "warm-up-engine")
        torch_round(engine, Path(parent) / "warm-up-torch", fsync=True)
        for repeat in range(args.checkpoint_repeats):
            order = ("engine", "torch") if repeat % 2 == 0 else ("torch", "engine")
            for variant in order:
                root = Path(parent) / f"{variant}-{repeat}"
                if variant == "engine":
                    runs[variant].append(engine_round(engine, root))
                else:
                    runs[variant].append(torch_round(engine, root, fsync=True))
    return {
        "first_save_s": first["save_s"],
        **{
            f"{variant}_{key}": statistics.median(run[key] for run in runs[variant])
            for variant in runs
            for key in ("save_s", "load_s", "bytes")
        },
    }


def child(args: argparse.Namespace) -> None:
    """One variant in this process; prints one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"variant": args.child}
    if args.child == "transformers":
        times, loss = transformers_steps(args)
    else:
        engine, times, loss = engine_steps(args, args.child)
    from benchmarks.measure import high_water_mark

    report.update(step_s=statistics.median(times[1:]), first_loss=loss, peak=high_water_mark())
    if args.child != "transformers" and args.checkpoint_repeats:
        report["checkpoint"] = checkpoint_rounds(engine, args)
    print("RESULT " + json.dumps(report), flush=True)


def run_child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "benchmarks.real_size", "--child", variant,
        "--model", args.model, "--steps", str(args.steps), "--rows", str(args.rows),
        "--tokens", str(args.tokens), "--threads", str(args.threads), "--lr", str(args.lr),
        "--checkpoint-repeats", str(args.checkpoint_repeats),
        *(["--dir", str(args.dir)] if args.dir else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def summary(rounds: list[dict[str, dict[str, Any]]], backends: list[str]) -> None:
    """Medians over rounds of each engine's ratios to the same round's transformers loop."""
    print(f"\nmedians over {len(rounds)} round(s), engine / transformers in the same round:")
    for backend in backends:
        time_ratio = statistics.median(
            r[backend]["step_s"] / r["transformers"]["step_s"] for r in rounds
        )
        memory_ratio = statistics.median(
            r[backend]["peak"] / r["transformers"]["peak"] for r in rounds
        )
        line = f"  {backend:9s} step time {time_ratio:.3f}x  peak RSS {memory_ratio:.3f}x"
        saves = [r[backend]["checkpoint"] for r in rounds if "checkpoint" in r[backend]]
        if saves:
            save = statistics.median(c["engine_save_s"] / c["torch_save_s"] for c in saves)
            load = statistics.median(c["engine_load_s"] / c["torch_load_s"] for c in saves)
            size = statistics.median(c["engine_bytes"] / c["torch_bytes"] for c in saves)
            line += (
                f"  checkpoint save {save:.2f}x, load {load:.2f}x torch.save + fsync / "
                f"torch.load (size {size:.3f}x)"
            )
        print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2-0.5b", choices=["qwen2-0.5b", "tiny"])
    parser.add_argument("--backends", default="megatron,fsdp2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--checkpoint-repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, help="where the temporary checkpoints go")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)  # before the steps, not after minutes of them
    backends = args.backends.split(",")
    variants = ["transformers", *backends]
    print(
        f"{args.model}: {args.rows} x {args.tokens} tokens, float32, AdamW, {args.threads} "
        f"thread(s), 1 warm-up + {args.steps} timed step(s) per process, {args.rounds} round(s)",
        flush=True,
    )
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        turn = index % len(variants)
        results: dict[str, dict[str, Any]] = {}
        for variant in variants[turn:] + variants[:turn]:
            result = results[variant] = run_child(variant, args)
            line = (
                f"round {index + 1} {variant:12s} step {result['step_s']:7.2f} s  peak RSS "
                f"{result['peak'] / GIB:6.2f} GiB  first loss {result['first_loss']:.5f}"
            )
            if "checkpoint" in result:
                c = result["checkpoint"]
                line += (
                    f"  save {c['engine_save_s']:.1f} s (first {c['first_save_s']:.1f} s) vs "
                    f"torch.save + fsync "
                    f"{c['torch_save_s']:.1f} s, load {c['engine_load_s']:.1f} s vs "
                    f"torch.load {c['torch_load_s']:.1f} s"
                )
            print(line, flush=True)
        rounds.append(results)
    summary(rounds, backends)


if __name__ == "__main__":
    main()
