"""The built-in instruction set: answers right by a computation of the test's own, the checker
telling right from wrong, prompts distinct, and the long-tailed lengths its docstring states."""

import re
from collections import Counter

import numpy as np
import pytest

import gradaccum.data.sft.builtin as tasks
from gradaccum.data.sft.load import tokenize_rows
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.tokenizers import ByteTokenizer


@pytest.fixture(scope="module")
def rows():
    return tasks.builtin_rows(seed=0)


def answer(prompt: str) -> str:
    """The answer, computed differently from the module: by regular expressions and loops."""
    m = re.fullmatch(r"reverse: ([a-f]+)\n", prompt)
    if m:
        s = m.group(1)
        return "".join(s[i] for i in range(len(s) - 1, -1, -1))
    m = re.fullmatch(r"sort: ([a-f]+)\n", prompt)
    if m:
        counts = Counter(m.group(1))
        return "".join(letter * counts[letter] for letter in "abcdef")
    m = re.fullmatch(r"add: (\d+)\+(\d+)\n", prompt)
    if m:
        return str(int(m.group(1)) + int(m.group(2)))
    m = re.fullmatch(r"count ([abc]): ([abc]+)\n", prompt)
    if m:
        return str(sum(1 for ch in m.group(2) if ch == m.group(1)))
    raise AssertionError(f"unexpected prompt {prompt!r}")


def test_answers_are_right_and_the_checker_knows(rows):
    for row in rows:
        assert row["completion"] == answer(row["prompt"])
        assert tasks.check(row["prompt"], row["completion"])
        wrong = (
            row["completion"] + "a"
            if row["task"] in ("reverse", "sort")
            else row["completion"] + "1"
        )
        assert not tasks.check(row["prompt"], wrong)
        assert not tasks.check(row["prompt"], "")


def test_unknown_prompt_is_refused():
    with pytest.raises(ValueError, match="not a built-in task prompt"):
        tasks.solve("translate: hello\n")


def test_seeded_distinct_and_mixed(rows):
    assert rows == tasks.builtin_rows(seed=0)
    assert tasks.builtin_rows(seed=1, n=200) != tasks.builtin_rows(seed=0, n=200)
    assert len({r["prompt"] for r in rows}) == len(rows) == tasks.DEFAULT_ROWS
    share = Counter(r["task"] for r in rows)
    assert set(share) == set(tasks.TASKS)
    assert min(share.values()) > 0.15 * len(rows)


def measured(rows):
    """(tokens, targets) per example in byte tokens: prompt + completion + EOS, completion + EOS."""
    tokens = [len(r["prompt"].encode()) + len(r["completion"].encode()) + 1 for r in rows]
    targets = [len(r["completion"].encode()) + 1 for r in rows]
    return tokens, targets


def nearest_rank(values, p):
    return int(np.percentile(values, p, method="inverted_cdf"))


def test_lengths_are_long_tailed(rows):
    tokens, targets = measured(rows)
    for values in (tokens, targets):
        median, p99 = nearest_rank(values, 50), nearest_rank(values, 99)
        assert p99 >= 2.5 * median and max(values) > p99
    # bounded by the generator: the longest prompt is "count a: " + 64 letters + newline,
    # the longest answer 40 letters
    assert max(tokens) <= max(len("count a: ") + 64 + 1 + 2 + 1, len("reverse: ") + 40 + 1 + 40 + 1)
    assert max(targets) <= 40 + 1


def test_docstring_states_the_measured_distribution(rows):
    tokens, targets = measured(rows)
    doc = tasks.__doc__
    for name, values in (("tokens", tokens), ("targets", targets)):
        m = re.search(rf"{name}: median (\d+), p90 (\d+), p99 (\d+), max (\d+)", doc)
        assert m, f"no {name} line in the docstring"
        stated = [int(x) for x in m.groups()]
        assert stated == [nearest_rank(values, p) for p in (50, 90, 99)] + [max(values)]


def test_rows_tokenize_whole_at_seq_len_128(rows):
    data = tokenize_rows(
        rows_from_dicts(rows, tasks.SOURCE), ByteTokenizer(), seq_len=128, source=tasks.SOURCE
    )
    assert len(data.examples) == len(rows) and data.truncated == 0
    ex = data.examples[0]
    assert ByteTokenizer().decode(ex.input_ids[ex.labels != -100]) == rows[0]["completion"]
