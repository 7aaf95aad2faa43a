"""The fused output layer + LM head (``heads.kernels.fused_output``, ``LMHead(fused=True)``):
log-probs, entropy, loss and gradients w.r.t. the hidden states and the output weight equal the
unfused path (``hidden @ W.T`` then ``log_probs_and_entropy``) up to float32 rounding
(:data:`TOLERANCE`), on random shapes and tiles, vocab-parallel at TP=2, through both backends
with packing and tied embeddings; the log-probs are bit-identical with and without the
entropy; the ``[tokens, vocab]`` logits are never allocated; heads that want raw logits keep
getting them.

Run as ``python -m`` through ``run_ranks``, ``compare_fused_with_unfused`` is one rank of the
two-process checks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.data.batching import jagged
from engine.losses import ActorLoss, LossFn, token_separable
from engine.registry import BACKENDS
from heads import lm as lm_module
from heads.base import PER_TOKEN, HeadContext, OutputSpec, shift_to_scored_token
from heads.errors import ConfigError
from heads.kernels import fused_output
from heads.kernels.fused_output import fused_log_probs_and_entropy, fused_log_probs_with_gradient
from heads.kernels.vocab_parallel import log_probs_and_entropy
from heads.lm import FUSED_MIN_LOGITS, LMHead
from strategies.backends.base import Packing
from strategies.backends.megatron.mesh import destroy_mesh
from tests.engine.test_packing import flat, loss_and_gradients
from tests.factories import raise_outputs_loss, random_batch, tiny_model
from tests.heads.kernels.test_vocab_parallel import _allocation_peak, assert_close_scaled
from tests.multiprocess import run_ranks
from tests.tolerances import LIPSCHITZ_ADAMW, relative_gap, reordered

#: The fused and unfused paths compute the same float32 function with the sums in another order:
#: the logits' dot products over the hidden size (32 in the engines, at most 40 in the function
#: cases) and the log-sum-exp over the vocabulary (64 in the engines, in tiles of 48; gradients
#: sum the same terms back). Relative to the magnitude (log-probs reach ~6): ``(32 + 64) * eps``,
#: 1.1e-5. A dropped temperature or a wrong tile offset changes results by O(0.1) or more.
TOLERANCE = reordered(32 + 64)


def case(
    seed: int, tokens: int, hidden: int, vocab: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Hidden states, output weight, targets and upstream gradients (log-probs, entropy)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * scale
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return h, w, targets, (torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen))


def results_and_gradients(
    compute: Any, h: torch.Tensor, w: torch.Tensor, upstream: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """log-probs, entropy, loss ``sum(g_lp log_probs + g_h entropy)`` and its gradients."""
    leaf_h, leaf_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    log_probs, entropy = compute(leaf_h, leaf_w)
    loss = (log_probs * upstream[0]).sum() + (entropy * upstream[1]).sum()
    grad_h, grad_w = torch.autograd.grad(loss, (leaf_h, leaf_w))
    return log_probs.detach(), entropy.detach(), loss.detach(), grad_h, grad_w


#: The function cases: shapes, tiles (tokens x vocabulary rows), temperatures, weight scales.
FUNCTION_CASES = {
    "tokens": st.integers(1, 70),
    "hidden": st.integers(1, 12),
    "vocab": st.integers(1, 90),
    "tile_tokens": st.integers(1, 80),
    "tile_vocab": st.integers(1, 100),
    "temperature": st.sampled_from([1.0, 0.6, 2.5]),
    "scale": st.sampled_from([0.3, 3.0]),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=40, deadline=None)
@given(**FUNCTION_CASES)
def test_fused_results_and_gradients_equal_the_unfused_path(
    tokens: int,
    hidden: int,
    vocab: int,
    tile_tokens: int,
    tile_vocab: int,
    temperature: float,
    scale: float,
    seed: int,
) -> None:
    """For any shape and tile, every result and gradient equals logits-then-head up to the
    rounding of sums over the tokens, the vocabulary and the hidden size in another order."""
    h, w, targets, upstream = case(seed, tokens, hidden, vocab, scale)
    fused = results_and_gradients(
        lambda a, b: fused_log_probs_and_entropy(
            a, b, targets, temperature=temperature, tile=(tile_tokens, tile_vocab)
        ),
        h,
        w,
        upstream,
    )
    unfused = results_and_gradients(
        lambda a, b: log_probs_and_entropy(a @ b.t(), targets, temperature=temperature),
        h,
        w,
        upstream,
    )
    for got, expected in zip(fused, unfused, strict=True):
        assert_close_scaled(got, expected, reordered(tokens + vocab + hidden))


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 60),
    vocab=st.integers(1, 70),
    tile_tokens=st.integers(1, 64),
    tile_vocab=st.integers(1, 80),
    seed=st.integers(0, 2**16),
)
def test_log_probs_are_bit_identical_with_and_without_entropy(
    tokens: int, vocab: int, tile_tokens: int, tile_vocab: int, seed: int
) -> None:
    """PPO's old log-probs (no entropy) and new ones (with entropy) come from the same ops."""
    h, w, targets, _ = case(seed, tokens, 6, vocab, scale=3.0)
    kwargs: dict[str, Any] = {"temperature": 0.7, "tile": (tile_tokens, tile_vocab)}
    with_entropy, entropy = fused_log_probs_and_entropy(h, w, targets, **kwargs)
    alone, none = fused_log_probs_and_entropy(h, w, targets, compute_entropy=False, **kwargs)
    assert entropy is not None and none is None
    assert torch.equal(with_entropy, alone)


def test_bfloat16_weights_give_the_unfused_results_within_bfloat16_rounding() -> None:
    h, w, targets, upstream = case(3, 200, 16, 300)
    h, w = h.bfloat16(), w.bfloat16()
    fused = results_and_gradients(
        lambda a, b: fused_log_probs_and_entropy(a, b, targets, tile=(64, 128)), h, w, upstream
    )
    unfused = results_and_gradients(
        lambda a, b: log_probs_and_entropy(a @ b.t(), targets), h, w, upstream
    )
    for got, expected in zip(fused, unfused, strict=True):
        assert got.dtype == expected.dtype
        assert_close_scaled(got, expected, 2e-2)


def test_forward_and_backward_never_allocate_the_logits() -> None:
    tokens, hidden, vocab, tile = 512, 8, 4096, (64, 512)
    h, w, targets, upstream = case(4, tokens, hidden, vocab)
    h.requires_grad_(True)
    w.requires_grad_(True)
    logits_bytes = tokens * vocab * 4
    tile_bytes = tile[0] * tile[1] * 4
    grads_bytes = (tokens + vocab) * hidden * 4

    def fused() -> None:
        log_probs, entropy = fused_log_probs_and_entropy(h, w, targets, tile=tile)
        torch.autograd.backward([log_probs, entropy], list(upstream))

    def unfused() -> None:
        log_probs, entropy = log_probs_and_entropy(h @ w.t(), targets)
        torch.autograd.backward([log_probs, entropy], list(upstream))

    # the gradients of h and W, three tile-sized work buffers and a few numbers per token
    assert _allocation_peak(fused) <= grads_bytes + 4 * tile_bytes + 64 * tokens
    assert _allocation_peak(fused) < logits_bytes / 4
    # the unfused path holds the logits and their gradient: shows the measure is meaningful
    assert _allocation_peak(unfused) >= 2 * logits_bytes


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"hidden": torch.zeros(3, 5)}, ValueError),
        ({"weight": torch.zeros(0, 4)}, ValueError),
        ({"targets": torch.zeros(3, dtype=torch.int32)}, TypeError),
        ({"targets": torch.zeros(2, dtype=torch.long)}, ValueError),
        ({"vocab_start": 2}, ValueError),
        ({"tile": (0, 4)}, ValueError),
    ],
)
def test_invalid_arguments_are_rejected(kwargs: dict[str, Any], error: type[Exception]) -> None:
    arguments: dict[str, Any] = {
        "hidden": torch.zeros(3, 4),
        "weight": torch.zeros(6, 4),
        "targets": torch.zeros(3, dtype=torch.long),
        **kwargs,
    }
    with pytest.raises(error):
        fused_log_probs_and_entropy(**arguments)


# -- the head contract ------------------------------------------------------------------------
def test_a_fused_output_layer_must_be_over_the_vocabulary() -> None:
    with pytest.raises(ConfigError, match="fused output layer needs kind 'vocab'"):
        OutputSpec(kind="replicated", features=1, fused=True)


class RecordingLogitsHead:
    """A custom head that wants the raw logits (``postprocess`` only), recording what it got."""

    name: ClassVar[str] = "logits-recorder"
    seen: ClassVar[list[tuple[int, ...]]] = []

    @property
    def outputs(self) -> Mapping[str, str]:
        return {"top": PER_TOKEN}

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="vocab")

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        self.seen.append(tuple(raw.shape))
        return {"top": shift_to_scored_token(raw.amax(-1), ctx)}


class FusedWithoutHiddenHead(RecordingLogitsHead):
    name: ClassVar[str] = "fused-without-hidden"

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="vocab", fused=True)


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_a_head_that_wants_logits_gets_them_from_every_backend(backend: str) -> None:
    RecordingLogitsHead.seen.clear()
    engine = Engine.build(
        head=RecordingLogitsHead(), backend=backend, device="cpu", config={"model": tiny_model()}
    ).initialize()
    engine.infer_batch(random_batch([4, 6], 64))
    assert RecordingLogitsHead.seen and all(shape[-1] == 64 for shape in RecordingLogitsHead.seen)


def test_a_head_asking_for_fusion_without_postprocess_hidden_is_refused_at_build() -> None:
    with pytest.raises(ConfigError, match="postprocess_hidden"):
        Engine.build(head=FusedWithoutHiddenHead(), device="cpu", config={"model": tiny_model()})


# -- through the engine -----------------------------------------------------------------------
HEAD_OPTIONS = {"compute_entropy": True, "temperature": 0.7}
#: Packed micro-batches on every backend that packs.
CASES = [
    (backend, tie, packed)
    for backend in ("megatron", "fsdp2")
    for tie in (False, True)
    for packed in (False, True)
    if not packed or isinstance(BACKENDS.create(backend), Packing)
]


def build(
    backend: str, fused: bool, tie: bool, packed: bool, min_logits: int = 0, **config: Any
) -> Engine:
    """``fused``: the tile loop whatever the size (``fused_min_logits`` 0), unless
    ``min_logits`` says otherwise. AdamW is :data:`LIPSCHITZ_ADAMW`, so that engines compared
    after steps (these are shared by the tests of a module) stay within rounding of each other."""
    settings_: dict[str, Any] = {
        "model": tiny_model(tie_embeddings=tie),
        "seed": 3,
        "optimizer": LIPSCHITZ_ADAMW,
        "head": {**HEAD_OPTIONS, "fused": fused, "fused_min_logits": min_logits},
        "micro_batch_size": 2,
        **config,
    }
    if packed:
        settings_["packing"] = True
    return Engine.build(head="lm", backend=backend, device="cpu", config=settings_).initialize()


@pytest.fixture(scope="module")
def engine_pairs() -> Iterator[dict[tuple[str, bool, bool], dict[bool, Engine]]]:
    destroy_mesh()
    pairs = {}
    for backend, tie, packed in CASES:
        engines = {fused: build(backend, fused, tie, packed) for fused in (True, False)}
        pairs[backend, tie, packed] = engines
    yield pairs
    destroy_mesh()


#: A token-separable loss (the fused head computes its gradient in the forward pass) that
#: reads log-probs and entropy, nonlinearly, through PPO's clip, KL penalty and entropy bonus.
SEPARABLE_LOSS = ActorLoss(
    entropy_coeff=0.01, kl_coeff=0.1, kl_type="k3", loss_agg_mode="seq-mean-token-mean"
)
LENGTHS = [5, 9, 3, 7, 2]


def actor_batch(seed: int) -> Any:
    """``random_batch`` with what :data:`SEPARABLE_LOSS` reads."""
    batch = random_batch(LENGTHS, 64, seed=seed)
    generator = torch.Generator().manual_seed(seed)

    def rows(scale: float) -> torch.Tensor:
        return jagged([scale * torch.randn(n, generator=generator) for n in LENGTHS])

    batch["old_log_probs"] = jagged([-4 * torch.rand(n, generator=generator) for n in LENGTHS])
    batch["ref_log_probs"] = jagged([-4 * torch.rand(n, generator=generator) for n in LENGTHS])
    batch["advantages"] = rows(1.0)
    batch["response_mask"] = jagged([(torch.arange(n) > n // 3).float() for n in LENGTHS])
    return batch


class CountCalls:
    """Counts the calls of ``module.name`` (replaced by this wrapper)."""

    def __init__(self, module: Any, name: str) -> None:
        self.calls = 0
        self.original = getattr(module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.original(*args, **kwargs)


def largest_differences(
    fused: Engine, unfused: Engine, seed: int, loss_fn: LossFn = raise_outputs_loss
) -> dict[str, float]:
    """Outputs (on output ranks), loss and this rank's gradients of fused vs unfused on one
    batch, then the outputs after one train step each, as gaps relative to the magnitudes
    (:func:`relative_gap`); every rank makes the same calls.
    ``loss_fn``: :func:`raise_outputs_loss` (not declared separable: the fused head recomputes
    in backward), or :data:`SEPARABLE_LOSS` (gradient in forward) on :func:`actor_batch`."""
    batch = (
        random_batch(LENGTHS, 64, seed=seed) if loss_fn is raise_outputs_loss else actor_batch(seed)
    )
    gaps: dict[str, float] = {}
    outputs = [engine.infer_batch(batch) for engine in (fused, unfused)]
    if fused.holds_outputs():
        for key in ("log_probs", "entropy"):
            gaps[key] = relative_gap(flat(outputs[0][key]), flat(outputs[1][key]))
    (loss, grads), (unfused_loss, unfused_grads) = (
        loss_and_gradients(engine, batch, loss_fn) for engine in (fused, unfused)
    )
    gaps["loss"] = relative_gap(torch.tensor(loss), torch.tensor(unfused_loss))
    assert set(grads) == set(unfused_grads)
    gaps["grad"] = max(relative_gap(grads[k], unfused_grads[k]) for k in grads)
    gaps["grad_size"] = -max(float(g.abs().max()) for g in grads.values())  # not a gap
    for engine in (fused, unfused):
        engine.train_batch(batch, loss_fn)
    after = [engine.infer_batch(batch) for engine in (fused, unfused)]
    if fused.holds_outputs():
        gaps["after_step"] = relative_gap(flat(after[0]["log_probs"]), flat(after[1]["log_probs"]))
    return gaps


@pytest.mark.parametrize(("backend", "tie", "packed"), CASES)
def test_a_fused_engine_equals_the_unfused_one(
    engine_pairs: dict[tuple[str, bool, bool], dict[bool, Engine]],
    backend: str,
    tie: bool,
    packed: bool,
) -> None:
    """infer_batch, a step's loss and gradients (megatron: its DDP main_grad buffers, the
    output or shared embedding weight's too) and the weights after a train step agree."""
    engines = engine_pairs[backend, tie, packed]
    gaps = largest_differences(engines[True], engines[False], seed=int(tie) + 2 * int(packed))
    assert -gaps.pop("grad_size") > 0
    assert all(gap <= TOLERANCE for gap in gaps.values()), gaps


@pytest.mark.parametrize(("backend", "tie", "packed"), CASES)
def test_with_a_token_separable_loss_the_gradient_in_forward_equals_the_unfused_one(
    engine_pairs: dict[tuple[str, bool, bool], dict[bool, Engine]],
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    tie: bool,
    packed: bool,
) -> None:
    """PPO's loss with entropy bonus and KL penalty (token-separable): the fused head computes
    its gradient in the forward pass, in tiles of 4 tokens x 48 vocabulary rows (chunk
    boundaries inside sequences and between them, in the model's layout, padded or packed;
    two tiles per chunk); outputs, loss, gradients and the step equal the unfused engine's.
    GSPO's (not separable) takes the recomputing path and equals it too."""
    counter = CountCalls(lm_module, "fused_log_probs_with_gradient")
    monkeypatch.setattr(lm_module, "fused_log_probs_with_gradient", counter)
    monkeypatch.setattr(fused_output, "default_tile", lambda *_: (4, 48))
    engines, seed = engine_pairs[backend, tie, packed], 11 + int(packed)
    gaps = largest_differences(engines[True], engines[False], seed, SEPARABLE_LOSS)
    micro_batches = len(engines[True].plan_micro_batches(actor_batch(seed)).groups)
    assert counter.calls == 2 * micro_batches  # forward_backward_batch, then train_batch
    assert -gaps.pop("grad_size") > 0
    assert all(gap <= TOLERANCE for gap in gaps.values()), gaps
    # PPO's old log-probs (a forward-only pass) and new ones (training, in forward): bit for bit
    batch, fused = actor_batch(seed), engines[True]
    with fused.train_mode():
        trained = fused.forward_backward_batch(batch, SEPARABLE_LOSS)["model_output"]
        fused.optimizer_zero_grad()
    inferred = fused.infer_batch(batch)
    for key in ("log_probs", "entropy"):
        assert torch.equal(flat(trained[key]), flat(inferred[key])), key
    counter.calls = 0
    gspo = ActorLoss(policy_loss="gspo", entropy_coeff=0.01)
    gaps = largest_differences(engines[True], engines[False], 13, gspo)
    assert counter.calls == 0
    assert all(gap <= TOLERANCE for gap in gaps.values() if gap >= 0), gaps


def test_gradient_in_forward_can_be_turned_off_and_a_detached_separable_loss_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = CountCalls(lm_module, "fused_log_probs_with_gradient")
    monkeypatch.setattr(lm_module, "fused_log_probs_with_gradient", counter)
    head = {**HEAD_OPTIONS, "fused_min_logits": 0, "gradient_in_forward": False}
    off = build("megatron", True, False, False, head=head)
    gaps = largest_differences(off, build("megatron", False, False, False), 8, SEPARABLE_LOSS)
    assert counter.calls == 0
    assert all(gap <= TOLERANCE for gap in gaps.values() if gap >= 0), gaps

    @token_separable
    def detached(outputs: Mapping[str, torch.Tensor], batch: Any, ctx: Any) -> Any:
        return outputs["log_probs"].detach().sum(), {}

    on = build("fsdp2", True, False, False)
    with pytest.raises(ConfigError, match="detached"):
        on.train_batch(random_batch([4, 6], 64), detached)
    assert counter.calls == 1
    with pytest.raises(ConfigError, match="gradient_in_forward"):
        LMHead(gradient_in_forward="yes")  # type: ignore[arg-type]


def test_a_loss_wrongly_declared_token_separable_is_refused_and_the_step_not_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GSPO's loss declared separable (it is not: a sequence's ratio pools its tokens): the
    head's check at the end of the in-forward loop refuses the step by name, the weights stay
    as they were, and the engine trains on with a separable loss."""
    monkeypatch.setattr(fused_output, "default_tile", lambda *_: (4, 48))
    wrong = functools.partial(ActorLoss(policy_loss="gspo", entropy_coeff=0.01))
    wrong.token_separable = True  # type: ignore[attr-defined]
    for backend, packed in (("megatron", False), ("fsdp2", True)):
        engine = build(backend, True, False, packed)
        before = dict(engine.get_per_tensor_param())
        with pytest.raises(ConfigError, match=r"not separable.*gradient_in_forward: false"):
            engine.train_batch(actor_batch(2), wrong)
        after = dict(engine.get_per_tensor_param())
        assert all(torch.equal(before[name], after[name]) for name in before), backend
        result = engine.train_batch(actor_batch(2), SEPARABLE_LOSS)
        trained = dict(engine.get_per_tensor_param())
        assert result["skipped"] == 0.0, backend
        assert not all(torch.equal(before[name], trained[name]) for name in before), backend


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_under_lora_the_gradient_in_forward_leaves_the_frozen_output_weight_alone(
    backend: str,
) -> None:
    """The output layer is frozen under LoRA: only the hidden states get a gradient (two
    matmuls); the adapters' gradients equal the unfused engine's."""
    from torch.distributed.tensor import DTensor

    lora = {"rank": 4, "alpha": 8, "target_modules": ["q", "v", "down"]}
    engines = {fused: build(backend, fused, False, False, lora=lora) for fused in (True, False)}
    batch = actor_batch(4)
    found = []
    for engine in engines.values():
        with engine.train_mode():
            engine.optimizer_zero_grad()
            loss = engine.forward_backward_batch(batch, SEPARABLE_LOSS)["loss"]
            (module,) = engine.backend.modules()
            grads = {}
            for name, param in module.named_parameters():
                if param.requires_grad:  # megatron's main_grad, fsdp2's sharded grad
                    grad = getattr(param, "main_grad", param.grad)
                    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
                    grads[name] = grad.clone()
            engine.optimizer_zero_grad()
        found.append((sum(loss), grads))
    (loss, grads), (unfused_loss, unfused_grads) = found
    assert abs(loss - unfused_loss) <= TOLERANCE
    assert set(grads) == set(unfused_grads) and grads
    assert not any("output_layer" in name or "lm_head" in name for name in grads)
    moved = {name for name, grad in grads.items() if grad.any()}
    assert moved and all("lora" in name for name in moved)  # B (A's gradient is 0 while B is)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, unfused_grads[name], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_a_fused_bfloat16_engine_equals_the_unfused_one_up_to_bfloat16_rounding(
    backend: str,
) -> None:
    """bfloat16 parameters: the matmul in bfloat16 as the output layer's, statistics in
    float32; with a loss that is not separable and with one that is."""
    engines = {
        fused: build(backend, fused, False, False, dtype="bfloat16") for fused in (True, False)
    }
    for loss_fn in (raise_outputs_loss, SEPARABLE_LOSS):  # recomputing, gradient in forward
        gaps = largest_differences(engines[True], engines[False], 6, loss_fn)
        assert -gaps.pop("grad_size") > 0
        assert all(gap <= 2e-2 for gap in gaps.values()), (loss_fn, gaps)


def test_the_backends_hand_a_fused_head_hidden_states_and_the_output_weight(
    engine_pairs: dict[tuple[str, bool, bool], dict[bool, Engine]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[tuple[int, ...], torch.Tensor]] = []
    original = LMHead.postprocess_hidden

    def recording(head: LMHead, hidden: torch.Tensor, weight: torch.Tensor, *args: Any) -> Any:
        seen.append((tuple(hidden.shape), weight))
        return original(head, hidden, weight, *args)

    monkeypatch.setattr(LMHead, "postprocess_hidden", recording)
    for (backend, tie, _), engines in engine_pairs.items():
        seen.clear()
        engines[True].infer_batch(random_batch([3, 4], 64))
        assert seen, backend
        (module,) = engines[True].backend.modules()
        for shape, weight in seen:
            assert shape[-1] == 32 and tuple(weight.shape) == (64, 32), (backend, shape)
            if backend == "megatron":  # fsdp2's is the gathered copy of its sharded parameter
                name = "embedding.word_embeddings" if tie else "output_layer"
                assert weight is module.get_submodule(name).weight, (backend, tie)
        seen.clear()
        engines[False].infer_batch(random_batch([3, 4], 64))
        assert not seen, backend


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_below_fused_min_logits_the_head_computes_the_logits_whole(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """tiny's micro-batches have far fewer than 2**21 logits: the default head takes them whole
    from the hidden states and weight (no tile loop) and equals the unfused engine; at or above
    the threshold the tile loop runs."""
    calls: list[int] = []
    original = lm_module.fused_log_probs_and_entropy

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(lm_module, "fused_log_probs_and_entropy", counting)
    whole = build(backend, True, False, False, FUSED_MIN_LOGITS)
    gaps = largest_differences(whole, build(backend, False, False, False), seed=7)
    assert not calls
    assert -gaps.pop("grad_size") > 0
    assert all(gap <= TOLERANCE for gap in gaps.values()), gaps
    batch = random_batch([5, 9, 3], 64)  # 2 rows x 9 tokens x 64 vocabulary in the first
    just_enough = build(backend, True, False, False, 2 * 9 * 64).infer_batch(batch)
    assert len(calls) == 1  # the first micro-batch fused, the second (1 row x 3) whole
    assert_close_scaled(
        flat(just_enough["log_probs"]),
        flat(build(backend, False, False, False).infer_batch(batch)["log_probs"]),
        TOLERANCE,
    )


@pytest.mark.parametrize("value", [-1, 1.5, True, "big"])
def test_a_bad_fused_min_logits_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ConfigError, match="fused_min_logits"):
        LMHead(fused_min_logits=value)


# -- across processes -------------------------------------------------------------------------
def compare_fused_with_unfused(parallel: dict[str, Any]) -> dict[str, float]:
    """One rank: vocab-parallel fused function vs full-vocabulary unfused (TP only), and fused
    vs unfused megatron engines on this layout (untied and padded; tied and packed)."""
    import torch.distributed as dist

    gaps: dict[str, float] = {}
    for tie, packed in ((False, False), (True, True)):
        engines = {
            fused: build("megatron", fused, tie=tie, packed=packed, parallel=parallel)
            for fused in (True, False)
        }
        found = largest_differences(engines[True], engines[False], seed=4)
        gaps.update({f"{name}.tie={tie}.packed={packed}": gap for name, gap in found.items()})
        counter = CountCalls(lm_module, "fused_log_probs_with_gradient")
        lm_module.fused_log_probs_with_gradient = counter  # type: ignore[assignment]
        try:
            found = largest_differences(engines[True], engines[False], 12, SEPARABLE_LOSS)
        finally:
            lm_module.fused_log_probs_with_gradient = counter.original  # type: ignore[assignment]
        gaps.update({f"{name}.in_forward.tie={tie}": gap for name, gap in found.items()})
        if engines[True].holds_outputs():  # the last stage computes the head
            gaps[f"in_forward_never_ran.tie={tie}"] = float(counter.calls == 0)
        if not packed:  # below fused_min_logits: this rank's vocabulary shard's logits, whole
            whole = build("megatron", True, tie, packed, FUSED_MIN_LOGITS, parallel=parallel)
            unfused = build("megatron", False, tie, packed, parallel=parallel)
            found = largest_differences(whole, unfused, seed=5)
            gaps.update({f"{name}.whole": gap for name, gap in found.items()})
    if parallel.get("tensor_parallel_size", 1) > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        h, w, targets, upstream = case(9, 40, 6, 30, scale=3.0)
        shard = 30 // world
        rows = slice(rank * shard, (rank + 1) * shard)

        def vocab_parallel(a: torch.Tensor, b: torch.Tensor) -> Any:
            return fused_log_probs_and_entropy(
                a, b[rows], targets, temperature=0.8, group=dist.group.WORLD,
                vocab_start=rank * shard, tile=(16, 4),
            )  # fmt: skip

        got = list(results_and_gradients(vocab_parallel, h, w, upstream))
        dist.all_reduce(got[3])  # the column-parallel layer's input: gradients summed over TP
        expected = results_and_gradients(
            lambda a, b: log_probs_and_entropy(a @ b.t(), targets, temperature=0.8),
            h,
            w,
            upstream,
        )
        for name, value, reference in zip(
            ("log_probs", "entropy", "loss", "grad_h"), got, expected, strict=False
        ):
            gaps[f"function.{name}"] = relative_gap(value, reference)
        gaps["function.grad_w"] = relative_gap(got[4][rows], expected[4][rows])

        def upstream_of(start: int, end: int, *_: Any) -> Any:
            return upstream[0][start:end], upstream[1][start:end]

        leaf_h, leaf_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        log_probs, entropy, anchor = fused_log_probs_with_gradient(
            leaf_h, leaf_w[rows], targets, upstream_of, temperature=0.8,
            group=dist.group.WORLD, vocab_start=rank * shard, tile=(16, 4),
        )  # fmt: skip
        assert entropy is not None
        loss = (log_probs * upstream[0]).sum() + (entropy * upstream[1]).sum() + anchor
        grad_h, grad_w = torch.autograd.grad(loss, (leaf_h, leaf_w))
        dist.all_reduce(grad_h)
        for name, value, reference in zip(
            ("log_probs", "entropy", "loss", "grad_h"),
            (log_probs, entropy, loss.detach(), grad_h),
            expected,
            strict=False,
        ):
            gaps[f"in_forward_function.{name}"] = relative_gap(value, reference)
        gaps["in_forward_function.grad_w"] = relative_gap(grad_w[rows], expected[4][rows])
    return gaps


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["tp2", "pp2"],
)
def test_fused_equals_unfused_across_processes(parallel: dict[str, Any]) -> None:
    reports = run_ranks(compare_fused_with_unfused, 2, parallel, timeout=300)
    compared = [report for report in reports if any(k.startswith("log_probs") for k in report)]
    assert compared, "no rank compared the engines' outputs"
    for rank, report in enumerate(reports):
        report = {name: gap for name, gap in report.items() if "grad_size" not in name}
        assert all(gap <= TOLERANCE for gap in report.values()), f"rank {rank}: {report}"
    if "tensor_parallel_size" in parallel:
        assert all("function.grad_w" in report for report in reports)
