"""FSDP2 packing: a packed micro-batch (one row, positions restarting at each sequence,
attention inside each sequence) gives what right-padded micro-batches give -- every head's
outputs, the loss and the gradients, within 1e-5 in float32 -- and in every transformers family
the backend builds (Llama, Qwen2, Qwen3, Mistral with its sliding window, Qwen3-MoE, Mixtral) a
packed row computes what each of its sequences computes alone. Two data-parallel ranks are in
``test_parallel.py``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine
from heads.errors import ConfigError
from strategies.backends.fsdp2.attention import PACKED_BOUNDS, packed_sdpa
from strategies.model.packed_attention import positions_in_sequences
from tests.engine.test_packing import (
    assert_loss_and_gradients_match_padded,
    assert_outputs_match_padded,
)
from tests.factories import raise_outputs_loss, random_batch, tiny_model

VOCAB = 64
HEADS = {"lm": {"compute_entropy": True}, "value": {}, "reward": {}}
#: Same seed, so the same weights; only how batches are cut and laid out differs.
LAYOUTS: dict[str, dict[str, Any]] = {
    "padded": {"micro_batch_size": 2},
    "packed-3": {"packing": True, "micro_batch_size": 3},
    "packed-budget-30": {"packing": True, "max_tokens_per_micro_batch": 30},
}


def build(head: str, **layout: Any) -> Engine:
    config = {"model": tiny_model(), "seed": 5, "optimizer": {"lr": 1e-3}, "head": HEADS[head]}
    return Engine.build(
        head=head, backend="fsdp2", device="cpu", config={**config, **layout}
    ).initialize()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[tuple[str, str], Engine]]:
    yield {(head, name): build(head, **spec) for head in HEADS for name, spec in LAYOUTS.items()}


lengths_mixes = st.lists(st.integers(1, 20), min_size=1, max_size=8)


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lengths=lengths_mixes, side=st.sampled_from(["left", "right"]), seed=st.integers(0, 999))
@pytest.mark.parametrize("head", list(HEADS))
def test_packed_outputs_equal_padded_ones_for_every_head(
    engines: dict[tuple[str, str], Engine], head: str, lengths: list[int], side: str, seed: int
) -> None:
    """Property: outputs do not depend on packing, micro-batch size, budget or padding side."""
    assert_outputs_match_padded(engines, head, random_batch(lengths, VOCAB, seed=seed), side)


@pytest.mark.parametrize("head", list(HEADS))
def test_packed_loss_and_gradients_equal_padded_ones(
    engines: dict[tuple[str, str], Engine], head: str
) -> None:
    batch = random_batch([9, 2, 17, 5, 12, 1, 20], VOCAB, seed=7)
    assert engines[head, "packed-budget-30"].plan_micro_batches(batch).packed
    assert_loss_and_gradients_match_padded(engines, head, batch)


def test_packed_training_steps_follow_padded_ones() -> None:
    runs = {}
    batch = random_batch([5, 17, 9, 12, 2, 20], VOCAB, seed=1)
    for name in ("padded", "packed-budget-30"):
        engine = build("value", **LAYOUTS[name])
        with engine.train_mode():
            runs[name] = [engine.train_batch(batch, raise_outputs_loss)["loss"] for _ in range(3)]
    assert runs["padded"][-1] != runs["padded"][0]
    assert runs["packed-budget-30"] == pytest.approx(runs["padded"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("qk_layernorm", [False, True], ids=["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_routes_packed_rows_as_padded_ones(qk_layernorm: bool) -> None:
    """A packed row holds real tokens only, each routed as on the padded path: the loss and
    every gradient (router and experts included) agree."""
    model = tiny_model(num_experts=4, expert_ffn_hidden_size=16, qk_layernorm=qk_layernorm)
    config = {"model": model, "seed": 5, "optimizer": {"lr": 1e-3}}
    engines = {
        ("value", name): Engine.build(
            head="value", backend="fsdp2", device="cpu", config={**config, **layout}
        ).initialize()
        for name, layout in LAYOUTS.items()
    }
    assert_loss_and_gradients_match_padded(
        engines, "value", random_batch([9, 2, 17, 5, 12], VOCAB, seed=2)
    )


def test_eager_attention_with_packing_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"Fsdp2Backend.attention='eager' cannot run packed"):
        Engine.build(
            head="lm",
            backend="fsdp2",
            device="cpu",
            config={"model": tiny_model(), "packing": True, "backend": {"attention": "eager"}},
        )


# ------------------------------------------------------------------ every transformers family


def family_config(family: str) -> Any:
    import transformers

    shape: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "max_position_embeddings": 64,
    }
    moe = {"num_experts_per_tok": 2, "intermediate_size": 24}
    configs = {
        "llama": lambda: transformers.LlamaConfig(**shape),
        "qwen2": lambda: transformers.Qwen2Config(**shape),
        "qwen3": lambda: transformers.Qwen3Config(**shape, head_dim=8),
        # a window shorter than the sequences: packed rows must keep it inside each sequence
        "mistral": lambda: transformers.MistralConfig(**shape, sliding_window=4),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **{**shape, **moe}, num_experts=4, moe_intermediate_size=24, head_dim=8
        ),
        "mixtral": lambda: transformers.MixtralConfig(**{**shape, **moe}, num_local_experts=4),
    }
    return configs[family]()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_a_packed_row_computes_what_each_sequence_computes_alone_in_every_family(
    family: str,
) -> None:
    """The body model with ``packed_sdpa`` on one packed row equals the same model on the
    right-padded rows (transformers' own sdpa path): attention stays in each sequence, the
    positions restart, a sliding window applies inside each sequence and a mixture of experts
    routes every token as it would alone."""
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(
        family_config(family), attn_implementation=packed_sdpa(), dtype=torch.float32
    ).eval()
    lengths = [5, 1, 9, 7]
    sequences = [torch.randint(0, VOCAB, (n,)) for n in lengths]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    row = torch.cat(sequences)[None]
    with torch.no_grad():
        packed = model(
            input_ids=row,
            attention_mask=torch.ones_like(row, dtype=torch.bool),
            position_ids=positions_in_sequences(bounds)[None],
            use_cache=False,
            **{PACKED_BOUNDS: tuple(bounds.tolist())},
        ).last_hidden_state[0]
        longest = max(lengths)
        padded_ids = torch.stack(
            [torch.nn.functional.pad(s, (0, longest - len(s))) for s in sequences]
        )
        mask = torch.arange(longest)[None] < torch.tensor(lengths)[:, None]
        padded = model(
            input_ids=padded_ids,
            attention_mask=mask,
            position_ids=torch.arange(longest)[None],
            use_cache=False,
        ).last_hidden_state
    for index, (start, end) in enumerate(itertools.pairwise(bounds.tolist())):
        torch.testing.assert_close(
            packed[start:end], padded[index, : end - start], rtol=1e-5, atol=1e-5
        )
