"""Every head x backend x device cell known to the registries builds, trains and infers, dense or
mixture-of-experts, packed or padded (a backend without the packing ability refuses packing by
name).

CUDA and NPU cells run *simulated* on this CPU (see tests/simulation.py) unless the hardware is
present; then they run for real and the hook assertions that need doubles are skipped.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.data.batching import sequence_lengths
from engine.registry import BACKENDS, DEVICES, HEADS
from heads.base import PER_SEQUENCE
from heads.errors import ConfigError
from strategies.backends.base import Packing
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import raise_outputs_loss, random_batch, tiny_model
from tests.simulation import EventLog, forget_applied_repatches, make_platform

CELLS = [
    (head, backend, device)
    for head in HEADS.names()
    for backend in BACKENDS.names()
    for device in DEVICES.names()
]


@st.composite
def cell_settings(draw: st.DrawFn) -> dict[str, Any]:
    heads = draw(st.sampled_from([2, 4]))
    experts = draw(st.sampled_from([{}, {"num_experts": 4, "expert_ffn_hidden_size": 16}]))
    return {
        "model": tiny_model(
            hidden_size=draw(st.sampled_from([16, 32])),
            num_layers=draw(st.integers(1, 2)),
            num_attention_heads=heads,
            num_query_groups=draw(st.sampled_from([1, heads])),
            vocab_size=draw(st.sampled_from([32, 64])),
            **experts,
        ),
        "lengths": draw(st.lists(st.integers(2, 24), min_size=1, max_size=6)),
        "micro_batch_size": draw(st.integers(1, 4)),
        "packing": draw(st.booleans()),
        "temperature": draw(st.sampled_from([0.3, 0.5, 1.0, 1.7])),
        "seed": draw(st.integers(0, 2**16)),
    }


def expected_repatch_overrides(engine: Engine) -> dict[str, Any]:
    return {"use_flash_attn": True, **engine.backend.transformer_overrides}


@pytest.mark.parametrize(("head", "backend", "device"), CELLS, ids=["-".join(c) for c in CELLS])
@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=cell_settings())
def test_every_cell_builds_trains_to_lower_loss_and_infers_aligned_outputs(
    head: str, backend: str, device: str, drawn: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron.core import parallel_state

    destroy_mesh()
    forget_applied_repatches()
    log = EventLog()
    original_init = parallel_state.initialize_model_parallel

    def recording_init(*args: Any, **kwargs: Any) -> None:
        log.append(("initialize_model_parallel", kwargs))
        original_init(*args, **kwargs)

    monkeypatch.setattr(parallel_state, "initialize_model_parallel", recording_init)
    platform, simulated = make_platform(device, log)
    head_options = {"temperature": drawn["temperature"]} if head == "lm" else {}
    config = {
        "model": drawn["model"],
        "micro_batch_size": drawn["micro_batch_size"],
        "packing": drawn["packing"],
        "seed": drawn["seed"],
        "optimizer": {"lr": 3e-4, "clip_grad": 0.0},
        "head": head_options,
    }
    if drawn["packing"] and not isinstance(BACKENDS.create(backend), Packing):
        with pytest.raises(ConfigError, match=f"the {backend} backend lacks the 'packing'"):
            Engine.build(head=head, backend=backend, device=platform, config=config)
        config["packing"] = False
    engine = Engine.build(head=head, backend=backend, device=platform, config=config).initialize()

    if simulated:
        # MindSpeed patches megatron: NPU contributes its repatch to megatron-kind backends only.
        repatches = [args for name, args in log if name == "repatch"]
        if device == "npu" and engine.backend.kind == "megatron":
            assert repatches == [expected_repatch_overrides(engine)]
            assert log.names().index("repatch") < log.names().index("initialize_model_parallel")
        else:
            assert repatches == []
        assert ("set_device", 0) in log

    batch = random_batch(drawn["lengths"], drawn["model"]["vocab_size"], seed=drawn["seed"])
    with engine.train_mode():
        losses = [engine.train_batch(batch, raise_outputs_loss)["loss"] for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]

    outputs = engine.infer_batch(batch)
    assert set(outputs.keys()) == set(engine.head.outputs)
    for key, granularity in engine.head.outputs.items():
        values = outputs[key]
        assert values.dtype == torch.float32
        if granularity == PER_SEQUENCE:
            assert values.shape == (batch.batch_size[0],)
            assert torch.isfinite(values).all()
            continue
        assert torch.equal(values.offsets().diff(), sequence_lengths(batch))
        assert torch.isfinite(values.values()).all()
        assert all(float(row[0]) == 0.0 for row in values.unbind())
    destroy_mesh()
