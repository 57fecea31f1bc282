"""Each `--packing` mode on 2 gloo ranks under DDP: every rank packs its share of the window
(longest first, dealt round-robin) with `gradaccum.data.packing.micro_batches`, the engine
sums the targets N over the ranks (a rank with fewer micro-batches repeats one with weight
0), and the gradient equals one process's big batch over the whole window, computed here
without the packer or the engine (every example right-padded into one float64 batch, plain
causal attention, the loss summed over the targets / N, one backward).

All scenarios run in one pair of processes (starting them costs seconds).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.data.packing import PACKINGS, micro_batches
from gradaccum.data.sft import tokenize_rows
from gradaccum.data.sft_rows import rows_from_dicts
from gradaccum.data.sft_tasks import builtin_rows
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.testing import run_ranks
from gradaccum.verification.reference import GradRecorder

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

SEQ_LEN = 128
TIMEOUT_S = 120.0
PAD = ByteTokenizer.pad_id
WINDOWS = [(0, 13), (13, 40)]  # example positions [start, stop) of each window
SIZES = {
    "none": {"micro_batch": 2},
    "window": {"micro_batch_tokens": 100},
    "padding-free": {"micro_batch_tokens": 128, "row_tokens": 64},
}


def sft_examples():
    rows = rows_from_dicts(builtin_rows(seed=7, n=60), "built-in")
    return tokenize_rows(rows, ByteTokenizer(), seq_len=SEQ_LEN, source="built-in").examples


def gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=ByteTokenizer.vocab_size, seq_len=SEQ_LEN, n_layer=2, n_head=2,
                    n_embd=32, dropout=0.0)  # fmt: skip
    return GPT(cfg)


def share(window, rank: int, world_size: int):
    order = sorted(window, key=lambda e: (-e.length, e.index))
    return order[rank::world_size]


def _rank(info, packing: str) -> dict:
    ddp = DistributedDataParallel(gpt())
    opt = GradRecorder(ddp.parameters())  # records the gradient, leaves the weights
    acc = Accumulator(ddp, opt)
    examples = sft_examples()
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


def big_batch_grads(examples) -> list[torch.Tensor]:
    model = gpt().double()
    width = max(e.length - 1 for e in examples)
    ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, e in enumerate(examples):
        ids[r, : e.length - 1] = torch.as_tensor(e.input_ids[:-1], dtype=torch.long)
        labels[r, : e.length - 1] = torch.as_tensor(e.labels[1:], dtype=torch.long)
    logits = model(ids)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    (loss_sum / int((labels != -100).sum())).backward()
    return [copy.deepcopy(p.grad) for p in model.parameters()]


def rel_error(got, want) -> float:
    return max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("packing", PACKINGS)
def test_ddp_packed_gradient_equals_one_process_big_batch(ranks, packing):
    examples = sft_examples()
    for step, (start, stop) in enumerate(WINDOWS):
        window = examples[start:stop]
        n = sum(e.num_targets for e in window)
        assert ranks[0][packing]["windows"][step]["tokens"] == n  # N over both ranks
        want = big_batch_grads(window)
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
