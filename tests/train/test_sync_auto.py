"""train --sync auto: the planner's rule (`gradaccum plan --sync auto`: the fastest sync whose
memory fits the device) applied to the run, among the policies the run can take, said with
why at the start; the run then trains as under the policy it chose."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.models.build import build_model
from gradaccum.plan import PlanInputs, make_plan
from gradaccum.testing import run_ranks
from gradaccum.train.config import TrainConfig
from gradaccum.train.resolve import resolve_plan
from gradaccum.train.rundir.metrics import read_metrics

SEQ, MICRO, K = 32, 2, 4  # k 4 on 2 ranks: micro sends twice what window does
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_info():
    return build_model(preset="tiny", vocab_size=256, seq_len=SEQ)[1]


def _config(**kw) -> TrainConfig:
    base = dict(sync="auto", seq_len=SEQ, micro_batch=MICRO, accum_steps=K, max_steps=4)
    return TrainConfig(**{**base, **kw})


def _resolved(monkeypatch, model_info, world: int, memory: int | None, **kw):
    monkeypatch.setattr("gradaccum.parallel.devices.total_memory_bytes", lambda d: memory)
    return resolve_plan(_config(**kw), model_info, world, CPU)


def _policy_totals(model_info, world: int) -> dict[str, float]:
    """Each policy's memory per device (bytes), as the planner estimates it for this run's
    shape and batch on `world` devices of ample memory."""
    plan = make_plan(PlanInputs(
        micro_batch=MICRO, accum_steps=K, seq_len=SEQ, gpus=world, steps=4,
        params=model_info.params, layers=model_info.layers, hidden=model_info.hidden,
        heads=model_info.heads, vocab=model_info.vocab_size, precision="fp32",
        device_memory=10**15, sync="auto", gpus_per_node=world,
    ))  # fmt: skip
    return {c.policy: c.memory_total_gb * 1e9 for c in plan.sync.policies}


def test_one_process_has_nothing_to_sync(monkeypatch, model_info):
    resolved = _resolved(monkeypatch, model_info, 1, 10**12)
    assert (resolved.sync, resolved.shards_model) == ("window", False)
    assert "one process" in resolved.sync_why


def test_a_device_of_unknown_memory_takes_the_fastest(monkeypatch, model_info):
    resolved = _resolved(monkeypatch, model_info, 2, None)  # a CPU: no memory to fit
    assert resolved.sync == "window" and "not known" in resolved.sync_why


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(compile=True), "--compile"),
        (dict(task="grpo", max_steps=2, accum_steps=None, micro_batch=None), "--task grpo"),
    ],
)
def test_what_is_not_sharded_takes_window_and_says_why(monkeypatch, model_info, kw, words):
    totals = _policy_totals(model_info, 2)
    tight = int((totals["window"] + totals["micro"]) / 2)  # only micro would fit
    resolved = _resolved(monkeypatch, model_info, 2, tight, **kw)
    assert resolved.sync == "window" and words in resolved.sync_why


def test_the_fastest_that_fits_is_chosen(monkeypatch, model_info):
    """Window (one all-reduce a window) is faster than micro (a reduce-scatter a micro-batch):
    with room for window it is chosen; with room for micro only (between the two totals the
    planner estimates) micro is, and the run is planned as --sync micro plans it."""
    totals = _policy_totals(model_info, 2)
    assert totals["micro"] < totals["window"]
    ample = _resolved(monkeypatch, model_info, 2, int(2 * totals["window"]))
    assert ample.sync == "window" and "fastest" in ample.sync_why
    tight = _resolved(monkeypatch, model_info, 2, int((totals["window"] + totals["micro"]) / 2))
    assert (tight.sync, tight.shards_model) == ("micro", True)
    explicit = resolve_plan(_config(sync="micro"), model_info, 2, CPU)
    assert tight.plan.memory == explicit.plan.memory and explicit.sync_why is None


def _train(info, out: str, data: str, sync: str, memory: int | None) -> list[dict]:
    """A 4-step run of --sync `sync` on this rank, the device's memory reported as `memory`;
    rank 0's training records and the opening's sync lines."""
    from gradaccum.parallel import devices
    from gradaccum.train.loop import train

    devices.total_memory_bytes = lambda device: memory
    config = dict(data=data, seq_len=SEQ, micro_batch=MICRO, accum_steps=K, max_steps=4,
                  eval_every=0, save_every=0, seed=1)  # fmt: skip
    summary = train(TrainConfig(out=out, sync=sync, **config))
    if info.rank:
        return []
    records = [r for r in read_metrics(f"{out}/metrics.jsonl") if "loss" in r]
    return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in records] + [
        {"sync": summary["sync"]}
    ]


@pytest.mark.slow
def test_two_ranks_train_under_the_chosen_policy_as_under_it_given(tmp_path, model_info):
    """2 gloo ranks, the device's memory between micro's and window's totals: --sync auto
    chooses micro and trains step for step as --sync micro does (the same windows, FSDP2's
    reduce-scatters: the same records bit for bit)."""
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(20_000, seed=3).astype(np.uint16))
    totals = _policy_totals(model_info, 2)
    tight = int((totals["window"] + totals["micro"]) / 2)
    auto = run_ranks(_train, 2, args=(str(tmp_path / "auto"), str(data), "auto", tight),
                     timeout_s=240)[0]  # fmt: skip
    given = run_ranks(_train, 2, args=(str(tmp_path / "micro"), str(data), "micro", None),
                      timeout_s=240)[0]  # fmt: skip
    assert auto[-1] == {"sync": "micro"} and auto == given


def test_the_choice_is_said_at_the_start_and_in_the_summary(tmp_path, capsys):
    from gradaccum.train.loop import train

    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(5_000, seed=3).astype(np.uint16))
    summary = train(_config(out=str(tmp_path / "run"), data=str(data), max_steps=1,
                            eval_every=0, save_every=0))  # fmt: skip
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sync")]
    assert said == ["sync   auto chose window: one process: no ranks to sync"]
    assert summary["sync"] == "window"
