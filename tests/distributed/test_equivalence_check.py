"""`gradaccum.testing.check_equivalence`, the harness behind `gradaccum verify --world-size N`:
it passes on a correct distributed window and fails on one that divides by k."""

from __future__ import annotations

import pytest
from reference import make_gpt

from gradaccum.testing import check_equivalence, rank_batches

from .ranks import TIMEOUT_S

pytestmark = pytest.mark.slow


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_ddp_window_with_a_short_rank_passes():
    report = check_equivalence(make_gpt, world_size=2, accum_steps=4, steps=3, timeout_s=TIMEOUT_S)
    assert report.passed, report.to_dict()
    assert report.grad_rel_error <= 1e-5
    # tokens counted here, from the data alone: window i holds rank r's micro-batches
    # 4i .. 4i + 3 (rank 1 holds 7: one short of window 2, none in window 3)
    data = [rank_batches(report.setup, r) for r in range(2)]
    want = [
        sum(int((b["labels"] != -100).sum()) for d in data for b in d[4 * i : 4 * i + 4])
        for i in range(3)
    ]
    assert report.tokens == want
    assert [len(d) for d in data] == [12, 7]
    # k = 4 micro-batches, one all-reduce of every fp32 gradient per window
    assert report.grad_collectives == [1, 1, 1]
    assert report.grad_bytes == [4 * _numel(make_gpt(0))] * 3
    # only the attention key biases (32 of each block's 96 c_attn biases) are left out
    assert report.excluded == {f"blocks.{i}.attn.c_attn.bias": 32 for i in range(2)}


def test_dividing_by_k_is_caught():
    # micro-batches of different token counts: the mean of micro-batch means is not the
    # token mean, and the check must say so
    report = check_equivalence(
        make_gpt,
        world_size=1,
        accum_steps=4,
        steps=1,
        normalize="micro_batch_mean",
        timeout_s=TIMEOUT_S,
    )
    assert not report.passed
    assert report.grad_rel_error > 1e-2


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="world_size 0"):
        check_equivalence(make_gpt, world_size=0)
    with pytest.raises(ValueError, match="wrapper 'zero3'"):
        check_equivalence(make_gpt, wrapper="zero3")
    with pytest.raises(ValueError, match="accum_steps 0"):
        check_equivalence(make_gpt, accum_steps=0)
