"""`gradaccum verify --task sft --packing window|padding-free`: the window's examples cut by a
token budget or packed into padding-free rows, checked against every example padded into one
unpacked float64 batch; the targets counted by hand; bad input in one line."""

import contextlib
import io
import json

import pytest

from gradaccum.cli import main
from gradaccum.data.sft.builtin import builtin_rows

ARGS = ["verify", "--task", "sft", "--seq-len", "128", "--micro-batch-tokens", "128", "--json"]


def _verify(*argv) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*ARGS, *argv])
    return code, json.loads(out.getvalue())


@pytest.mark.parametrize("mode", ["window", "padding-free"])
def test_packed_window_equals_the_unpacked_big_batch(mode):
    code, got = _verify("--packing", mode)
    assert code == 0 and got["passed"] is True and got["max_rel_err"] <= 1e-5
    rows = builtin_rows(seed=0, n=16)  # the window: 4 x 4 examples, every row drawn
    assert got["tokens"] == sum(len(r["completion"].encode()) + 1 for r in rows)
    window = got["sft_window"]
    assert window["packing"] == mode and sum(window["targets"]) == got["tokens"]
    assert len(window["targets"]) >= 2 and len(set(window["targets"])) > 1
    every = sum(len((r["prompt"] + r["completion"]).encode()) + 1 for r in rows)
    # each example's inputs are its tokens but the last: at most 128 positions a micro-batch
    assert window["tokens"] == every
    if mode == "padding-free":
        assert set(window["widths"]) == {128}
        # rows of 128 positions hold the 16 examples' inputs (one fewer token each)
        assert len(window["targets"]) >= -(-(every - 16) // 128)
    else:
        assert max(window["widths"]) <= 128
    assert got["wrong_ways"]["mean_over_k"] >= 1e-2


def test_hugging_face_padding_free_rows_through_position_ids(make_hf_folder):
    pytest.importorskip("transformers")
    folder = make_hf_folder("llama")
    config = f"{folder}/config.json"  # 64 positions: the later flags win
    argv = ["--packing", "padding-free", "--model-config", config, "--seq-len", "64"]
    code, got = _verify(*argv, "--micro-batch-tokens", "64")
    assert code == 0 and got["passed"] is True and got["max_rel_err"] <= 1e-5
    assert set(got["sft_window"]["widths"]) == {64} and len(got["sft_window"]["widths"]) > 1


@pytest.mark.parametrize(
    "argv, words",
    [
        (["verify", "--packing", "window"], "--packing window: needs --task sft"),
        (
            ["verify", "--task", "sft", "--micro-batch-tokens", "256"],
            "--micro-batch-tokens 256: needs --packing window or padding-free",
        ),
        (
            ["verify", "--task", "sft", "--packing", "padding-free", "--micro-batch-tokens", "32"],
            "--micro-batch-tokens 32: below --seq-len 64",
        ),
        (["verify", "--task", "sft", "--packing", "rows"], "--packing"),
    ],
)
def test_bad_packing_input_one_line_exit_2(capsys, argv, words):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err and "Traceback" not in err
