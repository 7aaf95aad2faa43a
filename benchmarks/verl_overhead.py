"""verl's ``TrainingWorker.train_batch`` (verl's PPO loss, through the plug-in's
``ComposableEngine``) against ``Engine.train_batch`` called directly (``ActorLoss``) on the same
model, batch, seed and engine config (the one the plug-in derives from verl's: activation
checkpointing and packed micro-batches in both), in one process on CPU; steps alternate, each
path first in turn, so machine noise hits both alike. Prints each part's median time per step,
the median of the steps' ratios, where the verl path's extra time goes, and the largest
difference between the two paths' losses and log-probabilities.

    python -m benchmarks.verl_overhead [--steps 20] [--sequences 16] [--layers 2]

The breakdown times each part by lightweight wrappers (exclusive time: a wrapped call's time
less that of the wrapped calls inside it) and autograd hooks around each loss's backward, with
verl left as it is:

- verl's own code: ``TrainingWorker.train_batch`` and ``BaseEngine.train_batch`` (batch flags,
  ``_postprocess_output``: loss sum, metrics, MFU), and verl's ``ppo_loss`` per micro-batch,
  forward and backward;
- the adapter (``engine.integrations.verl.adapter``): its mode context, batch translation,
  the wrapped loss (layout translation, each micro-batch's rows of verl's TensorDict) forward
  and backward, output and metrics translation;
- the engine: the rest (model forward and backward, head, optimizer), in both paths; the
  direct path's loss, ``ActorLoss``, forward and backward, apart.

``ratio excluding verl's own`` divides the verl path's time by the direct path's plus verl's
own code that has no counterpart there (its worker's bookkeeping, and its loss's cost beyond
``ActorLoss``'s): the adapter's and the engine's overhead alone (target <= 1.05).

Measured (16 sequences / 1412 tokens, 4 micro-batches, 2-layer Qwen3, fsdp2, 20 steps, a 2-core
machine shared with another job, three runs each): ratio 1.11-1.16 with 1 thread (1.20-1.23
before the adapter gathered verl's micro-batch rows itself), 1.07-1.14 with 2 threads
(1.20-1.31); verl's own code without counterpart ~6-7 ms a step (+5-6% of the direct step),
the adapter ~8-9 ms (+7%; 16-20 ms, +13-17%, before), the engine the same in both paths within
the noise (+-5%); ratio excluding verl's own 1.05-1.10 (1 thread) and 1.01-1.08 (2 threads),
1.14-1.23 before. Losses equal within 6e-9, log-probabilities exactly.

Measured again after the adapter's row selection and jagged tensors got cheaper (1 thread, the
machine shared with a CI run and another job, load average 3-18; three runs alternated with the
version before, medians): the adapter +4.2% of the direct step (4.0-4.3%; 5.9-8.0 ms) against
+6.3% before (6.0-6.7%; 8.9-22.3 ms); ratio excluding verl's own 1.055 (1.04-1.20, the engine's
time differing between the paths by up to 15% under the heaviest load) against 1.067
(1.05-1.08). Its CPU time measured apart on a captured step (thread time, best of 7): the four
micro-batch selections 4.6 -> 2.0 ms, the outputs in verl's layout 1.3 -> 0.5 ms, the loss-mask
count 0.3 -> 0.2 ms. What is left is mostly the selections' 32 jagged tensors (~27 us each to
make, torch's own class) and their non-tensor entries. Losses and log-probabilities unchanged.

Needs verl (``pip install -e '.[verl]'``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch
import torch.distributed as dist
from tensordict import TensorDict

#: The breakdown's parts (``Clock`` labels).
VERL, VERL_LOSS, ADAPTER, ENGINE, DIRECT_LOSS = (
    "verl's own",
    "verl's ppo_loss",
    "adapter",
    "engine",
    "ActorLoss",
)


class Clock:
    """Exclusive seconds per label of wrapped calls: time inside a wrapped call made from
    another counts for the inner call's label only."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open call: time spent in wrapped calls inside it

    def add(self, label: str, seconds: float) -> None:
        """``seconds`` measured apart (e.g. by hooks) moved to ``label`` from the open call's."""
        self.totals[label] += seconds
        if self._inner:
            self._inner[-1] += seconds

    def wrap(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.totals[label] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        return timed

    def wrap_context(self, label: str, factory: Callable[..., Any]) -> Callable[..., Any]:
        """A context manager factory whose managers' enter and exit count for ``label`` (their
        body: for whatever runs in it)."""
        clock = self

        @functools.wraps(factory)
        def make(*args: Any, **kwargs: Any) -> Any:
            manager = factory(*args, **kwargs)

            class Timed:
                def __enter__(self) -> Any:
                    return clock.wrap(label, manager.__enter__)()

                def __exit__(self, *exc: Any) -> Any:
                    return clock.wrap(label, manager.__exit__)(*exc)

            return Timed()

        return make

    def patch(self, target: Any, label: str, *names: str, context: bool = False) -> None:
        """Time the instance's methods ``names`` (context managers with ``context``)."""
        for name in names:
            wrap = self.wrap_context if context else self.wrap
            setattr(target, name, wrap(label, getattr(target, name)))

    def backward(self, output: torch.Tensor, stages: list[tuple[str, torch.Tensor]]) -> None:
        """Time the backward pass from ``output`` stage by stage: ``stages`` are ``(label,
        tensor)`` from the output back towards the inputs, the time from the gradient of one
        (or of ``output``) to that of the next counting for the next one's label (the CPU's
        autograd runs one node at a time, a loss's nodes before those of its inputs), moved out
        of the wrapped call that runs the backward pass."""
        last: list[float] = []

        def reached(label: str | None) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                now = time.perf_counter()
                if label is not None and last:
                    self.add(label, now - last[0])
                last[:] = [now]

            return hook

        if not output.requires_grad:  # forward only
            return
        output.register_hook(reached(None))
        for label, tensor in stages:
            if tensor.requires_grad:
                tensor.register_hook(reached(label))


def _checkpoint(directory: str, layers: int, vocab: int) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


class TimedLoss:
    """A loss function timed forward and backward for ``label``; declarations (required
    fields, token separability) read through to it."""

    def __init__(self, loss: Any, clock: Clock, label: str) -> None:
        self._loss, self._clock, self._label = loss, clock, label

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loss, name)

    def __call__(self, outputs: Mapping[str, torch.Tensor], data: Any, ctx: Any) -> Any:
        value, metrics = self._clock.wrap(self._label, self._loss)(outputs, data, ctx)
        self._clock.backward(value, [(self._label, t) for t in outputs.values()])
        return value, metrics


def _instrument_verl(worker: Any, verl_loss: Callable[..., Any], clock: Clock) -> None:
    """Time the verl path's parts (see the module doc): verl's worker code outside the wrapped
    calls, the adapter's methods and wrapped loss, verl's loss, the engine's methods."""
    adapter = worker.engine
    engine = adapter.engine
    clock.patch(adapter, VERL, "train_batch")  # BaseEngine.train_batch: verl's
    clock.patch(adapter, ADAPTER, "train_mode", context=True)
    clock.patch(
        adapter,
        ADAPTER,
        "forward_backward_batch",
        "optimizer_zero_grad",
        "optimizer_step",
        "lr_scheduler_step",
        "is_mp_src_rank_with_outputs",
        "get_data_parallel_group",
    )
    clock.patch(engine, ENGINE, "train_mode", context=True)
    clock.patch(engine, ENGINE, "forward_backward_batch", "optimizer_zero_grad", "optimizer_step")
    called: list[tuple[torch.Tensor, Mapping[str, torch.Tensor]]] = []

    def loss_fn(*, model_output: Mapping[str, torch.Tensor], **kwargs: Any) -> Any:
        value, metrics = verl_loss(model_output=model_output, **kwargs)
        called.append((value, model_output))
        return value, metrics

    worker.set_loss_fn(clock.wrap(VERL_LOSS, loss_fn))
    make_loss = adapter._loss

    def timed_loss_factory(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        wrapped = clock.wrap(ADAPTER, make_loss(*args, **kwargs))

        def loss(outputs: Mapping[str, torch.Tensor], micro: Any, ctx: Any) -> Any:
            value, metrics = wrapped(outputs, micro, ctx)
            verl_value, model_output = called.pop()
            clock.backward(
                value,
                [
                    (ADAPTER, verl_value),
                    *((VERL_LOSS, t) for t in model_output.values()),
                    *((ADAPTER, t) for t in outputs.values()),
                ],
            )
            return value, metrics

        return loss

    adapter._loss = timed_loss_factory


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # see docs/verl.md

    from verl.utils import tensordict_utils as tu
    from verl.workers.config import (
        ActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.config.checkpoint import CheckpointConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from engine import Engine
    from engine.data.batching import jagged
    from engine.integrations.verl.adapter import ComposableEngine
    from engine.losses import ActorLoss

    vocab, prompt = 256, 32
    path = _checkpoint(tempfile.mkdtemp(prefix="verl-overhead-"), args.layers, vocab)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 96, (args.sequences,), generator=generator).tolist()
    prompts = [torch.randint(0, vocab, (prompt,), generator=generator) for _ in lengths]
    responses = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    old = [-5.5 + 0.3 * torch.randn(n, generator=generator) for n in lengths]
    adv = [torch.randn(n, generator=generator) for n in lengths]
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]

    def verl_batch() -> TensorDict:
        mask = [torch.ones(n, dtype=torch.int64) for n in lengths]
        batch = TensorDict(
            {
                "input_ids": jagged(ids),
                "position_ids": jagged([torch.arange(len(row)) for row in ids]),
                "prompts": jagged(prompts),
                "responses": jagged(responses),
                "response_mask": jagged(mask),
                "loss_mask": jagged(mask),
                "old_log_probs": jagged(old),
                "advantages": jagged(adv),
            },
            batch_size=[len(ids)],
        )
        tu.assign_non_tensor(
            batch,
            global_batch_size=len(ids),
            temperature=1.0,
            global_token_num=[len(row) for row in ids],
        )
        return batch

    def full(rows: list[torch.Tensor]) -> torch.Tensor:
        return jagged([torch.cat([torch.zeros(prompt), row.float()]) for row in rows])

    engine_batch = TensorDict(
        {
            "input_ids": jagged(ids),
            "response_mask": full([torch.ones(n) for n in lengths]),
            "old_log_probs": full(old),
            "advantages": full(adv),
        },
        batch_size=[len(ids)],
    )
    micro = 4
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type="language_model",
            model_config=HFModelConfig(path=path, load_tokenizer=False),
            engine_config=FSDPEngineConfig(
                strategy="fsdp2",
                use_dynamic_bsz=False,
                micro_batch_size_per_gpu=micro,
                infer_micro_batch_size_per_gpu=micro,
                mixed_precision={"param_dtype": "fp32"},
                seed=7,
            ),
            optimizer_config=FSDPOptimizerConfig(lr=1e-4, total_training_steps=1000),
            checkpoint_config=CheckpointConfig(),
        )
    )
    worker.reset()
    assert isinstance(worker.engine, ComposableEngine), type(worker.engine)
    # the engine config the plug-in derived from verl's (its enable_gradient_checkpointing and
    # use_remove_padding, both on by default, checkpoint each layer and pack each micro-batch):
    # the direct engine is asked for the same work
    direct = Engine.build(
        head="lm", backend="fsdp2", device="cpu", config=worker.engine.engine.config
    ).initialize()
    assert direct.config.backend["activation_checkpointing"] and direct.config.packing

    clocks = {"verl": Clock(), "direct": Clock()}
    _instrument_verl(
        worker,
        functools.partial(
            ppo_loss, ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=micro)
        ),
        clocks["verl"],
    )
    loss = TimedLoss(ActorLoss(mask_key="response_mask"), clocks["direct"], DIRECT_LOSS)
    clocks["direct"].patch(direct, ENGINE, "train_mode", context=True)

    def through_verl(batch: TensorDict) -> float:
        return float(tu.get(worker.train_batch(batch), "metrics")["loss"])

    def directly() -> float:
        with direct.train_mode():
            return float(direct.train_batch(engine_batch, loss)["loss"])

    timed = {
        "verl": clocks["verl"].wrap(VERL, through_verl),
        "direct": clocks["direct"].wrap(ENGINE, directly),
    }
    parts: dict[str, list[dict[str, float]]] = {"verl": [], "direct": []}
    differences: list[float] = []
    for step in range(args.steps + 1):
        batch = verl_batch()  # verl's worker writes its flags into the batch: one per step
        values = {}
        runs = {"verl": functools.partial(timed["verl"], batch), "direct": timed["direct"]}
        for key in ("verl", "direct") if step % 2 else ("direct", "verl"):  # each first in turn
            clocks[key].totals.clear()
            values[key] = runs[key]()
            if step:  # the first step warms both up
                parts[key].append(dict(clocks[key].totals))
        differences.append(abs(values["verl"] - values["direct"]))
    theirs = worker.infer_batch(verl_batch())["log_probs"]
    ours = direct.infer_batch(engine_batch)["log_probs"]
    log_prob_difference = max(
        float((a[prompt - 1 : prompt - 1 + n] - b[prompt:]).abs().max())
        for a, b, n in zip(theirs.unbind(), ours.unbind(), lengths, strict=True)
    )
    _report(args, micro, sum(len(r) for r in ids), parts, differences, log_prob_difference)
    dist.destroy_process_group()


def _report(
    args: argparse.Namespace,
    micro: int,
    tokens: int,
    parts: dict[str, list[dict[str, float]]],
    differences: list[float],
    log_prob_difference: float,
) -> None:
    totals = {key: [sum(step.values()) for step in steps] for key, steps in parts.items()}
    pairs = list(zip(parts["verl"], parts["direct"], totals["verl"], totals["direct"], strict=True))
    # per step (the paths alternate, so a step's pair shares the machine's state): verl's own
    # code with no counterpart in the direct path, the adapter's, the engine's extra time
    extra = {
        "verl's own code without counterpart": [
            v.get(VERL, 0.0) + v.get(VERL_LOSS, 0.0) - d.get(DIRECT_LOSS, 0.0)
            for v, d, _, _ in pairs
        ],
        "adapter": [v.get(ADAPTER, 0.0) for v, _, _, _ in pairs],
        "engine, verl path - direct": [
            v.get(ENGINE, 0.0) - d.get(ENGINE, 0.0) for v, d, _, _ in pairs
        ],
    }
    own = extra["verl's own code without counterpart"]
    print(
        f"{args.sequences} sequences, {tokens} tokens, micro-batch {micro}, {args.layers} "
        f"layers, {args.steps} steps, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    print(f"{'median ms per step':34} {'verl':>8} {'direct':>8}")
    for label in (VERL, VERL_LOSS, DIRECT_LOSS, ADAPTER, ENGINE):
        row = []
        for key in ("verl", "direct"):
            steps = parts[key]
            seen = any(label in step for step in steps)
            row.append(
                f"{_median_ms([s.get(label, 0.0) for s in steps]):8.1f}" if seen else " " * 8
            )
        print(f"  {label:32} {row[0]} {row[1]}")
    print(f"  {'total':32} {_median_ms(totals['verl']):8.1f} {_median_ms(totals['direct']):8.1f}")
    ratio = statistics.median(t_v / t_d for _, _, t_v, t_d in pairs)
    print(f"ratio verl / direct (median of steps)     {ratio:.3f}")
    for name, values in extra.items():
        share = statistics.median(x / t_d for x, (_, _, _, t_d) in zip(values, pairs, strict=True))
        print(f"  {name:38} {_median_ms(values):6.1f} ms  {share:+6.1%} of direct")
    excluding = statistics.median(
        t_v / (t_d + o) for (_, _, t_v, t_d), o in zip(pairs, own, strict=True)
    )
    print(f"ratio excluding verl's own                {excluding:.3f}")
    print(f"max |loss difference| over steps          {max(differences):.2e}")
    print(f"max |log-prob difference| after           {log_prob_difference:.2e}")


if __name__ == "__main__":
    main()
