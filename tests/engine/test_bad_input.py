"""Bad input is refused by name, before any compute, and the engine trains on unharmed.

Each case (a misspelt name, a config value, a batch, a call out of order, a loss function that
breaks the contract) must raise its typed error with a message naming the field; the weights
and optimizer state of the engine it was aimed at (or, for a failed build, of an engine already
running in the process) are bit-identical afterwards, and that engine then trains on a good
batch with finite results.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from tensordict import TensorDict

from engine import Engine, EngineConfig
from engine.data.batching import from_token_lists, jagged, to_padded
from engine.losses import ActorLoss, RolloutCorrection, sft_loss, value_regression_loss
from heads.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    EngineError,
    EngineStateError,
    UnknownStrategyError,
)
from heads.lm import LMHead
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, snapshot, tiny_model, unchanged

CONFIG: dict[str, Any] = {"model": tiny_model(), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}}
LOSSES = {"value": value_regression_loss, "lm": sft_loss}
GOOD = random_batch([3, 5, 4], 64)
PADDED = to_padded(GOOD)


@attrs.frozen
class Case:
    """``attempt(engine, tmp_path)`` must raise ``error`` matching ``names``; ``head`` picks the
    engine it is aimed at (the one that must stay unharmed)."""

    attempt: Callable[[Engine, Path], Any]
    error: type[Exception]
    names: str
    head: str = "value"


def build(head_name: str = "value", /, **config: Any) -> Callable[[Engine, Path], Any]:
    """Build an engine with ``config`` on top of ``CONFIG``."""
    return lambda engine, _: Engine.build(head=head_name, device="cpu", config={**CONFIG, **config})


def initialize(head_name: str, backend: str, **model: Any) -> Callable[[Engine, Path], Any]:
    """Build and initialise an engine of ``tiny_model(**model)``, as a user would."""
    return lambda engine, _: Engine.build(
        head=head_name,
        backend=backend,
        device="cpu",
        config={**CONFIG, "model": tiny_model(**model)},
    ).initialize()


def build_named(**names: Any) -> Callable[[Engine, Path], Any]:
    return lambda engine, _: Engine.build(**{"device": "cpu", **names})


def train(batch: Any, loss: Any = value_regression_loss) -> Callable[[Engine, Path], Any]:
    return lambda engine, _: engine.train_batch(batch, loss)


def plan(batch: Any) -> Callable[[Engine, Path], Any]:
    return lambda engine, _: engine.plan_micro_batches(batch)


def with_field(name: str, value: torch.Tensor, base: TensorDict = GOOD) -> TensorDict:
    batch = base.clone()
    batch[name] = value
    return batch


def fields(**columns: torch.Tensor) -> TensorDict:
    return TensorDict(columns, batch_size=[len(next(iter(columns.values())))])


def loss_returning(make: Callable[[Any], Any]) -> Callable[[Engine, Path], Any]:
    """Train with a loss function returning ``make(values)`` (``values``: the head's output)."""
    return train(GOOD, lambda outputs, batch, ctx: make(outputs["values"]))


def offloaded(part: str, call: Callable[[Engine], Any]) -> Callable[[Engine, Path], Any]:
    def attempt(engine: Engine, _: Path) -> Any:
        engine.to("cpu", **{name: name == part for name in ("model", "optimizer", "grad")})
        try:
            return call(engine)
        finally:
            engine.to("device")

    return attempt


def failing_loss(outputs: Any, batch: Any, ctx: Any) -> Any:
    if ctx.micro_batch_index == 1:
        raise RuntimeError("loss exploded in micro-batch 1")
    return value_regression_loss(outputs, batch, ctx)


def in_eval_mode(engine: Engine, call: Callable[[], Any]) -> Any:
    with engine.eval_mode():
        return call()


def new_engine(call: Callable[[Engine], Any], **config: Any) -> Callable[[Engine, Path], Any]:
    """``call`` on another engine of the same model (never initialised, or forward-only)."""
    return lambda engine, _: call(
        Engine.build(head="value", device="cpu", config={**CONFIG, **config})
    )


NAMES = {
    "misspelt head": Case(build_named(head="valeu"), UnknownStrategyError, "did you mean 'value'"),
    "head in capitals": Case(build_named(head="LM"), UnknownStrategyError, "did you mean 'lm'"),
    "misspelt backend": Case(
        build_named(backend="megatorn"), UnknownStrategyError, "did you mean 'megatron'"
    ),
    "backend in capitals": Case(
        build_named(backend="Megatron"), UnknownStrategyError, "did you mean 'megatron'"
    ),
    "device gpu": Case(build_named(device="gpu"), UnknownStrategyError, "did you mean 'cuda'"),
    "device in capitals": Case(
        build_named(device="CPU"), UnknownStrategyError, "did you mean 'cpu'"
    ),
    "unknown device": Case(
        build_named(device="fpga"), UnknownStrategyError, "Known devices: cpu, cuda, npu"
    ),
    "head of the wrong type": Case(build_named(head=42), ConfigError, "head must be a name"),
    "head class, not object": Case(
        build_named(head=LMHead), ConfigError, "head must be an instance, not the class LMHead"
    ),
    "platform of the wrong type": Case(
        build_named(device=object()), ConfigError, "platform must be a name"
    ),
}

CONFIGS = {
    "a misspelt config key": Case(
        build(micro_batch_sise=2), ConfigError, "did you mean 'micro_batch_size'"
    ),
    "a misspelt optimizer key": Case(
        build(optimizer={"lrr": 1e-3}), ConfigError, r"OptimizerConfig has no field\(s\) lrr"
    ),
    "a mistyped model directory": Case(
        build(model="./checkpoints/qwen-0.5b"), ConfigError, "no such directory"
    ),
    "a misspelt preset": Case(build(model="tinny"), ConfigError, "did you mean 'tiny'"),
    "top-1 routing with normalised weights on megatron": Case(
        build("lm", model=tiny_model(num_experts=4, experts_per_token=1)),
        ConfigError,
        r"experts_per_token=1 with normalize_expert_weights=True",
        head="lm",
    ),
    "rollout correction masking with upper below 1": Case(
        lambda e, _: RolloutCorrection(mode="mask", upper=0.5),
        ConfigError,
        r"lower defaults to 1 / upper = 2",
    ),
    "config of the wrong type": Case(
        lambda engine, _: Engine.build(config=[1]), ConfigError, "config must be an EngineConfig"
    ),
    "micro_batch_size 0": Case(build(micro_batch_size=0), ConfigError, "micro_batch_size"),
    "micro_batch_size 2.5": Case(
        build(micro_batch_size=2.5), ConfigError, r"EngineConfig\.micro_batch_size must be int"
    ),
    "micro_batch_size True": Case(
        build(micro_batch_size=True), ConfigError, r"micro_batch_size must be int; got True"
    ),
    "micro_batch_size '4'": Case(
        build(micro_batch_size="4"), ConfigError, r"micro_batch_size must be int; got '4'"
    ),
    "forward_only 'false'": Case(
        build(forward_only="false"), ConfigError, r"EngineConfig\.forward_only must be bool"
    ),
    "seed above 2**31-1": Case(
        build(seed=2**40), ConfigError, r"EngineConfig\.seed must be in \[0, 2147483647\]"
    ),
    "negative seed": Case(build(seed=-1), ConfigError, r"EngineConfig\.seed must be in"),
    "fractional seed": Case(build(seed=1.5), ConfigError, r"EngineConfig\.seed must be int"),
    "token budget 0": Case(
        build(max_tokens_per_micro_batch=0), ConfigError, "max_tokens_per_micro_batch must be > 0"
    ),
    "total_steps 0": Case(build(total_steps=0), ConfigError, r"EngineConfig\.total_steps"),
    "unknown dtype": Case(build(dtype="fp8"), ConfigError, r"EngineConfig\.dtype must be one of"),
    "dtype not a string": Case(build(dtype=16), ConfigError, r"EngineConfig\.dtype must be str"),
    "unknown section": Case(build(optimiser={}), ConfigError, "optimiser"),
    "NaN lr": Case(
        build(optimizer={"lr": math.nan}), ConfigError, r"OptimizerConfig\.lr must be a finite"
    ),
    "infinite lr": Case(
        build(optimizer={"lr": math.inf}), ConfigError, r"OptimizerConfig\.lr must be a finite"
    ),
    "negative lr": Case(build(optimizer={"lr": -1.0}), ConfigError, r"lr must be > 0"),
    "lr as a string": Case(
        build(optimizer={"lr": "1e-3"}), ConfigError, r"OptimizerConfig\.lr must be float"
    ),
    "min_lr above lr": Case(
        build(optimizer={"lr": 1e-3, "min_lr": 1e-2}), ConfigError, r"min_lr .* must be <= lr"
    ),
    "NaN min_lr": Case(build(optimizer={"min_lr": math.nan}), ConfigError, r"\.min_lr must be"),
    "infinite weight decay": Case(
        build(optimizer={"weight_decay": math.inf}), ConfigError, r"\.weight_decay must be"
    ),
    "negative weight decay": Case(
        build(optimizer={"weight_decay": -0.1}), ConfigError, r"\.weight_decay must be >= 0"
    ),
    "beta1 of 1": Case(
        build(optimizer={"adam_beta1": 1.0}), ConfigError, r"adam_beta1 must be in \[0, 1\)"
    ),
    "NaN beta2": Case(build(optimizer={"adam_beta2": math.nan}), ConfigError, r"adam_beta2"),
    "zero eps": Case(build(optimizer={"adam_eps": 0.0}), ConfigError, r"adam_eps must be > 0"),
    "NaN clip_grad": Case(
        build(optimizer={"clip_grad": math.nan}), ConfigError, r"\.clip_grad must be a finite"
    ),
    "negative clip_grad": Case(
        build(optimizer={"clip_grad": -1.0}), ConfigError, r"\.clip_grad must be >= 0"
    ),
    "distributed optimizer 'yes'": Case(
        build(backend={"use_distributed_optimizer": "yes"}),
        ConfigError,
        r"use_distributed_optimizer must be bool",
    ),
    "unknown optimizer field": Case(
        build(optimizer={"lrr": 1.0}), ConfigError, r"OptimizerConfig has no field\(s\) lrr"
    ),
    "unknown decay style": Case(
        build(scheduler={"decay_style": "cosin"}), ConfigError, r"decay_style must be one of"
    ),
    "negative warmup": Case(
        build(scheduler={"warmup_steps": -1}), ConfigError, r"warmup_steps must be >= 0"
    ),
    "fractional decay steps": Case(
        build(scheduler={"decay_steps": 2.5}), ConfigError, r"decay_steps must be int"
    ),
    "decay within warmup": Case(
        build(scheduler={"warmup_steps": 5, "decay_steps": 5}), ConfigError, r"decay_steps"
    ),
    "unknown model preset": Case(build(model="huge"), ConfigError, "known presets"),
    "hidden size not divisible by heads": Case(
        build(model=tiny_model(hidden_size=30)), ConfigError, r"hidden_size \(30\) must be"
    ),
    "query groups not dividing heads": Case(
        build(model=tiny_model(num_query_groups=3)), ConfigError, r"num_query_groups must divide"
    ),
    "fractional query groups": Case(
        build(model=tiny_model(num_query_groups=1.5)), ConfigError, r"num_query_groups must be"
    ),
    "NaN norm epsilon": Case(
        build(model=tiny_model(norm_epsilon=math.nan)), ConfigError, r"norm_epsilon must be"
    ),
    "zero vocabulary": Case(
        build(model=tiny_model(vocab_size=0)), ConfigError, r"vocab_size must be > 0"
    ),
    "tie_embeddings 'no'": Case(
        build(model=tiny_model(tie_embeddings="no")), ConfigError, r"tie_embeddings must be bool"
    ),
    "unknown model field": Case(
        build(model=tiny_model(hiden_size=32)), ConfigError, "unknown ModelConfig field.*hiden"
    ),
    "tensor parallel 2.0": Case(
        build(parallel={"tensor_parallel_size": 2.0}), ConfigError, "tensor_parallel_size"
    ),
    "sequence_parallel 1": Case(
        build(parallel={"sequence_parallel": 1}), ConfigError, r"sequence_parallel must be bool"
    ),
    "temperature 0": Case(
        build("lm", head={"temperature": 0.0}), ConfigError, r"LMHead\.temperature must be > 0"
    ),
    "negative temperature": Case(
        build("lm", head={"temperature": -1.0}), ConfigError, r"LMHead\.temperature must be > 0"
    ),
    "NaN temperature": Case(
        build("lm", head={"temperature": math.nan}), ConfigError, r"LMHead\.temperature"
    ),
    "temperature 'hot'": Case(
        build("lm", head={"temperature": "hot"}), ConfigError, r"LMHead\.temperature must be"
    ),
    "compute_entropy 'true'": Case(
        build("lm", head={"compute_entropy": "true"}), ConfigError, r"compute_entropy must be"
    ),
    "unknown head option": Case(
        build("lm", head={"temprature": 1.0}), ConfigError, r"LMHead has no field\(s\) temprature"
    ),
    "unknown layer spec": Case(
        build(backend={"layer_spec": "te"}), ConfigError, r"layer_spec must be one of"
    ),
    "overlap_grad_reduce 'false'": Case(
        build(backend={"overlap_grad_reduce": "false"}),
        ConfigError,
        r"overlap_grad_reduce must be bool",
    ),
    "unknown non-finite policy": Case(
        build(non_finite={"policy": "ignore"}), ConfigError, r"NonFiniteConfig\.policy"
    ),
    "zero consecutive skips": Case(
        build(non_finite={"max_consecutive_skips": 0}), ConfigError, r"max_consecutive_skips"
    ),
    "offload 'yes'": Case(
        build(offload={"model": "yes"}), ConfigError, r"OffloadConfig\.model must be bool"
    ),
    "missing config file": Case(
        lambda engine, tmp: EngineConfig.from_yaml(tmp / "missing.yaml"),
        ConfigError,
        "cannot read config file .*missing.yaml",
    ),
    "initialize without the HF checkpoint": Case(
        lambda engine, _: Engine.build(
            head="lm", device="cpu", config={**CONFIG, "model": tiny_model(hf_path="/no/such")}
        ).initialize(),
        CheckpointError,
        "/no/such",
    ),
}

ACTOR_FIELDS = with_field(
    "advantages",
    jagged([torch.ones(n) for n in (3, 5, 4)]),
    with_field("old_log_probs", jagged([torch.zeros(n) for n in (3, 5, 4)])),
)

BATCHES = {
    "labels that differ from input_ids": Case(
        train(
            with_field(
                "labels",
                jagged([torch.full((n,), 65, dtype=torch.long) for n in (3, 5, 4)]),
                GOOD.exclude("loss_mask"),
            )
        ),
        BatchError,
        r"'labels' differ from 'input_ids' where they are not -100",
    ),
    "labels beside a loss_mask": Case(
        train(
            with_field(
                "labels",
                GOOD["input_ids"].clone(),
                with_field("loss_mask", jagged([torch.ones(n) for n in (3, 5, 4)])),
            )
        ),
        BatchError,
        "both 'labels' and 'loss_mask'",
    ),
    "a misspelt field the loss needs": Case(
        train(
            with_field(
                "retruns", jagged([torch.zeros(n) for n in (3, 5, 4)]), GOOD.exclude("returns")
            )
        ),
        BatchError,
        r"lacks field\(s\) returns needed here \(a misspelling: 'retruns' for 'returns'\?\)",
    ),
    "not a TensorDict": Case(train({"input_ids": [[1, 2]]}), BatchError, "tensordict.TensorDict"),
    "no sequences": Case(
        train(TensorDict({"input_ids": torch.zeros(0, 3, dtype=torch.long)}, [0])),
        BatchError,
        r"batch_size \[num_sequences > 0\]",
    ),
    "no input_ids": Case(train(fields(x=torch.zeros(2, 3))), BatchError, "has no 'input_ids'"),
    # planning checks the batch as the steps do, so it never plans with wrong lengths
    "planning no input_ids": Case(
        plan(fields(x=torch.zeros(2, 3))), BatchError, "has no 'input_ids'"
    ),
    "planning a list": Case(plan([[1, 2]]), BatchError, "tensordict.TensorDict"),
    "planning a mask with a hole": Case(
        plan(
            with_field(
                "attention_mask", torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]] * 2)[:3], PADDED
            )
        ),
        BatchError,
        r"'attention_mask' row 1 has a hole",
    ),
    "float input_ids": Case(
        train(fields(input_ids=torch.zeros(2, 3), returns=torch.zeros(2, 3))),
        BatchError,
        "'input_ids' must be int64 or int32",
    ),
    "3-D input_ids": Case(
        train(fields(input_ids=torch.zeros(2, 3, 1, dtype=torch.long))),
        BatchError,
        r"'input_ids' must be \[B, L\]",
    ),
    "a field the loss needs is missing": Case(
        train(from_token_lists([[1, 2, 3]])), BatchError, "lacks field.*returns"
    ),
    "token id beyond the vocabulary": Case(
        train(from_token_lists([[1, 2], [3, 99]], returns=[[0, 0], [0, 0]])),
        BatchError,
        r"'input_ids' must lie in \[0, 64\).*row 1, token 1 holds 99",
    ),
    "negative token id": Case(
        train(from_token_lists([[1, -1]], returns=[[0, 0]])),
        BatchError,
        r"row 0, token 1 holds -1",
    ),
    "sequence longer than the model's": Case(
        train(from_token_lists([[1] * 3, [1] * 65], returns=[[0] * 3, [0] * 65])),
        BatchError,
        r"row 1 has 65 tokens, more than ModelConfig\.max_sequence_length \(64\)",
    ),
    "empty sequence": Case(
        train(
            with_field("attention_mask", torch.tensor([[1, 1, 1, 0, 0]] * 2 + [[0] * 5]), PADDED)
        ),
        BatchError,
        r"row 2: empty sequence",
    ),
    "attention mask of another shape": Case(
        train(with_field("attention_mask", PADDED["attention_mask"][:, :2], PADDED)),
        BatchError,
        "'attention_mask' shape",
    ),
    "attention mask with a hole": Case(
        train(
            with_field(
                "attention_mask", torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]] * 2)[:3], PADDED
            )
        ),
        BatchError,
        r"'attention_mask' row 1 has a hole \(1 0 1 1 1\)",
    ),
    "attention mask of 2s": Case(
        train(with_field("attention_mask", PADDED["attention_mask"].long() * 2, PADDED)),
        BatchError,
        r"mask 'attention_mask' must hold only 0 and 1; row 0, position 0 holds 2",
    ),
    "a shorter per-token row": Case(
        train(with_field("returns", jagged([torch.zeros(3), torch.zeros(4), torch.zeros(4)]))),
        BatchError,
        r"'returns' has 4 values in row 1, where 'input_ids' has 5 tokens",
    ),
    "a narrower padded field": Case(
        train(with_field("returns", PADDED["returns"][:, :4], PADDED)),
        BatchError,
        r"field 'returns' has shape \[3, 4\]: per-token fields are \[3, 5\]",
    ),
    "Hugging Face -100 in a mask": Case(
        train(
            with_field(
                "loss_mask",
                jagged(
                    [torch.tensor([0.0, 1, 1]), torch.tensor([-100.0, 1, 1, 1, 1]), torch.ones(4)]
                ),
            )
        ),
        BatchError,
        r"'loss_mask' must hold only 0 and 1; row 1, token 0 holds -100; .*labels != -100",
    ),
    "fractional mask": Case(
        train(with_field("loss_mask", torch.where(PADDED["attention_mask"], 0.5, 0.0), PADDED)),
        BatchError,
        r"'loss_mask' must hold only 0 and 1; row 0, position 0 holds 0.5",
    ),
    "NaN in a mask": Case(
        train(
            with_field(
                "loss_mask",
                jagged([torch.ones(3), torch.ones(5), torch.tensor([1.0, math.nan, 1, 1])]),
            )
        ),
        BatchError,
        r"'loss_mask' must hold only 0 and 1; row 2, token 1 holds nan",
    ),
    "per-sequence field with several values": Case(
        train(with_field("scores", torch.zeros(3, 2))),
        BatchError,
        r"'scores' has shape \[3, 2\].*one value per row \(\[3\]\)",
    ),
    "jagged field in a padded batch": Case(
        train(with_field("returns", GOOD["returns"], PADDED)),
        BatchError,
        "field 'returns' is jagged but 'input_ids' is padded",
    ),
    "padding in a jagged batch": Case(
        train(
            with_field(
                "attention_mask",
                jagged([torch.ones(3), torch.tensor([1.0, 1, 1, 0, 0]), torch.ones(4)]),
            )
        ),
        BatchError,
        r"a jagged batch has no padding, but 'attention_mask' row 1, token 3 holds 0",
    ),
    "a nested TensorDict": Case(
        train(with_field("extra", TensorDict({"a": torch.zeros(3)}, [3]))),
        BatchError,
        "field 'extra' is a TensorDict",
    ),
}

CALL_ORDER = {
    "train before initialize": Case(
        new_engine(lambda e: e.train_batch(GOOD, value_regression_loss)),
        EngineStateError,
        r"train_batch\(\) needs an initialised engine",
    ),
    "infer before initialize": Case(
        new_engine(lambda e: e.infer_batch(GOOD)),
        EngineStateError,
        r"infer_batch\(\) needs an initialised engine",
    ),
    "train inside eval_mode": Case(
        lambda e, _: in_eval_mode(e, lambda: e.train_batch(GOOD, value_regression_loss)),
        EngineStateError,
        r"train_batch\(\) trains, but it is called inside eval_mode\(\)",
    ),
    "forward and backward inside eval_mode": Case(
        lambda e, _: in_eval_mode(e, lambda: e.forward_backward_batch(GOOD, value_regression_loss)),
        EngineStateError,
        r"forward_backward_batch\(\) trains, but it is called inside eval_mode",
    ),
    "train without a loss function": Case(
        train(GOOD, None), ConfigError, "train_batch needs a loss_function"
    ),
    "step before initialize": Case(
        new_engine(lambda e: e.optimizer_step()), EngineStateError, "call initialize"
    ),
    "offload before initialize": Case(
        new_engine(lambda e: e.to("cpu")), EngineStateError, "call initialize"
    ),
    "train a forward-only engine": Case(
        new_engine(
            lambda e: e.initialize().train_batch(GOOD, value_regression_loss), forward_only=True
        ),
        EngineStateError,
        r"config\.forward_only=True",
    ),
    # every call checks in one order: a forward-only engine is told so before what is offloaded
    "forward and backward on an offloaded forward-only engine": Case(
        new_engine(
            lambda e: e.initialize().to("cpu").forward_backward_batch(GOOD, value_regression_loss),
            forward_only=True,
        ),
        EngineStateError,
        r"forward_backward_batch\(\) trains, but this engine is forward-only",
    ),
    "zero the grads of a forward-only engine": Case(
        new_engine(lambda e: e.initialize().optimizer_zero_grad(), forward_only=True),
        EngineStateError,
        "forward-only",
    ),
    "train with the optimizer offloaded": Case(
        offloaded("optimizer", lambda e: e.train_batch(GOOD, value_regression_loss)),
        EngineStateError,
        r"train_batch\(\) needs the optimizer on the device",
    ),
    "train with the grads offloaded": Case(
        offloaded("grad", lambda e: e.train_batch(GOOD, value_regression_loss)),
        EngineStateError,
        r"needs the grad on the device",
    ),
    "infer with the model offloaded": Case(
        offloaded("model", lambda e: e.infer_batch(GOOD)),
        EngineStateError,
        r"needs the model on the device",
    ),
    "step with the model offloaded": Case(
        offloaded("model", lambda e: e.optimizer_step()),
        EngineStateError,
        r"optimizer_step\(\) needs the model",
    ),
    "training without a loss function": Case(
        lambda e, _: e.forward_backward_batch(GOOD, None),
        ConfigError,
        "needs a loss_function unless forward_only",
    ),
    "to an unknown place": Case(lambda e, _: e.to("gpu"), ConfigError, r"to\(\) takes 'cpu'"),
    "load a checkpoint from an empty directory": Case(
        lambda e, tmp: e.load_checkpoint(tmp), CheckpointError, "no complete checkpoint under"
    ),
}

LOSS_FUNCTIONS = {
    "returns a number": Case(
        loss_returning(lambda v: 1.0), ConfigError, r"must return \(loss, metrics\)"
    ),
    "returns three things": Case(
        loss_returning(lambda v: (v.sum(), {}, None)), ConfigError, r"must return \(loss, metrics\)"
    ),
    "loss of two elements": Case(
        loss_returning(lambda v: (v[0, :2], {})), ConfigError, "must be a scalar tensor"
    ),
    "metrics as a list": Case(
        loss_returning(lambda v: (v.sum(), [1.0])), ConfigError, "metrics must be a mapping"
    ),
    "a detached loss": Case(
        loss_returning(lambda v: (v.sum().detach(), {})), ConfigError, "detached from the model"
    ),
    "a new tensor as the loss": Case(
        loss_returning(lambda v: (torch.tensor(1.0, requires_grad=True), {})),
        ConfigError,
        "detached from the model",
    ),
    "a loss computed without grad": Case(
        loss_returning(lambda v: (torch.no_grad()(lambda: v.sum())(), {})),
        ConfigError,
        "detached from the model",
    ),
    "a text metric": Case(
        loss_returning(lambda v: (v.sum(), {"note": "fine"})),
        ConfigError,
        r"loss metric 'note' must be a number or a one-element tensor; got str",
    ),
    "a metric of several values": Case(
        loss_returning(lambda v: (v.sum(), {"per_row": v.sum(-1)})),
        ConfigError,
        r"loss metric 'per_row' must be a number",
    ),
    "a None metric": Case(
        loss_returning(lambda v: (v.sum(), {"kl": None})), ConfigError, r"loss metric 'kl'"
    ),
    "a loss that raises mid-batch": Case(
        train(GOOD, failing_loss), RuntimeError, "loss exploded in micro-batch 1"
    ),
    "an actor loss lacking its fields": Case(
        train(GOOD, ActorLoss(kl_coeff=0.1)),
        BatchError,
        "lacks field.*old_log_probs, advantages, ref_log_probs",
        head="lm",
    ),
    "an actor loss given per-sequence advantages": Case(
        train(
            with_field(
                "advantages",
                torch.ones(3),
                with_field("old_log_probs", jagged([torch.zeros(n) for n in (3, 5, 4)])),
            ),
            ActorLoss(),
        ),
        BatchError,
        r"field 'advantages' is per-sequence \(\[3\], one value per row\) but the loss reads "
        "it per token",
        head="lm",
    ),
    "an actor loss with rollout correction lacking rollout_log_probs": Case(
        train(
            with_field(
                "advantages",
                jagged([torch.ones(n) for n in (3, 5, 4)]),
                with_field("old_log_probs", jagged([torch.zeros(n) for n in (3, 5, 4)])),
            ),
            ActorLoss(rollout_correction=RolloutCorrection(level="sequence")),
        ),
        BatchError,
        "lacks field.*rollout_log_probs",
        head="lm",
    ),
    "a value loss given per-sequence returns": Case(
        train(with_field("returns", torch.zeros(3))),
        BatchError,
        "field 'returns' is per-sequence",
    ),
    "an entropy bonus on a head without entropy": Case(
        train(ACTOR_FIELDS, ActorLoss(entropy_coeff=0.1)),
        ConfigError,
        r"ActorLoss reads the head output\(s\) 'entropy', which head 'lm' does not produce",
        head="lm",
    ),
    "an unknown aggregation mode": Case(
        lambda e, _: ActorLoss(loss_agg_mode="token_mean"), ConfigError, "loss_agg_mode"
    ),
}

#: Too large to allocate: refused before anything is, naming the sizes (not the allocator's
#: ``RuntimeError: ... can't allocate memory``).
TOO_LARGE = {
    **{
        f"a vocabulary of 2**40 ({head}, {backend})": Case(
            initialize(head, backend, vocab_size=2**40),
            ConfigError,
            r"too large to allocate: [\d,]+ parameters, mostly the embedding \(vocab_size="
            r"1099511627776 x hidden_size=32\).*one rank holds [\d,]+ of them, [\d.]+ [TP]iB "
            r"\(float32 weights.*\), but the cpu device has [\d.,]+ [MGT]iB available",
        )
        for head in ("lm", "value", "reward")
        for backend in ("megatron", "fsdp2")
    },
    "a hidden size of 2**20": Case(
        initialize("value", "megatron", hidden_size=2**20),
        ConfigError,
        r"too large to allocate: .* mostly the attention \(num_layers=2 x hidden_size=1048576",
    ),
    "10**9 layers": Case(
        initialize("lm", "fsdp2", num_layers=10**9),
        ConfigError,
        r"too large to allocate: .* mostly the MLP \(num_layers=1000000000 x 3 x hidden_size=32 x "
        r"ffn_hidden_size=64\)",
    ),
    "2**30 experts": Case(
        initialize("lm", "megatron", num_experts=2**30),
        ConfigError,
        r"mostly the routed experts \(num_layers=2 x num_experts=1073741824",
    ),
}

CASES = {
    f"{group}: {name}": case
    for group, cases in (
        ("name", NAMES),
        ("config", CONFIGS),
        ("batch", BATCHES),
        ("call order", CALL_ORDER),
        ("loss function", LOSS_FUNCTIONS),
        ("model size", TOO_LARGE),
    )
    for name, case in cases.items()
}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    destroy_mesh()
    yield {
        head: Engine.build(head=head, device="cpu", config=CONFIG).initialize()
        for head in ("value", "lm")
    }
    destroy_mesh()


def test_there_are_enough_cases_of_every_kind() -> None:
    assert len(CASES) >= 60
    assert all(len(group) >= 10 for group in (NAMES, CONFIGS, BATCHES, CALL_ORDER, LOSS_FUNCTIONS))


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_refused_by_name_and_the_engine_trains_on(
    engines: dict[str, Engine], tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    engine = engines[case.head]
    before = snapshot(engine)
    with pytest.raises(case.error, match=case.names) as caught:
        case.attempt(engine, tmp_path)
    assert isinstance(caught.value, EngineError) or case.error is RuntimeError
    assert unchanged(before, engine), "the failed call changed the weights or optimizer state"
    result = engine.train_batch(GOOD, LOSSES[case.head])
    assert result["skipped"] == 0.0 and math.isfinite(float(result["loss"]))
    assert not unchanged(before, engine)


def test_a_sequence_longer_than_the_token_budget_is_named_with_its_length(
    engines: dict[str, Engine],
) -> None:
    budgeted = Engine.build(
        head="value", device="cpu", config={**CONFIG, "max_tokens_per_micro_batch": 10}
    ).initialize()
    before = snapshot(budgeted)
    with pytest.raises(BatchError, match=r"sequence 1 has 12 tokens, more than .*=10"):
        budgeted.train_batch(random_batch([4, 12, 3], 64), value_regression_loss)
    assert unchanged(before, budgeted)
    assert budgeted.train_batch(random_batch([4, 9, 3], 64), value_regression_loss)["loss"] >= 0
