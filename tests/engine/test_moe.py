"""Mixture-of-experts models on the megatron backend (one process): they train, report router
statistics, replay recorded routes exactly, and refuse what they cannot do naming the field.

Router replay's contract: ``infer_batch`` returns ``routed_experts`` ``[B, tokens, layers,
top_k]``; a batch carrying it is routed that way, each forced expert weighted by the live
router scores (so the router keeps its gradient).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from tensordict import TensorDict

from engine import Engine
from engine.data.batching import jagged
from engine.losses import sft_loss
from heads.errors import BatchError, ConfigError
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model

LENGTHS = [7, 12, 5, 9, 3, 10]
VOCAB = 64


def moe_model(**overrides: Any) -> dict[str, Any]:
    experts = {
        "num_experts": 4,
        "experts_per_token": 2,
        "expert_ffn_hidden_size": 32,
        "router_aux_loss_coeff": 0.01,
        "router_z_loss_coeff": 0.001,
    }
    return tiny_model(**{**experts, **overrides})


def build(
    *, router_replay: bool = True, model: dict[str, Any] | None = None, **extra: Any
) -> Engine:
    config = {
        "model": model or moe_model(),
        "seed": 3,
        "optimizer": {"lr": 1e-2},
        "micro_batch_size": 2,
        "router_replay": router_replay,
        **extra,
    }
    return Engine.build(head="lm", device="cpu", config=config).initialize()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    """Same seed, so the same weights: padded, packed, one sequence per micro-batch, and with
    full activation recompute."""
    destroy_mesh()
    yield {
        "padded": build(),
        "packed": build(packing=True, max_tokens_per_micro_batch=24),
        "single": build(micro_batch_size=1),
        # the router's only gradient then flows through the routing weights
        "no_aux": build(model=moe_model(router_aux_loss_coeff=0.0, router_z_loss_coeff=0.0)),
        "recompute": build(
            backend={
                "transformer_overrides": {
                    "recompute_granularity": "full",
                    "recompute_method": "uniform",
                    "recompute_num_layers": 1,
                }
            }
        ),
    }
    destroy_mesh()


def batch(seed: int = 0) -> TensorDict:
    return random_batch(LENGTHS, VOCAB, seed=seed)


def with_routes(rows: TensorDict, routes: torch.Tensor) -> TensorDict:
    replayed = rows.clone()
    replayed["routed_experts"] = routes
    return replayed


def values(nested: torch.Tensor) -> torch.Tensor:
    return nested.values() if nested.is_nested else nested


def router_gradients(engine: Engine, rows: TensorDict) -> dict[str, torch.Tensor]:
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(rows, sft_loss, return_outputs=False)
        grads = {
            name: param.main_grad.detach().clone()
            for module in engine.backend.modules()
            for name, param in module.named_parameters()
        }
        engine.optimizer_zero_grad()
    return grads


def test_the_model_has_a_router_and_experts_in_every_layer(engines: dict[str, Engine]) -> None:
    names = {name for m in engines["padded"].backend.modules() for name, _ in m.named_parameters()}
    for layer in (0, 1):
        prefix = f"decoder.layers.{layer}.mlp."
        assert f"{prefix}router.weight" in names
        for expert in range(4):
            assert f"{prefix}experts.local_experts.{expert}.linear_fc1.weight" in names
        assert f"{prefix}linear_fc1.weight" not in names


def test_infer_batch_returns_the_routes_aligned_with_the_tokens(engines: dict[str, Engine]) -> None:
    rows = batch()
    output = engines["padded"].infer_batch(rows)
    routes = output["routed_experts"]
    assert routes.dtype == torch.long
    assert routes.offsets().tolist() == rows["input_ids"].offsets().tolist()
    flat = routes.values()
    assert flat.shape[1:] == (2, 2)  # layers, top-k
    assert int(flat.min()) >= 0 and int(flat.max()) < 4
    assert bool((flat[..., 0] != flat[..., 1]).all())  # distinct experts per token


def test_replaying_the_recorded_routes_gives_the_recorded_pass_bit_for_bit(
    engines: dict[str, Engine],
) -> None:
    engine, rows = engines["padded"], batch()
    recorded = engine.infer_batch(rows)
    replayed = engine.infer_batch(with_routes(rows, recorded["routed_experts"]))
    assert torch.equal(values(replayed["log_probs"]), values(recorded["log_probs"]))
    assert torch.equal(values(replayed["routed_experts"]), values(recorded["routed_experts"]))


def test_packed_and_padded_engines_replay_the_same_routes_alike(
    engines: dict[str, Engine],
) -> None:
    rows = batch(seed=1)
    recorded = engines["padded"].infer_batch(rows)
    packed = engines["packed"].infer_batch(rows)
    assert torch.equal(values(packed["routed_experts"]), values(recorded["routed_experts"]))
    replay = with_routes(rows, recorded["routed_experts"])
    a, b = engines["padded"].infer_batch(replay), engines["packed"].infer_batch(replay)
    torch.testing.assert_close(values(a["log_probs"]), values(b["log_probs"]), atol=1e-5, rtol=0)
    assert torch.equal(values(b["routed_experts"]), values(recorded["routed_experts"]))


def test_replay_holds_under_activation_recompute_and_the_router_keeps_its_gradient(
    engines: dict[str, Engine],
) -> None:
    rows = batch(seed=2)
    routes = engines["padded"].infer_batch(rows)["routed_experts"]
    # forced routes that differ from what the router would choose: a reversed expert order
    forced = torch.nested.nested_tensor_from_jagged(3 - routes.values(), routes.offsets())
    replay = with_routes(rows, forced)
    plain = router_gradients(engines["padded"], replay)
    recomputed = router_gradients(engines["recompute"], replay)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    through_weights = router_gradients(engines["no_aux"], replay)
    for layer in (0, 1):
        assert float(through_weights[f"decoder.layers.{layer}.mlp.router.weight"].abs().sum()) > 0
    unforced = router_gradients(engines["padded"], rows)
    router = "decoder.layers.0.mlp.router.weight"
    assert not torch.allclose(unforced[router], plain[router])  # the forced routes were used


def test_after_a_step_replay_keeps_the_recorded_routes_while_free_routing_moves(
    engines: dict[str, Engine],
) -> None:
    engine = build(optimizer={"lr": 0.2})
    rows = batch(seed=3)
    recorded = engine.infer_batch(rows)["routed_experts"]
    replay = with_routes(rows, recorded)
    with engine.train_mode():
        for _ in range(3):
            engine.train_batch(replay, sft_loss)
    assert torch.equal(values(engine.infer_batch(replay)["routed_experts"]), recorded.values())
    free = values(engine.infer_batch(rows)["routed_experts"])
    assert not torch.equal(free, recorded.values())


def test_aux_and_z_loss_gradients_are_token_weighted_means_over_micro_batches(
    engines: dict[str, Engine],
) -> None:
    """The batch twice over, in twice the micro-batches, has the same token-mean loss and the
    same token-weighted aux and z losses: the same gradient (megatron alone would scale each
    micro-batch's aux loss by its token count)."""
    rows = random_batch([6] * 4, VOCAB, seed=4)  # no padding: every routed token is real
    twice = TensorDict(
        {key: jagged(list(rows[key].unbind()) * 2) for key in rows.keys()}, batch_size=[8]
    )
    once, doubled = (router_gradients(engines["padded"], b) for b in (rows, twice))
    for name, grad in once.items():
        torch.testing.assert_close(doubled[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert float(once["decoder.layers.0.mlp.router.weight"].abs().sum()) > 0


def test_offloading_between_phases_changes_nothing_in_training(engines: dict[str, Engine]) -> None:
    offloaded = build(offload={"model": True, "optimizer": True, "grad": True})
    plain = build()
    losses = {}
    for name, engine in (("offloaded", offloaded), ("plain", plain)):
        losses[name] = []
        for seed in range(2):
            with engine.train_mode():
                losses[name].append(engine.train_batch(batch(seed=seed), sft_loss)["loss"])
    assert losses["offloaded"] == losses["plain"]
    assert offloaded.backend.offloaded() == {"model", "optimizer", "grad"}


def test_train_batch_reports_router_statistics_per_layer(engines: dict[str, Engine]) -> None:
    engine = engines["single"]
    with engine.train_mode():
        metrics = engine.train_batch(batch(seed=6), sft_loss)
    for layer in (0, 1):
        assert metrics[f"router/layer_{layer}/load_max_over_mean"] >= 1.0
        assert metrics[f"router/layer_{layer}/aux_loss"] > 0
        assert metrics[f"router/layer_{layer}/z_loss"] > 0


def test_a_moe_model_learns(engines: dict[str, Engine]) -> None:
    engine = build(router_replay=False, optimizer={"lr": 3e-3})
    rows = batch(seed=7)
    with engine.train_mode():
        losses = [float(engine.train_batch(rows, sft_loss)["loss"]) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.1


def bad_routes(rows: TensorDict, kind: str) -> torch.Tensor:
    offsets = rows["input_ids"].offsets()
    tokens = int(offsets[-1])
    good = torch.tensor([0, 1]).expand(tokens, 2, 2).clone()
    if kind == "shape":
        good = good[:, :1]
    elif kind == "range":
        good[3, 1, 0] = 4
    elif kind == "negative":
        good[0, 0, 1] = -1
    elif kind == "duplicate":
        good[2, 0] = torch.tensor([1, 1])
    elif kind == "float":
        good = good.float()
    return torch.nested.nested_tensor_from_jagged(good, offsets)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("shape", r"'routed_experts' must be \[B, tokens, num_layers, experts_per_token\]"),
        ("range", r"'routed_experts' holds expert id 4, outside \[0, 4\)"),
        ("negative", r"'routed_experts' holds expert id -1"),
        ("duplicate", r"'routed_experts' routes a token to the same expert twice"),
        ("float", r"'routed_experts' must hold integer expert ids"),
    ],
)
def test_bad_routes_are_refused_naming_the_field(
    engines: dict[str, Engine], kind: str, message: str
) -> None:
    rows = batch()
    with pytest.raises(BatchError, match=message):
        engines["padded"].infer_batch(with_routes(rows, bad_routes(rows, kind)))


def test_routes_given_to_an_engine_without_router_replay_are_refused(
    engines: dict[str, Engine],
) -> None:
    engine = build(router_replay=False)
    rows = batch()
    with pytest.raises(BatchError, match=r"'routed_experts'.*without EngineConfig.router_replay"):
        engine.infer_batch(with_routes(rows, bad_routes(rows, "none")))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"backend": {"transformer_overrides": {"num_moe_experts": 4}}},
            r"'num_moe_experts': set ModelConfig.num_experts",
        ),
        (
            {"backend": {"transformer_overrides": {"moe_grouped_gemm": True}}},
            r"'moe_grouped_gemm': set MegatronBackend.layer_spec",
        ),
        (
            {"backend": {"transformer_overrides": {"num_layers": 3}}},
            r"'num_layers': set ModelConfig.num_layers",
        ),
        (
            {"model": tiny_model(), "parallel": {"expert_parallel_size": 2}},
            r"expert_parallel_size=2 needs a mixture-of-experts model",
        ),
        ({"model": tiny_model(), "router_replay": True}, r"router_replay needs a mixture-of-exp"),
        ({"model": moe_model(num_experts=3), "parallel": {"expert_parallel_size": 2}}, "divisible"),
        (
            {"model": moe_model(), "parallel": {"tensor_parallel_size": 2}},
            r"mixture-of-experts model with tensor_parallel_size > 1 needs sequence_parallel",
        ),
        (
            {"model": moe_model(router_score_function="sigmoid", normalize_expert_weights=False)},
            r"normalize_expert_weights=False with router_score_function='sigmoid'",
        ),
    ],
)
def test_what_the_megatron_backend_cannot_do_is_refused_naming_the_field(
    config: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # as a 2-rank launch: the layouts themselves fit
    with pytest.raises(ConfigError, match=message):
        Engine.build(head="lm", backend="megatron", device="cpu", config=config)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"num_experts": 2, "experts_per_token": 3}, r"experts_per_token \(3\) must be <= num_ex"),
        ({"expert_ffn_hidden_size": 32}, r"expert_ffn_hidden_size describes experts"),
        ({"num_experts": 4, "router_score_function": "relu"}, r"router_score_function must be"),
    ],
)
def test_the_model_config_checks_its_expert_fields(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Engine.build(head="lm", device="cpu", config={"model": tiny_model(**model)})


def test_transformer_engine_grouped_experts_get_global_numbers_too() -> None:
    """Under expert parallelism every expert is drawn under its global number, whichever layer
    spec names it (TransformerEngine's grouped GEMM: ``linear_fc1.weightE``)."""
    from strategies.backends.megatron.weight_init import expert_number, renumber_expert

    for name, number in (
        ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", 3),
        ("decoder.layers.1.mlp.experts.linear_fc2.weight2", 2),
    ):
        assert expert_number(name) == number
        assert expert_number(renumber_expert(name, number + 4)) == number + 4
    for dense in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.router.weight"):
        assert expert_number(dense) is None


def test_hugging_face_weights_of_grouped_experts_are_refused_naming_the_layer_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.config import EngineConfig
    from strategies.backends.megatron import backend as megatron

    monkeypatch.setattr(megatron, "uses_transformer_engine", lambda kind: True)
    config = EngineConfig.from_dict({"model": moe_model()})
    engine_config = config.replace(model=attrs.evolve(config.model, hf_path="/checkpoints/moe"))
    with pytest.raises(ConfigError, match=r"layer_spec='local'"):
        megatron.MegatronBackend(layer_spec="transformer_engine").validate(engine_config, 1)
