"""Fixtures for the data tests: tokenizers, and SFT files written on the spot."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gradaccum.data.tokenizers import ByteTokenizer, load_tokenizer


@pytest.fixture
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def hf_tok(hf_tokenizer_dir):
    """The suite's BPE tokenizer with its chat template, behind the Tokenizer interface."""
    return load_tokenizer(hf_tokenizer_dir, flag="--init-from")


@pytest.fixture
def raw_hf_tok(hf_tokenizer_dir):
    """The same tokenizer straight from transformers: the tests' independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_tokenizer_dir, local_files_only=True)


@pytest.fixture
def tokenizer_copy(hf_tokenizer_dir, tmp_path):
    """`tokenizer_copy(chat_template=...)`: a copy of the test tokenizer's folder with its chat
    template replaced (None: removed)."""

    def make(chat_template: str | None) -> str:
        folder = tmp_path / f"tok-{len(os.listdir(tmp_path))}"
        shutil.copytree(hf_tokenizer_dir, folder)
        template = folder / "chat_template.jinja"
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config.pop("chat_template", None)
        config_path.write_text(json.dumps(config))
        if template.exists():
            template.unlink()
        if chat_template is not None:
            template.write_text(chat_template)
        return str(folder)

    return make


@pytest.fixture
def write_jsonl(tmp_path):
    """`write_jsonl(rows, name="sft.jsonl")`: rows (dicts, or str lines written as they are)
    into a .jsonl file; returns its path."""

    def write(rows, name: str = "sft.jsonl") -> str:
        path = tmp_path / name
        lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return str(path)

    return write
