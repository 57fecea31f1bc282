"""What a person following a run in a log sees: a first line about 10 s in, then one every
tenth of the run or every 30 s, whichever comes first, each with the tokens/s of the steps
since the line before (not one step's)."""

import pytest

from gradaccum.train.console import Console, Progress


def lines_of(capsys, total: int, step_s: float, tokens_of) -> list[str]:
    """Progress of a run of `total` steps of `step_s` seconds each, step i training on
    tokens_of(i) tokens, on a console that is not a terminal (pytest's captured stdout)."""
    progress = Progress(Console(), total, 0, 4)
    for step in range(1, total + 1):
        progress.update(step, 2.0, tokens_of(step), step_s, 1e-3, step * step_s, step)
    progress.close()
    return capsys.readouterr().out.splitlines()


def fields(line: str) -> tuple[int, int, float]:
    """(step, elapsed seconds, tokens/s) of a progress line."""
    words = line.split()
    step = int(words[1].split("/")[0])
    rate = float(words[4].replace(",", ""))
    elapsed = int(words[words.index("s,") - 1])
    return step, elapsed, rate


def test_lines_come_by_time_and_by_step_with_the_rate_since_the_last_line(capsys):
    # 100 steps of 5 s; step i trains on 1000 i tokens. Lines: at 10 s (step 2), then 30 s
    # later (step 8), at the tenth of the run (step 10), 30 s after that (16), at 20, ...
    lines = lines_of(capsys, 100, 5.0, lambda i: 1000 * i)
    got = [fields(line) for line in lines]
    steps = [s for s, _, _ in got]
    assert steps[:7] == [2, 8, 10, 16, 20, 26, 30]
    assert steps[-1] == 100 and all(b - a <= 10 for a, b in zip(steps, steps[1:], strict=False))
    assert [e for _, e, _ in got[:3]] == [10, 40, 50]

    # tokens / seconds of the steps since the line before, by hand
    def rate(first: int, last: int) -> float:
        return sum(1000 * i for i in range(first, last + 1)) / (5.0 * (last - first + 1))

    assert got[0][2] == pytest.approx(rate(1, 2), abs=0.5)  # 300, not step 2's 400
    assert got[1][2] == pytest.approx(rate(3, 8), abs=0.5)  # 1,100, not step 8's 1,600
    assert got[2][2] == pytest.approx(rate(9, 10), abs=0.5)
    assert got[3][2] == pytest.approx(rate(11, 16), abs=0.5)


def test_a_fast_run_prints_every_tenth_and_the_last_step(capsys):
    # 50 steps of 0.1 s: 5 s in all, so no line by time; every 5 steps, and the last
    lines = lines_of(capsys, 50, 0.1, lambda i: 640)
    assert [fields(line)[0] for line in lines] == list(range(5, 51, 5))
    assert all(fields(line)[2] == pytest.approx(6400, abs=0.5) for line in lines)


def test_a_slow_first_step_still_gets_a_line_at_once(capsys):
    # 20 s per step: the first step ends past the 10 s mark, so it gets the first line
    lines = lines_of(capsys, 1000, 20.0, lambda i: 8192)
    assert fields(lines[0])[:2] == (1, 20)
    assert [fields(line)[0] for line in lines[:4]] == [1, 3, 5, 7]  # then every 30 s
