"""Tests for heads.kernels.vocab_parallel: per-token log-probs and entropy, full-vocab and
vocab-parallel.

The reference is plain PyTorch: ``log_softmax(logits.float() / T).gather(...)`` and
``-(p * log p).sum(-1)``, differentiated by autograd. The two-rank vocab-parallel check runs
its ranks through ``tests.multiprocess.run_ranks``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heads.kernels.vocab_parallel import MIN_TEMPERATURE, log_probs_and_entropy
from tests.multiprocess import run_ranks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def plain_log_probs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference computation with plain PyTorch ops (full vocabulary)."""
    scaled = logits.float() / max(temperature, MIN_TEMPERATURE)
    log_p = torch.log_softmax(scaled, dim=-1)
    log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_probs, entropy


def make_case(
    seed: int, shape: tuple[int, ...], vocab: int, dtype: torch.dtype, scale: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=gen)
    return logits, targets


def loss_weights(seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random upstream gradients for (log_probs, entropy)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def grads_of(
    logits: torch.Tensor,
    outputs: tuple[torch.Tensor, torch.Tensor | None],
    weights: tuple[torch.Tensor, torch.Tensor],
    which: str,
) -> torch.Tensor:
    """d(sum(w_lp * log_probs) + sum(w_h * entropy)) / d logits, for the outputs in ``which``."""
    log_probs, entropy = outputs
    loss = torch.zeros(())
    if which in ("both", "log_probs"):
        loss = loss + (log_probs * weights[0]).sum()
    if which in ("both", "entropy"):
        assert entropy is not None
        loss = loss + (entropy * weights[1]).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return grad


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, scale: float = 1.0
) -> None:
    """Close up to ``rtol`` relative to the largest magnitude, or to ``scale`` if larger
    (tiny temperatures scale values by up to 1e8)."""
    assert torch.isfinite(actual).all()
    if expected.numel():
        scale = max(scale, expected.abs().max().item())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale)


temperatures = st.one_of(
    st.sampled_from([1.0, 0.0, -2.0, MIN_TEMPERATURE]), st.floats(0.05, 5.0, allow_nan=False)
)
chunk_sizes = st.one_of(st.none(), st.integers(1, 9))


# ---------------------------------------------------------------- values


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    seq=st.integers(1, 7),
    vocab=st.integers(1, 50),
    temperature=temperatures,
    dtype=st.sampled_from(sorted(DTYPES)),
    chunk_size=chunk_sizes,
)
def test_log_probs_and_entropy_match_plain_pytorch(
    seed: int,
    batch: int,
    seq: int,
    vocab: int,
    temperature: float,
    dtype: str,
    chunk_size: int | None,
) -> None:
    logits, targets = make_case(seed, (batch, seq), vocab, DTYPES[dtype])
    log_probs, entropy = log_probs_and_entropy(
        logits, targets, temperature=temperature, chunk_size=chunk_size
    )
    expected_lp, expected_h = plain_log_probs_and_entropy(logits, targets, temperature)

    assert log_probs.dtype == torch.float32 and log_probs.shape == (batch, seq)
    assert entropy is not None and entropy.dtype == torch.float32 and entropy.shape == (batch, seq)
    # inputs of either dtype are upcast to float32 exactly, so float32 tolerance applies to both
    assert_close_scaled(log_probs, expected_lp, rtol=1e-5)
    assert_close_scaled(entropy, expected_h, rtol=1e-5)


def test_nonpositive_temperature_is_clamped_to_1e_minus_8_without_nan() -> None:
    logits, targets = make_case(0, (4, 5), 17, torch.float32)
    at_min, h_at_min = log_probs_and_entropy(logits, targets, temperature=MIN_TEMPERATURE)
    expected_lp, expected_h = plain_log_probs_and_entropy(logits, targets, MIN_TEMPERATURE)
    assert_close_scaled(at_min, expected_lp, rtol=1e-5)
    assert h_at_min is not None
    assert_close_scaled(h_at_min, expected_h, rtol=1e-5)
    for temperature in (0.0, -1.0, -1e9):
        log_probs, entropy = log_probs_and_entropy(logits, targets, temperature=temperature)
        assert entropy is not None
        assert torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()
        torch.testing.assert_close(log_probs, at_min, rtol=0, atol=0)
        torch.testing.assert_close(entropy, h_at_min, rtol=0, atol=0)


def test_without_entropy_returns_none_and_the_same_log_probs() -> None:
    logits, targets = make_case(1, (3, 4), 23, torch.float32)
    logits.requires_grad_(True)
    with_h = log_probs_and_entropy(logits, targets, temperature=0.7)
    without_h = log_probs_and_entropy(logits, targets, temperature=0.7, compute_entropy=False)
    assert without_h[1] is None
    torch.testing.assert_close(without_h[0], with_h[0], rtol=0, atol=0)
    weights = loss_weights(1, (3, 4))
    torch.testing.assert_close(
        grads_of(logits, without_h, weights, "log_probs"),
        grads_of(logits, with_h, weights, "log_probs"),
    )


def test_minus_inf_logits_get_zero_probability_and_no_nan() -> None:
    """Masked vocabulary padding (-inf) behaves as if those columns did not exist."""
    logits, targets = make_case(2, (3, 6), 13, torch.float32)
    padded = torch.cat([logits, torch.full((3, 6, 5), float("-inf"))], dim=-1)
    padded.requires_grad_(True)
    logits.requires_grad_(True)
    weights = loss_weights(2, (3, 6))

    got = log_probs_and_entropy(padded, targets)
    expected = log_probs_and_entropy(logits, targets)
    torch.testing.assert_close(got[0], expected[0])
    assert got[1] is not None and expected[1] is not None
    torch.testing.assert_close(got[1], expected[1])
    grad = grads_of(padded, got, weights, "both")
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad[..., :13], grads_of(logits, expected, weights, "both"))
    assert (grad[..., 13:] == 0).all()


def test_targets_outside_the_vocabulary_count_as_target_logit_zero() -> None:
    """An ignore index such as -100 does not fail; its log-prob is 0 - logsumexp."""
    logits, targets = make_case(3, (2, 5), 11, torch.float32)
    targets[0, 1] = -100
    targets[1, 3] = 11
    log_probs, _ = log_probs_and_entropy(logits, targets)
    lse = torch.logsumexp(logits, dim=-1)
    torch.testing.assert_close(log_probs[0, 1], -lse[0, 1])
    torch.testing.assert_close(log_probs[1, 3], -lse[1, 3])


def test_non_contiguous_logits_give_the_same_results() -> None:
    logits, targets = make_case(4, (4, 6), 32, torch.float32)
    strided = torch.randn(6, 4, 40).transpose(0, 1)[..., :32]
    strided.copy_(logits)
    assert not strided.is_contiguous()
    for got, expected in zip(
        log_probs_and_entropy(strided, targets, chunk_size=5),
        log_probs_and_entropy(logits, targets),
        strict=True,
    ):
        assert got is not None and expected is not None
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"targets": torch.zeros(3, dtype=torch.int64)}, ValueError),
        ({"targets": torch.zeros(2, 3, dtype=torch.int32)}, TypeError),
        ({"logits": torch.zeros(2, 3, 5, dtype=torch.int64)}, TypeError),
        ({"vocab_start": 5}, ValueError),
        ({"chunk_size": 0}, ValueError),
    ],
    ids=[
        "targets_shape_mismatch",
        "int32_targets",
        "integer_logits",
        "vocab_start_without_group",
        "zero_chunk_size",
    ],
)
def test_invalid_arguments_are_rejected(kwargs: dict[str, object], error: type[Exception]) -> None:
    args: dict[str, object] = {
        "logits": torch.zeros(2, 3, 5),
        "targets": torch.zeros(2, 3, dtype=torch.int64),
    }
    args.update(kwargs)
    with pytest.raises(error):
        log_probs_and_entropy(**args)  # type: ignore[arg-type]


# ---------------------------------------------------------------- gradients


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    seq=st.integers(1, 7),
    vocab=st.integers(1, 50),
    temperature=temperatures,
    dtype=st.sampled_from(sorted(DTYPES)),
    chunk_size=chunk_sizes,
    which=st.sampled_from(["both", "log_probs", "entropy"]),
)
def test_gradients_match_autograd_through_log_softmax(
    seed: int,
    batch: int,
    seq: int,
    vocab: int,
    temperature: float,
    dtype: str,
    chunk_size: int | None,
    which: str,
) -> None:
    logits, targets = make_case(seed, (batch, seq), vocab, DTYPES[dtype])
    weights = loss_weights(seed, (batch, seq))

    ours_in = logits.clone().requires_grad_(True)
    ours = log_probs_and_entropy(ours_in, targets, temperature=temperature, chunk_size=chunk_size)
    grad = grads_of(ours_in, ours, weights, which)

    plain_in = logits.float().requires_grad_(True)
    plain = plain_log_probs_and_entropy(plain_in, targets, temperature)
    expected = grads_of(plain_in, plain, weights, which)

    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    # bfloat16 gradients are rounded once from float32: allow one bfloat16 rounding step.
    # The gradient carries a factor 1/T: at T -> 0 it is float32 rounding noise times 1/T (e.g.
    # the entropy gradient of tied maxima), so the tolerance scales with 1/T.
    scale = 1.0 / max(temperature, MIN_TEMPERATURE)
    assert_close_scaled(grad, expected, rtol=1e-5 if dtype == "float32" else 1e-2, scale=scale)


# ---------------------------------------------------------------- memory


@contextmanager
def count_saved_bytes() -> Iterator[list[int]]:
    """Bytes of every tensor autograd saves for backward inside the block (input or not)."""
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield sizes


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_saved_tensors_for_backward_are_about_one_logits_sized_tensor(dtype: str) -> None:
    tokens, vocab = 64, 1000
    logits, targets = make_case(5, (tokens,), vocab, DTYPES[dtype])
    logits.requires_grad_(True)
    logits_bytes = logits.numel() * logits.element_size()

    with count_saved_bytes() as ours:
        log_probs_and_entropy(logits, targets, temperature=0.9)
    with count_saved_bytes() as plain:
        plain_log_probs_and_entropy(logits, targets, 0.9)

    # the logits themselves plus a few numbers per token (targets, max, log-sum-exp, entropy)
    assert sum(ours) <= logits_bytes + 32 * tokens
    # the plain computation keeps several float32 copies; shows the measure is meaningful
    assert sum(plain) >= 2 * tokens * vocab * 4


def _allocation_peak(fn: object) -> int:
    """Peak of bytes allocated minus freed while ``fn`` runs, from the profiler's allocator
    events (a count of allocations, so it does not depend on timing)."""
    from torch.profiler import ProfilerActivity, profile

    assert callable(fn)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:  # pragma: no cover - private profiler API moved
        pytest.skip("this torch build does not expose profiler allocation events")
    events = [e for e in results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_forward_and_backward_peak_allocation_is_bounded_by_chunks_and_gradient() -> None:
    tokens, vocab, chunk = 256, 2000, 32
    logits, targets = make_case(6, (tokens,), vocab, torch.float32)
    logits.requires_grad_(True)
    logits_bytes = logits.numel() * 4
    chunk_bytes = chunk * vocab * 4
    weights = loss_weights(6, (tokens,))

    def forward_only() -> None:
        with torch.no_grad():
            log_probs_and_entropy(logits, targets, chunk_size=chunk)

    def ours() -> None:
        out = log_probs_and_entropy(logits, targets, chunk_size=chunk)
        grads_of(logits, out, weights, "both")

    def plain() -> None:
        grads_of(logits, plain_log_probs_and_entropy(logits, targets, 1.0), weights, "both")

    per_token = 64 * tokens
    # forward: two float32 chunk buffers; backward: the gradient plus one chunk buffer
    # (measured: 2 chunks + 45 B/token, and gradient + 1 chunk + 37 B/token)
    assert _allocation_peak(forward_only) <= 2 * chunk_bytes + per_token
    assert _allocation_peak(ours) <= logits_bytes + chunk_bytes + per_token
    assert _allocation_peak(plain) >= 3 * logits_bytes


# ---------------------------------------------------------------- vocab parallel (2 processes)

# (seed, shape, vocab, vocab held by rank 0, dtype, temperature, compute_entropy, chunk_size)
PARALLEL_CASES = [
    (10, (2, 5), 16, 8, "float32", 1.0, True, None),
    (11, (3, 4), 33, 16, "float32", 0.6, True, 5),
    (12, (7,), 20, 10, "float32", 0.0, True, 3),
    (13, (2, 3), 24, 12, "bfloat16", 1.3, True, 2),
    (14, (4, 4), 30, 15, "float32", 1.0, False, 4),
]


# Normally the two ranks finish in about 4 s; the limit only stops a hang (and tolerates a
# heavily loaded machine).
RANK_TIMEOUT_S = 120


def vocab_parallel_rank() -> int:
    """One rank of the vocab-parallel check (started by ``run_ranks``): compare its shard's
    results and gradients with the plain full-vocabulary computation (all ranks build the same
    full logits from the seed). Returns how many cases it checked."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    rank = dist.get_rank()
    for seed, shape, vocab, split, dtype, temperature, with_h, chunk in PARALLEL_CASES:
        logits, targets = make_case(seed, shape, vocab, DTYPES[dtype])
        weights = loss_weights(seed, shape)
        start, end = (0, split) if rank == 0 else (split, vocab)
        shard = logits[..., start:end].clone().requires_grad_(True)
        ours = log_probs_and_entropy(
            shard,
            targets,
            temperature=temperature,
            compute_entropy=with_h,
            group=dist.group.WORLD,
            vocab_start=start,
            chunk_size=chunk,
        )
        which = "both" if with_h else "log_probs"
        grad = grads_of(shard, ours, weights, which)

        full = logits.float().requires_grad_(True)
        plain = plain_log_probs_and_entropy(full, targets, temperature)
        expected_grad = grads_of(full, plain, weights, which)[..., start:end]

        assert_close_scaled(ours[0], plain[0], rtol=1e-5)
        if with_h:
            assert ours[1] is not None
            assert_close_scaled(ours[1], plain[1], rtol=1e-5)
        else:
            assert ours[1] is None
        assert grad.dtype == shard.dtype
        assert_close_scaled(grad, expected_grad, rtol=1e-5 if dtype == "float32" else 1e-2)
    return len(PARALLEL_CASES)


@pytest.mark.multiprocess
def test_two_vocab_parallel_ranks_match_full_vocab() -> None:

    assert run_ranks(vocab_parallel_rank, 2, timeout=RANK_TIMEOUT_S) == [len(PARALLEL_CASES)] * 2
