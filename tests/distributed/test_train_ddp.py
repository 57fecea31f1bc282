"""`torchrun --nproc-per-node 2 -m gradaccum train` (gloo, CPU) against the one-process run.

Two ranks with micro-batch 4 read, at each micro-step, the same 8 sequences one rank with
micro-batch 8 reads (the data order is by global batch), so with the same global batch the
losses agree to fp32 rounding, and the final parameters within what AdamW makes of that
rounding (`gradaccum.testing.adamw_drift_bound`).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.testing import adamw_drift_bound
from gradaccum.train.loop import TrainConfig, train
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.metrics import read_metrics

STEPS = 4


def records(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


def losses(out) -> list[float]:
    return [r["loss"] for r in records(out)]


COMMON = [
    "--seq-len",
    "32",
    "--accum-steps",
    "2",
    "--max-steps",
    str(STEPS),
    "--eval-every",
    "0",
    "--save-every",
    "2",
    "--json",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One torchrun of 2 gloo ranks (micro-batch 4, k 2), checkpoints at steps 2 and 4."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp_out = tmp_path / "ddp"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "gradaccum",
            "train",
            "--data",
            str(data),
            "--micro-batch",
            "4",
            "--out",
            str(ddp_out),
            *COMMON,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data, ddp_out, json.loads(proc.stdout)  # only rank 0 prints


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path, two_ranks):
    data, ddp_out, summary = two_ranks
    assert summary["world_size"] == 2 and summary["tokens_per_step"] == 2 * 4 * 2 * 32

    one = train(
        TrainConfig(
            data=str(data),
            seq_len=32,
            micro_batch=8,
            accum_steps=2,
            max_steps=STEPS,
            eval_every=0,
            save_every=0,
            out=str(tmp_path / "one"),
        )
    )
    assert one["tokens_per_step"] == summary["tokens_per_step"]
    assert losses(ddp_out) == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert summary["tokens"] == one["tokens"] == STEPS * 512
    two_records, one_records = records(ddp_out), records(tmp_path / "one")
    # step 1 starts from the same initial weights: its window gradient agrees to rounding
    assert two_records[0]["grad_norm"] == pytest.approx(one_records[0]["grad_norm"], rel=1e-5)
    a = torch.load(ddp_out / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    # Adam divides by sqrt(v): where a gradient is zero up to rounding, fp32 rounding of the
    # all-reduce sets the direction of a step of up to lr, so after several steps the weights
    # agree only within adamw_drift_bound (about 2 lr per step); the losses above stay tight
    # because such weights barely move the loss.
    state = checkpoint.load(checkpoint.find_latest(str(ddp_out))).trainer_state
    betas = tuple(state["optimizer"]["param_groups"][0]["betas"])
    bound = adamw_drift_bound([r["lr"] for r in two_records], betas)
    for key in a:  # plus a few fp32 roundings of the weights themselves per step
        torch.testing.assert_close(a[key], b[key], rtol=2**-20, atol=bound)


@pytest.mark.slow
def test_a_two_rank_run_resumes_on_one_process_with_the_same_losses(tmp_path, two_ranks, capsys):
    """As if the 2-rank run had died after its step-2 checkpoint, continued on 1 process: the
    same 512 tokens per step (micro-batch 4 x k 4 instead of 4 x k 2 x 2 ranks), the same
    data position and optimizer state, so steps 3 and 4 match the 2-rank run's own."""
    from gradaccum.cli import main

    _, ddp_out, _ = two_ranks
    reference = losses(ddp_out)
    out = tmp_path / "died-after-step-2"
    shutil.copytree(ddp_out, out)
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    os.unlink(out / "model.pt")
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert "devices 2 -> 1 from step 2: micro-batch 4 x k 2 x 2 -> 4 x k 4 x 1" in captured.err
    summary = json.loads(captured.out)
    assert summary["world_size"] == 1 and summary["accum_steps"] == 4
    assert summary["tokens_per_step"] == 512
    resumed = losses(out)
    assert len(resumed) == len(reference) == STEPS
    assert resumed == pytest.approx(reference, rel=1e-5)


def _local_rank_pids(parent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of torchrun's worker processes (read from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError):
            continue
        if b"LOCAL_RANK" in env:
            found[int(env[b"LOCAL_RANK"])] = int(entry)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_the_other_within_the_timeout(tmp_path):
    """Rank 1 frozen (SIGSTOP) mid-run: rank 0 leaves within --dist-timeout 10 s (not torch's
    10 minutes) with one line saying another rank stopped answering."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(20_000, seed=3).astype(np.uint16))
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    argv += ["2", "-m", "gradaccum", "train", "--data", str(data), "--micro-batch", "2"]
    argv += [*COMMON[:5], "100000", "--eval-every", "0", "--dist-timeout", "10"]
    argv += ["--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    ranks = {}
    try:
        deadline = time.time() + 180
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        ranks = _local_rank_pids(proc.pid)
        assert set(ranks) == {0, 1}
        os.kill(ranks[1], signal.SIGSTOP)
        frozen = time.time()
        while _alive(ranks[0]) and time.time() - frozen < 120:
            time.sleep(0.2)
        waited = time.time() - frozen
        _, stderr = proc.communicate(timeout=180)
    finally:
        for pid in ranks.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        proc.kill()
    assert waited < 10 + 30, waited  # the timeout, plus time for a loaded machine
    lines = [x for x in stderr.splitlines() if x.startswith("gradaccum: error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert "rank 0 of 2: another rank stopped answering" in lines[0]
    assert "--dist-timeout 10 s" in lines[0]


@pytest.mark.slow
def test_a_batch_schedule_under_two_ranks_matches_one_process(tmp_path):
    """k follows the schedule from the tokens seen over all ranks: 2 ranks x micro-batch 4 take
    the same windows, lr and noise scale as one process with micro-batch 4 and twice their k
    (the same micro-batches: the noise scale depends on how a window is split)."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    schedule = ["--batch-schedule", "0:512,2048:1024,4096:2048", "--lr-rule", "sqrt"]
    common = ["--data", str(data), "--seq-len", "32", "--max-tokens", "8k", "--eval-every", "0"]
    common += ["--noise-scale", *schedule]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    argv += ["2", "-m", "gradaccum", "train", "--micro-batch", "4", "--out", str(tmp_path / "two")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*argv, *common], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = [sys.executable, "-m", "gradaccum", "train", "--micro-batch", "4"]
    proc = subprocess.run(
        [*one, "--out", str(tmp_path / "one"), *common], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def records(name):
        lines = read_metrics(os.path.join(tmp_path / name, "metrics.jsonl"))
        return [r for r in lines if "loss" in r]

    two, one = records("two"), records("one")
    assert [r["tokens_per_step"] for r in two] == [r["tokens_per_step"] for r in one]
    assert [r["tokens_per_step"] for r in two][0] == 512 and two[-1]["tokens_per_step"] == 2048
    assert [r["lr"] for r in two] == pytest.approx([r["lr"] for r in one], rel=1e-12)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    noise_two = [r["noise_scale_tokens"] for r in two if "noise_scale_tokens" in r]
    noise_one = [r["noise_scale_tokens"] for r in one if "noise_scale_tokens" in r]
    assert len(noise_two) == len(noise_one) > 0
    assert noise_two == pytest.approx(noise_one, rel=1e-4)
    assert [2 * r["accum_steps"] for r in two] == [r["accum_steps"] for r in one]
