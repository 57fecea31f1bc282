"""An elastic restart: `torchrun --max-restarts 2 -m gradaccum train` with rank 1 SIGKILLed
mid-window once ends as the same run uninterrupted.

Rank 1 kills itself as its 10th micro-batch starts (window 5 of k 2, after the step-4
checkpoint), on torchrun's first start of the group only (`elastic_worker.py`). torchrun stops
rank 0 and starts the group again with TORCHELASTIC_RESTART_COUNT 1; with no --resume given,
the run finds its own folder's checkpoint and continues from it (`--resume auto` under a
restart) instead of refusing the folder. The reference is the same command uninterrupted, with
the same checkpoint cadence.

The resumed run reads the same windows (the data position is in the checkpoint), on the same
2 ranks, from the same weights, AdamW state and lr step, and every sum it does is done in the
same order as in the uninterrupted run (gloo's all-reduce of 2 ranks on CPU is
deterministic), so the final weights are compared bit for bit, not within a bound.

No process of either torchrun (launcher or rank) is left at the end (`launchers.finish`).
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import numpy as np
import pytest
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.testing import adamw_drift_bound, free_port
from gradaccum.train.loop import TrainConfig, train
from gradaccum.train.parts import ADAM_BETAS
from gradaccum.train.rundir import resume
from gradaccum.train.rundir.metrics import read_metrics
from tests.distributed import launchers
from tests.distributed.launchers import finish

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")
STEPS = 8
KILL_AT_MICRO = 10  # window 5, micro-batch 2 of k 2: mid-window, after the step-4 checkpoint
RUN_S = 150  # one torchrun, restart included, on a loaded 2-core machine


def torchrun(out, data, extra_env: dict, sync: str) -> subprocess.CompletedProcess:
    """One `torchrun --standalone --nproc-per-node 2 --max-restarts 2` of the trainer, each
    rank micro-batch 4, under --sync `sync`, after which no process of it is left."""
    launcher = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    launcher += ["--monitor-interval", "0.5", WORKER]
    args = ["train", "--data", str(data), "--out", str(out), "--seq-len", "32"]
    args += ["--micro-batch", "4", "--accum-steps", "2", "--max-steps", str(STEPS)]
    args += ["--save-every", "2", "--eval-every", "0", "--json", "--sync", sync]
    # torchrun's own store, shared by every start of the group: the trainer keeps each
    # start's keys apart (`process_group._agent_store`)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", **extra_env}
    mark = str(out)
    return finish({mark: launchers.torchrun(launcher, args, mark, env)}, RUN_S)[mark]


def test_resume_auto_continues_only_where_a_checkpoint_is(tmp_path, monkeypatch):
    monkeypatch.delenv(resume.RESTART_COUNT, raising=False)
    empty, saved = tmp_path / "empty", tmp_path / "saved"
    empty.mkdir()
    (saved / "checkpoints" / "step-00000004").mkdir(parents=True)
    assert resume.continues({"resume": "auto", "out": str(empty)}) == (False, None)
    assert resume.continues({"resume": "auto", "out": str(saved)}) == (True, None)
    assert resume.continues({"resume": "auto"}) == (False, None)  # a new runs/<date> folder
    assert resume.continues({"resume": True, "out": str(empty)}) == (True, None)  # refused later
    assert resume.continues({"out": str(saved)}) == (False, None)  # refused later: a previous run
    monkeypatch.setenv(resume.RESTART_COUNT, "0")  # torchrun's first start
    assert resume.continues({"out": str(saved)}) == (False, None)
    monkeypatch.setenv(resume.RESTART_COUNT, "2")
    assert resume.continues({"out": str(empty)}) == (False, None)  # died before a checkpoint
    continued, line = resume.continues({"out": str(saved)})
    assert continued and line.startswith("restart 2 of the group: continuing from")


def test_resume_takes_auto_or_nothing(tmp_path, capsys):
    from gradaccum.cli import main

    assert main(["train", "--out", str(tmp_path), "--resume", "always"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gradaccum: error: --resume always: give --resume alone (continue) or "
                   "--resume auto"]  # fmt: skip


def train_steps(out) -> list[int]:
    return [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["window", "micro"])
def test_a_rank_killed_mid_window_restarts_and_ends_as_the_uninterrupted_run(tmp_path, sync):
    """window: DDP; micro: the model sharded with FSDP2, a reduce-scatter per micro-batch,
    whose checkpoints gather the weights and AdamW's state whole and whose resume shards
    them again; and that run equals one process over the same windows, to rounding."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    kill = {"GRADACCUM_TEST_KILL_RANK": "1", "GRADACCUM_TEST_KILL_AT_MICRO": str(KILL_AT_MICRO)}
    killed = torchrun(tmp_path / "killed", data, kill, sync)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert re.search(r"exitcode: -9\) local_rank: 1", killed.stderr), killed.stderr[-3000:]
    assert "resume: restart 1 of the group: continuing from step 4" in killed.stderr
    assert killed.stderr.count("resume: restart") == 1
    # every optimizer step once: windows 1-4 before the kill, 5-8 after it; window 5, cut
    # short by the kill, was never counted
    assert train_steps(tmp_path / "killed") == list(range(1, STEPS + 1))

    whole = torchrun(tmp_path / "whole", data, {}, sync)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "resume:" not in whole.stderr
    assert train_steps(tmp_path / "whole") == list(range(1, STEPS + 1))

    a = torch.load(tmp_path / "killed" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    losses = [
        [r["loss"] for r in read_metrics(os.path.join(tmp_path / run, "metrics.jsonl"))
         if "loss" in r]
        for run in ("killed", "whole")
    ]  # fmt: skip
    assert losses[0] == losses[1]
    if sync == "micro":
        one_process_equals(tmp_path, data, losses[1], b)


def one_process_equals(tmp_path, data, losses: list[float], weights: dict) -> None:
    """One process with micro-batch 8 reads, window by window, the 16 sequences the 2 ranks
    of micro-batch 4 read: the losses agree to fp32 rounding, the weights within what AdamW
    makes of it (`adamw_drift_bound`)."""
    config = TrainConfig(data=str(data), seq_len=32, micro_batch=8, accum_steps=2,
                         max_steps=STEPS, eval_every=0, save_every=0, out=str(tmp_path / "one"))  # fmt: skip
    train(config)
    records = [r for r in read_metrics(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    assert losses == pytest.approx([r["loss"] for r in records], rel=1e-5)
    one = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    bound = adamw_drift_bound([r["lr"] for r in records], ADAM_BETAS)
    for key in one:
        torch.testing.assert_close(weights[key], one[key], rtol=2**-20, atol=bound)


@pytest.mark.slow
def test_a_restart_with_one_node_gone_keeps_the_tokens_per_step(tmp_path):
    """`--nnodes 1:2`, two launchers of one rank each; once the step-2 checkpoint is written,
    node 1 (launcher and rank) is SIGKILLed. Node 0's group fails, torchrun restarts it, the
    rendezvous closes with node 0 alone, and the run continues on 1 rank from its newest
    checkpoint at the same 256 tokens per step: k 2 x 2 ranks becomes k 4 x 1, said in one
    line. Every step is in metrics.jsonl once, each of 256 tokens."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    out, port, steps = tmp_path / "run", free_port(), 40
    args = ["-m", "gradaccum", "train", "--data", str(data), "--out", str(out)]
    args += ["--seq-len", "32", "--micro-batch", "2", "--accum-steps", "2", "--json"]
    args += ["--max-steps", str(steps), "--save-every", "2", "--eval-every", "0"]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}  # see `torchrun` above
    started = {}
    for node in (0, 1):
        launcher = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2"]
        launcher += ["--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-id", "shrink"]
        launcher += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf"]
        # the node that stays hosts the rendezvous; both join within the last call
        launcher += [f"is_host={int(node == 0)},last_call_timeout=15"]
        started[f"{out}-node{node}"] = launchers.torchrun(launcher, args, f"{out}-node{node}", env)
    try:
        deadline = time.monotonic() + RUN_S
        while not (out / "checkpoints" / "step-00000002").is_dir():
            assert time.monotonic() < deadline and started[f"{out}-node0"].poll() is None
            time.sleep(0.05)
        launchers.kill_marked(f"{out}-node1")
    finally:
        done = finish(started, RUN_S)
    node0 = done[f"{out}-node0"]
    assert node0.returncode == 0, node0.stderr[-3000:]
    said = node0.stdout + node0.stderr
    resumed = re.search(r"resume: restart 1 of the group: continuing from step (\d+)", said)
    assert resumed, said[-3000:]
    at = int(resumed.group(1))
    assert 2 <= at < steps
    line = (
        f"resume: devices 2 -> 1 from step {at}: micro-batch 2 x k 2 x 2 -> 2 x k 4 x 1, "
        "256 tokens per step as before"
    )
    assert said.count(line) == 1, said[-3000:]
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert {r["tokens_per_step"] for r in records} == {256}
    assert [r["accum_steps"] for r in records] == [2] * at + [4] * (steps - at)
