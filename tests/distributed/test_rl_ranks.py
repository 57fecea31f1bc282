"""The GRPO-family losses on 2 gloo ranks under DDP: the window's P x G completions dealt to
ranks group by group (each prompt's G completions on one rank: rank 0 groups 0 and 2, rank 1
group 1), the counts summed over the ranks by the engine; every loss type's gradient equals
the float64 big batch over the whole window, computed by hand on one process."""

from __future__ import annotations

import pytest

from gradaccum import rl
from gradaccum.testing import run_ranks
from tests.reference import make_gpt, rel_error
from tests.test_rl import MAX_LEN, G, big_batch_by_hand, micro_batches, rl_window

from .ranks import ddp_recording_engine

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module


def _model():
    return make_gpt(seed=1, vocab=37, seq_len=24)


def _mine(rank: int) -> list[dict]:
    """Rank 0: groups 0 and 2 (8 completions, micro-batches of 3: 3 of them); rank 1: group
    1 (4 completions: 2 micro-batches), so the ranks hold unequal counts of everything."""
    rows = rl_window(seed=2)
    groups = [rows[i * G : (i + 1) * G] for i in range(3)]
    return (groups[0] + groups[2]) if rank == 0 else groups[1]


def scenarios(info) -> dict:
    out = {}
    for loss_type in rl.LOSS_TYPES:
        acc, opt = ddp_recording_engine(_model(), count_tokens=rl.counter(loss_type, MAX_LEN))
        loss = rl.PolicyLoss(loss_type, 0.2, 0.28, 0.0, MAX_LEN)
        acc.step(micro_batches(_mine(info.rank), 3), loss)
        out[loss_type] = opt.seen[0]
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(scenarios, 2, timeout_s=120.0)


@pytest.mark.parametrize("loss_type", rl.LOSS_TYPES)
def test_two_ranks_equal_the_big_batch(ranks, loss_type):
    want = big_batch_by_hand(_model(), rl_window(seed=2), loss_type)
    for rank in ranks:
        assert rel_error(rank[loss_type], want) <= 1e-5, loss_type
