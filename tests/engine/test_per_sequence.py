"""Per-sequence results (the ``reward`` head): one score per row, taken at the row's own last
token whatever the padding side, micro-batch size or token budget, returned in input order;
every head's outputs are checked against what it declares."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from engine import Engine
from engine.data.batching import from_token_lists, to_padded
from engine.losses import bradley_terry_loss, score_regression_loss
from engine.registry import BACKENDS, DEVICES
from heads.base import PER_SEQUENCE, PER_TOKEN, Granularity, HeadContext, OutputSpec
from heads.errors import BatchError, ConfigError
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model

VOCAB = 64
#: Engines with the same seed (so the same weights) that split batches differently.
LAYOUTS: dict[str, dict[str, Any]] = {
    "one-per-micro-batch": {"micro_batch_size": 1},
    "three-per-micro-batch": {"micro_batch_size": 3},
    "budget-24": {"max_tokens_per_micro_batch": 24},
    "budget-64": {"max_tokens_per_micro_batch": 64},
}


@pytest.fixture(scope="module")
def reward_engines() -> Iterator[dict[str, Engine]]:
    destroy_mesh()
    engines = {
        name: Engine.build(
            head="reward",
            device="cpu",
            config={"model": tiny_model(), "seed": 11, "optimizer": {"lr": 3e-3}, **layout},
        ).initialize()
        for name, layout in LAYOUTS.items()
    }
    yield engines
    destroy_mesh()


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=7),
    side=st.sampled_from(["left", "right"]),
    seed=st.integers(0, 1000),
)
def test_scores_do_not_depend_on_padding_side_micro_batch_size_or_token_budget(
    reward_engines: dict[str, Engine], lengths: list[int], side: str, seed: int
) -> None:
    batch = random_batch(lengths, VOCAB, seed=seed)
    reference = reward_engines["one-per-micro-batch"].infer_batch(batch)["scores"]
    assert reference.shape == (len(lengths),)
    padded = to_padded(batch, side=side)
    for name, engine in reward_engines.items():
        for given_batch in (batch, padded):
            scores = engine.infer_batch(given_batch)["scores"]
            torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-5, msg=name)


def test_a_score_is_read_at_the_rows_own_last_token(reward_engines: dict[str, Engine]) -> None:
    engine = reward_engines["three-per-micro-batch"]
    tokens = [[5, 9, 2, 7], [5, 9, 2], [5, 9]]
    scores = engine.infer_batch(from_token_lists(tokens))["scores"]
    alone = [float(engine.infer_batch(from_token_lists([row]))["scores"][0]) for row in tokens]
    assert scores.tolist() == pytest.approx(alone, abs=1e-5)
    assert len(set(alone)) == 3  # prefixes of one another, so only the last token tells them apart


def preference_batch(pairs: int, seed: int) -> TensorDict:
    """Pairs of random responses; the one with more even tokens is preferred."""
    generator = torch.Generator().manual_seed(seed)
    rows, chosen = [], []
    for _ in range(pairs):
        first, second = (
            torch.randint(0, VOCAB, (int(torch.randint(4, 10, (1,), generator=generator)),),
                          generator=generator).tolist()
            for _ in range(2)
        )  # fmt: skip
        even = [sum(token % 2 == 0 for token in row) / len(row) for row in (first, second)]
        rows += [first, second]
        chosen += [1, 0] if even[0] >= even[1] else [0, 1]
    batch = from_token_lists(rows)
    batch["pair_id"] = torch.arange(pairs).repeat_interleave(2)
    batch["chosen"] = torch.tensor(chosen)
    return batch


def test_bradley_terry_training_learns_the_preference(reward_engines: dict[str, Engine]) -> None:
    trainer = Engine.build(
        head="reward",
        device="cpu",
        config={"model": tiny_model(), "seed": 3, "micro_batch_size": 8, "optimizer": {"lr": 3e-3}},
    ).initialize()
    batches = [preference_batch(8, seed) for seed in range(4)]
    with trainer.train_mode():
        first = [trainer.train_batch(batch, bradley_terry_loss) for batch in batches]
        for _ in range(12):
            last = [trainer.train_batch(batch, bradley_terry_loss) for batch in batches]
    assert sum(r["loss"] for r in last) < 0.5 * sum(r["loss"] for r in first)
    assert sum(r["bt_accuracy"] for r in last) / len(last) > 0.9
    scores = trainer.infer_batch(batches[0])["scores"]
    chosen = batches[0]["chosen"].bool()
    assert bool((scores[chosen] > scores[~chosen]).all())  # infer agrees with training


def test_a_pair_split_across_micro_batches_is_refused_naming_the_pair(
    reward_engines: dict[str, Engine],
) -> None:
    engine = reward_engines["three-per-micro-batch"]
    before = [p.detach().clone() for p in engine.backend.modules()[0].parameters()]
    with pytest.raises(BatchError, match=r"pair_id 1 has 1 response"):
        engine.train_batch(preference_batch(3, seed=0), bradley_terry_loss)
    after = list(engine.backend.modules()[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_score_regression_fits_per_sequence_targets(reward_engines: dict[str, Engine]) -> None:
    engine = reward_engines["budget-64"]
    batch = random_batch([6, 4, 9, 5], VOCAB, seed=4)
    batch["targets"] = torch.tensor([1.0, -1.0, 0.5, 0.0])
    with engine.train_mode():
        losses = [engine.train_batch(batch, score_regression_loss)["loss"] for _ in range(15)]
    assert losses[-1] < 0.2 * losses[0]


def test_bradley_terry_value_is_the_mean_negative_log_sigmoid_of_the_margins() -> None:
    from engine.losses.contract import LossContext

    scores = torch.tensor([0.5, -0.25, 1.0, 2.0], requires_grad=True)
    batch = {"pair_id": torch.tensor([7, 7, 3, 3]), "chosen": torch.tensor([1, 0, 1, 0])}
    ctx = LossContext(
        micro_batch_index=0, num_micro_batches=1, data_parallel_size=1,
        global_counts={"sequences": 4.0},
    )  # fmt: skip
    loss, metrics = bradley_terry_loss({"scores": scores}, TensorDict(batch, [4]), ctx)
    margins = torch.tensor([0.75, -1.0])
    expected = -torch.nn.functional.logsigmoid(margins).mean()
    assert float(loss) == pytest.approx(float(expected))
    assert metrics["bt_accuracy"] == 0.5
    loss.backward()
    assert scores.grad is not None
    assert float(scores.grad[0]) == pytest.approx(-float(torch.sigmoid(-margins[0])) / 2)


@attrs.frozen
class DeclaredHead:
    """A head whose results can break its own declaration in the ways a custom head might."""

    name: ClassVar[str] = "declared"
    fault: str = "none"

    @property
    def outputs(self) -> dict[str, Granularity]:
        return {"score": PER_SEQUENCE if self.fault == "token-as-sequence" else PER_TOKEN}

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="replicated", features=1)

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        per_position = raw[..., 0].float()
        if self.fault == "no-shift" or self.fault == "token-as-sequence":
            return {"score": per_position}
        if self.fault == "undeclared-key":
            return {"scores": per_position}
        shifted = torch.zeros_like(per_position)
        shifted[:, 1:] = per_position[:, :-1]
        return {"score": shifted}


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("no-shift", r"head 'declared': per-token output 'score' has a value at position 0"),
        ("token-as-sequence", r"output 'score' is declared per sequence, so it must have shape"),
        ("undeclared-key", r"declares outputs \['score'\] but postprocess returned \['scores'\]"),
    ],
)
def test_outputs_that_break_the_heads_declaration_are_refused_naming_head_and_key(
    reward_engines: dict[str, Engine], fault: str, message: str
) -> None:
    engine = Engine(
        head=DeclaredHead(fault),
        backend=BACKENDS.create("megatron"),
        platform=DEVICES.create("cpu"),
        config={"model": tiny_model()},
    ).initialize()
    with pytest.raises(ConfigError, match=message):
        engine.infer_batch(random_batch([4, 6], VOCAB))
