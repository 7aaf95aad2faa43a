"""FSDP2 across processes matches one process: data parallel over 2 gloo ranks (FSDP, and HSDP
with 2 replicas of 1 shard) on the same global batch and seed as a single-process run; the
losses of every step and the final full weights agree within 1e-5 (measured: 2.6e-8 for the
LM, 2.3e-8 / 6e-8 for the value model after 3 AdamW steps), and the ranks hold bit-identical
full weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
LENGTHS = [6, 11, 3, 9, 14, 5, 8, 12]


def train_both_heads(
    backend: dict[str, Any], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """On every rank: train an LM and a value engine on this rank's data-parallel shard; report
    the losses and the full (gathered) weights. ``extra``: more engine settings."""
    from engine import Engine
    from engine.data.batching import take_rows
    from engine.losses import sft_loss, value_regression_loss
    from tests.factories import random_batch, tiny_model

    report: dict[str, Any] = {}
    for head, loss in (("lm", sft_loss), ("value", value_regression_loss)):
        config = {
            "model": tiny_model(),
            "micro_batch_size": 2,
            "seed": 11,
            "optimizer": {"lr": 1e-3, "clip_grad": 1.0},
            "backend": backend,
            **(extra or {}),
        }
        engine = Engine.build(head=head, backend="fsdp2", device="cpu", config=config)
        engine.initialize()
        rank, size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
        shard = len(LENGTHS) // size
        with engine.train_mode():
            losses = [
                engine.train_batch(
                    take_rows(
                        random_batch(LENGTHS, 64, seed=step),
                        slice(rank * shard, (rank + 1) * shard),
                    ),
                    loss,
                ).get("loss")
                for step in range(STEPS)
            ]
        weights = dict(engine.get_per_tensor_param())
        # the trained model's per-token outputs of this rank's shard (output ranks only)
        last = take_rows(
            random_batch(LENGTHS, 64, seed=STEPS), slice(rank * shard, (rank + 1) * shard)
        )
        result = engine.infer_batch(last)
        field = "log_probs" if head == "lm" else "values"
        report[head] = {
            "losses": losses,
            "weights": weights,
            "holds": engine.holds_outputs(),
            "outputs": None if result is None else result[field].values().clone(),
            "dp": rank,
        }
    return report


@pytest.fixture(scope="module")
def single_process() -> dict[str, Any]:
    (report,) = run_ranks(train_both_heads, 1, {}, timeout=180)
    return report


@pytest.mark.parametrize("backend", [{}, {"replicate_size": 2}], ids=["fsdp-dp2", "hsdp-2x1"])
def test_two_data_parallel_ranks_match_one_process(
    single_process: dict[str, Any], backend: dict[str, Any]
) -> None:
    reports = run_ranks(train_both_heads, 2, backend, timeout=300)
    for head in ("lm", "value"):
        expected = single_process[head]
        for report in reports:
            got = report[head]
            assert got["holds"]
            assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
            assert got["weights"].keys() == expected["weights"].keys()
            for name, tensor in got["weights"].items():
                torch.testing.assert_close(
                    tensor, expected["weights"][name], atol=1e-5, rtol=1e-5, msg=name
                )
        weights = expected["weights"]
        diff = max(
            float((reports[0][head]["weights"][n] - weights[n]).abs().max()) for n in weights
        )
        print(f"{backend or 'fsdp'} {head}: max |2 ranks - 1 process| weight = {diff:.1e}")
        first, second = (report[head]["weights"] for report in reports)
        assert all(torch.equal(first[name], second[name]) for name in first)


def packed_and_padded_gradients() -> dict[str, Any]:
    """On every rank: for each head, the loss and the full (reduced) gradients of this rank's
    shard of one batch, padded and packed."""
    from engine.data.batching import take_rows
    from tests.engine.test_packing import loss_and_gradients
    from tests.factories import random_batch
    from tests.strategies.backends.fsdp2.test_packing import HEADS, build

    report: dict[str, Any] = {}
    for head in HEADS:
        for name, layout in (
            ("padded", {"micro_batch_size": 2}),
            ("packed", {"packing": True, "max_tokens_per_micro_batch": 24}),
        ):
            engine = build(head, **layout)
            rank, size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
            shard = len(LENGTHS) // size
            batch = take_rows(
                random_batch(LENGTHS, 64, seed=3), slice(rank * shard, (rank + 1) * shard)
            )
            report[head, name] = loss_and_gradients(engine, batch)
    return report


@pytest.mark.timeout(300)
def test_packed_micro_batches_equal_padded_ones_on_two_data_parallel_ranks() -> None:
    """lm (with entropy), value and reward at DP=2: each rank's loss and the reduced gradients
    of packed micro-batches equal the padded ones within 1e-5."""
    reports = run_ranks(packed_and_padded_gradients, 2, timeout=240)
    for report in reports:
        for head in ("lm", "value", "reward"):
            loss, grads = report[head, "padded"]
            packed_loss, packed_grads = report[head, "packed"]
            assert packed_loss == pytest.approx(loss, rel=1e-5, abs=1e-5)
            assert any(bool(grad.abs().sum() > 0) for grad in grads.values())
            for name, grad in grads.items():
                torch.testing.assert_close(
                    packed_grads[name], grad, rtol=1e-5, atol=1e-5, msg=f"{head} {name}"
                )
    for head in ("lm", "value", "reward"):  # the gradients are reduced over both ranks
        first, second = (report[head, "packed"][1] for report in reports)
        assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("world", "extra"),
    [
        (2, {}),
        (2, {"packing": True, "model": {"num_query_groups": 1}}),
        (4, {"packing": True}),
    ],
    ids=["ulysses2", "ulysses2-packed-one-kv-head", "ulysses2xdp2-packed"],
)
def test_ulysses_sequence_parallelism_matches_one_process(
    world: int, extra: dict[str, Any]
) -> None:
    """Each sequence split over 2 ranks (attention over all of it through the all-to-all; one
    key/value head repeated for both ranks), alone and with 2 data-parallel ranks: the output
    ranks' losses and everyone's weights are one process's within 1e-5."""
    from tests.factories import tiny_model

    settings = {**extra, "model": tiny_model(**extra.get("model", {}))}
    (expected,) = run_ranks(train_both_heads, 1, {}, settings, timeout=180)
    reports = run_ranks(train_both_heads, world, {"ulysses_size": 2}, settings, timeout=300)
    for head in ("lm", "value"):
        holders = [report[head] for report in reports if report[head]["holds"]]
        assert len(holders) == world // 2  # the first rank of each sequence-parallel group
        for got in holders:
            assert got["losses"] == pytest.approx(expected[head]["losses"], rel=1e-5, abs=1e-6)
        # log-probs / values after training: the holders' shards in data-parallel order
        shards = [got["outputs"] for got in sorted(holders, key=lambda got: got["dp"])]
        torch.testing.assert_close(
            torch.cat(shards), expected[head]["outputs"], atol=1e-5, rtol=1e-5
        )
        for report in reports:
            for name, tensor in report[head]["weights"].items():
                torch.testing.assert_close(
                    tensor, expected[head]["weights"][name], atol=1e-5, rtol=1e-5, msg=name
                )
