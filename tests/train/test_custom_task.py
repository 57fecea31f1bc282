"""A task defined outside the package (examples/custom_task.py: sequence classification on the
built-in GPT) trains with `gradaccum train --task examples.custom_task:MajorityClass`: its
window gradient is the float64 big batch's, it evaluates, 2 gloo ranks take the same steps
as one process, and a resume at 1 and at 2 ranks continues bit for bit."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gradaccum.engine.accumulator import Accumulator
from gradaccum.parallel.process_group import RankInfo
from gradaccum.train import parts
from gradaccum.train.config import TrainConfig
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.train.tasks import task_class

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = "examples.custom_task:MajorityClass"
ARGS = ["--task", TASK, "--seq-len", "16", "--eval-every", "2", "--json"]


def test_the_window_gradient_is_the_float64_big_batch(monkeypatch):
    """k = 3 micro-batches of 5 sequences through the engine (SGD, lr 1: the step is minus
    the gradient) against one float64 mean cross-entropy over the 15 sequences."""
    monkeypatch.chdir(ROOT)
    config = TrainConfig(task=TASK, seq_len=16, micro_batch=5, accum_steps=3)
    task = task_class(TASK)(config, RankInfo(0, 1, 0, torch.device("cpu"), None, False))
    data = task.load_data()
    torch.manual_seed(0)
    model = parts.new_model(config, data.info)[0]
    reference = copy.deepcopy(model).double()
    stream = task.stream(data, 5)
    micro_batches = [next(stream) for _ in range(3)]
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0))
    result = acc.step(micro_batches, lambda m, b: task.loss(m, b, 1.0))
    assert result.tokens == 15  # the count: sequences, over the window
    ids = torch.cat([b["input_ids"] for b in micro_batches])
    labels = torch.cat([b["labels"] for b in micro_batches])
    logits = reference(ids)[:, -1, :2]  # the class ids 0 and 1
    F.cross_entropy(logits, labels).backward()  # the big batch's mean
    worst, scale = 0.0, 0.0
    for b, p, r in zip(before, model.parameters(), reference.parameters(), strict=True):
        worst = max(worst, float(((b - p.detach()).double() - r.grad).abs().max()))
        scale = max(scale, float(r.grad.abs().max()))
    assert scale > 0 and worst <= 1e-5 * scale, (worst, scale)


@pytest.mark.slow  # a subprocess: the CLI as a user runs it
def test_a_class_that_is_no_task_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", "train", "--task", "examples.custom_task:Stream",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--task examples.custom_task:Stream" in lines[0], lines
    assert "is not a task" in lines[0] and "loss" in lines[0]
    assert not (tmp_path / "run").exists()


def _train(out, *extra, ranks: int = 1) -> None:
    head = [sys.executable, "-m", "gradaccum"]
    if ranks > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), "-m", "gradaccum"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*head, "train", *ARGS, "--out", str(out), *extra],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """At 1 process (micro-batch 4, k 4) and 2 ranks (micro-batch 4, k 2), the same 16
    sequences a step: 4 steps with checkpoints at 2 and 4, and the same run as if it had died
    after its step-2 checkpoint, resumed."""
    root = tmp_path_factory.mktemp("custom")
    for ranks, k in ((1, "4"), (2, "2")):
        batch = ["--micro-batch", "4", "--accum-steps", k, "--save-every", "2"]
        straight, died = root / f"straight{ranks}", root / f"resumed{ranks}"
        _train(straight, *batch, "--max-steps", "4", ranks=ranks)
        shutil.copytree(straight, died)
        shutil.rmtree(died / "checkpoints" / "step-00000004")
        os.unlink(died / "model.pt")
        _train(died, *batch, "--max-steps", "4", "--resume", ranks=ranks)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_it_evaluates_and_resumes_bit_for_bit(runs, ranks):
    straight, resumed = runs / f"straight{ranks}", runs / f"resumed{ranks}"
    assert _losses(resumed) == _losses(straight) and len(_losses(straight)) == 4
    evals = [r for r in read_metrics(os.path.join(straight, "metrics.jsonl")) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(0 <= r["accuracy"] <= 1 for r in evals)
    a = torch.load(straight / "model.pt", weights_only=True)
    b = torch.load(resumed / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_ranks_take_the_steps_of_one_process(runs):
    one, two = _losses(runs / "straight1"), _losses(runs / "straight2")
    assert two == pytest.approx(one, rel=1e-5)
