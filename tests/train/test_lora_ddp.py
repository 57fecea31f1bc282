"""LoRA under torchrun: 2 gloo ranks (micro-batch 2, k 2) read the sequences one process
with micro-batch 2 and k 4 reads, so the losses and the first window's gradient norm agree to
fp32 rounding and the adapters within AdamW's drift bound; the base stays frozen under DDP
(its checkpoint holds the adapters only), a base in 4 bits (QLoRA) as well."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gradaccum.testing import adamw_drift_bound
from gradaccum.train.rundir import checkpoint

from .helpers import markov_npy, train_records

pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # a torchrun of two processes

COMMON = ["--seq-len", "16", "--micro-batch", "2", "--max-steps", "3", "--eval-every", "0"]
COMMON += ["--device", "cpu", "--lora-rank", "4", "--json"]


@pytest.mark.parametrize("base", [[], ["--base-bits", "4"]], ids=["fp32-base", "4-bit-base"])
def test_two_gloo_ranks_train_the_adapters_as_one_process(tmp_path, base):
    if base:
        pytest.importorskip("bitsandbytes")
    data = str(markov_npy(tmp_path / "markov.npy", 20_000, seed=4))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two, one = tmp_path / "two", tmp_path / "one"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += ["--nproc-per-node", "2", "-m", "gradaccum"]
    runs = [
        [*launch, "train", "--data", data, "--accum-steps", "2", "--out", str(two), *COMMON, *base],
        [sys.executable, "-m", "gradaccum", "train", "--data", data, "--accum-steps", "4"]
        + ["--out", str(one), *COMMON, *base],
    ]
    for argv in runs:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = train_records(two), train_records(one)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    assert a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=1e-5)
    ca = checkpoint.load(checkpoint.find_latest(str(two)))
    cb = checkpoint.load(checkpoint.find_latest(str(one)))
    assert ca.model_state.keys() == cb.model_state.keys()
    assert all(".lora_" in k for k in ca.model_state)
    betas = tuple(ca.trainer_state["optimizer"]["param_groups"][0]["betas"])
    bound = adamw_drift_bound([r["lr"] for r in a], betas)
    for key, tensor in ca.model_state.items():
        torch.testing.assert_close(tensor, cb.model_state[key], rtol=2**-20, atol=bound)
