"""Windows of SFT examples: the same windows whatever the micro-batch and the number of ranks,
ranks disjoint and covering each window, budgets kept, resumable, and a held-out split that is
never trained on."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum.data.sft.examples import make_example
from gradaccum.data.sft.windows import SFTBatches, split_heldout, split_window
from gradaccum.utils.errors import BadInput


def toy_examples(lengths, targets=None):
    """Examples whose ids are (index, position) codes, `targets[i]` targets at the end of
    example i (default: half its length, at least 1)."""
    out = []
    for i, n in enumerate(lengths):
        k = targets[i] if targets is not None else max(1, n // 2)
        ids = [1000 * i + t for t in range(n)]
        labels = [-100] * (n - k) + ids[n - k :]
        out.append(make_example(ids, labels, index=i))
    return out


def windows(examples, count, **kw):
    batches = SFTBatches(examples, pad_id=-1, **kw)
    return [next(batches) for _ in range(count)]


def all_ranks(examples, count, world_size, **kw):
    """Per window, the Window of every rank."""
    per_rank = [
        windows(examples, count, rank=r, world_size=world_size, **kw) for r in range(world_size)
    ]
    return list(zip(*per_rank, strict=True))


def example_of(batch, row):
    """Which example a micro-batch row holds (the ids encode it), or None for padding-only."""
    first = int(batch["input_ids"][row, 0])
    return first // 1000


lengths_st = st.lists(st.integers(2, 40), min_size=1, max_size=30)


@st.composite
def setups(draw):
    lengths = draw(lengths_st)
    n = len(lengths)
    if draw(st.booleans()):
        size = {"examples_per_step": draw(st.integers(1, n))}
    else:
        total = sum(max(1, x // 2) for x in lengths)
        size = {"tokens_per_step": draw(st.integers(1, total)), "budget": "targets"}
    return lengths, size, draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(setups())
def test_windows_do_not_depend_on_micro_batch_or_ranks(setup):
    lengths, size, micro_batch, world_size, seed = setup
    examples = toy_examples(lengths)
    one = windows(examples, 6, micro_batch=1, seed=seed, **size)
    split = all_ranks(examples, 6, world_size, micro_batch=micro_batch, seed=seed, **size)
    for ref, group in zip(one, split, strict=True):
        assert all(w.indices == ref.indices for w in group)
        assert all(
            (w.targets, w.tokens, w.epoch) == (ref.targets, ref.tokens, ref.epoch) for w in group
        )
        # the ranks' shares are disjoint and cover the window (as a multiset: a window that
        # straddles two epochs may hold an example twice)
        shares = [i for w in group for mb in w.shares for i in mb]
        assert Counter(shares) == Counter(ref.indices)
        sizes = [sum(len(mb) for mb in w.shares) for w in group]
        assert max(sizes) - min(sizes) <= 1
        for w in group:
            assert all(len(mb) <= micro_batch for mb in w.shares)
            if not w.shares:  # no example for this rank: one stand-in batch with no target
                assert len(w.micro_batches) == 1
                continue
            # the micro-batches hold those examples, and their targets add up to N
            for mb, batch in zip(w.shares, w.micro_batches, strict=True):
                assert [example_of(batch, r) for r in range(len(mb))] == mb
        counted = sum(int((b["labels"] != -100).sum()) for w in group for b in w.micro_batches)
        assert counted == ref.targets == sum(examples[i].num_targets for i in ref.indices)


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(0, 3))
def test_each_epoch_is_a_permutation(lengths, seed):
    examples = toy_examples(lengths)
    n = len(examples)
    stream = [
        i
        for w in windows(examples, 3 * n, micro_batch=2, examples_per_step=1, seed=seed)
        for i in w.indices
    ]
    for e in range(3):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    w = windows(examples, n + 1, micro_batch=1, examples_per_step=1, seed=seed)
    assert [x.epoch for x in w] == [0] * n + [1]


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(1, 60), st.sampled_from(["targets", "tokens"]))
def test_token_budget_fills_with_whole_examples(lengths, budget_size, budget):
    examples = toy_examples(lengths)
    counts = [e.num_targets if budget == "targets" else e.length for e in examples]
    if budget_size > sum(counts):
        return
    ws = windows(examples, 8, micro_batch=3, tokens_per_step=budget_size, budget=budget)
    for w, after in zip(ws, ws[1:], strict=False):
        total = sum(counts[i] for i in w.indices)
        assert total <= budget_size or len(w.indices) == 1
        assert total + counts[after.indices[0]] > budget_size  # the next one would not fit
        assert w.tokens == sum(lengths[i] for i in w.indices)


def test_different_seeds_give_different_orders():
    examples = toy_examples([5] * 20)
    a = windows(examples, 1, micro_batch=4, examples_per_step=20, seed=0)[0].indices
    b = windows(examples, 1, micro_batch=4, examples_per_step=20, seed=1)[0].indices
    assert sorted(a) == sorted(b) == list(range(20)) and a != b


def test_micro_batches_sorted_longest_first_for_less_padding():
    lengths = [3, 30, 4, 29, 5, 28, 6, 27]
    examples = toy_examples(lengths)
    w = windows(examples, 1, micro_batch=2, examples_per_step=8)[0]
    assert [[lengths[i] for i in mb] for mb in w.shares] == [[30, 29], [28, 27], [6, 5], [4, 3]]
    assert w.padded_tokens == 2 * (29 + 27 + 5 + 3)  # shifted layout: length - 1 per row
    unsorted = SFTBatches(
        examples, micro_batch=2, pad_id=0, examples_per_step=8, sort_by_length=False
    )
    assert next(unsorted).padded_tokens > w.padded_tokens


def test_split_window_by_hand():
    lengths = [10, 50, 20, 40, 30]
    # sorted: 1 (50), 3 (40), 4 (30), 2 (20), 0 (10); dealt to 2 ranks; runs of 2
    assert split_window([0, 1, 2, 3, 4], lengths, 2, 2) == [[[1, 4], [0]], [[3, 2]]]
    assert split_window([0, 1, 2, 3, 4], lengths, 2, 2, sort_by_length=False) == [
        [[0, 2], [4]],
        [[1, 3]],
    ]


def test_a_rank_without_examples_gets_a_batch_with_no_target():
    examples = toy_examples([6, 8, 10])
    group = all_ranks(examples, 1, 4, micro_batch=1, examples_per_step=3)[0]
    empty = [w for w in group if not w.shares]
    assert len(empty) == 1 and len(empty[0].micro_batches) == 1
    assert int((empty[0].micro_batches[0]["labels"] != -100).sum()) == 0
    assert empty[0].targets == sum(e.num_targets for e in examples)


@pytest.mark.parametrize("size", [{"examples_per_step": 5}, {"tokens_per_step": 17}])
def test_state_round_trip_across_layouts(size):
    examples = toy_examples(list(range(2, 25)))
    first = SFTBatches(examples, micro_batch=2, pad_id=0, seed=7, **size)
    for _ in range(15):  # past the first epoch
        next(first)
    state = first.state_dict()
    assert state["epoch"] == first.epoch >= 1 and state["windows"] == 15
    want = [next(first) for _ in range(4)]
    for micro_batch, world_size in ((2, 1), (1, 3)):
        for rank in range(world_size):
            again = SFTBatches(
                examples,
                micro_batch=micro_batch,
                pad_id=0,
                seed=7,
                rank=rank,
                world_size=world_size,
                **size,
            )
            again.load_state_dict(state)
            got = [next(again) for _ in range(4)]
            assert [w.indices for w in got] == [w.indices for w in want]
            if (micro_batch, world_size) == (2, 1):
                for a, b in zip(got, want, strict=True):
                    for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
                        assert all(x[k].equal(y[k]) for k in x)


def test_resume_refuses_other_data_or_seed():
    examples = toy_examples([4] * 10)
    state = SFTBatches(examples, micro_batch=1, pad_id=0, examples_per_step=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed was 1, now 2"):
        SFTBatches(examples, micro_batch=1, pad_id=0, examples_per_step=2, seed=2).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match="num_examples was 10, now 9"):
        SFTBatches(
            examples[:9], micro_batch=1, pad_id=0, examples_per_step=2, seed=1
        ).load_state_dict(state)


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"micro_batch": 0, "examples_per_step": 2}, "--micro-batch 0: must be >= 1"),
        ({"micro_batch": 1}, "give exactly one"),
        ({"micro_batch": 1, "examples_per_step": 2, "tokens_per_step": 9}, "give exactly one"),
        ({"micro_batch": 1, "examples_per_step": 11}, "--examples-per-step 11: must be in [1, 10]"),
        ({"micro_batch": 1, "tokens_per_step": 0}, "--tokens-per-step 0: must be >= 1"),
        (
            {"micro_batch": 1, "tokens_per_step": 21},
            "--tokens-per-step 21: the 10 training examples hold 20 targets",
        ),
    ],
)
def test_bad_sizes_are_one_line(kw, why):
    with pytest.raises(BadInput) as err:
        SFTBatches(toy_examples([4] * 10), pad_id=0, **kw)
    assert why in str(err.value)
    assert "\n" not in str(err.value)


# ---- the held-out split -------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 200), st.one_of(st.floats(0.01, 0.5), st.integers(1, 5)), st.integers(0, 5))
def test_heldout_split_sizes_and_disjointness(n, heldout, seed):
    examples = toy_examples([4] * n)
    if isinstance(heldout, int) and heldout >= n:
        return
    train, held = split_heldout(examples, heldout, seed)
    expected = heldout if isinstance(heldout, int) else max(1, round(heldout * n))
    assert len(held) == expected and len(train) == n - expected
    assert {e.index for e in train}.isdisjoint({e.index for e in held})
    assert sorted(e.index for e in train + held) == list(range(n))
    assert [e.index for e in train] == sorted(e.index for e in train)  # order kept
    assert [e.index for e in split_heldout(examples, heldout, seed)[1]] == [e.index for e in held]


def test_heldout_examples_are_never_trained_on():
    examples = toy_examples([3 + i % 17 for i in range(60)])
    train, held = split_heldout(examples, 0.2, seed=3)
    held_rows = {e.index for e in held}
    seen = set()
    for world_size in (1, 2):
        for rank in range(world_size):
            batches = SFTBatches(
                train,
                micro_batch=3,
                pad_id=0,
                examples_per_step=7,
                rank=rank,
                world_size=world_size,
            )
            for _ in range(30):  # several epochs
                w = next(batches)
                for mb, batch in zip(w.shares, w.micro_batches, strict=True):
                    seen.update(train[i].index for i in mb)
                    seen.update(example_of(batch, r) for r in range(len(mb)))
    assert seen == {e.index for e in train} and not seen & held_rows


@pytest.mark.parametrize(
    "heldout, why",
    [(1.0, "must be in [0, 1)"), (-1, "must be >= 0"), (10, "none left to train on")],
)
def test_bad_heldout(heldout, why):
    with pytest.raises(BadInput) as err:
        split_heldout(toy_examples([4] * 10), heldout)
    assert str(err.value).startswith(f"--val-fraction {heldout}: ") and why in str(err.value)


def test_no_heldout():
    examples = toy_examples([4] * 5)
    assert split_heldout(examples, 0.0) == (examples, [])
    assert np.array_equal(split_heldout(examples, 0)[0][0].input_ids, examples[0].input_ids)
