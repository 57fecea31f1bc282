"""Batch-size schedules: parsing, k per window, phases, LR rules (pure arithmetic)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum.plan.batch_schedule import LR_RULES, parse_batch_schedule, phases
from gradaccum.plan.schedule_plan import plan_schedule
from gradaccum.utils.errors import BadInput


def test_step_wise_schedule_by_hand():
    s = parse_batch_schedule("0:32k,1B:256k,10B:4M")
    assert s.points == ((0, 32_000), (1_000_000_000, 256_000), (10_000_000_000, 4_000_000))
    # micro-batch 4 x 1024 tokens on 8 ranks: 32,768 tokens per micro-step over all ranks
    assert s.accum_steps(0, 4096, 8) == 1  # 32k / 32,768 = 0.98 -> 1
    assert s.accum_steps(999_999_999, 4096, 8) == 1
    assert s.accum_steps(1_000_000_000, 4096, 8) == 8  # 256k / 32,768 = 7.8 -> 8
    assert s.accum_steps(10**11, 4096, 8) == 122  # 4M / 32,768 = 122.07 -> 122


def test_linear_ramp_by_hand():
    s = parse_batch_schedule("linear:0:32k,100M:1M")
    assert s.target(0) == 32_000
    assert s.target(50_000_000) == pytest.approx(516_000)  # half way
    assert s.target(10**9) == 1_000_000  # flat after the last point
    assert s.accum_steps(50_000_000, 1024, 1) == round(516_000 / 1024)


def test_phases_count_steps_and_tokens_by_hand():
    s = parse_batch_schedule("0:8k,100k:32k")
    got = phases(s, 300_000, micro_tokens=4096, world=1)
    # 8k/4096 -> k=2 (8192 tokens): ceil(100,000 / 8192) = 13 steps, ends at 106,496
    # then k=8 (32,768): ceil((300,000 - 106,496) / 32,768) = 6 steps, ends at 303,104
    assert [(p.accum_steps, p.steps, p.start_tokens, p.end_tokens) for p in got] == [
        (2, 13, 0, 106_496),
        (8, 6, 106_496, 303_104),
    ]


def test_lr_rules_relative_to_the_final_batch():
    s = parse_batch_schedule("0:8k,1M:32k")
    assert s.lr_factor(8192, "none", 4096, 1) == 1.0
    assert s.lr_factor(8192, "linear", 4096, 1) == pytest.approx(0.25)
    assert s.lr_factor(8192, "sqrt", 4096, 1) == pytest.approx(0.5)
    with pytest.raises(BadInput, match="--lr-rule"):
        s.lr_factor(8192, "cubic", 4096, 1)


@pytest.mark.parametrize(
    "text, why",
    [
        ("32k", "TOKENS_SEEN:TOKENS_PER_STEP"),
        ("1M:32k", "start at 0"),
        ("0:32k,1B:64k,1B:128k", "increase"),
        ("0:0", "--batch-schedule"),
        ("0:-5", "--batch-schedule"),
        ("0:abc", "--batch-schedule"),
    ],
)
def test_bad_schedules_name_the_flag(text, why):
    with pytest.raises(BadInput, match=why) as err:
        parse_batch_schedule(text)
    assert str(err.value).startswith("--batch-schedule")


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2**22), min_size=1, max_size=4),
    gaps=st.lists(st.integers(1, 2**26), min_size=3, max_size=3),
    micro=st.integers(1, 2**14),
    world=st.integers(1, 16),
    total=st.integers(1, 2**30),
    linear=st.booleans(),
)
def test_phases_cover_the_run_with_whole_windows(sizes, gaps, micro, world, total, linear):
    starts = [0]
    for gap in gaps[: len(sizes) - 1]:
        starts.append(starts[-1] + gap)
    text = ",".join(f"{a}:{b}" for a, b in zip(starts, sizes, strict=False))
    s = parse_batch_schedule(("linear:" if linear else "") + text)
    got = phases(s, total, micro, world)
    assert got[0].start_tokens == 0
    assert got[-1].end_tokens >= total
    for a, b in zip(got, got[1:], strict=False):
        assert a.end_tokens == b.start_tokens
        assert a.end_tokens < total
    for p in got:
        assert p.tokens_per_step == p.accum_steps * micro * world
        assert p.end_tokens - p.start_tokens == p.steps * p.tokens_per_step
        # k is the rounded target at the phase's first window, never below 1
        want = max(1, math.floor(s.target(p.start_tokens) / (micro * world) + 0.5))
        assert p.accum_steps == want


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2**20), min_size=1, max_size=4),
    gaps=st.lists(st.integers(1, 2**24), min_size=3, max_size=3),
    micro=st.integers(1, 2**12),
    world=st.integers(1, 8),
    total=st.integers(1, 2**28),
    linear=st.booleans(),
    micro_step_s=st.floats(0.001, 10),
    rule=st.sampled_from(LR_RULES),
)
def test_planned_phases_reach_the_total_within_one_step(
    sizes, gaps, micro, world, total, linear, micro_step_s, rule
):
    starts = [0]
    for gap in gaps[: len(sizes) - 1]:
        starts.append(starts[-1] + gap)
    text = ",".join(f"{a}:{b}" for a, b in zip(starts, sizes, strict=False))
    s = parse_batch_schedule(("linear:" if linear else "") + text)
    got = plan_schedule(
        s,
        total,
        micro,
        world,
        lr_rule=rule,
        base_lr=2.0,
        step_time=lambda k, tokens_per_step: k * micro_step_s,
    )
    last = got.phases[-1]
    assert total <= got.total_tokens < total + last.tokens_per_step
    assert got.total_tokens == sum(p.tokens for p in got.phases) == last.end_tokens
    assert got.total_steps == sum(p.steps for p in got.phases)
    final = max(1, math.floor(sizes[-1] / (micro * world) + 0.5)) * micro * world
    for p in got.phases:
        assert p.tokens == p.steps * p.accum_steps * micro * world
        assert p.time_s == pytest.approx(p.steps * p.accum_steps * micro_step_s)
        ratio = p.tokens_per_step / final
        want = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
        assert p.lr_factor == pytest.approx(want) and p.lr == pytest.approx(2.0 * want)
    assert got.total_time_s == pytest.approx(sum(p.time_s for p in got.phases))


def test_unknown_step_time_leaves_phase_and_total_time_unknown():
    s = parse_batch_schedule("0:4k,8k:16k")
    got = plan_schedule(
        s, 40_000, 1024, 1, lr_rule="none", base_lr=None, step_time=lambda k, tps: None
    )
    assert [p.time_s for p in got.phases] == [None, None] and got.total_time_s is None
    assert [p.lr for p in got.phases] == [None, None]


def test_schedule_text_reads_back():
    for text in ("0:32k,1B:256k,10B:4M", "linear:0:32Ki,100M:1M"):
        assert str(parse_batch_schedule(text)) == text
        assert parse_batch_schedule(str(parse_batch_schedule(text))) == parse_batch_schedule(text)
