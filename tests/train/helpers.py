"""What the trainer's tests share: a token file of the built-in corpus, a one-line-error check,
and a run's metrics records without their timing fields."""

import os

import numpy as np

from gradaccum.cli import main
from gradaccum.data.corpus import MarkovCorpus
from gradaccum.train.rundir.metrics import read_metrics

TIMING_FIELDS = ("tokens_per_s", "elapsed_s")
"""Fields of a metrics record that measure wall-clock time: they never match between two runs."""


def markov_npy(path, tokens: int, seed: int):
    """`tokens` tokens of the built-in corpus saved as uint16 ids at `path`; returns `path`."""
    np.save(path, MarkovCorpus().generate(tokens, seed=seed).astype(np.uint16))
    return path


def markov_folder(tmp_path_factory, tokens: int, seed: int):
    """A fresh folder holding markov.npy (see markov_npy), for a module's `data` fixture."""
    folder = tmp_path_factory.mktemp("data")
    markov_npy(folder / "markov.npy", tokens, seed)
    return folder


def one_line_error(capsys, argv, stdout_empty: bool = True) -> str:
    """`gradaccum argv` must exit 2 with one line on stderr and no traceback; that line."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    if stdout_empty:
        assert captured.out == ""
    return lines[0]


def without_timing(records: list[dict]) -> list[dict]:
    """The records with the wall-clock fields dropped: what two equal runs share exactly."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


def train_records(out) -> list[dict]:
    """metrics.jsonl's window lines (no eval or event lines), without the timing fields."""
    records = without_timing(read_metrics(os.path.join(out, "metrics.jsonl")))
    return [r for r in records if "loss" in r]
