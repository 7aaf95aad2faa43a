"""The fused LM head's gradient computed in its forward pass
(``heads.kernels.fused_output.fused_log_probs_with_gradient``): for a token-separable loss, its
results and the gradients of the hidden states and the output weight equal logits-then-head
(``hidden @ W.T`` then ``log_probs_and_entropy``, autograd) within 1e-5 in float32, on random
shapes, chunks and temperatures, with the weight trained or frozen (LoRA); the log-probs are
bit-identical with and without the entropy; the anchor carrying the gradients scales with its
upstream gradient and hands them over once. Vocab-parallel (TP=2) and engine-level checks are
in ``test_fused_lm_head``."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heads.base import HeadContext
from heads.errors import ConfigError
from heads.kernels.fused_output import (
    default_tile,
    fused_log_probs_and_entropy,
    fused_log_probs_with_gradient,
)
from heads.kernels.vocab_parallel import log_probs_and_entropy
from heads.lm import LMHead
from tests.heads.kernels.test_vocab_parallel import assert_close_scaled
from tests.heads.test_fused_lm_head import TOLERANCE, case


def separable_loss(
    log_probs: torch.Tensor, entropy: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """A nonlinear token-separable loss (its gradient at a token depends on that token only)."""
    loss = (a * log_probs + 0.2 * log_probs.square()).sum()
    if entropy is not None:
        loss = loss + (b * entropy - 0.1 * entropy.square()).sum()
    return loss


def upstream_from(
    a: torch.Tensor, b: torch.Tensor, asked: list[tuple[int, int]] | None = None
) -> object:
    """``upstream_of`` for :func:`separable_loss`, differentiated on each chunk alone."""

    def upstream_of(
        start: int, end: int, log_probs: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if asked is not None:
            asked.append((start, end))
        leaves = [v.detach().requires_grad_() for v in (log_probs, entropy) if v is not None]
        with torch.enable_grad():
            loss = separable_loss(
                leaves[0], leaves[1] if len(leaves) > 1 else None, a[start:end], b[start:end]
            )
            grads = torch.autograd.grad(loss, leaves)
        return grads[0], grads[1] if len(grads) > 1 else None

    return upstream_of


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 70),
    hidden=st.integers(1, 12),
    vocab=st.integers(1, 90),
    chunk=st.integers(1, 80),
    block=st.integers(1, 100),
    temperature=st.sampled_from([1.0, 0.6, 2.5]),
    with_entropy=st.booleans(),
    train_weight=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_gradient_in_forward_equals_logits_then_head(
    tokens: int,
    hidden: int,
    vocab: int,
    chunk: int,
    block: int,
    temperature: float,
    with_entropy: bool,
    train_weight: bool,
    seed: int,
) -> None:
    h, w, targets, (a, b) = case(seed, tokens, hidden, vocab, scale=3.0)
    leaf_h, leaf_w = h.clone().requires_grad_(True), w.clone().requires_grad_(train_weight)
    asked: list[tuple[int, int]] = []
    log_probs, entropy, anchor = fused_log_probs_with_gradient(
        leaf_h,
        leaf_w,
        targets,
        upstream_from(a, b, asked),
        temperature=temperature,
        compute_entropy=with_entropy,
        tile=(chunk, block),
    )
    assert not log_probs.requires_grad and anchor.item() == 0.0
    assert asked == [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]
    loss = separable_loss(log_probs, entropy, a, b) + anchor
    loss.backward()

    ref_h, ref_w = h.clone().requires_grad_(True), w.clone().requires_grad_(train_weight)
    expected = log_probs_and_entropy(
        ref_h @ ref_w.t(), targets, temperature=temperature, compute_entropy=with_entropy
    )
    expected_loss = separable_loss(*expected, a, b)
    expected_loss.backward()
    assert_close_scaled(log_probs, expected[0].detach(), TOLERANCE)
    if with_entropy:
        assert entropy is not None and expected[1] is not None
        assert_close_scaled(entropy, expected[1].detach(), TOLERANCE)
    else:
        assert entropy is None
    assert_close_scaled(loss.detach(), expected_loss.detach(), TOLERANCE)
    assert leaf_h.grad is not None and ref_h.grad is not None
    assert_close_scaled(leaf_h.grad, ref_h.grad, TOLERANCE)
    if train_weight:
        assert leaf_w.grad is not None and ref_w.grad is not None
        assert_close_scaled(leaf_w.grad, ref_w.grad, TOLERANCE)
    else:
        assert leaf_w.grad is None


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(1, 60),
    vocab=st.integers(1, 70),
    chunk=st.integers(1, 64),
    block=st.integers(1, 80),
    seed=st.integers(0, 2**16),
)
def test_its_log_probs_are_bit_identical_to_the_recomputing_paths_with_or_without_entropy(
    tokens: int, vocab: int, chunk: int, block: int, seed: int
) -> None:
    """The same tiles and arithmetic as ``fused_log_probs_and_entropy``: PPO's old log-probs
    (a forward-only pass, no entropy) and new ones (training, in forward, with entropy) agree
    bit for bit, and so do the recomputing path's."""
    h, w, targets, (a, b) = case(seed, tokens, 5, vocab, scale=3.0)
    found = [
        fused_log_probs_with_gradient(
            h.clone().requires_grad_(True),
            w,
            targets,
            upstream_from(a, b),
            temperature=0.8,
            compute_entropy=with_entropy,
            tile=(chunk, block),
        )[:2]
        for with_entropy in (True, False)
    ]
    assert torch.equal(found[0][0], found[1][0])
    recomputing, recomputing_entropy = fused_log_probs_and_entropy(
        h, w, targets, temperature=0.8, tile=(chunk, block)
    )
    assert torch.equal(found[0][0], recomputing)
    assert found[0][1] is not None and torch.equal(found[0][1], recomputing_entropy)


def test_the_anchor_scales_with_its_upstream_gradient_and_hands_the_gradients_over_once() -> None:
    h, w, targets, (a, b) = case(3, 20, 6, 30)
    grads = []
    for factor in (1.0, 2.5):
        leaf_h, leaf_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        _, _, anchor = fused_log_probs_with_gradient(
            leaf_h, leaf_w, targets, upstream_from(a, b), tile=(7, 11)
        )
        (factor * anchor).backward(retain_graph=True)
        assert leaf_h.grad is not None and leaf_w.grad is not None
        grads.append((leaf_h.grad.clone(), leaf_w.grad.clone()))
        with pytest.raises(RuntimeError, match="once"):
            anchor.backward()
    torch.testing.assert_close(grads[1][0], 2.5 * grads[0][0])
    torch.testing.assert_close(grads[1][1], 2.5 * grads[0][1])


def test_a_chunk_the_loss_gives_no_gradient_gets_none_and_bad_arguments_are_refused() -> None:
    h, w, targets, _ = case(4, 12, 3, 10)
    leaf_h = h.clone().requires_grad_(True)
    _, _, anchor = fused_log_probs_with_gradient(
        leaf_h, w, targets, lambda *_: (None, None), tile=(5, 4)
    )
    anchor.backward()
    assert leaf_h.grad is not None and not leaf_h.grad.any()
    with pytest.raises(ValueError, match="tile sizes"):
        fused_log_probs_with_gradient(h, w, targets, lambda *_: (None, None), tile=(0, 4))
    with pytest.raises(ValueError, match="no entropy"):
        fused_log_probs_with_gradient(
            h.clone().requires_grad_(True),
            w,
            targets,
            lambda s, e, lp, ent: (None, torch.ones(e - s)),
            compute_entropy=False,
        )
    with pytest.raises(ValueError, match="targets shape"):
        fused_log_probs_with_gradient(h, w, targets[:3], lambda *_: (None, None))


def test_outside_an_engine_a_wrong_separability_declaration_is_refused_at_once() -> None:
    """``LMHead`` checks the gradients each chunk was given against the loss's gradient with
    every token real; with no deferred checks in its context it raises at once. A loss pooling
    its tokens (here: normalised by their mean log-prob) is caught; a separable one is not."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 150, 8, requires_grad=True)  # 300 tokens: 3 chunks of 128 on CPU
    weight = torch.randn(64, 8)
    ids = torch.randint(0, 64, (2, 150))

    def pooled(results: Mapping[str, torch.Tensor]) -> torch.Tensor:
        log_probs = results["log_probs"]
        return (log_probs / log_probs.mean().detach()).sum()

    def separable(results: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return (results["log_probs"].square() - results["entropy"]).sum()

    head = LMHead(compute_entropy=True, fused_min_logits=0)
    head.postprocess_hidden_with_loss(hidden, weight, ids, HeadContext(), separable)
    with pytest.raises(ConfigError, match="not separable"):
        head.postprocess_hidden_with_loss(hidden, weight, ids, HeadContext(), pooled)


@pytest.mark.parametrize(
    ("tokens", "vocab", "device", "expected"),
    [
        (16384, 151936, "cuda", (1024, 16384)),  # 16M logits a tile on an accelerator
        (4096, 32768, "cuda", (512, 16384)),  # 1/16 of the micro-batch's logits
        (100, 32768, "cuda", (128, 16384)),  # 128 tokens at least
        (2048, 32768, "cpu", (128, 16384)),  # 1M logits on CPU (64 tokens), 128 at least
        (8192, 4096, "cpu", (256, 4096)),  # the vocabulary whole in one block
    ],
)
def test_the_tiles_both_fused_paths_share(
    tokens: int, vocab: int, device: str, expected: tuple[int, int]
) -> None:
    """The gradient in forward keeps a chunk of ``C`` tokens x the whole vocabulary, so ``C``
    is bounded: 1024 tokens a chunk at 16K x 152K on an accelerator (0.3 GiB in bfloat16)."""
    assert default_tile(tokens, vocab, torch.device(device)) == expected
