"""Critics and reward models enter and leave as Hugging Face classifiers, on both backends.

A ``...ForTokenClassification`` checkpoint is a value model (its ``score`` layer, with its bias,
is the value head's layer), a ``...ForSequenceClassification`` one a reward model (no bias), and
``save_hf`` writes them back as such: transformers reloads what the engine trained and gives
its numbers. A value head's ``values[t]`` is transformers' ``logits[t - 1]``; a reward head's
``scores`` are the sequence classifier's logits, which it pools at each row's last non-pad
token (the batch is right-padded with ``pad_token_id``, which no real token uses).

Tiny random models (``save_pretrained`` of transformers' own classes, float32): a dense Qwen2
with tied embeddings and a Qwen3-MoE. A handful of engines, built once per module, trained two
AdamW steps (lr 1e-2) before ``save_hf``. Outputs are compared relative to their magnitude
within :func:`forward_tolerance`, float32's epsilon times the longest chain of sums a value
goes through (``tests.tolerances.reordered``): 1.1e-4 for Qwen2, 9.8e-5 for Qwen3-MoE; the
steps move the outputs by more than 100 times that. Measured here (largest relative gaps):
engine vs transformers on the source 3.7e-7, trained engine vs transformers on its ``save_hf``
1.9e-7 (LoRA merged 1.9e-7, its PEFT adapter 1.8e-7), megatron at TP=2 / PP=2 within the same.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from heads.errors import CheckpointError, ConfigError
from strategies.backends.megatron.mesh import destroy_mesh
from strategies.hf.files import SafetensorsCheckpoint
from tests.factories import raise_outputs_loss, random_batch
from tests.multiprocess import run_ranks
from tests.strategies.backends.megatron import test_hf
from tests.strategies.backends.megatron.test_hf import VOCAB, save_random_model, source_state_dict
from tests.strategies.hf import test_moe_checkpoints
from tests.tolerances import relative_gap, reordered

TOKEN, SEQUENCE = "TokenClassification", "SequenceClassification"
#: The classifier's padding token; the batches draw their tokens below it.
PAD = VOCAB - 1
LENGTHS = [7, 12, 5, 9]
STEPS = 2
TOKENIZER_FILE = "tokenizer_config.json"
CONFIGS = {"qwen2": test_hf.hf_config, "qwen3_moe": test_moe_checkpoints.hf_config}

#: name -> (backend, family, head, the classifier it starts from): both backends, a dense and
#: a mixture-of-experts family, value and reward heads, score layers with a bias and without
#: (a critic started from a reward model), tied (Qwen2) and untied (Qwen3-MoE) embeddings.
CASES = {
    "megatron-qwen2-value": ("megatron", "qwen2", "value", TOKEN),
    "megatron-qwen3_moe-reward": ("megatron", "qwen3_moe", "reward", SEQUENCE),
    "megatron-qwen2-value-from-reward": ("megatron", "qwen2", "value", SEQUENCE),
    "fsdp2-qwen2-reward": ("fsdp2", "qwen2", "reward", SEQUENCE),
    "fsdp2-qwen3_moe-value": ("fsdp2", "qwen3_moe", "value", TOKEN),
}
#: LoRA (dense models only): a critic on megatron, a reward model on fsdp2, from Qwen2.
LORA_CASES = {
    "megatron-qwen2-value-lora": ("megatron", "qwen2", "value", TOKEN),
    "fsdp2-qwen2-reward-lora": ("fsdp2", "qwen2", "reward", SEQUENCE),
}
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q", "v", "o", "up", "down"]}
EXPORTED_AS = {"value": TOKEN, "reward": SEQUENCE}


def classifier_config(family: str, labels: int = 1) -> Any:
    config = CONFIGS[family](family)
    config.num_labels = labels
    config.pad_token_id = PAD
    return config


def save_classifier(family: str, task: str, directory: Path, labels: int = 1) -> Path:
    """A random classifier of ``family`` (its score bias, where it has one, not zero), with a
    tokenizer file for the export to carry along."""
    save_random_model(classifier_config(family, labels), directory, seed=0, task=task)
    (directory / TOKENIZER_FILE).write_text(json.dumps({"pad_token": "<pad>"}))
    return directory


def forward_tolerance(path: Path) -> float:
    """Relative tolerance for two float32 forwards of the model at ``path`` that sum in other
    orders: per layer, the query-key products (head_dim), softmax and attention over the
    positions (2 x the longest sequence), the norms, the output projection and the MLP's input
    (4 x hidden), the MLP's output (its intermediate size, and the chosen experts' sum); then
    the final norm and the score layer (2 x hidden)."""
    from strategies.hf.config_json import load_hf_config

    hf = load_hf_config(path)
    hidden = int(hf.hidden_size)
    head_dim = getattr(hf, "head_dim", None) or hidden // hf.num_attention_heads
    mlp = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    experts = getattr(hf, "num_experts_per_tok", 1)
    per_layer = head_dim + 2 * max(LENGTHS) + 4 * hidden + mlp + experts
    return reordered(hf.num_hidden_layers * per_layer + 2 * hidden)


def batch() -> Any:
    return random_batch(LENGTHS, PAD, seed=1)


def engine_outputs(engine: Engine, data: Any) -> Any:
    """Values from token 1 on (token 0 has none), or scores, as one flat tensor (None on a rank
    that receives no outputs)."""
    result = engine.infer_batch(data)
    if result is None:
        return None
    if "scores" in result:
        return result["scores"].clone()
    return torch.cat([row[1:] for row in result["values"].unbind()]).clone()


def transformers_outputs(path: Path, task: str, data: Any) -> torch.Tensor:
    """The classifier at ``path`` on ``data``, right-padded with ``PAD``: a token classifier's
    logits but the last (the value of token t is read at t - 1), a sequence classifier's. A
    token classifier of a checkpoint without ``score.bias`` (a sequence classifier's) gets a
    zero one, as the engine's layer adds none."""
    import transformers

    model = getattr(transformers, f"AutoModelFor{task}").from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    with SafetensorsCheckpoint(str(path)) as checkpoint:  # one file, or one per stage
        if task == TOKEN and "score.bias" not in checkpoint.files:
            torch.nn.init.zeros_(model.score.bias)
    rows = data["input_ids"].unbind()
    ids = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=PAD)
    mask = ids != PAD
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=mask.long()).logits[..., 0]
    if task == SEQUENCE:
        return logits
    return torch.cat([logits[i, : len(row) - 1] for i, row in enumerate(rows)])


def build(backend: str, checkpoint: Path, head: str, **config: Any) -> Engine:
    settings = {
        "model": str(checkpoint),
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-2},
        **config,
    }
    return Engine.build(head=head, backend=backend, device="cpu", config=settings).initialize()


def run(
    case: tuple[str, str, str, str], source: Path, directory: Path, lora: Any = None
) -> dict[str, Any]:
    """Build the engine of ``case`` on ``source``, train it, save it (with LoRA the PEFT
    adapter too); what the tests read."""
    backend, _, head, _ = case
    data = batch()
    engine = build(backend, source, head, seed=3, lora=lora)
    found: dict[str, Any] = {"before": engine_outputs(engine, data)}
    with engine.train_mode():
        for _ in range(STEPS):
            engine.train_batch(data, raise_outputs_loss)
    found["after"] = engine_outputs(engine, data)
    found["exported"] = dict(engine.get_per_tensor_param())
    engine.save_hf(directory / "saved")
    found["saved"] = directory / "saved"
    found["reloaded"] = transformers_outputs(directory / "saved", EXPORTED_AS[head], data)
    if lora is not None:
        engine.save_hf(directory / "adapter", adapter_only=True)
        found["adapter"] = directory / "adapter"
    return found


def run_all(
    cases: dict[str, tuple[str, str, str, str]],
    sources: dict[tuple[str, str], Path],
    root: Path,
    lora: Any = None,
) -> Iterator[dict[str, Any]]:
    """Every case's ``run``, on a fresh megatron mesh."""
    destroy_mesh()
    yield {
        name: run(case, sources[case[1], case[3]], root / name, lora)
        for name, case in cases.items()
    }
    destroy_mesh()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {
        (family, task): save_classifier(family, task, root / f"{family}-{task}")
        for family in CONFIGS
        for task in (TOKEN, SEQUENCE)
    }


@pytest.fixture(scope="module")
def runs(
    sources: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    yield from run_all(CASES, sources, tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("name", CASES)
def test_before_training_the_engine_gives_the_classifiers_outputs(
    runs: dict[str, Any], sources: dict[tuple[str, str], Path], name: str
) -> None:
    _, family, head, task = CASES[name]
    source = sources[family, task]
    expected = transformers_outputs(source, EXPORTED_AS[head], batch())
    gap = relative_gap(runs[name]["before"], expected)
    print(f"{name}: engine vs transformers {gap:.1e} (tolerance {forward_tolerance(source):.1e})")
    assert gap <= forward_tolerance(source)


@pytest.mark.parametrize("name", CASES)
def test_after_training_transformers_reloads_what_save_hf_wrote(
    runs: dict[str, Any], name: str
) -> None:
    found = runs[name]
    tolerance = forward_tolerance(found["saved"])
    gap = relative_gap(found["after"], found["reloaded"])
    print(f"{name}: trained engine vs reloaded transformers {gap:.1e} (tolerance {tolerance:.1e})")
    assert gap <= tolerance
    assert relative_gap(found["after"], found["before"]) > 100 * tolerance  # it trained


@pytest.mark.parametrize("name", CASES)
def test_the_export_is_the_classifier_transformers_writes(
    runs: dict[str, Any], sources: dict[tuple[str, str], Path], name: str
) -> None:
    """config.json names the class, its labels and padding token; the score layer keeps the
    source's bias, and a token classifier always holds one (zero where the layer has none)."""
    _, family, head, task = CASES[name]
    found, source = runs[name], sources[family, task]
    exported_as = EXPORTED_AS[head]
    config = json.loads((found["saved"] / "config.json").read_text())
    written = json.loads((source / "config.json").read_text())
    prefix = {"qwen2": "Qwen2", "qwen3_moe": "Qwen3Moe"}[family]
    assert config["architectures"] == [f"{prefix}For{exported_as}"]
    assert (config["id2label"], config["label2id"]) == (written["id2label"], written["label2id"])
    assert config["pad_token_id"] == PAD
    assert (found["saved"] / TOKENIZER_FILE).read_text() == (source / TOKENIZER_FILE).read_text()
    had_bias = task == TOKEN
    scores = {n for n in found["exported"] if n.startswith("score.")}
    assert scores == ({"score.weight", "score.bias"} if had_bias else {"score.weight"})
    saved = source_state_dict(found["saved"])
    assert ("score.bias" in saved) == (exported_as == TOKEN)
    if exported_as == TOKEN and not had_bias:
        assert torch.equal(saved["score.bias"], torch.zeros(1))
    assert not any(n.startswith(("lm_head", "value_head")) for n in saved)


# -- LoRA --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_runs(
    sources: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    yield from run_all(LORA_CASES, sources, tmp_path_factory.mktemp("lora"), LORA)


@pytest.mark.parametrize("name", LORA_CASES)
def test_a_lora_critic_or_reward_model_is_saved_merged_and_as_a_peft_adapter(
    lora_runs: dict[str, Any], sources: dict[tuple[str, str], Path], name: str
) -> None:
    """Merged: transformers' classifier of the export gives the trained engine's outputs. The
    PEFT adapter on transformers' token classifier of the source gives them too (a reward
    model's score at each row's last token)."""
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    _, family, head, task = LORA_CASES[name]
    found, source = lora_runs[name], sources[family, task]
    tolerance = forward_tolerance(source)
    merged_gap = relative_gap(found["after"], found["reloaded"])
    base = AutoModelForTokenClassification.from_pretrained(
        source, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    model = PeftModel.from_pretrained(base, str(found["adapter"])).eval()
    rows = batch()["input_ids"].unbind()
    with torch.no_grad():
        logits = [model(input_ids=row[None]).logits[0, :, 0] for row in rows]
    if head == "reward":
        peft = torch.stack([row_logits[-1] for row_logits in logits])
    else:
        peft = torch.cat([row_logits[:-1] for row_logits in logits])
    adapter_gap = relative_gap(found["after"], peft)
    print(f"{name}: merged {merged_gap:.1e}, PEFT adapter {adapter_gap:.1e} (tol {tolerance:.1e})")
    assert merged_gap <= tolerance and adapter_gap <= tolerance
    assert relative_gap(found["after"], found["before"]) > 100 * tolerance


# -- tensor and pipeline parallel (megatron) ---------------------------------------------------
def critic_on_ranks(source: str, parallel: dict[str, int], directory: str) -> Any:
    """On every rank: the critic's values (output ranks; None elsewhere), then ``save_hf``."""
    engine = build("megatron", Path(source), "value", forward_only=True, parallel=parallel)
    values = engine_outputs(engine, batch())
    engine.save_hf(directory)
    return values


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["tp2", "pp2"],
)
def test_a_critic_loads_and_saves_across_tensor_and_pipeline_ranks(
    sources: dict[tuple[str, str], Path], tmp_path: Path, parallel: dict[str, int]
) -> None:
    """The score layer (replicated on every tensor rank, on the last pipeline stage) loads and
    comes back with its bias, in one file or in one per stage."""
    source, saved = sources["qwen2", TOKEN], tmp_path / "saved"
    reports = run_ranks(critic_on_ranks, 2, str(source), parallel, str(saved), timeout=240)
    outputs = [values for values in reports if values is not None]
    expected = transformers_outputs(source, TOKEN, batch())
    tolerance = forward_tolerance(source)
    assert outputs and all(relative_gap(got, expected) <= tolerance for got in outputs)
    assert relative_gap(transformers_outputs(saved, TOKEN, batch()), expected) <= tolerance


# -- what is refused ---------------------------------------------------------------------------
def _edited(
    source: Path, directory: Path, tensors: dict[str, torch.Tensor | None], **config: Any
) -> Path:
    """A copy of ``source`` with ``tensors`` replaced (None: removed) and ``config`` set."""
    from safetensors.torch import save_file

    path = Path(shutil.copytree(source, directory))
    held = source_state_dict(path)
    for name, tensor in tensors.items():
        if tensor is None:
            held.pop(name)
        else:
            held[name] = tensor
    save_file(held, str(path / "model.safetensors"), metadata={"format": "pt"})
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, **config}))
    return path


def refused(error: pytest.ExceptionInfo[Exception]) -> str:
    """The message, which must never blame config.json's model_type for a classifier."""
    message = str(error.value)
    assert "model_type match" not in message
    return message


def test_a_classifier_of_other_num_labels_is_refused_for_a_one_output_head(
    fresh_mesh: None, tmp_path: Path
) -> None:
    source = save_classifier("qwen2", TOKEN, tmp_path / "two-labels", labels=2)
    with pytest.raises(ConfigError, match=r"head 'value' has 1 output") as error:
        build("megatron", source, "value")
    assert "num_labels=2" in refused(error) and "num_labels=1" in refused(error)


def test_an_lm_head_refuses_a_classifier(
    fresh_mesh: None, sources: dict[tuple[str, str], Path]
) -> None:
    with pytest.raises(ConfigError, match="needs a causal language model") as error:
        build("fsdp2", sources["qwen2", SEQUENCE], "lm")
    assert "is a classifier" in refused(error)


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        ({"score.weight": torch.zeros(1, 32)}, {}, r"score\.weight has shape \[1, 32\]"),
        ({}, {"id2label": {"0": "bad", "1": "good"}}, r"1 output row.*num_labels=2"),
        ({"score.bias": torch.zeros(2)}, {}, r"'score\.bias' .* shape \[2\].* \[1\]"),
        ({"lm_head.weight": torch.zeros(VOCAB, 64)}, {}, r"both a causal LM's lm_head"),
    ],
    ids=["score-shape", "labels-disagree", "bias-shape", "lm-head-too"],
)
def test_a_score_layer_that_does_not_fit_its_config_is_refused_naming_it(
    sources: dict[tuple[str, str], Path],
    tmp_path: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    message: str,
) -> None:
    from strategies.hf.config_json import model_config_from_hf

    path = _edited(sources["qwen2", TOKEN], tmp_path / "edited", tensors, **config)
    with pytest.raises(CheckpointError, match=message) as error:
        model_config_from_hf(path)
    refused(error)


def test_a_reward_model_takes_a_token_classifier_only_without_a_bias_to_lose(
    fresh_mesh: None, sources: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    """A sequence classifier has no bias: a non-zero one is refused; a zero one (an exported
    critic's) is left out, and the scores are the token classifier's at the last token."""
    with pytest.raises(ConfigError, match=r"no bias, but .*score\.bias is not zero") as error:
        build("fsdp2", sources["qwen2", TOKEN], "reward")
    assert "head='value'" in refused(error)
    destroy_mesh()
    zero = _edited(sources["qwen2", TOKEN], tmp_path / "zero", {"score.bias": torch.zeros(1)})
    engine = build("fsdp2", zero, "reward", forward_only=True)
    assert "score.bias" not in dict(engine.get_per_tensor_param())
    data = batch()
    expected = transformers_outputs(zero, SEQUENCE, data)  # the same weights, pooled
    assert relative_gap(engine_outputs(engine, data), expected) <= forward_tolerance(zero)


def test_a_critic_from_a_causal_lm_exports_a_token_classifier_with_a_zero_bias(
    fresh_mesh: None, tmp_path: Path
) -> None:
    source = test_hf.save_checkpoint("qwen2", tmp_path / "lm")
    engine = build("megatron", source, "value", forward_only=True)
    engine.save_hf(tmp_path / "saved")
    saved = source_state_dict(tmp_path / "saved")
    assert torch.equal(saved["score.bias"], torch.zeros(1)) and "lm_head.weight" not in saved
    data = batch()
    expected = transformers_outputs(tmp_path / "saved", TOKEN, data)
    assert relative_gap(engine_outputs(engine, data), expected) <= forward_tolerance(source)
