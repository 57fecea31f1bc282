"""Each `--packing` mode on 2 gloo ranks under DDP: every rank packs its share of the window
(longest first, dealt round-robin) with `gradaccum.data.sft.packing.micro_batches`, the engine
sums the targets N over the ranks (a rank with fewer micro-batches repeats one with weight
0), and the gradient equals one process's big batch over the whole window, computed without
the packer or the engine (`tests.reference.sft_big_batch_grads`: every example right-padded
into one float64 batch, plain causal attention, the loss summed over the targets / N, one
backward).

All scenarios run in one pair of processes (starting them costs seconds).
"""

from __future__ import annotations

import pytest

from gradaccum.data.sft.packing import PACKINGS, micro_batches
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.loss import causal_lm_loss
from gradaccum.testing import run_ranks
from tests.reference import byte_gpt, rel_error, sft_big_batch_grads, sft_examples

from .ranks import ddp_recording_engine

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

TIMEOUT_S = 120.0
PAD = ByteTokenizer.pad_id
ROWS = {"seed": 7, "n": 60}  # the built-in rows the windows are cut from
WINDOWS = [(0, 13), (13, 40)]  # example positions [start, stop) of each window
SIZES = {
    "none": {"micro_batch": 2},
    "window": {"micro_batch_tokens": 100},
    "padding-free": {"micro_batch_tokens": 128, "row_tokens": 64},
}


def share(window, rank: int, world_size: int):
    order = sorted(window, key=lambda e: (-e.length, e.index))
    return order[rank::world_size]


def _rank(info, packing: str) -> dict:
    acc, opt = ddp_recording_engine(byte_gpt())
    examples = sft_examples(**ROWS)
    counts = []
    for start, stop in WINDOWS:
        mine = share(examples[start:stop], info.rank, info.world_size)
        batches = micro_batches(mine, packing, pad_id=PAD, **SIZES[packing])
        result = acc.step(batches, causal_lm_loss)
        counts.append({"micro_batches": len(batches), "tokens": result.tokens})
    return {"windows": counts, "grads": opt.seen}


def scenarios(info) -> dict:
    return {packing: _rank(info, packing) for packing in PACKINGS}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(scenarios, 2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("packing", PACKINGS)
def test_ddp_packed_gradient_equals_one_process_big_batch(ranks, packing):
    examples = sft_examples(**ROWS)
    for step, (start, stop) in enumerate(WINDOWS):
        window = examples[start:stop]
        n = sum(e.num_targets for e in window)
        assert ranks[0][packing]["windows"][step]["tokens"] == n  # N over both ranks
        want = sft_big_batch_grads(byte_gpt(), window)
        for rank in ranks:
            assert rel_error(rank[packing]["grads"][step], want) <= 1e-5


def test_ranks_hold_unequal_numbers_of_micro_batches(ranks):
    """The premise: in some mode and window one rank runs more micro-batches than the other."""
    pairs = [
        (ranks[0][p]["windows"][s]["micro_batches"], ranks[1][p]["windows"][s]["micro_batches"])
        for p in PACKINGS
        for s in range(len(WINDOWS))
    ]
    assert any(a != b for a, b in pairs)
