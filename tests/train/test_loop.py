"""The trainer end to end on CPU: it learns, it resumes bit for bit, accumulation is exact."""

import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.models.build import build_model
from gradaccum.testing import adamw_drift_bound
from gradaccum.train.loop import TrainConfig, train
from gradaccum.train.resolve import resolve_plan
from gradaccum.train.rundir.metrics import read_metrics

from .helpers import without_timing


@pytest.fixture(scope="module")
def markov_npy(tmp_path_factory):
    """A short stream of the built-in chain as a token file: fast to load, known floor."""
    corpus = MarkovCorpus()
    path = tmp_path_factory.mktemp("data") / "markov.npy"
    np.save(path, corpus.generate(120_000, seed=1).astype(np.uint16))
    return str(path)


def tiny(out, data, **kw):
    base = dict(
        out=str(out),
        data=data,
        seq_len=32,
        micro_batch=4,
        accum_steps=2,
        max_steps=6,
        eval_every=2,
        save_every=0,
        lr=3e-3,
    )
    base.update(kw)
    return TrainConfig(**base)


def params(out) -> dict:
    return torch.load(os.path.join(out, "model.pt"), weights_only=True)


@pytest.mark.slow  # 60 steps
def test_a_short_run_learns_from_about_ln_v(tmp_path, markov_npy):
    floor = MarkovCorpus().entropy_rate
    summary = train(
        tiny(tmp_path, markov_npy, micro_batch=16, max_steps=60, eval_every=0, warmup_steps=6)
    )
    # a fresh model predicts about uniformly over the 512 ids: loss ln 512
    assert summary["initial_loss"] == pytest.approx(math.log(512), abs=0.15)
    assert summary["final_eval_loss"] < math.log(512) - 2.0
    assert summary["final_eval_loss"] > floor  # no model beats the entropy rate
    assert summary["steps"] == 60 and summary["tokens"] == 60 * 16 * 32 * 2
    lines = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    train_lines = [r for r in lines if "eval_loss" not in r]
    assert [r["step"] for r in train_lines] == list(range(1, 61))
    assert {(r["accum_steps"], r["micro_batch"]) for r in train_lines} == {(2, 16)}
    assert all(r["tokens"] == r["step"] * 1024 for r in train_lines)
    assert not any(r["skipped"] for r in train_lines)


@pytest.mark.slow  # trains past a few steps
def test_resume_is_bit_exact(tmp_path, markov_npy):
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(tiny(whole, markov_npy))
    stopped = train(tiny(split, markov_npy), should_stop=lambda step: step >= 3)
    assert stopped["stopped"] and stopped["steps"] == 3
    assert not os.path.exists(split / "model.pt")  # only a finished run exports its model
    resumed = train(tiny(split, markov_npy, resume=True))
    assert resumed["steps"] == 6

    a = without_timing(read_metrics(whole / "metrics.jsonl"))
    b = without_timing(read_metrics(split / "metrics.jsonl"))
    assert len(a) == 6 + 3 and a == b  # 6 steps, eval at 2, 4, 6
    pa, pb = params(whole), params(split)
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.slow  # trains past a few steps
def test_accumulated_run_equals_the_big_batch_run(tmp_path, markov_npy):
    # b 4 x k 2 reads the same 8 sequences per step as b 8 x k 1 (the data order is by
    # global batch), so the two runs must agree to fp32 rounding.
    acc = train(tiny(tmp_path / "acc", markov_npy, max_steps=3, eval_every=0))
    big = train(
        tiny(tmp_path / "big", markov_npy, micro_batch=8, accum_steps=1, max_steps=3, eval_every=0)
    )
    la = [r["loss"] for r in read_metrics(tmp_path / "acc" / "metrics.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_metrics(tmp_path / "big" / "metrics.jsonl") if "loss" in r]
    assert la == pytest.approx(lb, rel=1e-5)
    pa, pb = params(tmp_path / "acc"), params(tmp_path / "big")
    # Adam turns fp32 rounding of a gradient that is zero up to rounding into a step of up
    # to lr either way: after several steps weights agree only within adamw_drift_bound
    lrs = [r["lr"] for r in read_metrics(tmp_path / "acc" / "metrics.jsonl") if "loss" in r]
    bound = adamw_drift_bound(lrs, betas=(0.9, 0.95))  # train's AdamW betas
    for k in pa:  # plus a few fp32 roundings of the weights themselves per step
        torch.testing.assert_close(pa[k], pb[k], rtol=2**-20, atol=bound)
    assert acc["tokens"] == big["tokens"] == 3 * 8 * 32


@pytest.mark.parametrize(
    "tokens, seq_len, micro, expected",
    [
        (8192, 128, "auto", (16, 4)),  # CPU cap 2048 tokens = 16 sequences; 8192 / 2048 = 4
        (1024, 128, "auto", (8, 1)),  # the whole step is 8 sequences: k stays 1
        (8192, 256, "auto", (8, 4)),
        (6000, 128, 16, (16, 3)),  # round(46.875 / 16) = 3: lands at 6144
    ],
)
def test_micro_batch_and_k_on_cpu(tokens, seq_len, micro, expected, tmp_path):
    cfg = TrainConfig(out=str(tmp_path), tokens_per_step=tokens, seq_len=seq_len, micro_batch=micro)
    _, info = build_model(preset="tiny", vocab_size=512, seq_len=seq_len)
    r = resolve_plan(cfg, info, 1, torch.device("cpu"))
    assert (r.micro_batch, r.accum_steps) == expected
    assert r.tokens_per_step == expected[0] * expected[1] * seq_len
    assert r.total_steps == math.ceil(1_572_864 / r.tokens_per_step)  # the default budget


@pytest.mark.slow
def test_sigterm_saves_at_a_window_boundary_and_exits_0(tmp_path, markov_npy):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "gradaccum",
        "train",
        "--data",
        markov_npy,
        "--seq-len",
        "32",
        "--micro-batch",
        "4",
        "--accum-steps",
        "2",
        "--max-steps",
        "100000",
        "--eval-every",
        "0",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count("\n") < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "stopped by SIGTERM" in stdout
    steps = [r["step"] for r in read_metrics(metrics)]
    from gradaccum.train.rundir import checkpoint

    saved = checkpoint.load(checkpoint.find_latest(str(out)))
    assert saved.step == steps[-1] >= 3  # saved at the boundary it stopped at
    assert saved.trainer_state["data"]["position"] == 2 * saved.step
