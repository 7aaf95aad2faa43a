"""``python -m engine train``: one line of metrics per step, text and chat data tokenized by the
model's tokenizer, the final model as a Hugging Face directory; ``matrix``; bad input exits
non-zero, named."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from tests.engine.data.test_text import CHAT_TEMPLATE, tiny_chat_model
from tests.multiprocess import TORCHRUN_TWO_RANKS, fresh_process_env, run_command, run_module

ROOT = Path(__file__).resolve().parents[3]


def run(*args: str, launcher: tuple[str, ...] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m engine *args`` (forked from the tests' zygote where it can be), or under
    ``launcher`` (e.g. torchrun, then ``-m``), one thread, killed after 300 s."""
    env = fresh_process_env()
    if launcher is None:
        return run_module("engine", list(args), env, ROOT, timeout=300)
    return run_command([*launcher, "engine", *args], env, ROOT, timeout=300)


STEP_LINE = re.compile(r"^step +(\d+)/(\d+) +loss ([\d.]+) +grad_norm ([\d.]+) +lr ([\d.e+-]+)")


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
@pytest.mark.parametrize("head", ["value", "lm"])
def test_train_prints_one_metrics_line_per_step_and_learns(head: str, backend: str) -> None:
    result = run(
        "train", "--head", head, "--backend", backend, "--device", "auto", "--steps", "12",
        "--seed", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [STEP_LINE.match(line) for line in result.stdout.splitlines()]
    losses = [float(match.group(3)) for match in steps if match]
    assert len(losses) == 12
    assert sum(losses[-3:]) < sum(losses[:3])
    assert "tokens/s" in result.stdout
    assert "is_fx_tracing" not in result.stderr  # torch's notice users cannot act on


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_train_with_packing_learns(backend: str) -> None:
    packed = ("train", "--head", "value", "--steps", "10", "--seed", "3", "--packing")
    result = run(*packed, "--max-tokens-per-micro-batch", "128", "--backend", backend)
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [float(m.group(3)) for m in map(STEP_LINE.match, result.stdout.splitlines()) if m]
    assert len(losses) == 10
    assert sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("train", "--steps", "0"), "must be a positive integer"),
        (("train", "--device", "gpu"), "unknown device 'gpu'"),
        (("train", "--head", "valeu"), "did you mean 'value'"),
        (("train", "--model", "huge"), "unknown model preset 'huge'"),
        (("train", "--max-length", "999"), "exceeds the model's max_sequence_length"),
        (("train", "--device", "npu"), "torch_npu"),
    ],
)
def test_bad_arguments_exit_non_zero_with_a_message_naming_the_problem(
    args: tuple[str, ...], message: str
) -> None:
    result = run(*args)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_config_file_with_an_unknown_key_is_rejected_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("optimizer:\n  lr: 1e-3\n  betas: [0.9, 0.95]\n")
    result = run("train", "--config", str(config), "--steps", "1")
    assert result.returncode == 2
    assert "betas" in result.stderr


def test_a_config_file_sets_engine_settings_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("model: tiny\nmicro_batch_size: 3\noptimizer:\n  lr: 0.5\n")
    result = run("train", "--config", str(config), "--steps", "1", "--lr", "0.002")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lr 2.00e-03" in result.stdout


@pytest.mark.multiprocess
def test_train_runs_under_torchrun_with_tensor_parallelism() -> None:
    result = run(
        "train", "--head", "value", "--steps", "3", "--tensor-parallel-size", "2",
        launcher=TORCHRUN_TWO_RANKS,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tp=2" in result.stdout
    assert len([line for line in result.stdout.splitlines() if STEP_LINE.match(line)]) == 3


def test_train_runs_under_torchrun_with_fsdp2_data_parallelism() -> None:
    result = run("train", "--backend", "fsdp2", "--steps", "3", launcher=TORCHRUN_TWO_RANKS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend=fsdp2" in result.stdout and "dp=2" in result.stdout
    assert len([line for line in result.stdout.splitlines() if STEP_LINE.match(line)]) == 3


def test_matrix_lists_every_cell_and_why_npu_cannot_run_here() -> None:
    result = run("matrix", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    cells = {(c["head"], c["backend"], c["device"]): c for c in report["cells"]}
    assert set(cells) == {
        (head, backend, device)
        for head in ("lm", "value", "reward")
        for backend in ("megatron", "fsdp2")
        for device in ("cpu", "cuda", "npu")
    }
    common = [
        "checkpoints", "async_checkpoints", "huggingface_export", "sharded_export", "offload",
        "packing",
    ]  # fmt: skip
    assert report["backend_abilities"]["fsdp2"] == [*common, "lora"]
    megatron = [*common, "router_replay", "router_statistics", "lora"]
    assert report["backend_abilities"]["megatron"] == megatron
    for backend in ("megatron", "fsdp2"):
        assert cells[("value", backend, "cpu")]["runs_here"]
    npu = cells[("value", "megatron", "npu")]
    assert not npu["runs_here"]
    assert any("torch_npu" in reason for reason in npu["reasons"])
    assert report["versions"]["megatron-core"] == "0.16.1"
    assert report["versions"]["torch-npu"] is None


def test_matrix_says_each_reason_once_under_the_cells_it_stops() -> None:
    result = run("matrix")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    reasons = [line for line in lines if line.startswith("    ")]
    assert len(reasons) == len(set(reasons))
    npu = lines.index("unavailable: {lm, reward, value} x {fsdp2, megatron} x npu")
    assert "torch_npu" in lines[npu + 1]
    assert "runs here: {lm, reward, value} x {fsdp2, megatron} x cpu" in lines


def test_cells_are_described_as_one_product_where_they_form_one() -> None:
    from engine.cli.matrix import describe_cells

    def cell(head: str, backend: str, device: str) -> dict[str, str]:
        return {"head": head, "backend": backend, "device": device}

    square = [cell(h, b, "npu") for h in ("lm", "value") for b in ("megatron", "fsdp2")]
    assert describe_cells(square) == "{lm, value} x {megatron, fsdp2} x npu"
    ragged = [cell("lm", "megatron", "npu"), cell("value", "fsdp2", "npu")]
    assert describe_cells(ragged) == "lm x megatron x npu, value x fsdp2 x npu"


def test_matrix_picks_up_registered_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.cli.matrix import cells
    from engine.registry import HEADS
    from tests.engine.test_registry import RewardHead

    HEADS.register("reward-matrix", RewardHead)  # a user's head (tests/engine/test_registry.py)
    try:
        names = {(c["head"], c["device"]) for c in cells() if c["runs_here"]}
        assert ("reward-matrix", "cpu") in names
    finally:
        HEADS.unregister("reward-matrix")


def test_train_reads_jsonl_data_and_writes_metrics_and_a_plot(tmp_path: Path) -> None:
    data = tmp_path / "values.jsonl"
    rows = [
        {"input_ids": [i % 7, 3, 5, 1 + i % 5], "returns": [0.0, 0.5, 0.25, 1.0]} for i in range(6)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    result = run(
        "train", "--head", "value", "--data", str(data), "--batch-size", "4", "--steps", "4",
        "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"data={data}" in result.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    assert all(record["num_tokens"] == 16.0 for record in records)
    assert (out / "metrics.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"input_ids": [1, 2, 3]}\n', "lacks 'returns'"),
        ('{"input_ids": [1, 2], "returns": [0.5]}\n', "'returns' must be a list as long as"),
        ('{"input_ids": [1, 2], "returns": [0, 1]}\nnot json\n', ":2 is not JSON"),
        ("", "holds no records"),
        # checked when read, not when a step first draws the record
        ('{"input_ids": [1, 2.7], "returns": [0, 1]}\n', ":1: 'input_ids' holds 2.7"),
        ('{"input_ids": [1, 128], "returns": [0, 1]}\n', "bad.jsonl:1, token 1 holds 128"),
        ('{"input_ids": [1, 2], "returns": [0, "x"]}\n', "'returns' holds 'x'"),
        (
            '{"input_ids": [1, 2], "returns": [0, 1], "loss_mask": [0, 2]}\n',
            "bad.jsonl:1, token 1 holds 2",
        ),
        ('{"input_ids": [1, 2], "returns": [0, 1], "loss_mask": [1, true]}\n', ":1: 'loss_mask' "),
        ('{"input_ids": [true, 2], "returns": [0, 1]}\n', "holds True; token ids are ints"),
        ('{"input_ids": [1], "returns": [0]}\n', ":1: a sequence needs at least 2 tokens"),
        (
            '{"input_ids": [1, 2], "returns": [0, 1]}\n'
            '{"input_ids": [3, 999], "returns": [0, 1]}\n',
            "bad.jsonl:2, token 1 holds 999",
        ),
        (
            '{"input_ids": [1, 2], "returns": [0, 1]}\n'
            + json.dumps({"input_ids": [1] * 300, "returns": [0] * 300}),
            "bad.jsonl:2 has 300 tokens, more than the model's max_sequence_length",
        ),
    ],
)
def test_train_rejects_bad_jsonl_data_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    from engine.cli import main

    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    assert main(["train", "--head", "value", "--data", str(data), "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_train_refuses_sequences_over_the_token_budget_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli import main

    budget = ["--packing", "--max-tokens-per-micro-batch", "8", "--device", "cpu"]
    data = tmp_path / "data.jsonl"
    rows = [{"input_ids": [1] * n, "returns": [0.0] * n} for n in (4, 9, 3, 5)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["train", "--head", "value", "--data", str(data), "--batch-size", "2", *budget]
    assert main(args) == 2
    assert (
        "data.jsonl:2 has 9 tokens, more than max_tokens_per_micro_batch (8)"
        in capsys.readouterr().err
    )
    assert main(["train", "--max-length", "9", *budget]) == 2
    assert "--max-length 9 exceeds max_tokens_per_micro_batch (8)" in capsys.readouterr().err


def test_train_refuses_to_overwrite_an_earlier_runs_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", "--device", "cpu", "--output-dir", str(tmp_path)]) == 2
    assert "an earlier run's" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


CONVERSATIONS = [
    [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    for question, answer in [("what is one plus one", "two"), ("what is two plus two", "four")]
] * 4


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("chat-model"))


def write_records(path: Path, records: Sequence[Mapping[str, object]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_train_sft_on_chat_records_ends_with_a_model_transformers_loads(
    chat_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    out = tmp_path / "run"
    result = run(
        "train", "--model", str(chat_model), "--data", str(data), "--batch-size", "4",
        "--steps", "6", "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(m.group(3)) for m in map(STEP_LINE.match, result.stdout.splitlines()) if m]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2])
    exported = out / "huggingface"
    last = result.stdout.splitlines()[-1]
    assert last.startswith("done in ")
    assert last.endswith(f"; model (lm head) as a Hugging Face directory in {exported}")
    trained = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(chat_model).state_dict()
    assert trained.keys() == initial.keys()
    assert not torch.equal(trained["model.norm.weight"], initial["model.norm.weight"])
    assert AutoTokenizer.from_pretrained(exported).chat_template == CHAT_TEMPLATE


def test_text_and_prompt_response_records_are_read_with_their_loss_masks(
    chat_model: Path, tmp_path: Path
) -> None:
    from engine.cli.train import read_sequences
    from engine.config import EngineConfig
    from engine.data.text import load_tokenizer, tokenize_record

    config = EngineConfig(model=str(chat_model))
    tokenizer = load_tokenizer(chat_model)
    for records in (
        [{"text": "hello world"}, {"text": "what is two plus two"}],
        [{"prompt": "what is one plus one", "response": " two", "id": 7}],
    ):
        data = write_records(tmp_path / "data.jsonl", records)
        read = read_sequences(str(data), "lm", config)
        assert read == [tokenize_record(record, tokenizer) for record in records]


def test_train_says_where_the_model_could_not_be_exported_and_still_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine import Engine
    from engine.cli import main
    from heads.errors import ConfigError

    def refuse(engine: Engine, directory: Path) -> None:
        raise ConfigError(f"save_hf cannot write head {engine.head.name!r}")

    monkeypatch.setattr(Engine, "save_hf", refuse)
    out = tmp_path / "run"
    args = ["train", "--head", "value", "--steps", "1", "--device", "cpu", "--output-dir", str(out)]
    assert main(args) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(
        "model (value head) not exported as a Hugging Face directory: save_hf cannot write "
        "head 'value'"
    )


@pytest.mark.parametrize(
    ("lines", "model", "message"),
    [
        (['{"text": "hello"}'], "tiny", ":1: text records need the model's tokenizer, and the "
         "model is a preset"),
        (['{"text": "hello"}'], "no-tokenizer", "holds none (no tokenizer.json"),
        (['{"text": "hello"}', '{"messages": []}'], "chat", ":2: a record of kind messages, but "
         "line 1 is of kind text"),
        (['{"text": "hello"}', '{"text": ""}'], "chat", ":2: 'text' is empty"),
        (['{"text": "hello"}', '{"input_ids": [1, 2]}'], "chat", ":2: a record of kind input_ids"),
        (['{"prompt": "a", "text": "b"}'], "chat", ":1: the record mixes kinds"),
        ([json.dumps({"text": "hello world " * 40})], "chat", "jsonl:1 has 121 tokens, more than "
         "the model's max_sequence_length (64); shorten or drop the sequence"),
    ],
)  # fmt: skip
def test_train_refuses_bad_text_records_naming_the_line_and_what_to_do(
    chat_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    lines: list[str],
    model: str,
    message: str,
) -> None:
    from transformers import AutoModelForCausalLM

    from engine.cli import main

    if model == "no-tokenizer":  # the chat model's weights and config, no tokenizer files
        AutoModelForCausalLM.from_pretrained(chat_model).save_pretrained(tmp_path / "bare")
    directory = {"chat": str(chat_model), "no-tokenizer": str(tmp_path / "bare")}.get(model, model)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    assert main(["train", "--data", str(data), "--model", directory, "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_text_records_are_refused_for_a_value_head(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli import main

    data = write_records(tmp_path / "data.jsonl", [{"text": "hello world"}])
    args = ["train", "--head", "value", "--model", str(chat_model), "--data", str(data)]
    assert main([*args, "--device", "cpu"]) == 2
    assert ":1: text records train an LM head (SFT); --head value needs" in capsys.readouterr().err
