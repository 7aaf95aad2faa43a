"""Text and chat records tokenized by the model's own Hugging Face tokenizer, with the loss mask
that says which tokens ``sft_loss`` trains, so SFT data need not be tokenized by hand.

Three kinds of record (besides ``{"input_ids": [...]}``, already tokenized):

- ``{"text": ...}``: every token is trained;
- ``{"prompt": ..., "response": ...}`` (or ``"completion"``): the prompt, taken as written (no
  chat template), is masked out; the response is trained;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered by the tokenizer's chat
  template; the assistant turns are trained, everything else (system and user turns, the
  template's generation prompt before each assistant turn) masked, as verl's multi-turn SFT does.

The tokenizer's end-of-sequence token ends a text and a response (unless the tokenizer already
put it there), so the model learns to stop; a chat template places its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from engine.data.batching import from_token_lists
from heads.errors import BatchError, ConfigError

TOKENS, TEXT, PROMPT_RESPONSE, MESSAGES = "input_ids", "text", "prompt/response", "messages"
#: Each kind of record and the fields that mark it.
KIND_FIELDS: dict[str, tuple[str, ...]] = {
    TOKENS: ("input_ids",),
    TEXT: ("text",),
    PROMPT_RESPONSE: ("prompt", "response", "completion"),
    MESSAGES: ("messages",),
}
RESPONSE_FIELDS = ("response", "completion")
#: Files one of which a directory holds when it holds a tokenizer (transformers' names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def record_kind(record: Mapping[str, Any]) -> str:
    """The kind of ``record`` (a key of :data:`KIND_FIELDS`), from the fields it holds."""
    kinds = [kind for kind, names in KIND_FIELDS.items() if any(name in record for name in names)]
    if len(kinds) == 1:
        return kinds[0]
    wanted = "'input_ids' (tokenized), 'text', 'prompt' and 'response', or 'messages'"
    if not kinds:
        held = ", ".join(map(repr, record)) or "nothing"
        raise BatchError(f"a record holds {wanted}; this one holds {held}")
    raise BatchError(f"the record mixes kinds ({' and '.join(kinds)}); one record holds {wanted}")


class OneKind:
    """Refuses a data set that mixes kinds of record: a mix is most often two sources joined by
    mistake, and the kinds mask the loss differently."""

    def __init__(self) -> None:
        self.first: tuple[str, str] | None = None  # (kind, where)

    def check(self, record: Mapping[str, Any], where: str) -> str:
        """The record's kind, refused when it is not the first record's."""
        kind = record_kind(record)
        if self.first is None:
            self.first = (kind, where)
        elif kind != self.first[0]:
            raise BatchError(
                f"a record of kind {kind}, but {self.first[1]} is of kind {self.first[0]}; a data "
                "set holds one kind of record: convert them to one kind, or train on them "
                "separately"
            )
        return kind


def load_tokenizer(directory: str | os.PathLike[str] | None) -> Any:
    """The tokenizer saved in the model's Hugging Face directory (local files only).

    Checked for its files first: transformers builds an empty tokenizer of the model's family
    from a directory that has none, which would turn every text into no tokens."""
    if directory is None:
        raise ConfigError(
            "text records need the model's tokenizer, and the model is a preset: give a Hugging "
            "Face checkpoint directory with its tokenizer files as the model, or tokenized "
            "'input_ids' records"
        )
    if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"text records need the model's tokenizer, and {os.fspath(directory)} holds none "
            f"(no {', '.join(TOKENIZER_FILES)}): save it there "
            "(tokenizer.save_pretrained(DIR)), or give tokenized 'input_ids' records"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(
            f"transformers cannot load the tokenizer in {os.fspath(directory)}: {error}"
        ) from None


def tokenize_record(record: Mapping[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """``input_ids`` and ``loss_mask`` (1: a token the loss trains) of a text, prompt/response
    or messages record (see the module's docstring)."""
    kind = record_kind(record)
    if kind == TEXT:
        ids = _with_eos(_encode(tokenizer, _string(record, "text"), special=True), tokenizer)
        return _masked(ids, [1] * len(ids))
    if kind == PROMPT_RESPONSE:
        return _prompt_response(record, tokenizer)
    if kind == MESSAGES:
        return _conversation(record["messages"], tokenizer)
    raise BatchError("the record is already tokenized ('input_ids'): nothing to tokenize")


def text_batch(records: Sequence[Mapping[str, Any]], tokenizer: Any) -> TensorDict:
    """A batch for ``sft_loss`` (``input_ids``, ``loss_mask``) from records of one kind."""
    kinds, token_lists, masks = OneKind(), [], []
    for index, record in enumerate(records):
        try:
            kinds.check(record, f"record {index}")
            tokenized = tokenize_record(record, tokenizer)
        except BatchError as error:
            raise BatchError(f"record {index}: {error}") from None
        token_lists.append(tokenized["input_ids"])
        masks.append(tokenized["loss_mask"])
    return from_token_lists(token_lists, loss_mask=masks)


def _prompt_response(record: Mapping[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    present = [name for name in RESPONSE_FIELDS if name in record]
    if "prompt" not in record or len(present) != 1:
        raise BatchError(
            "a prompt/response record holds 'prompt' and one of 'response' or 'completion'; "
            f"this one holds {', '.join(map(repr, record))}"
        )
    prompt = _encode(tokenizer, _string(record, "prompt", empty=True), special=True)
    response = _encode(tokenizer, _string(record, present[0]), special=False)
    response = _with_eos(response, tokenizer)
    return _masked(prompt + response, [0] * len(prompt) + [1] * len(response))


def _conversation(messages: Any, tokenizer: Any) -> dict[str, list[int]]:
    """The whole conversation rendered once; each assistant turn located as the tokens between
    the conversation before it (with the generation prompt) and the conversation through it."""
    _check_messages(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise BatchError(
            "'messages' records are rendered by the tokenizer's chat template, and this "
            "tokenizer has none: add one (tokenizer.chat_template = ...; save_pretrained), or "
            "give prompt/response records"
        )
    whole = _render(tokenizer, messages, generation_prompt=False)
    trained = [0] * len(whole)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if turn == 0:
            raise BatchError(
                "'messages' starts with an assistant turn; a conversation to train on starts "
                "with a system or user turn (what precedes each assistant turn is its prompt)"
            )
        start = len(_prefix(tokenizer, messages[:turn], whole, generation_prompt=True))
        end = len(_prefix(tokenizer, messages[: turn + 1], whole, generation_prompt=False))
        trained[start:end] = [1] * (end - start)
    if not any(trained):
        raise BatchError("'messages' has no assistant turn: nothing to train on")
    return _masked(whole, trained)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BatchError("'messages' must be a non-empty list of {'role', 'content'} objects")
    for number, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise BatchError(
                f"message {number} of 'messages' must be an object with 'role' and 'content' "
                f"strings, got {message!r}"
            )


def _prefix(
    tokenizer: Any, messages: list[Any], whole: list[int], *, generation_prompt: bool
) -> list[int]:
    """``messages`` rendered, checked to be the start of the whole conversation's tokens."""
    ids = _render(tokenizer, messages, generation_prompt=generation_prompt)
    if whole[: len(ids)] != ids:
        raise BatchError(
            f"the chat template renders the first {len(messages)} message(s) as other than the "
            "start of the whole conversation (a template that rewrites earlier turns?), so the "
            "assistant turns cannot be located; give 'input_ids' and 'loss_mask' records "
            "tokenized your way"
        )
    return ids


def _render(tokenizer: Any, messages: list[Any], *, generation_prompt: bool) -> list[int]:
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except (TemplateError, ValueError, TypeError) as error:
        raise BatchError(f"the chat template refused the conversation: {error}") from None
    return _encode(tokenizer, text, special=False)  # the template places special tokens


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=special)["input_ids"]
    if text and not ids:
        raise BatchError(
            f"the tokenizer turns {text[:40]!r} into no tokens; is it the model's tokenizer?"
        )
    return ids


def _with_eos(ids: list[int], tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids if eos is None or ids[-1:] == [eos] else [*ids, eos]


def _masked(ids: list[int], trained: list[int]) -> dict[str, list[int]]:
    """The first token is never trained: nothing predicts it."""
    return {"input_ids": ids, "loss_mask": [0, *trained[1:]]}


def _string(record: Mapping[str, Any], name: str, *, empty: bool = False) -> str:
    value = record[name]
    if not isinstance(value, str):
        raise BatchError(f"{name!r} must be a string, got {type(value).__name__}")
    if not empty and not value.strip():
        raise BatchError(f"{name!r} is empty: nothing to train on; drop the record")
    return value
