"""The LM head's ``sum_pi_squared`` output (``LMHead(compute_sum_pi_squared=True)``, verl's
``calculate_sum_pi_squared``): ``sum_v softmax(z / T)_v ** 2`` computed directly, on random
shapes, chunks, tiles and temperatures, unfused and fused, in bfloat16, vocab-parallel at TP=2
and through whole engines on both backends; without gradient, and leaving the log-probs, the
entropy and their gradients unchanged bit for bit.

Run as ``python -m`` through ``run_ranks``, ``tensor_parallel_rank`` is one rank of the
two-process check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine
from heads.base import HeadContext, shift_to_scored_token
from heads.kernels import fused_output
from heads.kernels.fused_output import fused_sum_pi_squared
from heads.kernels.vocab_parallel import MIN_TEMPERATURE, sum_pi_squared
from heads.lm import LMHead
from strategies.backends.megatron.mesh import destroy_mesh
from tests.engine.test_packing import flat, loss_and_gradients
from tests.factories import raise_outputs_loss, tiny_model
from tests.heads.kernels.test_vocab_parallel import DTYPES, chunk_sizes, make_case
from tests.heads.test_fused_lm_head import FUNCTION_CASES, SEPARABLE_LOSS, actor_batch, case
from tests.multiprocess import run_ranks
from tests.tolerances import reordered

BF16_EPS = torch.finfo(torch.bfloat16).eps


def direct(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The reference: the squared softmax summed over the vocabulary, in float32."""
    scaled = logits.float() / max(temperature, MIN_TEMPERATURE)
    return torch.softmax(scaled, dim=-1).square().sum(-1)


def allowed(logits: torch.Tensor, temperature: float, logits_error: float = 0.0) -> float:
    """How far two float32 computations of ``sum p ** 2`` from ``logits`` may be apart.

    ``S`` and ``S2`` here, the softmax's normaliser and the sum of squares there, are sums of
    ``V`` positive terms (each off by its exp's and square's rounding): ``S2 / S ** 2``
    compounds three such relative errors, relative to ``sum p ** 2 <= 1``. A change ``d`` of
    the scaled logits ``s = z / T`` moves ``sum p ** 2`` by at most ``2 max |d|``
    (``|d sum p ** 2 / d s_j| = 2 p_j |p_j - sum p ** 2|`` sums to at most 2): the logits
    differ by ``logits_error``, and ``(z - M) / T`` here and ``z / T - max(z / T)`` there
    round values up to ``2 max |z| / T`` twice each (``4 eps max |z| / T`` in all)."""
    vocab = logits.shape[-1]
    rounding = reordered(4) * float(logits.abs().max())
    return reordered(3 * (vocab + 2)) + 2 * (rounding + logits_error) / max(
        temperature, MIN_TEMPERATURE
    )


def matmul_error(hidden: torch.Tensor, weight: torch.Tensor) -> float:
    """Two float32 products ``hidden @ weight.T`` summing the hidden size in other orders
    differ by at most ``reordered(hidden) * max sum_i |h_i w_i|``."""
    magnitudes = hidden.detach().abs().float() @ weight.detach().abs().float().t()
    return reordered(hidden.shape[-1]) * float(magnitudes.max())


def gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.isfinite(got).all()
    return float((got - expected).abs().max()) if got.numel() else 0.0


# -- the functions ----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 7)),
    vocab=st.integers(1, 50),
    temperature=st.one_of(st.just(1.0), st.floats(0.05, 5.0)),
    dtype=st.sampled_from(sorted(DTYPES)),
    chunk_size=chunk_sizes,
)
def test_sum_pi_squared_equals_the_squared_softmax_summed(
    seed: int,
    shape: tuple[int, int],
    vocab: int,
    temperature: float,
    dtype: str,
    chunk_size: int | None,
) -> None:
    """For any shape, chunk and temperature, in float32 or bfloat16 (upcast exactly), the
    result is the plain computation's up to float32 rounding, and has no gradient."""
    logits, _ = make_case(seed, shape, vocab, DTYPES[dtype])
    logits.requires_grad_(True)
    got = sum_pi_squared(logits, temperature=temperature, chunk_size=chunk_size)
    assert not got.requires_grad
    assert gap(got, direct(logits.detach(), temperature)) <= allowed(logits, temperature)


@settings(max_examples=40, deadline=None)
@given(drawn=st.fixed_dictionaries(FUNCTION_CASES))
def test_fused_sum_pi_squared_equals_it_from_the_logits(drawn: dict[str, Any]) -> None:
    """For any shape and tile (online over the vocabulary blocks), the fused result is the
    plain one from ``hidden @ W.T`` up to float32 rounding."""
    sizes = (drawn["tokens"], drawn["hidden"], drawn["vocab"])
    h, w, _, _ = case(drawn["seed"], *sizes, drawn["scale"])
    temperature, tile = drawn["temperature"], (drawn["tile_tokens"], drawn["tile_vocab"])
    got = fused_sum_pi_squared(h.requires_grad_(True), w, temperature=temperature, tile=tile)
    assert not got.requires_grad
    logits = h.detach() @ w.t()
    tolerance = allowed(logits, temperature, matmul_error(h, w))
    assert gap(got, direct(logits, temperature)) <= tolerance


def test_bfloat16_weights_give_it_within_bfloat16_rounding_of_the_logits() -> None:
    """The matmul in bfloat16, the statistics in float32: the tiles' logits and the
    reference's are each a float32 sum rounded to bfloat16 (half an ulp), so they differ by
    at most an ulp of the largest, plus the float32 sums' reordering."""
    # logits of a few units: an ulp of the largest stays a small part of sum p ** 2's range
    h, w, _, _ = case(3, 200, 16, 300, scale=0.3)
    h, w = h.bfloat16(), w.bfloat16()
    logits = h @ w.t()
    got = fused_sum_pi_squared(h, w, temperature=0.7, tile=(64, 128))
    error = BF16_EPS * float(logits.abs().max()) + matmul_error(h, w)
    assert gap(got, direct(logits, 0.7)) <= allowed(logits, 0.7, error)


def test_a_temperature_at_or_below_zero_is_clamped_to_1e_minus_8() -> None:
    h, w, _, _ = case(5, 12, 4, 20, scale=3.0)
    logits = h @ w.t()
    at_min = sum_pi_squared(logits, temperature=MIN_TEMPERATURE)
    fused_at_min = fused_sum_pi_squared(h, w, temperature=MIN_TEMPERATURE, tile=(5, 7))
    for temperature in (0.0, -1.0):
        assert torch.equal(sum_pi_squared(logits, temperature=temperature), at_min)
        assert torch.equal(fused_sum_pi_squared(h, w, temperature=temperature, tile=(5, 7)), at_min)
    # all the mass on the largest logit (random logits have no ties)
    assert torch.equal(at_min, torch.ones(12)) and torch.equal(fused_at_min, torch.ones(12))


# -- the head ---------------------------------------------------------------------------------
HEAD: dict[str, Any] = {"temperature": 0.7, "compute_entropy": True, "fused_min_logits": 0}


def head_results(
    head: LMHead, path: str, h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, ctx: HeadContext
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """The head's results on one of its paths (``postprocess``: from ``h @ w.T``), and the
    gradients of ``h`` and ``w`` for a token-separable loss of the log-probs and entropy."""
    leaf_h, leaf_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    generator = torch.Generator().manual_seed(1)
    upstream = [torch.randn(ids.shape, generator=generator) for _ in range(2)]

    def loss_of(results: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return (results["log_probs"] * upstream[0] + results["entropy"] * upstream[1]).sum()

    anchor = None
    if path == "postprocess":
        results = head.postprocess(leaf_h @ leaf_w.t(), ids, ctx)
    elif path == "postprocess_hidden":
        results = head.postprocess_hidden(leaf_h, leaf_w, ids, ctx)
    else:
        results, anchor = head.postprocess_hidden_with_loss(leaf_h, leaf_w, ids, ctx, loss_of)
        assert anchor is not None
    loss = loss_of(results) if anchor is None else loss_of(results).detach() + anchor
    return results, torch.autograd.grad(loss, (leaf_h, leaf_w))


PATHS = ["postprocess", "postprocess_hidden", "postprocess_hidden_with_loss"]


@pytest.mark.parametrize("path", PATHS)
def test_every_path_of_the_head_gives_it_aligned_and_leaves_the_rest_bit_identical(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """``sum_pi_squared[t]`` comes from the hidden state at ``t - 1`` (0 at position 0), has
    no gradient, and turning it on changes neither the log-probs, the entropy nor the
    gradients, by a bit; the fused paths in tiles of 3 tokens x 5 vocabulary rows."""
    monkeypatch.setattr(fused_output, "default_tile", lambda *_: (3, 5))
    h, w, _, _ = case(7, 2 * 9, 6, 23, scale=3.0)
    h = h.view(2, 9, 6)
    ids = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(2))
    on, off = (LMHead(**HEAD, compute_sum_pi_squared=flag) for flag in (True, False))
    assert list(on.outputs) == ["log_probs", "entropy", "sum_pi_squared"]
    assert "sum_pi_squared" not in off.outputs
    results, grads = head_results(on, path, h, w, ids, HeadContext())
    without, expected_grads = head_results(off, path, h, w, ids, HeadContext())
    assert set(results) == set(on.outputs) and set(without) == set(off.outputs)
    for key in without:
        assert torch.equal(results[key], without[key]), key
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert torch.equal(grad, expected)
    squares = results["sum_pi_squared"]
    assert not squares.requires_grad
    logits = h @ w.t()
    expected_squares = shift_to_scored_token(direct(logits, HEAD["temperature"]))
    error = 0.0 if path == "postprocess" else matmul_error(h, w)
    assert gap(squares, expected_squares) <= allowed(logits, HEAD["temperature"], error)


# -- across processes -------------------------------------------------------------------------
RANK_TIMEOUT_S = 120


def tensor_parallel_rank() -> list[tuple[str, float, float]]:
    """One rank of two, each holding half the vocabulary (15 of 30 rows, tiles of 4 x 4): the
    functions and every path of the head vs the full-vocabulary reference, as ``(what, gap,
    tolerance)``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    fused_output.default_tile = lambda *_: (4, 4)  # a fresh process: no need to restore it
    rank, group = dist.get_rank(), dist.group.WORLD
    h, w, _, _ = case(9, 2 * 6, 5, 30, scale=3.0)
    h = h.view(2, 6, 5)
    ids = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(3))
    rows = slice(rank * 15, (rank + 1) * 15)
    temperature = float(HEAD["temperature"])
    logits = h @ w.t()
    expected = direct(logits, temperature)
    unfused, fused = allowed(logits, temperature), allowed(logits, temperature, matmul_error(h, w))
    found = [
        ("function", gap(sum_pi_squared(logits[..., rows], temperature=temperature, group=group,
                                        chunk_size=5), expected), unfused),
        ("fused_function", gap(fused_sum_pi_squared(h, w[rows], temperature=temperature,
                                                    group=group), expected), fused),
    ]  # fmt: skip
    ctx = HeadContext(tensor_parallel_group=group, vocab_start=rank * 15)
    head = LMHead(**HEAD, compute_sum_pi_squared=True)
    for path in PATHS:
        if path == "postprocess":
            results = head.postprocess(logits[..., rows], ids, ctx)
        else:
            results = head_results(head, path, h, w[rows], ids, ctx)[0]
        squares = results["sum_pi_squared"]
        tolerance = unfused if path == "postprocess" else fused
        found.append((path, gap(squares, shift_to_scored_token(expected)), tolerance))
    return found


@pytest.mark.multiprocess
def test_two_vocab_parallel_ranks_equal_the_full_vocabulary() -> None:
    for rank, found in enumerate(run_ranks(tensor_parallel_rank, 2, timeout=RANK_TIMEOUT_S)):
        assert len(found) == 2 + len(PATHS)
        assert all(got <= tolerance for _, got, tolerance in found), (rank, found)


# -- through the engine -----------------------------------------------------------------------
def build(backend: str, fused: bool, squares: bool) -> Engine:
    """``fused``: the tile loop whatever the micro-batch's size."""
    head = {**HEAD, "fused": fused, "compute_sum_pi_squared": squares}
    config = {"model": tiny_model(), "seed": 3, "micro_batch_size": 2, "head": head}
    return Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[tuple[str, bool, bool], Engine]]:
    """Per (backend, fused, compute_sum_pi_squared)."""
    destroy_mesh()
    yield {
        (backend, fused, squares): build(backend, fused, squares)
        for backend in ("megatron", "fsdp2")
        for fused in (True, False)
        for squares in (True, False)
    }
    destroy_mesh()


def checked_against_the_logits(
    name: str, found: list[tuple[float, float]]
) -> Callable[..., dict[str, torch.Tensor]]:
    """``LMHead.<name>`` (``postprocess``: logits; ``postprocess_hidden``: hidden states and
    weight) comparing each call's ``sum_pi_squared`` with the direct computation from the
    logits there, recording ``(gap, tolerance)`` in ``found``."""
    original = getattr(LMHead, name)

    def checked(head: LMHead, raw: torch.Tensor, *args: Any) -> dict[str, torch.Tensor]:
        results: dict[str, torch.Tensor] = original(head, raw, *args)
        if name == "postprocess":
            logits, error = raw.detach(), 0.0
        else:
            logits, error = raw.detach() @ args[0].detach().t(), matmul_error(raw, args[0])
        expected = shift_to_scored_token(direct(logits, head.temperature), args[-1])
        tolerance = allowed(logits, head.temperature, error)
        found.append((gap(results["sum_pi_squared"], expected), tolerance))
        return results

    return checked


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_an_engines_sum_pi_squared_is_its_logits_and_changes_nothing_else(
    engines: dict[tuple[str, bool, bool], Engine], monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """``infer_batch``'s ``sum_pi_squared`` equals the direct computation from each
    micro-batch's logits (fused and unfused), and the fused engine's the unfused one's; with
    it on, ``infer_batch``'s log-probs and entropy and a step's loss gradients (recomputing
    and in forward) are the ones without it, bit for bit, and a training pass returns the
    forward-only pass's values."""
    batch = actor_batch(4)
    found, tolerances = {}, {}
    for fused, name in ((True, "postprocess_hidden"), (False, "postprocess")):
        checks: list[tuple[float, float]] = []
        monkeypatch.setattr(LMHead, name, checked_against_the_logits(name, checks))
        found[fused] = engines[backend, fused, True].infer_batch(batch)
        monkeypatch.undo()
        assert checks and all(got <= tolerance for got, tolerance in checks), checks
        tolerances[fused] = max(tolerance for _, tolerance in checks)
    squares = {fused: flat(outputs["sum_pi_squared"]) for fused, outputs in found.items()}
    starts = batch["input_ids"].offsets()[:-1]
    assert torch.equal(squares[True][starts], torch.zeros(len(starts)))
    # the same hidden states; the logits differ by the fused tiles' matmul error at most
    assert gap(squares[True], squares[False]) <= tolerances[True]
    for fused in (True, False):
        on, off = engines[backend, fused, True], engines[backend, fused, False]
        without = off.infer_batch(batch)
        for key in without.keys():
            assert torch.equal(flat(found[fused][key]), flat(without[key])), (fused, key)
        for loss_fn in (raise_outputs_loss, SEPARABLE_LOSS):
            (_, grads), (_, expected) = (loss_and_gradients(e, batch, loss_fn) for e in (on, off))
            assert set(grads) == set(expected)
            assert all(torch.equal(grads[k], expected[k]) for k in grads), (fused, loss_fn)
    fused_engine = engines[backend, True, True]
    with fused_engine.train_mode():
        trained = fused_engine.forward_backward_batch(batch, SEPARABLE_LOSS)["model_output"]
        fused_engine.optimizer_zero_grad()
    assert torch.equal(flat(trained["sum_pi_squared"]), squares[True])
