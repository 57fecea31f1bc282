"""SFT windows on 2 gloo ranks under DDP: each rank takes its share of the window's examples
(`SFTBatches(rank=, world_size=)`), the engine sums the targets N over the ranks, and the
gradient equals one process's big batch over the whole window, computed here without the
engine or the collate (every example padded into one float64 batch, the loss summed over the
targets / N, one backward).

All scenarios run in one pair of processes (starting them costs seconds).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.data.sft import tokenize_rows
from gradaccum.data.sft_batches import SFTBatches
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
# (window size, micro-batch): 9 examples in pairs leave rank 0 with 3 micro-batches and
# rank 1 with 2; the token budget makes a window of its own length.
SIZES = {
    "examples": {"examples_per_step": 9, "micro_batch": 2},
    "tokens": {"tokens_per_step": 150, "micro_batch": 3},
}
WINDOWS = 2


def sft_examples():
    rows = rows_from_dicts(builtin_rows(seed=7, n=120), "built-in")
    return tokenize_rows(rows, ByteTokenizer(), seq_len=SEQ_LEN, source="built-in").examples


def gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=ByteTokenizer.vocab_size, seq_len=SEQ_LEN, n_layer=2, n_head=2,
                    n_embd=32, dropout=0.0)  # fmt: skip
    return GPT(cfg)


def _rank(info, size: dict, normalize: str) -> dict:
    model = gpt()
    ddp = DistributedDataParallel(model)
    opt = GradRecorder(ddp.parameters())  # records the gradient, leaves the weights
    acc = Accumulator(ddp, opt, normalize=normalize)
    batches = SFTBatches(
        sft_examples(), pad_id=ByteTokenizer.pad_id, seed=1, rank=info.rank,
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


def big_batch_grads(examples) -> list[torch.Tensor]:
    """One process, float64: every example of the window padded into one batch (inputs
    ids[:-1], targets labels[1:]), cross-entropy summed over the targets / their count."""
    model = gpt().double()
    width = max(len(e.input_ids) - 1 for e in examples)
    ids = torch.full((len(examples), width), ByteTokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.input_ids) - 1
        ids[r, :n] = torch.as_tensor(e.input_ids[:-1], dtype=torch.long)
        labels[r, :n] = torch.as_tensor(e.labels[1:], dtype=torch.long)
    logits = model(ids)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )
    (loss_sum / int((labels != -100).sum())).backward()
    return [copy.deepcopy(p.grad) for p in model.parameters()]


def rel_error(got, want) -> float:
    return max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("name", list(SIZES))
def test_each_rank_takes_its_share_and_n_is_summed(ranks, name):
    examples = sft_examples()
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
    examples = sft_examples()
    for step, window in enumerate(ranks[0][name]["windows"]):
        want = big_batch_grads([examples[i] for i in window["indices"]])
        for rank in ranks:
            assert rel_error(rank[name]["grads"][step], want) <= 1e-5


def test_mean_over_k_under_ddp_is_off(ranks):
    examples = sft_examples()
    for step, window in enumerate(ranks[0]["mean_over_k"]["windows"]):
        want = big_batch_grads([examples[i] for i in window["indices"]])
        assert rel_error(ranks[0]["mean_over_k"]["grads"][step], want) >= 1e-2
