"""Tokens/s of the shared Hugging Face generator (:func:`engine.generation.sampling.generate`,
the demo's and verl's ``composable_hf`` rollout's) vs ``transformers``' own ``model.generate``,
on the same model, prompts and sampling settings.

Two models, random weights (nothing downloaded), float32 on the CPU:

* ``task``: the shipped verl task's tiny Qwen3 (``engine.integrations.verl.task.model_config``)
  with its batch and lengths: 16 prompts x 8 samples = 128 rows of 11 tokens (the chat prompt
  ``<|im_start|> user \\n repeat : kiwi <|im_end|> \\n <|im_start|> assistant \\n``), 4 new
  tokens each (``data.max_response_length=4``).
* ``0.5b``: a Qwen2-0.5B-shape model (hidden 896, 24 layers, 14 heads / 2 KV heads,
  intermediate 4864, vocabulary 151936; ``--layers`` fewer for a quick run), 16 prompts of 8-16
  tokens, left-padded, 32 new tokens each.

Sampling as verl's rollout does by default: temperature 1, no top-k, no top-p (``--top-k`` /
``--top-p`` to change), each row's token drawn by verl's picker (Gumbel-max from the replica's
stream, ``--pick multinomial`` for the demo's). End-of-sequence stopping is off on both sides,
so both generate exactly ``rows x new tokens`` tokens (checked); only generated tokens count.
``transformers`` runs with its dynamic cache and, with ``--static``, its static cache
(``cache_implementation="static"``). The variants alternate, their order flipped every round,
so that load on a shared machine hits them alike; printed: each one's median tokens/s and the
median over rounds of ours / transformers' (above 1: ours is faster).

    python -m benchmarks.generation [--models task 0.5b] [--rounds 5] [--layers 24] [--static]
    python -m benchmarks.generation --quick     # a 2-layer 0.5b, 4 x 8 tokens: under a minute
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from engine.generation.sampling import GumbelMax, Multinomial, Warp, generate, left_padded
from engine.generation.weights import build_model


def task_config(layers: int | None) -> object:
    from engine.integrations.verl import task

    return task.model_config()


def qwen2_half_b_config(layers: int | None) -> object:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=layers or 24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )


class Shape(NamedTuple):
    """A model's config (from ``--layers``) and its batch: rows, prompt lengths, new tokens."""

    config: Callable[[int | None], object]
    rows: int
    shortest: int
    longest: int
    new_tokens: int


MODELS = {
    "task": Shape(task_config, rows=128, shortest=11, longest=11, new_tokens=4),
    "0.5b": Shape(qwen2_half_b_config, rows=16, shortest=8, longest=16, new_tokens=32),
}
#: ``--quick``: 2 layers, and a smaller batch for the 0.5b's 151936-word output layer.
QUICK = {"task": MODELS["task"], "0.5b": MODELS["0.5b"]._replace(rows=4, new_tokens=8)}


def prompts(rows: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts (no pad or end-of-sequence token, ids 0 and 1 here and in the task's
    vocabulary up to 3) of lengths between ``shortest`` and ``longest``."""
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=rng).tolist()
    return [torch.randint(4, vocab, (length,), generator=rng).tolist() for length in lengths]


def run_ours(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int,
    warp: Warp,
    pick_name: str,
) -> int:
    rng = torch.Generator().manual_seed(0)
    rows = input_ids.shape[0]
    pick = GumbelMax([rng] * rows) if pick_name == "gumbel" else Multinomial(rng)
    out = generate(
        model, input_ids, attention_mask=mask, max_tokens=new_tokens, warp=warp, pick=pick
    )
    return int(out.lengths.sum())


def run_transformers(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int,
    warp: Warp,
    cache: str | None,
) -> int:
    from transformers import GenerationConfig

    settings = GenerationConfig(
        do_sample=True,
        temperature=warp.temperature,
        top_k=max(warp.top_k, 0),  # 0: no top-k (its default is 50)
        top_p=warp.top_p,
        max_new_tokens=new_tokens,
        eos_token_id=None,  # no stopping: every row generates new_tokens
        pad_token_id=0,
        cache_implementation=cache,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, generation_config=settings)
    return (out.shape[1] - input_ids.shape[1]) * out.shape[0]


def measure(name: str, args: argparse.Namespace) -> None:
    shape = (QUICK if args.quick else MODELS)[name]
    rows, new_tokens = args.rows or shape.rows, args.new_tokens or shape.new_tokens
    torch.manual_seed(0)
    model = build_model(shape.config(args.layers))
    config = model.config
    input_ids, mask = left_padded(
        prompts(rows, shape.shortest, shape.longest, config.vocab_size, seed=1), pad=0
    )
    warp = Warp(temperature=1.0, top_k=args.top_k, top_p=args.top_p)
    variants: dict[str, Callable[[], int]] = {
        "ours": lambda: run_ours(model, input_ids, mask, new_tokens, warp, args.pick),
        "transformers": lambda: run_transformers(model, input_ids, mask, new_tokens, warp, None),
    }
    if args.static:
        variants["transformers static"] = lambda: run_transformers(
            model, input_ids, mask, new_tokens, warp, "static"
        )
    expected = rows * new_tokens
    for variant, run in variants.items():  # warm-up, and the count of tokens
        if run() != expected:
            raise SystemExit(f"{variant} generated other than {rows} x {new_tokens} tokens")
    seconds: dict[str, list[float]] = {variant: [] for variant in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for variant in order:
            start = time.perf_counter()
            variants[variant]()
            seconds[variant].append(time.perf_counter() - start)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"{name}: {parameters / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, "
        f"{rows} rows of {input_ids.shape[1]} prompt tokens (left-padded), {new_tokens} new "
        f"tokens, top_k={args.top_k} top_p={args.top_p}, pick={args.pick}, "
        f"{args.rounds} rounds, {torch.get_num_threads()} thread(s)"
    )
    for variant, times in seconds.items():
        print(f"  {variant:20s} {expected / statistics.median(times):10.1f} tokens/s")
    for variant in variants:
        if variant != "ours":
            ratios = [
                theirs / ours
                for ours, theirs in zip(seconds["ours"], seconds[variant], strict=True)
            ]
            print(
                f"  ours / {variant}: {statistics.median(ratios):.3f}x "
                f"(rounds {min(ratios):.3f}-{max(ratios):.3f})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument("--layers", type=int, help="layers of the 0.5b model (default 24)")
    parser.add_argument("--rows", type=int, help="prompts in the batch (default: the model's)")
    parser.add_argument("--new-tokens", type=int, help="tokens per row (default: the model's)")
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--pick", choices=("gumbel", "multinomial"), default="gumbel")
    parser.add_argument("--static", action="store_true", help="also transformers' static cache")
    parser.add_argument(
        "--quick", action="store_true", help="a 2-layer 0.5b, 4 rows of 8 new tokens, 3 rounds"
    )
    args = parser.parse_args()
    if args.quick:
        args.layers, args.rounds = args.layers or 2, 3
    for name in args.models:
        measure(name, args)


if __name__ == "__main__":
    main()
