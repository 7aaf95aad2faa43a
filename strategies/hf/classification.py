"""Critics and reward models as Hugging Face classifiers, for both backends.

transformers' ``...ForTokenClassification`` scores every position with ``score`` (``hidden ->
num_labels``, with a bias); ``...ForSequenceClassification`` applies its ``score`` (no bias) and
pools each row's last non-pad token. A value or reward head's output layer is such a ``score``
layer: it is read from a classifier checkpoint (with its bias, where it has one), exported as
``score.weight`` / ``score.bias``, and ``save_hf`` writes a per-token head (value) as a token
classifier, a per-sequence head (reward) as a sequence classifier. An LM head is a causal LM.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch

from heads.base import PER_SEQUENCE, PER_TOKEN, Head, declared_results
from heads.errors import CheckpointError, ConfigError
from strategies.hf.files import SafetensorsCheckpoint
from strategies.part_configs import ModelConfig

#: A classifier's output layer, and the names its tensors have in checkpoints and exports.
SCORE = "score"
SCORE_WEIGHT, SCORE_BIAS = f"{SCORE}.weight", f"{SCORE}.bias"

#: What ``save_hf`` writes: the transformers model class, as ``AutoModelFor<task>`` names it.
Task = Literal["CausalLM", "TokenClassification", "SequenceClassification"]
CAUSAL_LM: Task = "CausalLM"
TOKEN_CLASSIFICATION: Task = "TokenClassification"
SEQUENCE_CLASSIFICATION: Task = "SequenceClassification"
#: transformers' ``model_type -> class name`` table of each task (``models.auto.modeling_auto``).
_CLASS_TABLES: dict[Task, str] = {
    CAUSAL_LM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    TOKEN_CLASSIFICATION: "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    SEQUENCE_CLASSIFICATION: "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}


def score_name(parameter: str) -> str:
    """The checkpoint name of a head layer's parameter (``value_head.bias`` -> ``score.bias``)."""
    return f"{SCORE}.{parameter.rpartition('.')[2]}"


def class_name(model_type: str, task: Task) -> str:
    """transformers' class of ``task`` for ``model_type`` (``Qwen2ForTokenClassification``)."""
    from transformers.models.auto import modeling_auto

    names: dict[str, str] = getattr(modeling_auto, _CLASS_TABLES[task])
    if model_type not in names:
        raise ConfigError(f"transformers has no {task} model for model_type={model_type!r}")
    return names[model_type]


@attrs.frozen(kw_only=True)
class ScoreLayer:
    """A classifier checkpoint's ``score`` layer: its outputs (``num_labels``) and bias."""

    labels: int
    bias: bool

    @property
    def names(self) -> set[str]:
        return {SCORE_WEIGHT, SCORE_BIAS} if self.bias else {SCORE_WEIGHT}


def read_score_layer(checkpoint: SafetensorsCheckpoint, hf_config: Any) -> ScoreLayer | None:
    """The checkpoint's ``score`` layer (None: not a classifier), checked against its config:
    ``[num_labels, hidden_size]``, and a bias of ``[num_labels]`` where there is one."""
    if SCORE_WEIGHT not in checkpoint.files:
        return None
    weight = checkpoint.read_any(SCORE_WEIGHT)
    hidden = int(hf_config.hidden_size)
    where = checkpoint.path
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise CheckpointError(
            f"{where}: {SCORE_WEIGHT} has shape {list(weight.shape)}; a classifier of this "
            f"config.json (hidden_size={hidden}) has [num_labels, {hidden}]"
        )
    labels = int(weight.shape[0])
    stated = getattr(hf_config, "num_labels", None)
    if stated is not None and int(stated) != labels:
        raise CheckpointError(
            f"{where}: {SCORE_WEIGHT} has {labels} output row(s), but config.json says "
            f"num_labels={stated} (its id2label); make config.json's id2label / label2id list "
            f"{labels} label(s), or give the classifier that was saved with it"
        )
    bias = SCORE_BIAS in checkpoint.files
    if bias:
        checkpoint.read(SCORE_BIAS, torch.Size([labels]))  # CheckpointError on another shape
    return ScoreLayer(labels=labels, bias=bias)


@attrs.frozen(kw_only=True)
class HeadLayer:
    """A head's output layer as the backends build, load and export it."""

    #: The head's name, for messages.
    head: str
    #: What ``save_hf`` writes; None where no transformers class computes the head's results
    #: (a layer behind both per-token and per-sequence results).
    task: Task | None
    #: Outputs of a value or reward head's own layer (0 for the vocabulary's).
    features: int
    #: That layer has a bias.
    bias: bool
    #: Its weights are the checkpoint's ``score`` layer (else drawn new).
    from_checkpoint: bool

    def export_task(self) -> Task:
        """``task``, or ConfigError saying why ``save_hf`` cannot write this head."""
        if self.task is None:
            raise ConfigError(
                f"save_hf writes a transformers model, but head {self.head!r} declares both "
                "per-token and per-sequence results from one layer, which neither "
                "...ForTokenClassification nor ...ForSequenceClassification computes; use "
                "get_per_tensor_param for its weights"
            )
        return self.task


def head_layer(model: ModelConfig, head: Head) -> HeadLayer:
    """The output layer ``head`` gets on ``model``; ConfigError where the checkpoint does not
    fit the head (a classifier under an LM head, ``num_labels`` other than the head's outputs,
    a bias a sequence classifier could not hold)."""
    spec = head.output_spec()
    labels = model.checkpoint_labels if model.hf_path is not None else None
    task = _task(head)
    if spec.kind == "vocab":
        if labels is not None:
            raise ConfigError(
                f"head {head.name!r} needs a causal language model, but {model.hf_path} is a "
                f"classifier (a score layer of {labels} output(s), no lm_head); give the causal "
                "LM's checkpoint, or build a value or reward head on this one"
            )
        if model.head_bias:
            raise ConfigError(
                f"ModelConfig.head_bias is for a value or reward head's own layer; head "
                f"{head.name!r} outputs the vocabulary, through a layer without a bias; set it "
                "to false"
            )
        return HeadLayer(head=head.name, task=task, features=0, bias=False, from_checkpoint=False)
    if labels is not None and labels != spec.features:
        raise ConfigError(
            f"head {head.name!r} has {spec.features} output(s), but the classifier "
            f"{model.hf_path} has num_labels={labels} (its score layer is [{labels}, hidden]); "
            f"give one saved with num_labels={spec.features}, or its causal LM checkpoint (the "
            "head's layer is then drawn new)"
        )
    bias = model.head_bias
    if bias and task == SEQUENCE_CLASSIFICATION:
        bias = _keep_sequence_bias(model, head.name)
    return HeadLayer(
        head=head.name,
        task=task,
        features=spec.features,
        bias=bias,
        from_checkpoint=labels is not None,
    )


def _task(head: Head) -> Task | None:
    if head.output_spec().kind == "vocab":
        return CAUSAL_LM
    granularities = {result.granularity for result in declared_results(head).values()}
    if granularities <= {PER_TOKEN}:
        return TOKEN_CLASSIFICATION
    return SEQUENCE_CLASSIFICATION if granularities == {PER_SEQUENCE} else None


def _keep_sequence_bias(model: ModelConfig, head: str) -> bool:
    """False (the layer goes without) where the checkpoint's score bias is zero, as an exported
    critic's is; ConfigError for any other: transformers' sequence classifier has no bias, so
    ``save_hf`` could not write it back."""
    found = "ModelConfig.head_bias is true"
    if model.hf_path is not None and model.checkpoint_labels is not None:
        with SafetensorsCheckpoint(model.hf_path) as checkpoint:
            held = SCORE_BIAS in checkpoint.files
            bias = checkpoint.read_any(SCORE_BIAS) if held else None
        if bias is not None and not bool(bias.any()):
            return False
        if bias is not None:
            largest = float(bias.abs().max())
            found = f"{model.hf_path}'s {SCORE_BIAS} is not zero (max |bias| {largest:.3g})"
    raise ConfigError(
        f"head {head!r} is written back as a ...ForSequenceClassification, whose score layer "
        f"has no bias, but {found}; start it from a sequence classifier or a causal LM "
        "checkpoint, or use this one as head='value' (a token classifier keeps its bias)"
    )


def exported_config(hf_config: Any, layer: HeadLayer) -> Any:
    """``hf_config`` (the source's transformers config) as the config of what ``layer``
    exports: a classifier's ``architectures``, and ``num_labels`` (``id2label`` /
    ``label2id``: the source's where it had as many, else transformers' ``LABEL_i``);
    ``pad_token_id`` stays the source's. A causal LM's is the source's as it is."""
    task = layer.export_task()
    if task == CAUSAL_LM:
        return hf_config
    hf_config.architectures = [class_name(hf_config.model_type, task)]
    hf_config.num_labels = layer.features
    if task == TOKEN_CLASSIFICATION and hasattr(hf_config, "token_classification_bias"):
        hf_config.token_classification_bias = True  # the export always has score.bias
    return hf_config


def with_score_bias(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as a token classifier holds them: a ``score.bias`` of zeros added where the
    engine's layer has none (transformers' layer always has one)."""
    weight = tensors.get(SCORE_WEIGHT)
    if weight is not None and SCORE_BIAS not in tensors:
        tensors[SCORE_BIAS] = weight.new_zeros(weight.shape[0])
    return tensors
