"""Mistakes that used to pass silently are refused, or honoured where the intent is clear:
training outside a mode context, Hugging Face labels, per-sequence lists, unmasked left
padding, a checkpoint of another engine in the way, an unfinished later save."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import Engine
from engine.data.batching import from_token_lists, to_padded, validate_batch
from engine.losses import sft_loss
from heads.errors import BatchError, CheckpointError
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model

CONFIG = {"model": tiny_model(), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}, "seed": 4}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    destroy_mesh()
    built = {
        backend: Engine.build(head="lm", backend=backend, device="cpu", config=CONFIG).initialize()
        for backend in ("megatron", "fsdp2")
    }
    yield built
    destroy_mesh()


def module_training(engine: Engine) -> bool:
    (module,) = engine.backend.modules()
    return bool(module.training)


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_outside_the_mode_contexts_each_call_runs_in_the_mode_it_needs(
    engines: dict[str, Engine], backend: str
) -> None:
    """After an ``eval_mode()`` block the model is in evaluation mode; a ``train_batch`` outside
    both contexts trains in training mode, an ``infer_batch`` evaluates; inside ``train_mode()``
    an inference keeps the mode it is in."""
    engine, batch = engines[backend], random_batch([4, 6], 64)
    with engine.eval_mode():
        engine.infer_batch(batch)
    assert not module_training(engine)
    seen: list[bool] = []

    def recording(outputs, data, ctx):  # type: ignore[no-untyped-def]
        seen.append(module_training(engine))
        return sft_loss(outputs, data, ctx)

    engine.train_batch(batch, recording)
    assert seen and all(seen)
    engine.infer_batch(batch)
    assert not module_training(engine)
    with engine.train_mode():
        engine.infer_batch(batch)
        assert module_training(engine)


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_hugging_face_labels_train_the_tokens_they_do_not_mark_minus_100(
    engines: dict[str, Engine], backend: str
) -> None:
    """``labels`` (ids, -100 where not trained) give the loss and gradient of the loss mask they
    stand for, bit for bit."""
    engine = engines[backend]
    tokens = [[5, 9, 3, 7], [2, 8, 1]]
    masks = [[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
    labels = [[-100, -100, 3, 7], [-100, 8, 1]]
    with_mask = from_token_lists(tokens, loss_mask=masks)
    with_labels = from_token_lists(tokens)
    with_labels["labels"] = from_token_lists(labels)["input_ids"]
    results = []
    for batch in (with_mask, with_labels):
        with engine.train_mode():
            result = engine.forward_backward_batch(batch, sft_loss)
            (module,) = engine.backend.modules()
            grads = [
                getattr(p, "main_grad", p.grad).clone()
                for p in module.parameters()
                if getattr(p, "main_grad", p.grad) is not None
            ]
            engine.optimizer_zero_grad()
        results.append((result["loss"], grads))
    (mask_loss, mask_grads), (label_loss, label_grads) = results
    assert mask_loss == label_loss
    assert all(torch.equal(a, b) for a, b in zip(mask_grads, label_grads, strict=True))


def test_from_token_lists_takes_numbers_as_per_sequence_fields() -> None:
    batch = from_token_lists([[1, 2, 3], [4, 5]], group_ids=[7, 7], score=[0.5, 1.0])
    assert batch["group_ids"].dtype == torch.int64 and batch["group_ids"].tolist() == [7, 7]
    assert batch["score"].dtype == torch.float32 and batch["score"].shape == (2,)
    with pytest.raises(BatchError, match="mixes numbers"):
        from_token_lists([[1, 2], [3]], weights=[0.5, [1.0]])
    with pytest.raises(BatchError, match="has 1 entries for 2 sequences"):
        from_token_lists([[1, 2], [3]], group_ids=[0])
    with pytest.raises(BatchError, match="sequence 1 has 1 tokens and 2 values"):
        from_token_lists([[1, 2], [3]], advantages=[[0.1, 0.2], [0.3, 0.4]])


def test_unmasked_left_padding_is_refused_where_the_pad_token_is_known(tmp_path: Path) -> None:
    """A padded batch without ``attention_mask`` whose row starts with the checkpoint's pad id
    is refused (the pads would be tokens); with the mask, or jagged, it runs."""
    left = to_padded(random_batch([2, 5], 64), side="left", pad_id=0).exclude("attention_mask")
    with pytest.raises(BatchError, match=r"row\(s\) \[0\] start with the model's pad token id 0"):
        validate_batch(left, pad_token_id=0)
    validate_batch(left, pad_token_id=None)  # no pad token known: every position a token
    masked = to_padded(random_batch([2, 5], 64), side="left", pad_id=0)
    validate_batch(masked, pad_token_id=0)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen2")
    assert json.loads((tmp_path / "qwen2" / "config.json").read_text())["pad_token_id"] == 0
    engine = Engine.build(
        head="lm", backend="fsdp2", device="cpu", config={"model": str(tmp_path / "qwen2")}
    ).initialize()
    with pytest.raises(BatchError, match="Give attention_mask"):
        engine.infer_batch(left)
    assert engine.infer_batch(masked)["log_probs"].is_nested


def test_a_checkpoint_of_another_backend_is_not_replaced_and_an_unfinished_save_is_named(
    engines: dict[str, Engine], tmp_path: Path
) -> None:
    megatron, fsdp2 = engines["megatron"], engines["fsdp2"]
    saved = megatron.save_checkpoint(tmp_path, global_step=3)
    manifest = (Path(saved) / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError, match=r"holds a checkpoint of a 'lm' head engine on the "):
        fsdp2.save_checkpoint(tmp_path, global_step=3)
    assert (Path(saved) / "manifest.json").read_bytes() == manifest
    assert megatron.save_checkpoint(tmp_path, global_step=3) == saved  # its own: replaced
    # a later save whose process died before it published (its temporary directory stays)
    unfinished = tmp_path / ".tmp-global_step_5-somewhere-123-0123abcd"
    os.makedirs(unfinished)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatron.load_checkpoint(tmp_path)
    messages = [str(w.message) for w in caught]
    assert any("skipping the save of step 5" in m and "did not finish" in m for m in messages)
    assert megatron.global_step == 3


def test_top_one_routing_runs_where_its_weighting_can_be_honoured() -> None:
    """One expert per token: megatron weights it by its softmax probability
    (``normalize_expert_weights=False``); fsdp2 also with weight 1 (normalised)."""
    destroy_mesh()
    batch = random_batch([4, 6], 64)
    for backend, normalize in (("megatron", False), ("fsdp2", True)):
        model = tiny_model(num_experts=4, experts_per_token=1, normalize_expert_weights=normalize)
        engine = Engine.build(
            head="lm", backend=backend, device="cpu", config={**CONFIG, "model": model}
        ).initialize()
        result = engine.train_batch(batch, sft_loss)
        assert result["skipped"] == 0.0, backend
    destroy_mesh()
