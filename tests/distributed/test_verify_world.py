"""`gradaccum verify --world-size 2`: DDP and FSDP2 over 2 gloo processes on CPU against one
process taking the whole batch, through gradaccum.testing, for the built-in GPT and for a
Hugging Face GPT-2 through gradaccum.hf."""

from __future__ import annotations

import json

import pytest

from gradaccum.cli import main

pytestmark = pytest.mark.slow

SMALL = ["--micro-batch", "2", "--seq-len", "16", "--k", "2", "--world-size", "2", "--json"]


def _world(capsys, *argv) -> dict:
    code = main(["verify", *argv])
    got = json.loads(capsys.readouterr().out)
    assert code == 0, got
    return got


def _check(got: dict) -> None:
    assert got["passed"] is True
    assert [w["wrapper"] for w in got["world"]] == ["ddp", "fsdp2"]
    for w in got["world"]:
        assert w["passed"] and w["world_size"] == 2
        assert w["grad_rel_err"] <= 1e-5 and w["param_rel_err"] <= 1e-5
        # tokens per window as the engine reported them, summed over the ranks, against the
        # single process's count of the same windows
        assert w["tokens"] == w["tokens_expected"] and min(w["tokens"]) > 0


def test_world_size_2_passes_for_ddp_and_fsdp2(capsys):
    _check(_world(capsys, *SMALL))


def test_world_size_2_passes_for_a_gpt2_config(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    config.save_pretrained(tmp_path)
    _check(_world(capsys, *SMALL, "--model-config", str(tmp_path / "config.json")))
