"""Examples longer than seq_len: cut from the completion's end, or dropped; the counts and the
length distribution the start-of-run print gives."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradaccum.data.sft.load import load_sft, quantiles
from gradaccum.data.sft.rows import alpaca_prompt
from gradaccum.utils.errors import BadInput


def rows_of(prompt_lens, completion_lens):
    return [
        {"prompt": "p" * p, "completion": "c" * c}
        for p, c in zip(prompt_lens, completion_lens, strict=True)
    ]


def test_truncated_from_the_completions_end(write_jsonl, byte_tok):
    # byte tokens: prompt p, completion c + EOS
    prompt_lens, completion_lens, seq_len = [3, 5, 8, 12, 2], [4, 6, 1, 3, 20], 10
    data = load_sft(write_jsonl(rows_of(prompt_lens, completion_lens)), byte_tok, seq_len=seq_len)
    totals = [
        p + c + 1 for p, c in zip(prompt_lens, completion_lens, strict=True)
    ]  # 8, 12, 10, 16, 23
    assert data.truncated == 2  # 12 and 23 cut; 16 has a 12-token prompt: no target left
    assert data.dropped_no_target == 1 and data.dropped_long == 0
    assert [e.index for e in data.examples] == [0, 1, 2, 4]
    for ex in data.examples:
        p, c = prompt_lens[ex.index], completion_lens[ex.index]
        full = list(b"p" * p + b"c" * c) + [256]
        labels = [-100] * p + full[p:]
        assert ex.input_ids.tolist() == full[:seq_len]
        assert ex.labels.tolist() == labels[:seq_len]
        assert ex.truncated == (totals[ex.index] > seq_len)


def test_drop_long(write_jsonl, byte_tok):
    data = load_sft(
        write_jsonl(rows_of([3, 5, 8, 12, 2], [4, 6, 1, 3, 20])),
        byte_tok,
        seq_len=10,
        drop_long=True,
    )
    assert (data.truncated, data.dropped_long, data.dropped_no_target) == (0, 3, 0)
    assert [e.index for e in data.examples] == [0, 2]
    assert "0 truncated, 3 dropped" in " ".join(data.summary_lines())


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=300))
def test_quantiles_are_nearest_rank(values):
    q = quantiles(values)
    ref = [int(np.percentile(values, p, method="inverted_cdf")) for p in (50, 90, 99)]
    assert [q.median, q.p90, q.p99, q.max] == ref + [max(values)]


def test_length_summary_from_the_rows(write_jsonl, byte_tok):
    rng = np.random.default_rng(3)
    prompt_lens = rng.integers(1, 40, 200).tolist()
    completion_lens = rng.integers(1, 30, 200).tolist()
    data = load_sft(write_jsonl(rows_of(prompt_lens, completion_lens)), byte_tok, seq_len=128)
    s = data.lengths()
    tokens = [p + c + 1 for p, c in zip(prompt_lens, completion_lens, strict=True)]
    targets = [c + 1 for c in completion_lens]
    for q, values in ((s.tokens, tokens), (s.targets, targets)):
        assert q.max == max(values)
        assert q.median == int(np.percentile(values, 50, method="inverted_cdf"))
        assert q.p99 == int(np.percentile(values, 99, method="inverted_cdf"))
    assert s.examples == 200 and data.to_dict()["lengths"]["targets"]["max"] == max(targets)
    lines = data.summary_lines()
    assert f"targets per example: median {s.targets.median}, p90 {s.targets.p90}" in lines[-1]


@pytest.mark.parametrize("seq_len", [2, 3])
def test_shortest_seq_len(write_jsonl, byte_tok, seq_len):
    data = load_sft(write_jsonl(rows_of([1], [5])), byte_tok, seq_len=seq_len)
    assert data.examples[0].input_ids.tolist() == list(b"pccccc")[:seq_len]
    assert data.examples[0].num_targets == seq_len - 1


@pytest.mark.parametrize("drop_long", [False, True])
def test_prompts_alone_longer_than_seq_len_say_so_and_the_seq_len_that_keeps_them(
    write_jsonl, byte_tok, drop_long
):
    """Before: "no example left to train on (0 bad rows skipped, 3 longer than --seq-len 128
    dropped)", not saying the Alpaca template's prompt alone is longer than that."""
    instructions = ["Sort the letters.", "Reverse the word.", "Count the vowels in the word."]
    rows = [{"instruction": i, "input": "", "output": "ok"} for i in instructions]
    # byte tokens: the prompt is the template's bytes, the completion "ok" + EOS
    prompts = sorted(len(alpaca_prompt(i).encode()) for i in instructions)
    assert prompts[0] > 128
    keeps = prompts[-1] + 3 if drop_long else prompts[-1] + 1
    with pytest.raises(BadInput) as err:
        load_sft(write_jsonl(rows), byte_tok, seq_len=128, drop_long=drop_long)
    assert str(err.value).endswith(
        "the Alpaca template's prompt alone is longer than --seq-len 128 in all 3 examples "
        f"(median {prompts[1]}, max {prompts[-1]} tokens); --seq-len {keeps} or more keeps them"
    )
    data = load_sft(write_jsonl(rows, name="b.jsonl"), byte_tok, seq_len=keeps)
    assert len(data.examples) == 3  # every one kept (the longest cut to one target)
