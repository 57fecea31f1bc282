"""`--data hf:NAME[:SPLIT]`: one loader for pretraining text (`load_tokens`) and SFT rows
(`read_rows`), and both keep `datasets` to its local cache while they load (--data-split where
the spec names no split); a save_to_disk folder is read with load_from_disk, and pretraining
refuses a folder as --data naming what it reads."""

from __future__ import annotations

import os

import pytest

from gradaccum.data.sft.rows import read_rows
from gradaccum.data.tokens import load_tokens

datasets = pytest.importorskip("datasets")

OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def test_text_and_rows_load_offline_and_the_setting_is_put_back(monkeypatch):
    for name in OFFLINE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    seen = []

    def load_dataset(name, split):  # what the loader sees while datasets loads
        seen.append((name, split, *(os.environ.get(n) for n in OFFLINE)))
        seen.append(datasets.config.HF_HUB_OFFLINE)
        return datasets.Dataset.from_dict({"text": ["ab", None, "c"]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    train, _, info = load_tokens("hf:owner/set:test", seq_len=2, val_fraction=0.0)
    rows = read_rows("hf:owner/set")
    read_rows("hf:owner/set", "validation")  # --data-split where the spec names no split
    read_rows("hf:owner/set:test", "validation")  # the spec's own split comes first
    assert seen == [
        ("owner/set", "test", "1", "1"),
        True,
        ("owner/set", "train", "1", "1"),
        True,
        ("owner/set", "validation", "1", "1"),
        True,
        ("owner/set", "test", "1", "1"),
        True,
    ]
    assert [os.environ.get(n) for n in OFFLINE] == [None, None]
    assert datasets.config.HF_HUB_OFFLINE is False
    # "ab", end of document, "c", end of document: bytes, 256 after each row (None skipped)
    assert train.tokens.tolist() == [97, 98, 256, 99, 256] and info.eod_token == 256
    assert [r.where for r in rows] == [f"hf:owner/set:train row {i}" for i in range(3)]


def test_both_say_the_same_when_the_local_cache_cannot_give_it(monkeypatch):
    def load_dataset(name, split):
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub or cannot be accessed")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for read in (lambda s: load_tokens(s, seq_len=2), read_rows):
        with pytest.raises(ValueError) as err:
            read("hf:no/such")
        assert str(err.value) == (
            "--data hf:no/such: cannot load from the local datasets cache (Dataset 'no/such' "
            "doesn't exist on the Hub or cannot be accessed)"
        )


def _no_cache(monkeypatch):
    def load_dataset(*args, **kw):
        raise AssertionError("a save_to_disk folder is read with load_from_disk")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def test_pretraining_reads_a_save_to_disk_folder_as_hf_folder(tmp_path, monkeypatch):
    folder = str(tmp_path / "text")
    datasets.Dataset.from_dict({"text": ["ab", "c"]}).save_to_disk(folder)
    splits = str(tmp_path / "splits")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["xy"]}),
         "test": datasets.Dataset.from_dict({"text": ["z"]})}
    ).save_to_disk(splits)  # fmt: skip
    _no_cache(monkeypatch)
    train, _, _ = load_tokens(f"hf:{folder}", seq_len=2, val_fraction=0.0)
    assert train.tokens.tolist() == [97, 98, 256, 99, 256]
    train, _, _ = load_tokens(f"hf:{splits}:test", seq_len=1, val_fraction=0.0)
    assert train.tokens.tolist() == [122, 256]
    # as a plain --data FOLDER it is refused, pointing at the form that reads it
    with pytest.raises(ValueError) as err:
        load_tokens(folder, seq_len=2)
    assert str(err.value) == (
        f"--data {folder}: is a folder written by save_to_disk; pretraining reads its 'text' "
        f"column as --data hf:{folder}"
    )


def test_pretraining_refuses_a_plain_folder_and_an_unknown_file_naming_its_formats(tmp_path):
    formats = "a .txt, .bin or .npy file or hf:NAME[:SPLIT]"
    (tmp_path / "t.csv").write_text("1,2")
    with pytest.raises(ValueError) as err:
        load_tokens(str(tmp_path), seq_len=2)
    assert str(err.value) == f"--data {tmp_path}: is a folder; expected {formats}"
    with pytest.raises(ValueError) as err:
        load_tokens(str(tmp_path / "t.csv"), seq_len=2)
    assert str(err.value) == f"--data {tmp_path / 't.csv'}: unknown format; expected {formats}"
