"""Every public Engine method, called in every state an engine can be in (not initialised,
offloaded in part or whole, forward-only, after a failed call), either works or raises a typed
error; none crashes the process (e.g. by touching device storage that offloading freed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from engine import Engine
from engine.losses import sft_loss
from heads.errors import CheckpointError, EngineError, EngineStateError
from strategies.backends.base import OFFLOAD_PARTS
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model

CONFIG = {"model": tiny_model(), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}}
PARTS = frozenset(OFFLOAD_PARTS)
BATCH = random_batch([3, 6, 4], 64)


@attrs.frozen
class Call:
    """A public method call, what it needs to run, and the typed error it gives even then."""

    run: Callable[[Engine, Path], Any]
    #: "initialized", "trainable" and the parts that must be on the device.
    needs: frozenset[str] = frozenset({"initialized"})
    error: type[EngineError] | None = None


def _enter(context: Any) -> None:
    with context:
        pass


TRAINING = frozenset({"initialized", "trainable", *PARTS})
CALLS = {
    "initialize": Call(lambda e, _: e.initialize(), needs=frozenset()),
    "plan_micro_batches": Call(lambda e, _: e.plan_micro_batches(BATCH), needs=frozenset()),
    "train_mode": Call(lambda e, _: _enter(e.train_mode())),
    "eval_mode": Call(lambda e, _: _enter(e.eval_mode())),
    "to(cpu)": Call(lambda e, _: e.to("cpu")),
    "to(cpu, optimizer only)": Call(lambda e, _: e.to("cpu", model=False, grad=False)),
    "to(device)": Call(lambda e, _: e.to("device")),
    "forward_backward_batch": Call(
        lambda e, _: e.forward_backward_batch(BATCH, sft_loss), needs=TRAINING
    ),
    "forward_backward_batch(forward_only)": Call(
        lambda e, _: e.forward_backward_batch(BATCH, None, forward_only=True),
        needs=frozenset({"initialized", "model"}),
    ),
    "train_batch": Call(lambda e, _: e.train_batch(BATCH, sft_loss), needs=TRAINING),
    "infer_batch": Call(
        lambda e, _: e.infer_batch(BATCH), needs=frozenset({"initialized", "model"})
    ),
    "optimizer_zero_grad": Call(
        lambda e, _: e.optimizer_zero_grad(),
        needs=frozenset({"initialized", "trainable", "grad"}),
    ),
    "optimizer_step": Call(lambda e, _: e.optimizer_step(), needs=TRAINING),
    "lr_scheduler_step": Call(
        lambda e, _: e.lr_scheduler_step(), needs=frozenset({"initialized", "trainable"})
    ),
    "get_data_parallel_rank": Call(lambda e, _: e.get_data_parallel_rank()),
    "get_data_parallel_size": Call(lambda e, _: e.get_data_parallel_size()),
    "get_data_parallel_group": Call(lambda e, _: e.get_data_parallel_group()),
    "holds_outputs": Call(lambda e, _: e.holds_outputs()),
    "get_per_tensor_param": Call(
        lambda e, _: list(e.get_per_tensor_param()), needs=frozenset({"initialized", "model"})
    ),
    "save_hf": Call(lambda e, d: e.save_hf(d / "hf"), needs=frozenset({"initialized", "model"})),
    "save_checkpoint": Call(
        lambda e, d: e.save_checkpoint(d / "checkpoints"), needs=frozenset({"initialized", *PARTS})
    ),
    "load_checkpoint(nothing saved)": Call(
        lambda e, d: e.load_checkpoint(d),
        needs=frozenset({"initialized", *PARTS}),
        error=CheckpointError,
    ),
}


def _fail_mid_batch(engine: Engine) -> None:
    def broken(outputs: Any, batch: Any, ctx: Any) -> Any:
        if ctx.micro_batch_index == 1:
            raise RuntimeError("loss exploded")
        return sft_loss(outputs, batch, ctx)

    with pytest.raises(RuntimeError, match="loss exploded"):
        engine.train_batch(BATCH, broken)


@attrs.frozen
class State:
    engine: str  # "new" (never initialised), "trainer" or "reference" (forward-only)
    away: frozenset[str] = frozenset()  # parts offloaded
    setup: Callable[[Engine], None] = lambda engine: None

    def has(self) -> frozenset[str]:
        if self.engine == "new":
            return frozenset()
        trainable = {"trainable"} if self.engine == "trainer" else set()
        return frozenset({"initialized", *trainable, *(PARTS - self.away)})


STATES = {
    "not initialised": State("new"),
    "ready": State("trainer"),
    "model offloaded": State("trainer", frozenset({"model"})),
    "optimizer offloaded": State("trainer", frozenset({"optimizer"})),
    "grad offloaded": State("trainer", frozenset({"grad"})),
    "all offloaded": State("trainer", PARTS),
    "forward-only": State("reference"),
    "forward-only, offloaded": State("reference", PARTS),
    "after a failed call": State("trainer", setup=_fail_mid_batch),
}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    destroy_mesh()
    yield {
        "trainer": Engine.build(head="lm", device="cpu", config=CONFIG).initialize(),
        "reference": Engine.build(
            head="lm", device="cpu", config={**CONFIG, "forward_only": True}
        ).initialize(),
    }
    destroy_mesh()


@pytest.mark.parametrize("call_name", CALLS)
@pytest.mark.parametrize("state_name", STATES)
def test_every_public_method_in_every_state_works_or_raises_a_typed_error(
    engines: dict[str, Engine], tmp_path: Path, state_name: str, call_name: str
) -> None:
    state, call = STATES[state_name], CALLS[call_name]
    if state.engine == "new":
        engine = Engine.build(head="lm", device="cpu", config=CONFIG)
    else:
        engine = engines[state.engine]
        engine.to("cpu", **{part: part in state.away for part in PARTS})
        state.setup(engine)
    missing = call.needs - state.has()
    expected = EngineStateError if missing else call.error
    try:
        if expected is None:
            call.run(engine, tmp_path)
        else:
            with pytest.raises(expected) as caught:
                call.run(engine, tmp_path)
            if not missing & {"initialized", "trainable"} and missing:  # names the part
                assert any(part in str(caught.value) for part in missing), caught.value
    finally:
        if engine.device is not None:  # initialised
            engine.to("device")
