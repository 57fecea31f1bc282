"""A window's examples in each `--packing` mode (`gradaccum.data.sft.packing`) through the engine:
the gradient equals one big batch over the same examples, computed without the packer or the
engine (`tests.reference.sft_big_batch_grads`: every example right-padded into one float64
batch, plain causal attention, the loss summed over the targets / N, one backward); the
micro-batches themselves checked against hand-derived layouts."""

from __future__ import annotations

import pytest
import torch

from gradaccum.data.sft.examples import make_example
from gradaccum.data.sft.packing import (
    PACKINGS,
    bucket_lengths,
    collate_packed,
    collate_window,
    document_positions,
    micro_batches,
    pack_rows,
    window_micro_batches,
)
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.utils.errors import BadInput
from tests.reference import byte_gpt as gpt  # the short names test_packing_buckets imports
from tests.reference import engine_grads, rel_error, sft_examples
from tests.reference import sft_big_batch_grads as big_batch_grads

PAD = ByteTokenizer.pad_id

MODES = {
    "none": {"micro_batch": 5},
    "window": {"micro_batch_tokens": 160},
    "padding-free": {"micro_batch_tokens": 128, "row_tokens": 64},
}


@pytest.mark.parametrize("packing", PACKINGS)
def test_each_mode_window_gradient_equals_the_big_batch(packing):
    examples = sft_examples()[:24]
    batches = micro_batches(examples, packing, pad_id=PAD, **MODES[packing])
    # the premise: several micro-batches holding every target once
    assert len(batches) >= 3
    assert sum(int((b["labels"] != -100).sum()) for b in batches) == sum(
        e.num_targets for e in examples
    )
    if packing == "padding-free":
        assert len({tuple(b["input_ids"].shape) for b in batches}) == 1
        assert int(batches[0]["document_ids"].max()) >= 2  # rows do hold several examples
    model = gpt()
    want = big_batch_grads(model, examples)
    assert rel_error(engine_grads(model, batches), want) <= 1e-5


def test_window_groups_respect_the_budget_longest_first():
    lengths = [9, 4, 12, 4, 7, 30, 2, 5]
    examples = [make_example(list(range(2, n + 2)), [5] * n, i) for i, n in enumerate(lengths)]
    groups = window_micro_batches(examples, 24, PAD, layout="unshifted")
    # longest first; hand-derived: 30 alone (over budget), 12+9 (2x12), 7+5+4 (3x7), 4+2
    assert groups == [[5], [2, 0], [4, 7, 1], [3, 6]]
    batches = collate_window(examples, groups, PAD, layout="unshifted", buckets=[8, 16, 32])
    assert [tuple(b["input_ids"].shape) for b in batches] == [(1, 32), (2, 16), (3, 8), (2, 8)]
    assert batches[2]["attention_mask"].sum() == 7 + 5 + 4
    assert int((batches[1]["labels"] != -100).sum()) == 11 + 8


def test_with_buckets_the_budget_counts_the_bucket_width():
    examples = [make_example(list(range(2, n + 2)), [5] * n, i) for i, n in enumerate([9, 9, 9])]
    assert window_micro_batches(examples, 20, PAD, "unshifted") == [[0, 1], [2]]
    assert window_micro_batches(examples, 20, PAD, "unshifted", buckets=[16]) == [[0], [1], [2]]


def test_bucket_lengths():
    assert bucket_lengths(100) == [13, 25, 50, 100]
    assert bucket_lengths(3, 4) == [1, 2, 3]


def test_pack_rows_first_fit_decreasing_within_the_row():
    lengths = [5, 3, 7, 2, 4, 6]
    examples = [make_example(list(range(2, n + 2)), [5] * n, i) for i, n in enumerate(lengths)]
    # hand-derived first-fit decreasing into rows of 9: 7+2 | 6+3 | 5+4
    assert pack_rows(examples, 9) == [[2, 3], [5, 1], [0, 4]]
    # shifted layout: one position fewer each (6+3 | 5+4 | 2+1)
    assert pack_rows(examples, 9, layout="shifted") == [[2, 4], [5, 0], [1, 3]]
    with pytest.raises(BadInput, match="--micro-batch-tokens 6"):
        pack_rows(examples, 6)


@pytest.mark.parametrize("layout", ["shifted", "unshifted"])
def test_collate_packed_layout_by_hand(layout):
    a = make_example([10, 11, 12, 13], [-100, -100, 12, 13], 0)
    b = make_example([20, 21, 22], [-100, 21, 22], 1)
    out = collate_packed([a, b], [[0, 1]], 8, pad_id=0, layout=layout, num_rows=2)
    if layout == "shifted":  # inputs ids[:-1], labels labels[1:]
        want_ids = [10, 11, 12, 20, 21, 0, 0, 0]
        want_labels = [-100, 12, 13, 21, 22, -100, -100, -100]
        want_pos, want_doc = [0, 1, 2, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, -1, -1, -1]
    else:  # unshifted; the first label of b is -100, so a's last token predicts nothing
        want_ids = [10, 11, 12, 13, 20, 21, 22, 0]
        want_labels = [-100, -100, 12, 13, -100, 21, 22, -100]
        want_pos, want_doc = [0, 1, 2, 3, 0, 1, 2, 0], [0, 0, 0, 0, 1, 1, 1, -1]
    assert out["input_ids"].tolist() == [want_ids, [0] * 8]
    assert out["labels"].tolist() == [want_labels, [-100] * 8]
    assert out["position_ids"].tolist() == [want_pos, [0] * 8]
    assert out["document_ids"].tolist() == [want_doc, [-1] * 8]
    assert all(v.dtype == torch.int64 for v in out.values())


def test_rows_packed_shifted_overflow_unshifted_is_refused():
    examples = [make_example([2, 3, 4], [-100, 3, 4], i) for i in range(2)]
    rows = pack_rows(examples, 4, layout="shifted")
    assert rows == [[0, 1]]
    with pytest.raises(ValueError, match="row_tokens 4"):
        collate_packed(examples, rows, 4, 0, layout="unshifted")


def test_padding_free_micro_batches_have_one_shape():
    examples = sft_examples(seed=1)[:30]
    # rows of 128 // 2 tokens (the default row: budget / micro_batch), 2 per micro-batch
    batches = micro_batches(examples, "padding-free", micro_batch=2, micro_batch_tokens=128,
                            pad_id=PAD)  # fmt: skip
    rows = pack_rows(examples, 64, layout="shifted")
    assert len(rows) % 2 == 1  # the premise: the last micro-batch is not full
    assert {tuple(b["input_ids"].shape) for b in batches} == {(2, 64)}
    assert len(batches) == -(-len(rows) // 2)
    filled = len(rows) - 2 * (len(batches) - 1)  # rows of the last micro-batch; empty ones after
    assert (batches[-1]["document_ids"][filled:] == -1).all()
    assert (batches[-1]["labels"][filled:] == -100).all()


def test_micro_batches_bad_input():
    examples = sft_examples()[:4]
    with pytest.raises(BadInput, match="--packing pack"):
        micro_batches(examples, "pack", pad_id=PAD, micro_batch=2)
    with pytest.raises(BadInput, match="--micro-batch-tokens None"):
        micro_batches(examples, "window", pad_id=PAD)
    with pytest.raises(BadInput, match="--micro-batch 0"):
        micro_batches(examples, "none", pad_id=PAD, micro_batch=0)
    assert micro_batches([], "window", pad_id=PAD, micro_batch_tokens=64) == []


def test_document_positions_of_a_token_stream():
    eod = 9
    ids = torch.tensor([[5, 6, 9, 7, 8, 9, 9, 1], [1, 2, 3, 4, 5, 6, 7, 8]])
    positions, documents = document_positions(ids, eod)
    # an EOD opens the next document; the row's first tokens are document 0
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [0] * 8]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], list(range(8))]
    one_pos, one_doc = document_positions(ids[0], eod)
    assert one_pos.tolist() == positions[0].tolist() and one_doc.shape == (8,)
