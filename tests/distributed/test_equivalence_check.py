"""`check_equivalence`, the helper behind `gradaccum verify --world-size N`: it passes on a
correct distributed window and fails on one that divides by k."""

from __future__ import annotations

import pytest

from gradaccum.distributed_check import check_equivalence, small_gpt

from .ranks import TIMEOUT_S


def test_ddp_window_with_a_short_rank_passes():
    report = check_equivalence(world_size=2, accum_steps=4, steps=3, timeout_s=TIMEOUT_S)
    assert report.passed, report.to_dict()
    assert report.grad_rel_error <= 1e-5
    assert report.tokens == report.tokens_expected
    # k = 4 micro-batches, one all-reduce of every fp32 gradient per window
    numel = sum(p.numel() for p in small_gpt(0).parameters())
    assert report.grad_collectives == [1, 1, 1]
    assert report.grad_bytes == [4 * numel] * 3
    # only the attention key biases (32 of each block's 96 c_attn biases) are left out
    assert report.excluded == {f"blocks.{i}.attn.c_attn.bias": 32 for i in range(2)}


def test_dividing_by_k_is_caught():
    # micro-batches of different token counts: the mean of micro-batch means is not the
    # token mean, and the check must say so
    report = check_equivalence(
        world_size=1, accum_steps=4, steps=1, normalize="micro_batch_mean", timeout_s=TIMEOUT_S
    )
    assert not report.passed
    assert report.grad_rel_error > 1e-2


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="world_size 0"):
        check_equivalence(world_size=0)
    with pytest.raises(ValueError, match="wrapper 'zero3'"):
        check_equivalence(wrapper="zero3")
    with pytest.raises(ValueError, match="accum_steps 0"):
        check_equivalence(accum_steps=0)
