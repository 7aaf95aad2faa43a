"""verl's ``TrainingWorker.train_batch`` (verl's PPO loss, through the plug-in's
``ComposableEngine``) against ``Engine.train_batch`` called directly (``ActorLoss``) on the same
model, batch and seed, in one process on CPU; steps alternate so machine noise hits both alike.
Prints the median step time of each, their ratio (target <= 1.10), and the largest difference
between the two paths' losses and log-probabilities after the first step.

    python -m benchmarks.verl_overhead [--steps 20] [--sequences 16] [--layers 2]

Needs verl (``pip install -e '.[verl]'``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch
import torch.distributed as dist
from tensordict import TensorDict


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
    worker.set_loss_fn(
        functools.partial(
            ppo_loss, ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=micro)
        )
    )
    direct = Engine.build(
        head="lm",
        backend="fsdp2",
        device="cpu",
        config={
            "model": path,
            "micro_batch_size": micro,
            "seed": 7,
            "optimizer": {"lr": 1e-4},
            "backend": {"activation_checkpointing": True},
            # verl's use_remove_padding (its default) packs each micro-batch: so does this one
            "packing": True,
        },
    ).initialize()
    loss = ActorLoss(mask_key="response_mask")

    times: dict[str, list[float]] = {"verl": [], "direct": []}
    differences: list[float] = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        through_verl = tu.get(worker.train_batch(verl_batch()), "metrics")["loss"]
        middle = time.perf_counter()
        with direct.train_mode():
            directly = direct.train_batch(engine_batch, loss)["loss"]
        end = time.perf_counter()
        differences.append(abs(float(through_verl) - float(directly)))
        if step:  # the first step warms both up
            times["verl"].append(middle - start)
            times["direct"].append(end - middle)
    theirs = worker.infer_batch(verl_batch())["log_probs"]
    ours = direct.infer_batch(engine_batch)["log_probs"]
    log_prob_difference = max(
        float((a[prompt - 1 : prompt - 1 + n] - b[prompt:]).abs().max())
        for a, b, n in zip(theirs.unbind(), ours.unbind(), lengths, strict=True)
    )
    verl_s, direct_s = (statistics.median(times[key]) for key in ("verl", "direct"))
    print(
        f"{args.sequences} sequences, {sum(len(r) for r in ids)} tokens, micro-batch {micro}, "
        f"{args.layers} layers, {args.steps} steps, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    print(f"TrainingWorker.train_batch (verl)   median {verl_s * 1e3:8.1f} ms")
    print(f"Engine.train_batch (direct)         median {direct_s * 1e3:8.1f} ms")
    print(f"ratio verl / direct                 {verl_s / direct_s:.3f}")
    print(f"max |loss difference| over steps    {max(differences):.2e}")
    print(f"max |log-prob difference| after     {log_prob_difference:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
