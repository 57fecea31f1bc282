"""`--task sft --data FOLDER` for a folder written by datasets' `save_to_disk` (a Dataset, or a
DatasetDict's --data-split) and `hf:FOLDER[:SPLIT]`: the same examples as the same rows in a
.jsonl file, read by train and verify alike; a missing split and a plain folder in one line."""

from __future__ import annotations

import json
import os

import pytest

from gradaccum.cli import main
from gradaccum.data.sft.load import load_sft
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.train.rundir.metrics import read_metrics

datasets = pytest.importorskip("datasets")

WORDS = ("fox", "quick brown", "lazy dog", "over", "the", "jumps", "sort and add", "count")
PAIRS = [
    {"prompt": f"reverse: {WORDS[i % 8]} {i}\n", "completion": f"{i} {WORDS[i % 8][::-1]}"}
    for i in range(40)
]
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"sort {WORDS[i % 8]}"},
            {"role": "assistant", "content": "".join(sorted(WORDS[i % 8]))},
        ]
    }
    for i in range(40)
]
SEQ_LEN = 96
"""Longer than every example: none is cut."""
EOS = 256
"""The byte tokenizer's end of sequence, after each completion."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Paths of the rows saved three ways: `one` (a Dataset of PAIRS), `dd` (a DatasetDict:
    train = PAIRS, test = CHATS), and .jsonl files of the same rows; `plain`, a folder of
    .jsonl files that save_to_disk did not write."""
    root = tmp_path_factory.mktemp("on-disk")
    paths = {name: str(root / name) for name in ("one", "dd", "plain")}
    datasets.Dataset.from_list(PAIRS).save_to_disk(paths["one"])
    splits = {"train": datasets.Dataset.from_list(PAIRS), "test": datasets.Dataset.from_list(CHATS)}
    datasets.DatasetDict(splits).save_to_disk(paths["dd"])
    os.makedirs(paths["plain"])
    for name, rows in (("pairs", PAIRS), ("chats", CHATS)):
        paths[name] = os.path.join(paths["plain"], f"{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths


def _examples(spec: str, split: str = "train") -> list[tuple[list, list]]:
    data = load_sft(spec, ByteTokenizer(), split=split, seq_len=SEQ_LEN)
    return [(e.input_ids.tolist(), e.labels.tolist()) for e in data.examples]


@pytest.mark.parametrize(
    "spec, split, same_as",
    [
        ("{one}", "train", "pairs"),  # a Dataset: its rows, whatever --data-split says
        ("{dd}", "train", "pairs"),  # a DatasetDict: --data-split's default
        ("{dd}", "test", "chats"),
        ("hf:{dd}:test", "train", "chats"),  # the spec's own split comes first
        ("hf:{dd}", "test", "chats"),
        ("hf:{one}", "train", "pairs"),
    ],
)
def test_examples_equal_those_of_the_same_rows_as_jsonl(saved, spec, split, same_as):
    got = _examples(spec.format(**saved), split)
    assert got == _examples(saved[same_as])
    if same_as == "pairs":  # and, by hand: prompt bytes, then the completion's bytes and EOS
        for (ids, labels), row in zip(got, PAIRS, strict=True):
            prompt, completion = list(row["prompt"].encode()), list(row["completion"].encode())
            assert ids == prompt + completion + [EOS]
            assert labels == [-100] * len(prompt) + completion + [EOS]


def test_a_bad_row_is_named_by_its_index_in_the_split(tmp_path):
    folder = str(tmp_path / "bad")
    rows = [dict(r) for r in PAIRS[:8]]
    rows[5]["completion"] = ""
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(folder)
    with pytest.raises(ValueError) as err:
        load_sft(folder, ByteTokenizer(), split="test", seq_len=SEQ_LEN)
    assert (
        str(err.value) == f"--data {os.path.join(folder, 'test')} row 5: field 'completion': empty"
    )


def _train(out, data: str, *argv: str) -> int:
    return main(
        ["train", "--task", "sft", "--data", data, "--max-steps", "2", "--out", str(out),
         "--seq-len", str(SEQ_LEN), "--examples-per-step", "4", "--eval-every", "0", *argv]
    )  # fmt: skip


@pytest.mark.parametrize("which", ["dataset", "dataset_dict"])
def test_train_two_steps_on_a_save_to_disk_folder(saved, tmp_path, capsys, which):
    out = tmp_path / "run"
    if which == "dataset":
        code, read, fmt = _train(out, saved["one"]), saved["one"], "prompt-completion"
    else:
        code = _train(out, saved["dd"], "--data-split", "test")
        read, fmt = os.path.join(saved["dd"], "test"), "messages"
    printed = capsys.readouterr().out
    assert code == 0
    assert f"data: {read} ({fmt}): 40 rows, 40 examples, seq_len {SEQ_LEN}" in printed
    windows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in windows] == [1, 2] and all(r["examples"] == 4 for r in windows)


@pytest.mark.parametrize(
    "data, argv, flag",
    [
        ("{dd}", ["--data-split", "valid"], "--data-split valid"),
        ("hf:{dd}:valid", [], "--data hf:{dd}:valid"),
    ],
)
def test_a_missing_split_is_one_line_listing_the_splits(saved, tmp_path, capsys, data, argv, flag):
    code = _train(tmp_path / "run", data.format(**saved), *argv)
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    want = (
        f"{flag.format(**saved)}: no split 'valid' in the DatasetDict {saved['dd']}; its splits: "
    )
    assert want + "train, test\n" in err
    assert not os.path.exists(tmp_path / "run")


def test_a_plain_folder_says_what_each_task_reads(saved, tmp_path, capsys):
    plain = saved["plain"]
    assert _train(tmp_path / "run", plain) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"--data {plain}: is a folder, but not one written by " in err
    assert err.endswith(
        "--task sft reads a .jsonl, .json or .parquet file, a folder written by save_to_disk, "
        "or hf:NAME[:SPLIT]\n"
    )
    assert main(["train", "--data", plain, "--out", str(tmp_path / "run")]) == 2
    _, err = capsys.readouterr()
    assert err.endswith(
        f"--data {plain}: is a folder; expected a .txt, .bin or .npy file or hf:NAME[:SPLIT]\n"
    )


def test_verify_reads_a_datasetdict_split(saved, capsys):
    argv = ["verify", "--task", "sft", "--data", saved["dd"], "--data-split", "train"]
    code = main([*argv, "--seq-len", "64", "--k", "2", "--micro-batch", "2", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == 0 and got["passed"] is True
    assert got["sft_window"]["source"] == os.path.join(saved["dd"], "train")
    assert got["sft_window"]["examples"] == 4
