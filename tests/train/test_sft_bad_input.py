"""`gradaccum train --task sft` on bad input: one line `--flag value: why`, exit 2 through the
command line, nothing written in --out."""

import json
import os

import pytest

from gradaccum.cli import main
from gradaccum.train.config import TrainConfig
from gradaccum.utils.errors import BadInput
from tests.conftest import train_tokenizer

from .helpers import one_line_error


def _jsonl(path, rows: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return str(path)


def _refused(capsys, tmp_path, *argv) -> str:
    out = tmp_path / "run"
    capsys.readouterr()  # what the fixtures printed (transformers' progress bars)
    line = one_line_error(capsys, ["train", "--out", str(out), "--max-steps", "1", *argv])
    assert not out.exists(), os.listdir(out)  # nothing written, not even the folder
    return line.removeprefix("gradaccum: error: ")


GOOD = {"prompt": "add: 1+2\n", "completion": "3"}


def test_pretraining_data_for_sft(capsys, tmp_path):
    for name in ("tokens.bin", "tokens.npy", "text.txt"):
        path = tmp_path / name
        path.write_bytes(b"\0" * 64)
        line = _refused(capsys, tmp_path, "--task", "sft", "--data", str(path))
        assert line.startswith(f"--data {path}: a .{name.split('.')[1]} file is text or tokens")
        assert "--task sft reads a .jsonl, .json or .parquet file" in line


def test_examples_per_step_only_with_sft(capsys, tmp_path):
    line = _refused(capsys, tmp_path, "--examples-per-step", "8")
    assert line.startswith("--examples-per-step 8: only with --task sft")


def test_examples_and_tokens_per_step_both(capsys, tmp_path):
    line = _refused(
        capsys, tmp_path, "--task", "sft", "--examples-per-step", "8", "--tokens-per-step", "100"
    )
    assert line.startswith("--examples-per-step 8: give either --examples-per-step or")


@pytest.mark.parametrize(
    "kw, start",
    [
        ({"data_format": "messages"}, "--data-format messages: only with --task sft"),
        ({"train_on_prompt": True}, "--train-on-prompt True: only with --task sft"),
        ({"task": "sft", "accum_steps": 2}, "--accum-steps 2: an SFT step is"),
        ({"task": "sft", "batch_schedule": "0:8k"}, "--batch-schedule 0:8k: not with --task sft"),
        ({"task": "finetune"}, "--task finetune: choose one of pretrain, sft"),
    ],
)
def test_settings_of_the_other_task(kw, start):
    with pytest.raises(BadInput) as err:
        TrainConfig(**kw)
    assert str(err.value).startswith(start)


def test_folder_without_a_tokenizer(capsys, tmp_path, make_hf_folder):
    folder = make_hf_folder("gpt2", tokenizer=False)
    line = _refused(capsys, tmp_path, "--task", "sft", "--init-from", folder)
    assert line.startswith(f"--init-from {folder}: no tokenizer in the folder")


def test_messages_without_a_chat_template(capsys, tmp_path, make_hf_folder):
    folder = make_hf_folder("gpt2", tokenizer=False)
    train_tokenizer(folder, chat_template=None)
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    data = _jsonl(tmp_path / "chat.jsonl", rows * 3)
    line = _refused(capsys, tmp_path, "--task", "sft", "--init-from", folder, "--data", data)
    assert line.startswith(f"--init-from {folder}: the tokenizer has no chat template")


@pytest.mark.parametrize(
    "bad, where, why",
    [
        ('{"prompt": "a", "completion": ', "line 2", ""),
        ({"prompt": "a"}, "line 2", "completion"),
        ({"prompt": "a", "completion": ""}, "line 2", "completion"),
        ({"prompt": "a", "completion": 7}, "line 2", "completion"),
    ],
)
def test_a_bad_row_names_file_and_line(capsys, tmp_path, bad, where, why):
    data = _jsonl(tmp_path / "sft.jsonl", [GOOD, bad, GOOD])
    line = _refused(capsys, tmp_path, "--task", "sft", "--data", data)
    assert line.startswith(f"--data {data} {where}: "), line
    assert why in line


def test_no_assistant_turn_names_file_and_line(capsys, tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    alone = {"messages": [{"role": "user", "content": "hi"}]}
    data = _jsonl(tmp_path / "chat.jsonl", [chat, chat, alone])
    line = _refused(capsys, tmp_path, "--task", "sft", "--data", data)
    assert line.startswith(f"--data {data} line 3: "), line
    assert "assistant" in line


def test_bad_rows_skipped_and_counted(capsys, tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", [GOOD, {"prompt": "a"}, GOOD, GOOD])
    out = tmp_path / "run"
    args = ["--task", "sft", "--data", data, "--skip-bad-rows", "--examples-per-step", "2"]
    assert main(["train", "--out", str(out), "--max-steps", "1", "--eval-every", "0", *args]) == 0
    printed = capsys.readouterr().out
    assert "4 rows, 3 examples" in printed
    assert f"skipped 1 bad rows, e.g. --data {data} line 2" in printed
