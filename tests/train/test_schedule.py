"""LR schedules in optimizer steps, against values worked out by hand."""

import io
import math

import pytest
import torch

from gradaccum.train.schedule import Schedule, lr_at, make_scheduler

# warmup 10 steps, 110 in all, so the decay runs over 100 steps; min ratio 0.1, peak lr 2.
HAND = [
    # (step, kind, lr)
    (0, "cosine", 2 * 1 / 10),  # first warmup step is not at lr 0
    (4, "cosine", 2 * 5 / 10),
    (9, "cosine", 2.0),  # last warmup step reaches the peak
    (10, "cosine", 2.0),  # decay starts at the peak
    (35, "cosine", 2 * (0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5)))),  # a quarter: cos(pi/4)
    (60, "cosine", 2 * 0.55),  # halfway: cos(pi/2) = 0
    (110, "cosine", 2 * 0.1),  # the end: the min ratio
    (500, "cosine", 2 * 0.1),  # past the end it stays there
    (35, "linear", 2 * (0.1 + 0.9 * 0.75)),
    (60, "linear", 2 * 0.55),
    (110, "linear", 2 * 0.1),
    (4, "constant", 2 * 5 / 10),
    (60, "constant", 2.0),
    (500, "constant", 2.0),
]


@pytest.mark.parametrize("step, kind, expected", HAND)
def test_lr_at_matches_hand_values(step, kind, expected):
    got = lr_at(step, lr=2.0, total_steps=110, warmup_steps=10, kind=kind, min_ratio=0.1)
    assert got == pytest.approx(expected, rel=1e-12)


def test_no_warmup_starts_at_the_peak():
    assert lr_at(0, 1.0, total_steps=4, warmup_steps=0, kind="linear", min_ratio=0.0) == 1.0
    # linear to zero over 4 steps: 1, 3/4, 1/2, 1/4, then 0 at step 4
    got = [lr_at(s, 1.0, 4, 0, "linear", 0.0) for s in range(5)]
    assert got == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_scheduler_follows_the_schedule_and_resumes_from_its_state():
    def build():
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=0.5)
        return opt, make_scheduler(opt, Schedule(total_steps=20, warmup_steps=4, kind="cosine"))

    opt, sched = build()
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, 0.5, 20, 4, "cosine") for s in range(12)])

    # the state holds only numbers: it round-trips through torch.load(weights_only=True)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    opt2, sched2 = build()
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(12, 0.5, 20, 4, "cosine"))
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(13, 0.5, 20, 4, "cosine"))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(total_steps=0),
        dict(total_steps=5, warmup_steps=-1),
        dict(total_steps=5, kind="step"),
        dict(total_steps=5, min_ratio=1.5),
    ],
)
def test_bad_schedules_are_refused(kwargs):
    with pytest.raises(ValueError):
        Schedule(**kwargs)
