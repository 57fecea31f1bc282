"""`gradaccum train --micro-batch auto`: the size measured by `gradaccum.fit`, printed and
trained with."""

import os

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.train.corpus import MarkovCorpus
from gradaccum.train.metrics import read_metrics


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "markov.npy"
    np.save(path, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    return str(path)


def train_lines(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "eval_loss" not in r]


def test_micro_batch_auto_measures_and_trains_with_the_size_it_prints(tmp_path, data, capsys):
    argv = ["train", "--out", str(tmp_path), "--data", data, "--seq-len", "32"]
    argv += ["--tokens-per-step", "512", "--max-steps", "2", "--eval-every", "0"]
    assert main([*argv, "--micro-batch", "auto"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch candidates (measured)" in out
    chosen = [x for x in out.splitlines() if x.startswith("chosen: micro-batch ")]
    assert len(chosen) == 1
    micro = int(chosen[0].split()[2])
    lines = train_lines(tmp_path)
    assert {(r["micro_batch"], r["accum_steps"]) for r in lines} == {(micro, 512 // (micro * 32))}
    assert all(r["tokens"] == r["step"] * 512 for r in lines)


def test_micro_batch_auto_with_accum_steps_given_is_not_probed(tmp_path, data, capsys):
    argv = ["train", "--out", str(tmp_path), "--data", data, "--seq-len", "32"]
    argv += ["--tokens-per-step", "512", "--accum-steps", "4", "--max-steps", "1"]
    assert main([*argv, "--micro-batch", "auto", "--eval-every", "0"]) == 0
    assert "micro-batch candidates" not in capsys.readouterr().out
    assert {(r["micro_batch"], r["accum_steps"]) for r in train_lines(tmp_path)} == {(4, 4)}
