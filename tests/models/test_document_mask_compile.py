"""torch.compile of the built-in GPT on padding-free rows: 20 ragged windows of SFT examples
(different counts and lengths, so different numbers of rows) are compiled at most twice, read
from torch's own counter of captured graphs. Backend "eager": Dynamo captures the graphs (what
recompiles) without inductor's code generation, too slow for a CPU test; the count of
captured graphs is the same for any backend. Window micro-batches with length buckets, filled
to budget // width rows, compile at most once per bucket."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from gradaccum import Accumulator
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.data.sft.load import tokenize_rows
from gradaccum.data.sft.packing import bucket_lengths, micro_batches
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.sft.windows import SFTBatches
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss

SEQ_LEN = 64
PAD = ByteTokenizer.pad_id


def windows(count: int):
    rows = rows_from_dicts(builtin_rows(seed=4, n=200), "built-in")
    examples = tokenize_rows(rows, ByteTokenizer(), seq_len=SEQ_LEN, source="built-in").examples
    stream = SFTBatches(examples, micro_batch=1, pad_id=PAD, tokens_per_step=150, seed=0)
    for _ in range(count):
        window = next(stream)
        yield [examples[i] for i in window.indices]


def graphs_compiled(packing: str, count: int, **sizes) -> tuple[int, int, set]:
    """(graphs captured, micro-batches run, their shapes) over `count` windows."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=ByteTokenizer.vocab_size, seq_len=SEQ_LEN, n_layer=1,
                          n_head=2, n_embd=16))  # fmt: skip
    compiled = torch.compile(model, backend="eager", dynamic=False)
    acc = Accumulator(compiled, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32")
    runs, shapes = 0, set()
    for examples in windows(count):
        batches = micro_batches(examples, packing, pad_id=PAD, **sizes)
        acc.step(batches, causal_lm_loss)
        runs += len(batches)
        shapes |= {tuple(b["input_ids"].shape) for b in batches}
    return counters["stats"]["unique_graphs"], runs, shapes


@pytest.mark.slow  # 20 windows
def test_padding_free_rows_compile_at_most_twice_over_20_ragged_windows():
    graphs, runs, shapes = graphs_compiled(
        "padding-free", 20, micro_batch_tokens=2 * SEQ_LEN, row_tokens=SEQ_LEN
    )
    assert runs >= 40 and shapes == {(2, SEQ_LEN)}  # the premise: many micro-batches, one shape
    assert 1 <= graphs <= 2


@pytest.mark.slow  # 20 windows
def test_window_buckets_compile_at_most_once_per_bucket_over_20_ragged_windows():
    """Window micro-batches rounded up to a bucket width and filled to budget // width rows
    by empty rows: one shape per bucket, whatever the windows' lengths and counts."""
    buckets = bucket_lengths(SEQ_LEN)
    graphs, runs, shapes = graphs_compiled(
        "window", 20, micro_batch_tokens=2 * SEQ_LEN, buckets=buckets
    )
    assert runs >= 40 and len(shapes) >= 2  # the premise: many micro-batches, several widths
    assert shapes <= {(2 * SEQ_LEN // w, w) for w in buckets}
    assert 1 <= graphs <= len(buckets) + 1


def test_the_counter_counts_recompiles_of_ragged_micro_batches():
    """The premise of the bound: padded to their own longest, 3 windows already compile once
    per shape seen (up to Dynamo's recompile limit, past which it stops compiling)."""
    graphs, _, shapes = graphs_compiled("none", 3, micro_batch=4)
    assert len(shapes) >= 4
    assert graphs >= min(len(shapes), torch._dynamo.config.recompile_limit) > 2
