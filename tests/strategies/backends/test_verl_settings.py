"""Each backend's translation of verl's settings: plain mappings in, its options out, what it
cannot honour reported to the callback it is given (no verl import)."""

from __future__ import annotations

from typing import Any

from strategies.backends.fsdp2.backend import Fsdp2Backend
from strategies.backends.megatron.backend import MegatronBackend

CPU_OFFLOAD = ("override_optimizer_config.optimizer_cpu_offload", "optimizer_cpu_offload", True)


def test_fsdp2_translates_its_fsdp_settings_and_refuses_every_optimizer_setting() -> None:
    """fsdp2 reads FSDP's mixed precision for the compute dtype, a forward-only engine's weights
    in bf16 host memory (verl's reference), and refuses fsdp_size that does not divide the world
    and any setting of megatron's optimizer, in the order it reads them."""
    refused: list[tuple[str, str, Any, str]] = []
    engine = {"forward_only": True, "model_dtype": None, "fsdp_size": 3}
    options = Fsdp2Backend.options_from_verl(
        {}, engine, [CPU_OFFLOAD], 4, lambda *refusal: refused.append(refusal)
    )
    assert options == {
        "activation_checkpointing": False,
        "reshard_after_forward": True,
        "weights_dtype": "bfloat16",
        "cpu_offload": True,
    }
    assert refused == [
        ("engine", "fsdp_size", 3, "must divide the world size (4)"),
        ("optimizer", CPU_OFFLOAD[0], True, "megatron's optimizer settings only"),
    ]
    mixed = {"mixed_precision": {"param_dtype": "fp32"}}
    assert Fsdp2Backend.verl_compute_dtype(mixed) == ("mixed_precision.param_dtype", "fp32")
    assert Fsdp2Backend.verl_compute_dtype({"model_dtype": "fp32"})[1] == "bf16"


def test_megatron_keeps_its_optimizer_overrides_and_refuses_another_key() -> None:
    """megatron takes OPTIMIZER_OVERRIDES' fields as given (its own checks validate them),
    recomputes fully for gradient checkpointing, and refuses Ulysses and other keys."""
    refused: list[tuple[str, str, Any, str]] = []
    sgd = ("override_optimizer_config.optimizer", "optimizer", "sgd")
    options = MegatronBackend.options_from_verl(
        {"enable_gradient_checkpointing": True},
        {"ulysses_sequence_parallel_size": 2},
        [CPU_OFFLOAD, sgd],
        1,
        lambda *refusal: refused.append(refusal),
    )
    assert options["optimizer_overrides"] == {"optimizer_cpu_offload": True}
    assert options["transformer_overrides"]["recompute_granularity"] == "full"
    assert [setting for _, setting, _, _ in refused] == [
        "ulysses_sequence_parallel_size",
        "override_optimizer_config.optimizer",
    ]
    assert MegatronBackend.verl_compute_dtype({}) == ("dtype", "bfloat16")
