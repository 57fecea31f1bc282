"""SFT windows on 2 gloo ranks under DDP: each rank takes its share of the window's examples
(`SFTBatches(rank=, world_size=)`), the engine sums the targets N over the ranks, and the
gradient equals one process's big batch over the whole window, computed without the engine
or the collate (`tests.reference.sft_big_batch_grads`: every example padded into one float64
batch, the loss summed over the targets / N, one backward).

All scenarios run in one pair of processes (starting them costs seconds).
"""

from __future__ import annotations

import pytest

from gradaccum.data.sft.windows import SFTBatches
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.loss import causal_lm_loss
from gradaccum.testing import run_ranks
from tests.reference import byte_gpt, rel_error, sft_big_batch_grads, sft_examples

from .ranks import ddp_recording_engine

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

TIMEOUT_S = 120.0
# (window size, micro-batch): 9 examples in pairs leave rank 0 with 3 micro-batches and
# rank 1 with 2; the token budget makes a window of its own length.
SIZES = {
    "examples": {"examples_per_step": 9, "micro_batch": 2},
    "tokens": {"tokens_per_step": 150, "micro_batch": 3},
}
WINDOWS = 2
ROWS = {"seed": 7, "n": 120}  # the built-in rows the windows are drawn from


def _rank(info, size: dict, normalize: str) -> dict:
    acc, opt = ddp_recording_engine(byte_gpt(), normalize=normalize)
    batches = SFTBatches(
        sft_examples(**ROWS), pad_id=ByteTokenizer.pad_id, seed=1, rank=info.rank,
        world_size=info.world_size, **size,
    )  # fmt: skip
    out = []
    for _ in range(WINDOWS):
        window = next(batches)
        result = acc.step(window.micro_batches, causal_lm_loss)
        out.append(
            {
                "indices": window.indices,
                "shares": window.shares,
                "targets": window.targets,
                "micro_batches": len(window.micro_batches),
                "tokens": result.tokens,
            }
        )
    return {"windows": out, "grads": opt.seen}


def scenarios(info) -> dict:
    out = {name: _rank(info, size, "tokens") for name, size in SIZES.items()}
    out["mean_over_k"] = _rank(info, SIZES["examples"], "micro_batch_mean")
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(scenarios, 2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("name", list(SIZES))
def test_each_rank_takes_its_share_and_n_is_summed(ranks, name):
    examples = sft_examples(**ROWS)
    for w0, w1 in zip(ranks[0][name]["windows"], ranks[1][name]["windows"], strict=True):
        assert w0["indices"] == w1["indices"]  # one window, seen alike by both ranks
        mine = [i for share in w0["shares"] for i in share]
        theirs = [i for share in w1["shares"] for i in share]
        assert sorted(mine + theirs) == sorted(w0["indices"]) and not set(mine) & set(theirs)
        n = sum(examples[i].num_targets for i in w0["indices"])
        assert w0["tokens"] == w1["tokens"] == w0["targets"] == n  # N over both ranks
        own = [sum(examples[i].num_targets for i in s) for s in (mine, theirs)]
        assert own[0] != own[1]  # the ranks hold different numbers of targets


def test_ranks_hold_unequal_numbers_of_micro_batches(ranks):
    first = [r["examples"]["windows"][0]["micro_batches"] for r in ranks]
    assert first == [3, 2]


@pytest.mark.parametrize("name", list(SIZES))
def test_ddp_gradient_equals_one_process_big_batch(ranks, name):
    examples = sft_examples(**ROWS)
    for step, window in enumerate(ranks[0][name]["windows"]):
        want = sft_big_batch_grads(byte_gpt(), [examples[i] for i in window["indices"]])
        for rank in ranks:
            assert rel_error(rank[name]["grads"][step], want) <= 1e-5


def test_mean_over_k_under_ddp_is_off(ranks):
    examples = sft_examples(**ROWS)
    for step, window in enumerate(ranks[0]["mean_over_k"]["windows"]):
        want = sft_big_batch_grads(byte_gpt(), [examples[i] for i in window["indices"]])
        assert rel_error(ranks[0]["mean_over_k"]["grads"][step], want) >= 1e-2
