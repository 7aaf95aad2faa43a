"""A task that ships with the project, so verl's RL trainer runs on a CPU out of the box: a
word-level tokenizer with a chat template and a tiny Qwen3 made locally (nothing downloaded),
verl's parquet files for a synthetic task, and its reward in verl's
``custom_reward_function`` form (:func:`compute_score`).

The task, *repeat*: the prompt names a word (``repeat : kiwi``); the answer should be that
word, ``ANSWER_LENGTH`` times. The reward is the share of the answer's first
``ANSWER_LENGTH`` words that equal it (0 to 1). A model with random weights scores about
``1 / vocabulary``; it learns first to answer with task words, then with the prompt's word.

    python -m engine.integrations.verl.task DIR   # DIR/model, DIR/data/{train,test}.parquet
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Words the prompts ask for.
WORDS = ("kiwi", "plum", "fig", "lime")
#: Words the answer has (the reward counts this many).
ANSWER_LENGTH = 4
#: Where verl's reward manager finds this task's rows (the parquet's ``data_source``).
DATA_SOURCE = "composable_engine/repeat"
SPECIAL = ("[PAD]", "[UNK]", "<|im_start|>", "<|im_end|>")
VOCABULARY = (*SPECIAL, "\n", "system", "user", "assistant", "repeat", ":", *WORDS)
#: Qwen's ChatML layout (verl's agent loop checks it: ``<|im_end|>`` then one newline token).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """verl's ``custom_reward_function``: the share of the answer's first ``ANSWER_LENGTH``
    words that are ``ground_truth``."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"compute_score scores {DATA_SOURCE!r} rows, not {data_source!r}")
    words = solution_str.split()[:ANSWER_LENGTH]
    return sum(word == ground_truth for word in words) / ANSWER_LENGTH


def write_tokenizer(directory: Path) -> Any:
    """A word-level tokenizer over :data:`VOCABULARY` with a chat template (words split at
    spaces; the newline and the chat markers are tokens of their own)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(VOCABULARY)}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_tokens([AddedToken("\n", normalized=False, special=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def model_config(*, moe: bool = False) -> Any:
    """The tiny Qwen3 (or Qwen3-MoE) config of this task's model (its tokenizer's ids)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    shape: dict[str, Any] = dict(
        vocab_size=16,  # a multiple of the tensor-parallel sizes the engine may use
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=VOCABULARY.index("[PAD]"),
        eos_token_id=VOCABULARY.index("<|im_end|>"),
        bos_token_id=None,
    )
    if moe:
        return Qwen3MoeConfig(
            **shape,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    return Qwen3Config(**shape, intermediate_size=128)


def write_model(directory: Path, *, moe: bool = False, seed: int = 0) -> None:
    """A tiny Qwen3 (or Qwen3-MoE) with this task's tokenizer, random weights from ``seed``."""
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    write_tokenizer(directory)
    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(model_config(moe=moe))
    model.save_pretrained(directory)


def write_data(directory: Path, *, train: int = 256, test: int = 32) -> dict[str, str]:
    """verl's RL parquet files (``prompt`` as chat messages, ``reward_model.ground_truth``)."""
    import pandas as pd

    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("train", train), ("test", test)):
        records = [
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"repeat : {WORDS[i % len(WORDS)]}"}],
                "ability": "repeat",
                "reward_model": {"style": "rule", "ground_truth": WORDS[i % len(WORDS)]},
                "extra_info": {"split": split, "index": i},
            }
            for i in range(rows)
        ]
        path = directory / f"{split}.parquet"
        pd.DataFrame(records).to_parquet(path)
        paths[split] = str(path)
    return paths


def write(directory: str | Path, *, moe: bool = False) -> dict[str, str]:
    """The model (``DIR/model``) and data (``DIR/data``); returns their paths."""
    root = Path(directory)
    (root / "model").mkdir(parents=True, exist_ok=True)
    write_model(root / "model", moe=moe)
    paths = write_data(root / "data")
    return {"model": str(root / "model"), **paths, "reward": str(Path(__file__).resolve())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write model/ and data/")
    parser.add_argument("--moe", action="store_true", help="a mixture-of-experts model")
    args = parser.parse_args(argv)
    print(json.dumps(write(args.directory, moe=args.moe), indent=2))


if __name__ == "__main__":
    main()
