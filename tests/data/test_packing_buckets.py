"""Bucketed shapes (`gradaccum.data.sft.packing`): padding-free rows as wide as the bucket of the
example opening them, and window micro-batches filled to budget // width rows by empty rows.
Layouts checked against hand-derived ones; gradients against the float64 big batch of
tests/data/test_packing.py (no packer, no engine, no document mask)."""

from __future__ import annotations

import pytest

from gradaccum.data.sft.examples import make_example
from gradaccum.data.sft.packed import Packing, rank_micro_batches
from gradaccum.data.sft.packing import (
    bucket_lengths,
    collate_window,
    micro_batches,
    pack_micro_batches,
    pack_rows,
    window_micro_batches,
)

from .test_packing import PAD, big_batch_grads, engine_grads, gpt, rel_error, sft_examples


def examples_of(lengths):
    return [make_example(list(range(2, n + 2)), [5] * n, i) for i, n in enumerate(lengths)]


def test_bucketed_rows_by_hand():
    examples = examples_of([20, 12, 6, 5, 4, 3, 3])
    # fixed rows of 32: 20+12, then 6+5+4+3+3 = 21 in the second
    assert pack_rows(examples, 32) == [[0, 1], [2, 3, 4, 5, 6]]
    # bucketed: 20 opens a 32 (room 12, taken by 12); 6, 5, 4 each open an 8 (rooms 2, 3, 4);
    # the 3s go first fit: into 5's row (room 0), then 4's (room 1)
    rows = pack_rows(examples, 32, buckets=[8, 16, 32])
    assert rows == [[0, 1], [2], [3, 5], [4, 6]]
    runs = pack_micro_batches(examples, 32, 32, buckets=[8, 16, 32])
    # rows of one width together, 32 // 8 = 4 of the 8-wide per micro-batch
    assert runs == [([[0, 1]], 32), ([[2], [3, 5], [4, 6]], 8)]
    assert pack_micro_batches(examples, 32, 32) == [([[0, 1]], 32), ([[2, 3, 4, 5, 6]], 32)]


@pytest.mark.parametrize("layout", ["shifted", "unshifted"])
def test_bucketed_micro_batches_hold_each_example_once_in_bucket_widths(layout):
    examples = sft_examples()[:40]
    buckets = bucket_lengths(64)
    batches = micro_batches(examples, "padding-free", pad_id=PAD, layout=layout,
                            micro_batch_tokens=128, row_tokens=64, buckets=buckets)  # fmt: skip
    widths = {b["input_ids"].shape[1] for b in batches}
    assert widths <= set(buckets) and len(widths) >= 2
    assert all(b["input_ids"].numel() <= 128 for b in batches)
    # every target once (an example's first label is a prompt token's, -100, in both layouts)
    assert sum(int((b["labels"] != -100).sum()) for b in batches) == sum(
        e.num_targets for e in examples
    )
    starts = sum(int((b["position_ids"] == 0).logical_and(b["document_ids"] >= 0).sum())
                 for b in batches)  # fmt: skip
    assert starts == len(examples)


def test_bucketed_padding_free_gradient_equals_the_big_batch_with_less_attention():
    examples = sft_examples()[:24]
    sizes = {"pad_id": PAD, "micro_batch_tokens": 128, "row_tokens": 64}
    fixed = micro_batches(examples, "padding-free", **sizes)
    bucketed = micro_batches(examples, "padding-free", buckets=bucket_lengths(64), **sizes)
    # the point: a block-masked row computes width^2 attention; narrower rows compute less
    cost = lambda bs: sum(b["input_ids"].shape[0] * b["input_ids"].shape[1] ** 2 for b in bs)  # noqa: E731
    assert cost(bucketed) < cost(fixed)
    model = gpt()
    assert rel_error(engine_grads(model, bucketed), big_batch_grads(model, examples)) <= 1e-5


def test_window_fill_budget_pads_rows_by_hand():
    examples = examples_of([9, 4, 12, 4, 7, 30, 2, 5])
    buckets = [8, 16, 32]
    groups = window_micro_batches(examples, 32, PAD, "unshifted", buckets)
    # longest first: 30 (32 wide) alone; 12+9 (2x16); 7+5+4+4 (4x8); 2 (8 wide)
    assert groups == [[5], [2, 0], [4, 7, 1, 3], [6]]
    batches = collate_window(examples, groups, PAD, "unshifted", buckets, fill_budget=32)
    assert [tuple(b["input_ids"].shape) for b in batches] == [(1, 32), (2, 16), (4, 8), (4, 8)]
    last = batches[3]
    assert (last["labels"][1:] == -100).all() and (last["input_ids"][1:] == PAD).all()
    assert (last["attention_mask"][1:] == 1).all()  # a row attending to nothing risks NaN
    assert int((last["labels"] != -100).sum()) == examples[6].num_targets == 1


def test_filled_window_gradient_equals_the_big_batch():
    examples = sft_examples()[:40]
    batches = micro_batches(examples, "window", pad_id=PAD, micro_batch_tokens=256,
                            buckets=bucket_lengths(128))  # fmt: skip
    shapes = {tuple(b["input_ids"].shape) for b in batches}
    assert all(256 // t == b for b, t in shapes)  # every micro-batch full to the budget
    assert any(int((b["labels"] != -100).any(dim=1).sum()) < b["labels"].shape[0]
               for b in batches)  # fmt: skip  # the premise: some rows are empty
    model = gpt()
    assert rel_error(engine_grads(model, batches), big_batch_grads(model, examples)) <= 1e-5


def test_the_trainers_cut_under_compile_and_without():
    """`sft_packed.rank_micro_batches`: --compile (fixed_rows) fills window micro-batches to
    one shape per bucket; without it padding-free rows are bucketed, every example once."""
    examples = sft_examples()[:40]
    share = list(range(len(examples)))
    buckets = tuple(bucket_lengths(128))
    compiled = Packing("window", 256, 128, buckets, fixed_rows=True)
    shares, batches = rank_micro_batches(examples, share, compiled, PAD, "shifted")
    assert {tuple(b["input_ids"].shape) for b in batches} <= {(256 // w, w) for w in buckets}
    assert sorted(i for s in shares for i in s) == share
    rowed = Packing("padding-free", 256, 128, row_buckets=buckets)
    shares, batches = rank_micro_batches(examples, share, rowed, PAD, "shifted")
    assert {b["input_ids"].shape[1] for b in batches} <= set(buckets)
    assert sorted(i for s in shares for i in s) == share
    model = gpt()
    assert rel_error(engine_grads(model, batches), big_batch_grads(model, examples)) <= 1e-5
