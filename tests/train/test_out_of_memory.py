"""Out of memory in the middle of a training window: the window is abandoned, the micro-batch
halved and k doubled, and the window redone. The run must equal one that trained with the
halved micro-batch from that window on (made here by a resume with --micro-batch), with nothing
counted twice."""

import os

import pytest
import torch

from gradaccum.cli import main
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.train.tasks import language

from .helpers import markov_folder, train_records

K = 4
FAIL_AT = K + 3  # the third micro-batch of the second window


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return markov_folder(tmp_path_factory, 40_000, seed=1)


def config(out, data, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        data=str(data / "markov.npy"),
        seq_len=16,
        micro_batch=4,
        accum_steps=K,
        max_steps=4,
        eval_every=0,
        save_every=0,
    )
    return TrainConfig(**{**base, **kw})


def fail_once(monkeypatch, at: int, error=torch.OutOfMemoryError) -> dict:
    """causal_lm_loss raising `error` at its `at`-th training call, once."""
    real, seen = language.causal_lm_loss, {"calls": 0}

    def failing(model, batch):
        seen["calls"] += model.training  # the held-out loss is not counted
        if seen["calls"] == at:
            raise error("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(model, batch)

    monkeypatch.setattr(language, "causal_lm_loss", failing)
    return seen


def weights(out) -> dict:
    return torch.load(os.path.join(out, "model.pt"), weights_only=True)


def assert_same_weights(a: dict, b: dict, rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        err = (a[name] - b[name]).norm() / b[name].norm().clamp(min=1e-30)
        assert err <= rel, (name, float(err))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """Step 1 at micro-batch 4 x k 4, then a resume at micro-batch 2 (k 8) to step 4."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train(config(out, data), should_stop=lambda step: step >= 1)
    train(config(out, data, micro_batch=2, resume=True))
    return out


def test_out_of_memory_mid_window_redoes_it_with_half_the_micro_batch(
    tmp_path, data, reference, monkeypatch
):
    seen = fail_once(monkeypatch, FAIL_AT)
    out = tmp_path / "run"
    summary = train(config(out, data))
    monkeypatch.undo()
    # Window 1: 4 calls; window 2: 2 before the failure, then 8 again; windows 3 and 4: 8 each.
    assert seen["calls"] == K + 3 + 3 * 2 * K
    assert_same_weights(weights(out), weights(reference))
    records = train_records(out)
    assert [r["loss"] for r in records] == pytest.approx(
        [r["loss"] for r in train_records(reference)], rel=1e-6
    )
    assert [r["tokens"] for r in records] == [256 * s for s in (1, 2, 3, 4)]  # none twice
    assert [(r["micro_batch"], r["accum_steps"]) for r in records] == [(4, 4)] + [(2, 8)] * 3
    assert summary["tokens"] == 4 * 256 and summary["steps"] == 4
    assert (summary["micro_batch"], summary["accum_steps"]) == (2, 8)
    events = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "event" in r]
    assert [(e["step"], e["event"], e["micro_batch"], e["accum_steps"]) for e in events] == [
        (2, "out_of_memory", 2, 8)
    ]
    saved = checkpoint.load(checkpoint.find_latest(str(out)))
    assert saved.trainer_state["data"]["sequences"] == 4 * 256 // 16
    assert saved.trainer_state["plan"]["micro_batch"] == 2


def test_a_run_that_recovered_resumes_at_the_smaller_micro_batch(
    tmp_path, data, reference, monkeypatch
):
    fail_once(monkeypatch, FAIL_AT)
    out = tmp_path / "run"
    train(config(out, data), should_stop=lambda step: step >= 3)
    monkeypatch.undo()
    train(config(out, data, resume=True))
    assert_same_weights(weights(out), weights(reference))
    assert [r["micro_batch"] for r in train_records(out)] == [4, 2, 2, 2]


def test_out_of_memory_at_micro_batch_one_stops_with_one_line(tmp_path, data, monkeypatch, capsys):
    fail_once(monkeypatch, 2)
    argv = ["train", "--data", str(data / "markov.npy"), "--seq-len", "16", "--micro-batch"]
    argv += ["1", "--accum-steps", "2", "--max-steps", "2", "--out", str(tmp_path / "run")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradaccum: error: rank 0: out of memory in step 1")
    assert "--activation-checkpointing" in err[0]


def test_other_errors_mid_window_are_not_taken_for_out_of_memory(tmp_path, data, monkeypatch):
    fail_once(monkeypatch, 3, error=RuntimeError)
    with pytest.raises(RuntimeError, match="injected"):
        train(config(tmp_path / "run", data))
