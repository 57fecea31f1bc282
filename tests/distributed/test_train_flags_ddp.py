"""The ranks' per-micro-step flags under torchrun (`gradaccum.train.recovery`): launched before
a micro-batch's forward and read one micro-batch later, so the host never waits for them
while the device has work queued; only the window's last micro-step reads its own flag first
(its backward carries the gradients' all-reduce). A stop request on one rank mid-window still
abandons the same window on both, with nothing stepped."""

import os
import signal
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.parallel import collectives
from gradaccum.testing import run_ranks
from gradaccum.train.config import TrainConfig
from gradaccum.train.rundir.metrics import read_metrics

K = 4  # micro-batches per window on each rank


def config(out, data, **kw) -> TrainConfig:
    base = dict(out=str(out), data=str(data), seq_len=16, micro_batch=2, accum_steps=K)
    return TrainConfig(**{**base, "eval_every": 0, "save_every": 0, **kw})


def _events(info, out, data):
    """Train 2 windows, logging the order of forwards and flag launches and reads."""
    from gradaccum.train import loop, recovery
    from gradaccum.train.tasks import language

    log: list[str] = []
    real_loss, real_max = language.causal_lm_loss, collectives.max_over_ranks

    class Logged(collectives.LaunchedMax):
        def __init__(self, value, group=None):
            log.append("launch")
            super().__init__(value, group)

        def value(self):
            log.append("read")
            return super().value()

    def forward(model, batch):
        log.append("forward" if model.training else "eval")
        return real_loss(model, batch)

    def blocking(value, group=None):
        if sys._getframe(1).f_globals["__name__"] == recovery.__name__:
            log.append("blocking")  # the flags' agreement, not the run's other collectives
        return real_max(value, group)

    language.causal_lm_loss, recovery.collectives.LaunchedMax = forward, Logged
    recovery.collectives.max_over_ranks = blocking
    run_config = loop.prepare(config(out, data, max_steps=2))
    summary = loop.Run.build(run_config, info).train(None)
    return [summary["steps"], [e for e in log if e != "eval"]]


@pytest.mark.slow
def test_each_flag_is_read_one_micro_batch_after_its_forward(tmp_path):
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(20_000, seed=2).astype(np.uint16))
    results = run_ranks(_events, 2, args=(str(tmp_path / "run"), str(data)), timeout_s=240)
    # Per window of 4: micro-steps 0-2 launch their flag and run their forward before it is
    # read (at the next micro-step); the last reads the pending one, then agrees on its own
    # blocking before its forward; then the stop flag between windows (blocking).
    window = ["launch", "forward", "read", "launch", "forward", "read", "launch", "forward"]
    window += ["read", "blocking", "forward", "blocking"]
    for steps, log in results:
        assert steps == 2
        assert log == window * 2


def _stop_mid_window(info, out, data):
    """Rank 1 gets SIGTERM during the second micro-batch of window 2."""
    from gradaccum.train import loop
    from gradaccum.train.tasks import language

    if info.rank == 1:
        real, seen = language.causal_lm_loss, {"calls": 0}

        def signalled(model, batch):
            seen["calls"] += model.training
            if seen["calls"] == K + 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(model, batch)

        language.causal_lm_loss = signalled
    run_config = loop.prepare(config(out, data, max_steps=6, save_every=1))
    summary = loop.Run.build(run_config, info).train(None)
    return [summary["steps"], summary.get("stopped")]


@pytest.mark.slow
def test_a_stop_on_one_rank_mid_window_abandons_it_on_both(tmp_path):
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(20_000, seed=2).astype(np.uint16))
    out = tmp_path / "run"
    results = run_ranks(_stop_mid_window, 2, args=(str(out), str(data)), timeout_s=240)
    assert [steps for steps, _ in results] == [1, 1]  # window 2 abandoned on both ranks
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in records] == [1]


def _gloo_beside_another_backend(info):
    """`host_group` under a default group that is not gloo makes a gloo group of its own: its
    flags are CPU tensors, reduced without a device."""
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real(group)
    try:
        group = collectives.host_group(timeout_s=30)
    finally:
        dist.get_backend = real
    assert group is not None and dist.get_backend(group) == "gloo"
    launched = collectives.LaunchedMax(info.rank * 5 + 1, group)
    blocking = collectives.max_over_ranks(7 - info.rank, group)
    return [launched.value(), blocking, torch.device("cpu") == collectives.collective_device(group)]


@pytest.mark.slow
def test_flags_go_through_gloo_beside_a_device_backend():
    assert run_ranks(_gloo_beside_another_backend, 2) == [[6, 7, True], [6, 7, True]]
