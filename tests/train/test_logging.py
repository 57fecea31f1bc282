"""A run says what it does through `logging` (the logger "gradaccum"): a program that embeds
`gradaccum.train` can take its lines into its own handlers or silence them, and what it trains
does not change; left alone, the lines come on stdout as the command prints them."""

from __future__ import annotations

import logging

import pytest

from gradaccum.train.loop import train

from .helpers import markov_npy, train_records
from .small_run import small_config


@pytest.fixture
def library_logger():
    """The "gradaccum" logger, put back as it was after the test."""
    log = logging.getLogger("gradaccum")
    saved = (list(log.handlers), log.propagate, log.level)
    yield log
    log.handlers[:], log.propagate = saved[0], saved[1]
    log.setLevel(saved[2])


@pytest.fixture
def data(tmp_path):
    return markov_npy(tmp_path / "markov.npy", 5_000, seed=3)


def _run(tmp_path, data, name: str, **kw) -> list[dict]:
    train(small_config(tmp_path / name, data, max_steps=2, save_every=0, **kw))
    return train_records(tmp_path / name)


def test_left_alone_the_lines_are_on_stdout(tmp_path, data, capsys):
    _run(tmp_path, data, "plain")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gradaccum plan") and out[-1].startswith("step 2: eval loss")


def test_a_program_takes_them_into_its_own_handlers(tmp_path, data, capsys, library_logger):
    plain = _run(tmp_path, data, "plain")
    printed = capsys.readouterr().out.splitlines()
    library_logger.handlers.clear()
    library_logger.propagate = False
    caught: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = caught.append
    library_logger.addHandler(handler)
    routed = _run(tmp_path, data, "routed")
    assert capsys.readouterr().out == ""
    assert [r.name for r in caught] == ["gradaccum.train"] * len(caught)
    said = "\n".join(r.getMessage() for r in caught).splitlines()
    # the same lines, but for the folders and the speeds that differ between the two runs
    assert [line[:6] for line in said] == [line[:6] for line in printed]
    assert routed == plain


def test_a_level_above_info_silences_them_and_changes_nothing_trained(
    tmp_path, data, capsys, library_logger
):
    plain = _run(tmp_path, data, "plain")
    capsys.readouterr()
    library_logger.setLevel(logging.WARNING)
    quiet = _run(tmp_path, data, "quiet")
    assert capsys.readouterr().out == ""
    assert quiet == plain


def test_under_json_the_lines_are_on_stderr(tmp_path, data, capsys):
    _run(tmp_path, data, "json", json=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "step 2/2" in captured.err
