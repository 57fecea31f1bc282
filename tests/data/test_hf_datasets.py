"""`--data hf:NAME[:SPLIT]`: one loader for pretraining text (`load_tokens`) and SFT rows
(`read_rows`), and both keep `datasets` to its local cache while they load."""

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
    assert seen == [("owner/set", "test", "1", "1"), True, ("owner/set", "train", "1", "1"), True]
    assert [os.environ.get(n) for n in OFFLINE] == [None, None]
    assert datasets.config.HF_HUB_OFFLINE is False
    # "ab", end of document, "c", end of document: bytes, 256 after each row (None skipped)
    assert train.tokens.tolist() == [97, 98, 256, 99, 256] and info.eod_token == 256
    assert [r.where for r in rows] == [f"hf:owner/set row {i}" for i in range(3)]


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
