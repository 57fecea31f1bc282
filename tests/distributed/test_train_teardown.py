"""A run under several ranks gives back everything that holds the process group before the
group is destroyed. A DDP model still alive then (a run's parts point at each other, so only
the cyclic collector frees them) keeps the group's C++ side until interpreter exit, where gloo
can abort the process ("terminate called without an active exception", exit -6 after a run
that succeeded: a torchrun job reported failed)."""

import gc

import numpy as np
import pytest
from torch.nn.parallel import DistributedDataParallel

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.testing import run_ranks
from gradaccum.train.config import TrainConfig


def _alive_ddp() -> int:
    return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())


class Failed(Exception):
    pass


def _fail(step: int) -> bool:
    raise Failed(f"a failure after step {step}")


def _train_then_count(info, out, data):
    from gradaccum.train.loop import train

    config = dict(data=data, seq_len=16, micro_batch=2, accum_steps=2, max_steps=2,
                  eval_every=0, save_every=0)  # fmt: skip
    gc.disable()  # only what the run itself collects is collected
    try:
        train(TrainConfig(out=out, **config))
        finished = _alive_ddp()
        try:  # a run that fails mid-loop on every rank, its model under DDP
            train(TrainConfig(out=out + "-failed", **config), should_stop=_fail)
        except Failed:
            pass
        return finished, _alive_ddp()
    finally:
        gc.enable()


@pytest.mark.slow
def test_no_ddp_model_outlives_a_run(tmp_path):
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(20_000, seed=3).astype(np.uint16))
    args = (str(tmp_path / "run"), str(data))
    assert run_ranks(_train_then_count, 2, args=args, timeout_s=240) == [(0, 0), (0, 0)]
