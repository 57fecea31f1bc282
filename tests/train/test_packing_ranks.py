"""The trainer's packed windows over ranks: examples dealt by tokens (a hand-worked case), every
rank's share together the whole window, and the ranks' summed gradient (what DDP adds) equal
to a float64 computation of each example alone; --packing bad input in one line."""

import pytest
import torch
import torch.nn.functional as F

from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.data.sft.load import tokenize_rows
from gradaccum.data.sft.packed import deal_by_tokens
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.train.config import TrainConfig
from gradaccum.train.sft import SFTStream

from .helpers import one_line_error

SEQ_LEN = 64


def test_deal_by_tokens_by_hand():
    # longest first to the lighter rank: 10 -> r0, 9 -> r1, 8 -> r1 (9 < 10), 3 -> r0
    # (10 < 17), 2 -> r0 (13 < 17), 1 -> r0 (15 < 17): loads 16 and 17, where round-robin
    # gives 10 + 8 + 2 = 20 and 9 + 3 + 1 = 13
    lengths = {0: 3, 1: 10, 2: 1, 3: 8, 4: 9, 5: 2}
    assert deal_by_tokens([0, 1, 2, 3, 4, 5], lengths, 2) == [[1, 0, 5, 2], [4, 3]]
    assert deal_by_tokens([4, 2], lengths, 3) == [[4], [2], []]


def _examples():
    rows = rows_from_dicts(builtin_rows(seed=5, n=80), "built-in")
    return tokenize_rows(rows, ByteTokenizer(), seq_len=SEQ_LEN, source="built-in").examples


def _gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=ByteTokenizer.vocab_size, seq_len=SEQ_LEN, n_layer=2, n_head=2,
                    n_embd=32, dropout=0.0)  # fmt: skip
    return GPT(cfg)


@pytest.mark.parametrize("mode", ["window", "padding-free"])
def test_two_ranks_shares_sum_to_the_float64_big_batch(mode):
    examples = _examples()
    config = TrainConfig(task="sft", seq_len=SEQ_LEN, examples_per_step=13, packing=mode,
                         micro_batch_tokens=2 * SEQ_LEN)  # fmt: skip
    streams = [SFTStream(config, examples, ByteTokenizer.pad_id, 2, r, 2) for r in range(2)]
    windows = [next(s) for s in streams]
    assert windows[0].indices == windows[1].indices
    shares = [[i for mb in w.shares for i in mb] for w in windows]
    assert sorted(shares[0] + shares[1]) == sorted(windows[0].indices)
    loads = [sum(examples[i].length for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(examples[i].length for i in windows[0].indices)
    for w in windows:
        assert all(b["input_ids"].numel() <= 2 * SEQ_LEN for b in w.micro_batches)
    # what DDP sums: each rank's micro-batch loss sums, over N, one backward
    model = _gpt()
    total = sum(causal_lm_loss(model, b)[0] for w in windows for b in w.micro_batches)
    n = windows[0].targets
    (total / n).backward()
    got = [p.grad.clone() for p in model.parameters()]
    ref = _gpt().double()
    want_total = 0
    for i in windows[0].indices:  # each example alone, float64
        e = examples[i]
        ids = torch.as_tensor(e.input_ids[:-1], dtype=torch.long)[None]
        labels = torch.as_tensor(e.labels[1:], dtype=torch.long)
        want_total = want_total + F.cross_entropy(ref(ids)[0], labels, reduction="sum")
    (want_total / n).backward()
    for g, p in zip(got, ref.parameters(), strict=True):
        assert float((g.double() - p.grad).norm() / p.grad.norm()) <= 1e-5
    assert n == sum(examples[i].num_targets for i in windows[0].indices)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--micro-batch-tokens", "256"], "--micro-batch-tokens 256: only with --task sft"),
        (["--packing", "window"], "--packing window: only with --task sft"),
        (
            ["--task", "sft", "--packing", "none", "--micro-batch-tokens", "256"],
            "--micro-batch-tokens 256: needs --packing window or padding-free",
        ),
        (
            ["--task", "sft", "--micro-batch-tokens", "64"],
            "--micro-batch-tokens 64: below --seq-len 128: a padding-free row (the default",
        ),
        (["--task", "sft", "--packing", "rows"], "--packing rows: choose one of none, window"),
    ],
)
def test_bad_packing_flags_one_line_exit_2(capsys, tmp_path, argv, words):
    line = one_line_error(capsys, ["train", *argv, "--out", str(tmp_path / "run")])
    assert words in line
    assert not (tmp_path / "run").exists()
