"""LM and value heads: per-token results aligned with the token they score."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heads.base import HeadContext, OutputSpec
from heads.errors import ConfigError
from heads.lm import LMHead
from heads.value import ValueHead


def plain_log_probs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: log_softmax + gather, shifted so entry t scores token t."""
    log_p = torch.log_softmax(logits.float() / max(temperature, 1e-8), dim=-1)
    picked = log_p[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)[:, :-1]
    zero = torch.zeros(logits.shape[0], 1)
    return torch.cat([zero, picked], 1), torch.cat([zero, entropy], 1)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 4),
    seq=st.integers(1, 12),
    vocab=st.integers(2, 50),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 2.5]),
    seed=st.integers(0, 10_000),
)
def test_lm_head_log_probs_and_entropy_equal_log_softmax_gather(
    batch: int, seq: int, vocab: int, temperature: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=generator) * 3
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    head = LMHead(temperature=temperature, compute_entropy=True)

    results = head.postprocess(logits, input_ids, HeadContext())

    expected_log_probs, expected_entropy = plain_log_probs_and_entropy(
        logits, input_ids, temperature
    )
    torch.testing.assert_close(results["log_probs"], expected_log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["entropy"], expected_entropy, atol=1e-5, rtol=1e-5)


def test_lm_head_log_prob_at_t_scores_token_t_from_the_logits_at_t_minus_1() -> None:
    vocab = 5
    logits = torch.full((1, 3, vocab), -1e4)
    logits[0, 0, 3] = 0.0  # position 0 is certain the next token is 3
    logits[0, 1, 1] = 0.0  # position 1 is certain the next token is 1
    results = LMHead().postprocess(logits, torch.tensor([[4, 3, 2]]), HeadContext())
    log_probs = results["log_probs"][0]
    assert log_probs[0] == 0.0  # the first token has no prediction
    assert log_probs[1] == pytest.approx(0.0, abs=1e-6)  # token 3 was predicted at position 0
    assert log_probs[2] < -1e3  # token 2 was ruled out at position 1


def test_lm_head_without_entropy_returns_log_probs_only() -> None:
    results = LMHead().postprocess(
        torch.randn(2, 4, 7), torch.zeros(2, 4, dtype=torch.long), HeadContext()
    )
    assert set(results) == {"log_probs"} == set(LMHead().outputs)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf, "hot", True])
def test_lm_head_rejects_a_temperature_that_is_not_a_finite_positive_number(
    temperature: object,
) -> None:
    with pytest.raises(ConfigError, match=r"LMHead\.temperature"):
        LMHead(temperature=temperature)  # type: ignore[arg-type]


def test_value_head_gives_one_float32_value_per_token_from_the_previous_position() -> None:
    raw = torch.arange(6, dtype=torch.bfloat16).reshape(1, 6, 1)
    values = ValueHead().postprocess(raw, torch.zeros(1, 6, dtype=torch.long), HeadContext())[
        "values"
    ]
    assert values.dtype == torch.float32
    assert values.shape == (1, 6)
    assert values.tolist() == [[0.0, 0.0, 1.0, 2.0, 3.0, 4.0]]


def test_value_head_asks_for_a_replicated_untied_single_output_layer() -> None:
    spec = ValueHead().output_spec()
    assert spec == OutputSpec(kind="replicated", features=1, allow_tied_embeddings=False)


def test_a_replicated_output_layer_cannot_be_tied_to_the_embedding() -> None:
    with pytest.raises(ValueError, match="tied"):
        OutputSpec(kind="replicated", features=1, allow_tied_embeddings=True)
