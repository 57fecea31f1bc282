"""Sharded checkpoints (--sync micro): every rank writes its own shards through
torch.distributed.checkpoint, and the run resumes on any layout as if never stopped.

One scenario, shared by the slow tests (`runs`): 4 gloo ranks under --sync micro train 8
steps, a checkpoint every 2; the same command is SIGKILLed on rank 1 as its 10th micro-batch
starts (window 5 of k 2: after the step-4 checkpoint), torchrun told not to restart it; the
folder it left is resumed, in copies, on 4 ranks and on 2 under --sync micro, and on one
process (no FSDP2, the sharded state read whole by dcp). Each continuation reads the windows
the uninterrupted run read (the data order is one stream whatever the layout), so its losses
agree to fp32 rounding and its weights within what AdamW makes of rounding
(`adamw_drift_bound`, from step 5).

The others: what each of 4 ranks writes and what rank 0 holds while it saves
(`/proc/self/status`'s peak resident memory, reset before the save), and a checkpoint written as the previous
version wrote them (whole tensors, no format) resumed under --sync micro.

No process of any launch is left at the end (`launchers.finish`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.models.build import build_model
from gradaccum.parallel import sharding
from gradaccum.testing import adamw_drift_bound, run_ranks
from gradaccum.train.loop import TrainConfig, train
from gradaccum.train.parts import ADAM_BETAS
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.metrics import read_metrics
from tests.distributed import launchers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")
WORLD, STEPS, SAVED_AT = 4, 8, 4
KILL_AT_MICRO = 10  # window 5, micro-batch 2 of k 2: mid-window, after the step-4 checkpoint
RUN_S = 300  # one launch of 4 ranks on a loaded 2-core machine
RESUMED = {"four": (4, []), "two": (2, []), "one": (1, ["--sync", "window"])}
"""The continuations of the killed run: ranks, and the flags besides --resume."""


def launch(out, nproc: int, args: list[str], env=None) -> subprocess.CompletedProcess:
    """`gradaccum train ARGS --out OUT --json` on `nproc` ranks (torchrun; one process
    without it), after which no process of it is left."""
    args = ["train", *args, "--out", str(out), "--json"]
    mark = str(out)
    if nproc == 1:
        full = {**os.environ, "OMP_NUM_THREADS": "1", launchers.MARK: mark}
        argv = [sys.executable, "-m", "gradaccum", *args]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full)  # fmt: skip
    else:
        launcher = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0"]
        launcher += ["--monitor-interval", "0.5", WORKER]
        proc = launchers.torchrun(launcher, args, mark, env)
    return launchers.finish({mark: proc}, RUN_S)[mark]


def records(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (CompletedProcess, out folder)} for "whole", "killed" and each of `RESUMED`."""
    tmp = tmp_path_factory.mktemp("sharded")
    data = tmp / "markov.npy"
    np.save(data, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    args = ["--data", str(data), "--seq-len", "32", "--micro-batch", "2", "--accum-steps", "2"]
    args += ["--max-steps", str(STEPS), "--save-every", "2", "--eval-every", "0"]
    args += ["--sync", "micro", "--keep-checkpoints", "4"]
    done = {"whole": (launch(tmp / "whole", WORLD, args), tmp / "whole")}
    kill = {"GRADACCUM_TEST_KILL_RANK": "1", "GRADACCUM_TEST_KILL_AT_MICRO": str(KILL_AT_MICRO)}
    done["killed"] = (launch(tmp / "killed", WORLD, args, kill), tmp / "killed")
    for name, (nproc, extra) in RESUMED.items():
        out = tmp / name
        shutil.copytree(tmp / "killed", out)
        done[name] = (launch(out, nproc, ["--resume", *extra]), out)
    return done


@pytest.mark.slow
def test_the_killed_run_left_a_sharded_checkpoint_every_rank_wrote(runs):
    killed, out = runs["killed"]
    assert killed.returncode != 0 and "exitcode: -9" in killed.stderr, killed.stderr[-3000:]
    path = checkpoint.find_latest(str(out))
    assert os.path.basename(path) == f"step-{SAVED_AT:08d}"
    assert checkpoint.is_sharded(path) and not os.path.exists(os.path.join(path, "model.pt"))
    shards = sorted(os.listdir(os.path.join(path, checkpoint.SHARDED)))
    assert shards == [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD)]
    assert checkpoint.damage(path) is None  # the manifest covers every shard
    assert checkpoint.load(path).trainer_state[checkpoint.FORMAT_KEY] == checkpoint.FORMAT
    # --init-from reads it whole: the weights of the uninterrupted run's step 4 (the same 4
    # ranks over the same windows), within what AdamW makes of rounding
    model, _ = build_model(init_from=path)
    same = torch.load(runs["whole"][1] / "model.pt", weights_only=True).keys()
    want = checkpoint.read_model_state(checkpoint.folder_of(str(runs["whole"][1]), SAVED_AT))
    bound = adamw_drift_bound([r["lr"] for r in records(runs["whole"][1])[:SAVED_AT]], ADAM_BETAS)
    assert model.state_dict().keys() == want.keys() == same
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=2**-20, atol=bound)
    with open(os.path.join(path, checkpoint.SHARDED, "__1_0.distcp"), "r+b") as f:
        f.write(b"\0")  # one byte other than it was: the manifest's checksum sees it
    assert checkpoint.damage(path) == "sharded/__1_0.distcp does not match its checksum"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_resumed_on_another_layout_continues_as_the_uninterrupted_run(runs, name):
    resumed, out = runs[name]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = records(runs["whole"][1])
    got = records(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    after = [r["loss"] for r in got[SAVED_AT:]]
    assert after == pytest.approx([r["loss"] for r in whole[SAVED_AT:]], rel=1e-5)
    a = torch.load(out / "model.pt", weights_only=True)
    b = torch.load(runs["whole"][1] / "model.pt", weights_only=True)
    lrs = [r["lr"] for r in whole[SAVED_AT:]]
    bound = adamw_drift_bound(lrs, ADAM_BETAS, first_step=SAVED_AT + 1)
    assert a.keys() == b.keys()
    for key in b:  # plus a few fp32 roundings of the weights themselves per step
        torch.testing.assert_close(a[key], b[key], rtol=2**-20, atol=bound)


class Blocks(torch.nn.Module):
    """A stack of d x d linear layers, each an FSDP2 unit (`sharding.shard`)."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _resident(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _peak_over(fn) -> int:
    """Bytes of resident memory `fn()` added at its peak: memory freed before it handed back
    to the system (glibc's malloc_trim, so that `fn` cannot reuse it unseen) and the peak
    reset (Linux: /proc/self/clear_refs), then the peak after it less the resident before."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _resident("VmRSS")
    fn()
    return _resident("VmHWM") - before


def _save_peaks(info, out: str) -> dict:
    """One AdamW step of `Blocks` (16 MB of weights, 32 MB of AdamW moments) sharded over the
    ranks, then on each rank what the sharded save added (the shards taken and written, as
    `Run.checkpoint_contents` and `Outputs.save` do), and what a gather of the optimizer's
    state whole (the previous checkpoint's) adds."""
    torch.manual_seed(0)
    model = sharding.shard(Blocks(4, 1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # whole shapes
    moments = 2 * weights  # exp_avg, exp_avg_sq
    main = info.rank == 0
    trainer = {"step": 1} if main else None

    def sharded():
        shards = sharding.sharded_state(model, optimizer)
        checkpoint.save_sharded(out, 1, shards, {"n_layer": 4}, trainer, is_main=main)

    saved = _peak_over(sharded)
    gathered = _peak_over(lambda: sharding.full_optimizer_state(optimizer, main))
    return {"weights": weights, "moments": moments, "sharded": saved, "gathered": gathered}


@pytest.mark.slow
def test_each_rank_writes_its_share_and_rank_0_holds_little_while_saving(tmp_path):
    """4 ranks save `Blocks` sharded. Rank r's file (rank 0's with dcp's .metadata) is
    within 10% of the state / 4, the state counted from the model's own parameters (weights
    and AdamW's two moments, whole shapes); rank 0's resident memory grew by under half the
    optimizer state's size while it saved, where a gather of that state whole grows it by
    the whole of it (the measure sees what is held)."""
    peaks = run_ranks(_save_peaks, WORLD, args=(str(tmp_path),), timeout_s=240)[0]
    folder = os.path.join(tmp_path, checkpoint.CHECKPOINTS, "step-00000001")
    assert checkpoint.damage(folder) is None and checkpoint.is_sharded(folder)
    shards = os.path.join(folder, checkpoint.SHARDED)
    wrote = [os.path.getsize(os.path.join(shards, f"__{r}_0.distcp")) for r in range(WORLD)]
    wrote[0] += os.path.getsize(os.path.join(shards, ".metadata"))
    share = (peaks["weights"] + peaks["moments"]) / WORLD
    for rank, size in enumerate(wrote):
        assert abs(size - share) <= 0.1 * share, (rank, size, share)
    assert peaks["gathered"] >= 0.9 * peaks["moments"], peaks
    assert peaks["sharded"] < 0.5 * peaks["moments"], peaks


def _rewrite_manifest(path: str) -> None:
    """manifest.json of checkpoint folder `path` made anew: each file's size and sha256."""
    files = {}
    for name in sorted(os.listdir(path)):
        if name != checkpoint.MANIFEST:
            with open(os.path.join(path, name), "rb") as f:
                body = f.read()
            files[name] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    with open(os.path.join(path, checkpoint.MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"files": files}, f)


@pytest.mark.slow
def test_a_checkpoint_of_whole_tensors_without_a_format_resumes_sharded(tmp_path):
    """A checkpoint as the previous version wrote (model.pt, AdamW's state whole in
    trainer.pt keyed by parameter index, no format) resumes under --sync micro on 2 ranks:
    the continuation equals one process run through."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(40_000, seed=1).astype(np.uint16))
    base = dict(data=str(data), seq_len=32, micro_batch=4, accum_steps=2, max_steps=4,
                save_every=2, eval_every=0, json=True)  # fmt: skip
    train(TrainConfig(**base, out=str(tmp_path / "whole")))
    old = tmp_path / "old"
    train(TrainConfig(**base, out=str(old)), should_stop=lambda step: step >= 2)
    path = checkpoint.find_latest(str(old))
    state = torch.load(os.path.join(path, "trainer.pt"), weights_only=True)
    del state[checkpoint.FORMAT_KEY]
    torch.save(state, os.path.join(path, "trainer.pt"))
    _rewrite_manifest(path)
    assert checkpoint.damage(path) is None and not checkpoint.is_sharded(path)
    resumed = launch(old, 2, ["--resume", "--sync", "micro"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = records(old), records(tmp_path / "whole")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    a = torch.load(old / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    bound = adamw_drift_bound([r["lr"] for r in want[2:]], ADAM_BETAS, first_step=3)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=2**-20, atol=bound)
