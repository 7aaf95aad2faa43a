"""A model's size counted from its config: exactly the parameters each backend builds, a rank's
share of them as each backend lays them out, and the refusal naming the sizes behind it."""

from __future__ import annotations

from typing import Any

import pytest

from engine import Engine
from engine.config import coerce_config
from heads.errors import ConfigError
from heads.lm import LMHead
from heads.value import ValueHead
from strategies.backends.fsdp2.backend import Fsdp2Backend
from strategies.backends.megatron.backend import MegatronBackend
from strategies.memory.model_size import ParameterCount, RankMemory, check_fits, count_parameters
from strategies.part_configs import ModelConfig
from tests.factories import tiny_model

#: (model, head): each shape option the count reads, under an LM head and a value head.
BUILT = {
    "dense LM": (tiny_model(), "lm"),
    "dense value model with a head bias": (tiny_model(head_bias=True), "value"),
    "tied LM": (tiny_model(tie_embeddings=True), "lm"),
    "tied embeddings under a value head": (tiny_model(tie_embeddings=True), "value"),
    "qkv biases": (tiny_model(add_qkv_bias=True), "lm"),
    "query-key norms and a head_dim": (tiny_model(qk_layernorm=True, head_dim=16), "lm"),
    "mixture of experts": (tiny_model(num_experts=4, expert_ffn_hidden_size=16), "lm"),
}


def lm_count(**model: Any) -> ParameterCount:
    return count_parameters(ModelConfig(**tiny_model(**model)), LMHead().output_spec())


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
@pytest.mark.parametrize("name", BUILT)
def test_the_count_is_exactly_the_parameters_the_backend_builds(
    fresh_mesh: None, backend: str, name: str
) -> None:
    model, head = BUILT[name]
    engine = Engine.build(
        head=head, backend=backend, device="cpu", config={"model": model, "forward_only": True}
    ).initialize()
    built = sum(p.numel() for module in engine.backend.modules() for p in module.parameters())
    count = count_parameters(engine.config.model, engine.head.output_spec())
    assert count.total == built


def test_a_megatron_rank_holds_its_tensor_and_pipeline_share_and_its_optimizer_state() -> None:
    count = lm_count(num_layers=4)
    embedding = count.embedding.parameters

    def share(world: int, distributed: bool = False, **parallel: int) -> RankMemory:
        config = coerce_config({"model": tiny_model(num_layers=4), "parallel": parallel})
        backend = MegatronBackend(use_distributed_optimizer=distributed)
        return backend.memory_per_rank(config, count, world)

    whole = share(1)
    assert (whole.parameters, whole.bytes) == (count.total, 16 * count.total)
    assert share(2, tensor_parallel_size=2).parameters == count.total // 2
    # each stage holds half the layers; the first the embedding, the last as large an output
    assert share(2, pipeline_parallel_size=2).parameters == count.layers // 2 + embedding
    # the distributed optimizer splits the moments over the 4 data-parallel ranks
    assert share(4, distributed=True).bytes == count.total * (4 + 4 + 8 // 4)
    assert "split over 4 ranks" in share(4, distributed=True).counted


def test_a_tied_embedding_has_its_copy_on_the_last_pipeline_stage() -> None:
    count = lm_count(num_layers=4, tie_embeddings=True)
    config = coerce_config(
        {"model": tiny_model(num_layers=4), "parallel": {"pipeline_parallel_size": 2}}
    )
    memory = MegatronBackend().memory_per_rank(config, count, 2)
    assert count.output.parameters == 0
    assert memory.parameters == count.layers // 2 + count.embedding.parameters


def test_megatron_splits_routed_experts_over_expert_parallel_ranks_too() -> None:
    count = lm_count(num_experts=4)
    config = coerce_config(
        {"model": tiny_model(num_experts=4), "parallel": {"expert_parallel_size": 2}}
    )
    memory = MegatronBackend().memory_per_rank(config, count, 2)
    assert memory.parameters == count.total - count.experts.parameters // 2


def test_fsdp2_counts_the_whole_model_it_builds_on_every_rank_before_sharding() -> None:
    count = lm_count()
    config = coerce_config({"model": tiny_model()})
    one, eight = (Fsdp2Backend().memory_per_rank(config, count, world) for world in (1, 8))
    assert (one.parameters, one.bytes) == (count.total, 16 * count.total)  # weights + state
    assert (eight.parameters, eight.bytes) == (count.total, 4 * count.total)  # the build
    assert "the whole model" in eight.counted
    reference = coerce_config({"model": tiny_model(), "forward_only": True})
    assert Fsdp2Backend().memory_per_rank(reference, count, 1).bytes == 4 * count.total


def test_a_lora_or_forward_only_engine_counts_no_optimizer_state() -> None:
    count = lm_count()
    for extra in ({"forward_only": True}, {"lora": {"rank": 4}}):
        config = coerce_config({"model": tiny_model(), "dtype": "bfloat16", **extra})
        assert MegatronBackend().memory_per_rank(config, count, 1).bytes == 2 * count.total


def test_a_model_is_refused_only_beyond_the_memory_available_naming_its_sizes() -> None:
    count = count_parameters(ModelConfig(**tiny_model(vocab_size=2**20)), ValueHead().output_spec())
    need = RankMemory(parameters=count.total, bytes=3 * 2**30, counted="float32 weights")
    check_fits(count, need, 3 * 2**30, "the cpu device")  # just enough
    with pytest.raises(ConfigError) as refused:
        check_fits(count, need, 2**30, "the cpu device")
    assert str(refused.value) == (
        f"the model is too large to allocate: {count.total:,} parameters, mostly the embedding "
        f"(vocab_size=1048576 x hidden_size=32); one rank holds {count.total:,} of them, 3.0 GiB "
        "(float32 weights), but the cpu device has 1.0 GiB available; make those ModelConfig "
        "sizes smaller"
    )
