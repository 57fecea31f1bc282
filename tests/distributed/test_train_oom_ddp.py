"""Out of memory on one rank in the middle of a window under torchrun: the ranks agree before
the next micro-batch, every rank abandons the window, halves its micro-batch, doubles k and
redoes it. The run must equal one process that trained with the halved micro-batch from that
window on (2 ranks x b read what one process with micro-batch 2b reads).

Each window is compared from the same weights: step 1 from the same initial weights, the
redone window and those after it from the two ranks' own step-1 checkpoint, resumed on one
process. Losses, gradient norms and tokens are compared tightly; the weights after Adam steps
only within `adamw_drift_bound` (an element whose gradient is zero up to rounding steps by up
to lr either way on its last bits, so two runs that agree on every gradient to rounding can
differ there by about 2 lr per step)."""

import os
import shutil

import numpy as np
import pytest
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.testing import adamw_drift_bound, run_ranks
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.metrics import read_metrics

K = 4  # per rank


def config(out, data, **kw) -> TrainConfig:
    base = dict(out=str(out), data=str(data), seq_len=16, max_steps=4, eval_every=0)
    return TrainConfig(**{**base, "save_every": 1, "keep_checkpoints": 4, **kw})


def _train_with_failure(info, out, data, fail_rank, fail_at, sync="window"):
    from gradaccum.train import loop
    from gradaccum.train.tasks import language

    if info.rank == fail_rank:
        real, seen = language.causal_lm_loss, {"calls": 0}

        def failing(model, batch):
            seen["calls"] += model.training
            out = real(model, batch)  # as a real one: past DDP's forward hooks (collectives)
            if seen["calls"] == fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return out

        language.causal_lm_loss = failing
    run_config = loop.prepare(config(out, data, micro_batch=4, accum_steps=K, sync=sync))
    summary = loop.Run.build(run_config, info).train(None)
    return [summary["steps"], summary["micro_batch"], summary["accum_steps"]]


def train_records(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


def _weights(out) -> dict:
    return torch.load(os.path.join(out, "model.pt"), weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank, fail_at", [(0, K + 3), (1, K + 3), (1, K + 1)])
def test_one_rank_out_of_memory_mid_window_is_redone_by_all(tmp_path, fail_rank, fail_at):
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(40_000, seed=1).astype(np.uint16))
    out = tmp_path / "two"
    # The third micro-batch of window 2 on one rank (the others learn of it before the last
    # micro-batch), or its first (the others have run the second before they read it); the
    # other rank is fine.
    summaries = run_ranks(
        _train_with_failure, 2, args=(str(out), str(data), fail_rank, fail_at), timeout_s=240
    )
    assert summaries == [[4, 2, 2 * K], [4, 2, 2 * K]]

    # step 1 from the same initial weights: one process reading what the 2 ranks x 4 read
    first = tmp_path / "first"
    train(config(first, data, micro_batch=8, accum_steps=K), should_stop=lambda s: s >= 1)
    # the redone window and the rest, from the two ranks' own weights and optimizer state
    # after step 1: one process with micro-batch 4 reads what 2 ranks x 2 read
    rest = tmp_path / "rest"
    shutil.copytree(out, rest)
    for name in os.listdir(rest / "checkpoints"):
        if checkpoint.is_step_name(name) and name != "step-00000001":
            shutil.rmtree(rest / "checkpoints" / name)
    os.unlink(rest / "model.pt")
    train(config(rest, data, micro_batch=4, accum_steps=K, resume=True))
    records = train_records(out)
    expected = train_records(first)[:1] + train_records(rest)[1:]
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    assert [r["tokens"] for r in records] == [512 * s for s in (1, 2, 3, 4)]
    assert [(r["micro_batch"], r["accum_steps"]) for r in records] == [(4, K)] + [(2, 2 * K)] * 3
    # the window gradients of steps 1 and 2 (the redone one) start from the same weights
    assert [r["grad_norm"] for r in records[:2]] == pytest.approx(
        [r["grad_norm"] for r in expected[:2]], rel=1e-5
    )
    a, b = _weights(out), _weights(rest)
    betas = tuple(_optimizer_state(rest)["param_groups"][0]["betas"])
    bound = adamw_drift_bound([r["lr"] for r in records[1:]], betas, first_step=2)
    for name in b:  # plus a few fp32 roundings of the weights themselves per step
        torch.testing.assert_close(a[name], b[name], rtol=2**-20, atol=bound)


def _optimizer_state(out) -> dict:
    return checkpoint.load(checkpoint.find_latest(str(out))).trainer_state["optimizer"]


def _stopped_by(info, out, data) -> str:
    """A --sync micro run whose rank 1 runs out of memory mid-window: each rank's one line."""
    from gradaccum.utils.errors import RanksLost, RunFailed

    try:
        _train_with_failure(info, out, data, 1, K + 3, sync="micro")
    except (RunFailed, RanksLost) as err:
        return str(err)
    return "finished"


@pytest.mark.slow
def test_out_of_memory_under_a_sharded_model_stops_in_one_line(tmp_path):
    """Under --sync micro the other rank waits in the failed micro-step's reduce-scatter:
    no window can be redone together. The failed rank stops the run naming the smaller
    micro-batch to resume with; the other ends when that process does, in one line too; the
    step-1 checkpoint is there."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(40_000, seed=1).astype(np.uint16))
    out = tmp_path / "two"
    lines = run_ranks(_stopped_by, 2, args=(str(out), str(data)), timeout_s=240)
    assert lines[1].startswith(
        "rank 1: out of memory in step 2 (CUDA out of memory (injected)); a model sharded by "
        "--sync micro cannot redo the window smaller"
    ), lines
    assert lines[1].endswith("continue with --resume --micro-batch 2 (the tokens per step stay)")
    assert lines[0].startswith("rank 0 of 2: another rank stopped answering"), lines
    assert checkpoint.find_latest(str(out)).endswith("step-00000001")
