"""Text, prompt/response and chat records become token ids and a loss mask through the model's
own tokenizer; bad records are refused saying what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.data.text import OneKind, load_tokenizer, record_kind, text_batch, tokenize_record
from heads.errors import BatchError, ConfigError

#: A Qwen-style chat template: each turn ``<|im_start|>ROLE\nCONTENT<|im_end|>\n``.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["what is one plus one", "two", "what is two plus two", "four", "hello world"]


def tiny_chat_model(directory: Path, *, max_positions: int = 64) -> Path:
    """A 2-layer Qwen2 with a byte-level BPE tokenizer (trained offline on :data:`WORDS`, as
    Qwen2's own class rebuilds it) and :data:`CHAT_TEMPLATE`, saved in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(WORDS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(tiny_chat_model(tmp_path_factory.mktemp("chat-model")))


def trained_text(tokenizer: Any, tokenized: dict[str, list[int]]) -> str:
    """The text of the tokens the loss mask trains."""
    ids, mask = tokenized["input_ids"], tokenized["loss_mask"]
    assert len(ids) == len(mask)
    return str(tokenizer.decode([token for token, kept in zip(ids, mask, strict=True) if kept]))


def test_a_text_record_trains_every_token_after_the_first_and_ends_with_eos(
    tokenizer: Any,
) -> None:
    tokenized = tokenize_record({"text": "hello world"}, tokenizer)
    ids = tokenizer("hello world")["input_ids"]
    assert tokenized["input_ids"] == [*ids, tokenizer.eos_token_id]
    assert tokenized["loss_mask"] == [0] + [1] * len(ids)


@pytest.mark.parametrize("answer_field", ["response", "completion"])
def test_a_prompt_response_record_trains_the_response_and_eos_only(
    tokenizer: Any, answer_field: str
) -> None:
    record = {"prompt": "what is one plus one", answer_field: " two"}
    tokenized = tokenize_record(record, tokenizer)
    prompt = tokenizer("what is one plus one")["input_ids"]
    assert tokenized["input_ids"][: len(prompt)] == prompt
    assert tokenized["loss_mask"][: len(prompt)] == [0] * len(prompt)
    assert trained_text(tokenizer, tokenized) == " two<|im_end|>"


def test_a_conversation_trains_the_assistant_turns_as_the_chat_template_renders_them(
    tokenizer: Any,
) -> None:
    messages = [
        {"role": "system", "content": "hello world"},
        {"role": "user", "content": "what is one plus one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
    ]
    tokenized = tokenize_record({"messages": messages}, tokenizer)
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(tokenized["input_ids"]) == whole
    # each assistant turn's text and end of turn; the generation prompt before it is masked
    assert trained_text(tokenizer, tokenized) == "two<|im_end|>\nfour<|im_end|>\n"


def test_a_batch_of_records_carries_their_tokens_and_loss_masks(tokenizer: Any) -> None:
    records = [{"text": "hello world"}, {"text": "what is two plus two"}]
    batch = text_batch(records, tokenizer)
    expected = [tokenize_record(record, tokenizer) for record in records]
    for row, wanted in enumerate(expected):
        assert batch["input_ids"][row].tolist() == wanted["input_ids"]
        assert batch["loss_mask"][row].tolist() == wanted["loss_mask"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "hello", "messages": []}, "mixes kinds (text and messages)"),
        ({"id": 3}, "this one holds 'id'"),
        ({"text": "  "}, "'text' is empty: nothing to train on"),
        ({"text": 5}, "'text' must be a string, got int"),
        ({"prompt": "what is"}, "holds 'prompt' and one of 'response' or 'completion'"),
        ({"prompt": "a", "response": "b", "completion": "c"}, "and one of 'response' or"),
        ({"prompt": "what is", "response": ""}, "'response' is empty"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "message 0 of 'messages' must be an object with"),
        ({"messages": [{"role": "user", "content": "two"}]}, "no assistant turn"),
        ({"messages": [{"role": "assistant", "content": "two"}]}, "starts with an assistant"),
        ({"input_ids": [1, 2]}, "already tokenized"),
    ],
)
def test_bad_records_are_refused_saying_what_is_wrong(
    tokenizer: Any, record: dict[str, Any], message: str
) -> None:
    with pytest.raises(BatchError) as refused:
        tokenize_record(record, tokenizer)
    assert message in str(refused.value)


def test_a_conversation_needs_a_chat_template(tokenizer: Any) -> None:
    plain = load_tokenizer(Path(tokenizer.name_or_path))
    plain.chat_template = None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "two"}]
    with pytest.raises(BatchError, match=r"has none: add one .* or give prompt/response"):
        tokenize_record({"messages": messages}, plain)


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer: Any) -> None:
    rewriting = load_tokenizer(Path(tokenizer.name_or_path))
    # the last turn is marked, so the conversation's start depends on how long it is
    rewriting.chat_template = (
        "{% for m in messages %}{% if loop.last %}<|im_start|>{% endif %}{{ m['content'] }}\n"
        "{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "two"}]
    with pytest.raises(BatchError, match="assistant turns cannot be located"):
        tokenize_record({"messages": messages}, rewriting)


def test_a_data_set_of_mixed_kinds_is_refused_naming_the_first_record() -> None:
    kinds = OneKind()
    assert kinds.check({"text": "a"}, "line 1") == "text"
    assert kinds.check({"text": "b"}, "line 2") == "text"
    with pytest.raises(BatchError, match="a record of kind messages, but line 1 is of kind text"):
        kinds.check({"messages": []}, "line 3")


def test_text_batch_names_the_bad_record(tokenizer: Any) -> None:
    with pytest.raises(
        BatchError, match="record 1: a record of kind prompt/response, but record 0 is"
    ):
        text_batch([{"text": "a"}, {"prompt": "a", "response": "b"}], tokenizer)
    with pytest.raises(BatchError, match="record 0: 'text' is empty"):
        text_batch([{"text": ""}], tokenizer)


def test_record_kinds_follow_their_fields() -> None:
    assert record_kind({"input_ids": [1], "returns": [0.0]}) == "input_ids"
    assert record_kind({"completion": "b", "prompt": "a", "id": 1}) == "prompt/response"
    assert record_kind({"messages": []}) == "messages"


def test_a_tokenizer_comes_only_from_a_directory_that_holds_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the model is a preset"):
        load_tokenizer(None)
    # transformers would build an empty Qwen2 tokenizer here, turning every text into nothing
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ConfigError, match=r"holds none .*tokenizer\.json.*save it there"):
        load_tokenizer(tmp_path)
