"""A training step reads device values on the host once: every ``float(tensor)``, ``.item()``,
``bool(tensor)``, ``.tolist()`` ... of a device value waits for an accelerator to finish
everything queued before it, so the engine gathers the step's losses, metrics, head-contract
checks and gradient norm and fetches them together at the end of the step
(``engine.host_values``).

On the CPU nothing waits, so these tests record the reads themselves, wherever they happen (the
engine, the losses, megatron's or torch's code): at most one per step."""

from __future__ import annotations

import functools
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from engine import Engine
from engine.losses import ActorLoss
from heads.errors import ConfigError
from heads.value import ValueHead
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import raise_outputs_loss, random_batch, tiny_model

CONVERSIONS = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"}


class DeviceReads(TorchFunctionMode):
    """Records every host read of a value that lives on the engine's device.

    On the CPU the device is the host, so "on the device" is tracked: the model's parameters and
    whatever is moved with ``.to(device)`` (a copy here too, as it is on an accelerator) are
    device values, and so is every result of an
    operation on one, and every tensor (and the base of every view) an operation writes one
    into. Reads of the host-side batch (lengths, planning) are host work on an
    accelerator too, and are not counted."""

    def __init__(self, roots: list[torch.Tensor]) -> None:
        super().__init__()
        # by identity (a tensor's == is elementwise), forgotten when the tensor dies
        self.device_values: dict[int, weakref.ref[torch.Tensor]] = {}
        self.reads: list[str] = []
        for root in roots:
            self.add(root)

    def add(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self.device_values[key] = weakref.ref(tensor, lambda _: self.device_values.pop(key, None))

    def holds(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor) in self.device_values

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        on_device = any(self.holds(x) for x in leaves)
        name = getattr(func, "__name__", "")
        if name in CONVERSIONS and on_device:
            caller = traceback.extract_stack(limit=3)[0]
            self.reads.append(f"{name} at {caller.filename}:{caller.lineno}")
        result = func(*args, **kwargs)
        moved = name == "to" and any(
            isinstance(x, torch.device | str) for x in (*args[1:], *kwargs.values())
        )
        if moved and result is args[0]:  # a copy, as on an accelerator: the host's stays apart
            result = result.clone()
        if on_device or moved:
            written = [result, kwargs.get("out")]
            if name.endswith("_") and not name.startswith("__") and args:
                written.append(args[0])  # an in-place op writes a device value into its target
            for out in tree_flatten(written)[0]:
                if isinstance(out, torch.Tensor):
                    self.add(out)
                    if out._base is not None:  # a view: what it was taken from holds it too
                        self.add(out._base)
        return result


def device_reads_during(engine: Engine, step: Callable[[], Any]) -> list[str]:
    roots = [p for module in engine.backend.modules() for p in module.parameters()]
    mode = DeviceReads(roots)
    move = TensorDict.to

    def to_device(self: TensorDict, *args: Any, **kwargs: Any) -> Any:
        """A micro-batch's fields moved to the device: copies, each a device value (a
        TensorDict already on the CPU is returned as it is, without a tensor's ``.to``)."""
        moved = move(self, *args, **kwargs)
        if not isinstance(moved, TensorDict):
            return moved
        moved = moved.apply(torch.clone)
        for leaf in moved.values(include_nested=True, leaves_only=True):
            mode.add(leaf)
        return moved

    TensorDict.to = to_device  # type: ignore[method-assign]
    try:
        with mode:
            step()
    finally:
        TensorDict.to = move  # type: ignore[method-assign]
    return mode.reads


def lm_batch(seed: int) -> Any:
    lengths = (5, 9, 14, 3, 11, 7)
    batch = random_batch(lengths, 64, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for name in ("old_log_probs", "ref_log_probs", "advantages"):
        batch[name] = torch.nested.nested_tensor(
            [torch.randn(n, generator=generator) for n in lengths], layout=torch.jagged
        )
    return batch


@pytest.fixture(scope="module", params=["megatron", "fsdp2"])
def actor(request: pytest.FixtureRequest) -> Iterator[Engine]:
    destroy_mesh()
    engine = Engine.build(
        head="lm",
        backend=request.param,
        device="cpu",
        config={
            "model": tiny_model(),
            "micro_batch_size": 2,
            "optimizer": {"clip_grad": 1.0},
            "head": {"compute_entropy": True},
        },
    ).initialize()
    yield engine
    destroy_mesh()


def test_a_training_step_reads_the_device_once(actor: Engine) -> None:
    loss = ActorLoss(kl_coeff=0.1, entropy_coeff=0.01)
    batch = lm_batch(1)
    summaries = []
    with actor.train_mode():
        actor.train_batch(lm_batch(0), loss)  # warm-up: lazy state is built on first use
        reads = device_reads_during(actor, lambda: summaries.append(actor.train_batch(batch, loss)))
    assert len(reads) <= 1, reads
    # the numbers still arrive: three micro-batches' losses and metrics, and the norm
    (summary,) = summaries
    assert float(summary["grad_norm"]) > 0
    assert set(summary) >= {"loss", "pg_loss", "kl", "entropy", "pg_clipfrac"}


def test_the_recorder_sees_a_read_of_a_device_value(actor: Engine) -> None:
    """The check above can fail: a loss that converts a metric itself is one read more."""

    def converting(outputs: Any, batch: Any, ctx: Any) -> Any:
        loss, metrics = ActorLoss()(outputs, batch, ctx)
        return loss, {**metrics, "pg_loss": float(metrics["pg_loss"])}

    with actor.train_mode():
        reads = device_reads_during(actor, lambda: actor.train_batch(lm_batch(2), converting))
    assert len(reads) == 1 + 3, reads  # the fetch, and one per micro-batch


def test_fetched_numbers_equal_those_read_one_by_one(actor: Engine) -> None:
    """The losses and metrics fetched together are what converting each one gives."""
    batch = lm_batch(3)
    seen: list[tuple[float, float]] = []

    def recording(outputs: Any, batch: Any, ctx: Any) -> Any:
        loss, metrics = ActorLoss(kl_coeff=0.1)(outputs, batch, ctx)
        seen.append((float(loss), float(metrics["kl"])))
        return loss, metrics

    result = actor.forward_backward_batch(batch, recording, forward_only=True)
    assert result["loss"] == [loss for loss, _ in seen]
    assert result["metrics"]["kl"] == [kl for _, kl in seen]
    assert all(type(value) is float for value in result["loss"])


def test_a_head_contract_violation_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first-position check is left on the device during the step, and still raises."""
    destroy_mesh()
    engine = Engine.build(
        head="value", backend="megatron", device="cpu", config={"model": tiny_model()}
    ).initialize()
    original = ValueHead.postprocess

    def unshifted(self: Any, raw: torch.Tensor, ids: torch.Tensor, ctx: Any) -> Any:
        return {"values": original(self, raw, ids, ctx)["values"] + 1.0}

    monkeypatch.setattr(ValueHead, "postprocess", unshifted)
    with engine.train_mode(), pytest.raises(ConfigError, match="has a value at position 0"):
        engine.train_batch(random_batch([4, 6], 64), raise_outputs_loss)
    destroy_mesh()


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_a_packed_step_reads_the_device_once(backend: str) -> None:
    """Packed rows too: their offsets are split and unpacked on the host, and megatron's local
    layer spec keeps them there for its rotary embedding, which reads them twice a layer."""
    destroy_mesh()
    engine = Engine.build(
        head="lm",
        backend=backend,
        device="cpu",
        config={"model": tiny_model(), "micro_batch_size": 3, "packing": True},
    ).initialize()
    loss = ActorLoss(kl_coeff=0.1)
    batch = lm_batch(4)
    with engine.train_mode():
        engine.train_batch(lm_batch(5), loss)
        reads = device_reads_during(engine, lambda: engine.train_batch(batch, loss))
    assert len(reads) <= 1, reads


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_the_fused_heads_tile_loops_read_the_device_once(backend: str) -> None:
    """``fused_min_logits: 0``: the fused head's loops run, padded and packed, with the
    gradient in forward (PPO's loss, token-separable: asked for its gradient once per chunk) and
    recomputing in backward (GSPO's)."""
    for packing in (False, True):
        destroy_mesh()
        engine = Engine.build(
            head="lm",
            backend=backend,
            device="cpu",
            config={
                "model": tiny_model(),
                "micro_batch_size": 3,
                "packing": packing,
                "head": {"compute_entropy": True, "fused_min_logits": 0},
            },
        ).initialize()
        for loss in (
            ActorLoss(kl_coeff=0.1, entropy_coeff=0.01),
            ActorLoss(policy_loss="gspo", entropy_coeff=0.01),
        ):
            with engine.train_mode():
                engine.train_batch(lm_batch(6), loss)
                step = functools.partial(engine.train_batch, lm_batch(7), loss)
                reads = device_reads_during(engine, step)
            assert len(reads) <= 1, (packing, loss.policy_loss, reads)
    destroy_mesh()
