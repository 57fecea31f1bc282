"""`gradaccum.testing.check_equivalence`, the harness behind `gradaccum verify --world-size N`:
it passes on a correct distributed window and fails on the usual mistakes (each micro-batch's
mean divided by k, an optimizer step after every micro-batch), under DDP and FSDP2, all in one
start of 2 ranks."""

from __future__ import annotations

import pytest

from gradaccum.testing import EquivalenceSetup, check_equivalence, check_equivalences, rank_batches
from tests.reference import make_gpt

from .ranks import TIMEOUT_S

pytestmark = pytest.mark.slow

MISTAKES = {
    "mean_over_k": {"normalize": "micro_batch_mean"},
    "step_every_micro_batch": {"step_every_micro_batch": True},
}


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def reports() -> dict:
    setups = {("right", "ddp"): EquivalenceSetup(world_size=2, accum_steps=4, steps=3)}
    for wrapper in ("ddp", "fsdp2"):
        for name, how in MISTAKES.items():
            setups[name, wrapper] = EquivalenceSetup(world_size=2, wrapper=wrapper, **how)
    got = check_equivalences(make_gpt, list(setups.values()), timeout_s=2 * TIMEOUT_S)
    return dict(zip(setups, got, strict=True))


def test_ddp_window_with_a_short_rank_passes(reports):
    report = reports["right", "ddp"]
    assert report.passed, report.to_dict()
    assert report.grad_rel_error <= 1e-5 and report.loss_rel_error <= 1e-5
    assert report.step_error <= report.step_tolerance == 1e-5  # 3 steps (test_references)
    # tokens counted here, from the data alone: window i holds rank r's micro-batches
    # 4i .. 4i + 3 (rank 1 holds 7: one short of window 2, none in window 3)
    data = [rank_batches(report.setup, r) for r in range(2)]
    want = [
        sum(int((b["labels"] != -100).sum()) for d in data for b in d[4 * i : 4 * i + 4])
        for i in range(3)
    ]
    assert report.tokens == want
    assert [len(d) for d in data] == [12, 7]
    assert report.steps == report.windows == 3
    # k = 4 micro-batches, one all-reduce of every fp32 gradient per window
    assert report.grad_collectives == [1, 1, 1]
    assert report.grad_bytes == [4 * _numel(make_gpt(0))] * 3


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_dividing_by_k_is_caught(reports, wrapper):
    # micro-batches of different token counts: the mean of micro-batch means is not the
    # token mean, and the check must say so
    report = reports["mean_over_k", wrapper]
    assert not report.passed
    assert report.grad_rel_error > 1e-2 and report.loss_rel_error > 1e-2


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_stepping_every_micro_batch_is_caught(reports, wrapper):
    report = reports["step_every_micro_batch", wrapper]
    assert not report.passed
    assert (report.steps, report.windows) == (4 * 3, 3)
    assert "12 optimizer steps for 3 windows" in report.notes[0]


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="world_size 0"):
        check_equivalence(make_gpt, world_size=0)
    with pytest.raises(ValueError, match="wrapper 'zero3'"):
        check_equivalence(make_gpt, wrapper="zero3")
    with pytest.raises(ValueError, match="accum_steps 0"):
        check_equivalence(make_gpt, accum_steps=0)
    with pytest.raises(ValueError, match=r"world sizes \[1, 2\]"):
        check_equivalences(make_gpt, [EquivalenceSetup(world_size=w) for w in (1, 2)])
