"""`gradaccum verify --task sft --packing window|padding-free`: the window's examples cut by a
token budget or packed into padding-free rows, checked against every example padded into one
unpacked float64 batch; the targets counted by hand; bad input in one line."""

import contextlib
import io
import json

import pytest

from gradaccum.cli import main
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.verification.sft import SFTWindow

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
    # each micro-batch within the budget of 128 positions, padding included; together they
    # hold the 16 examples' inputs (one fewer token each)
    positions = [r * w for r, w in zip(window["rows"], window["widths"], strict=True)]
    assert max(positions) <= 128 and sum(positions) >= every - 16
    if mode == "padding-free":  # rows bucketed by length, as the trainer cuts them
        assert set(window["widths"]) <= {16, 32, 64, 128}
        assert sum(window["rows"]) < 16  # some rows hold several examples
    assert got["wrong_ways"]["mean_over_k"] >= 1e-2


def test_hugging_face_padding_free_rows_through_position_ids(make_hf_folder):
    pytest.importorskip("transformers")
    folder = make_hf_folder("llama")
    config = f"{folder}/config.json"  # 64 positions: the later flags win
    argv = ["--packing", "padding-free", "--model-config", config, "--seq-len", "64"]
    code, got = _verify(*argv, "--micro-batch-tokens", "64")
    assert code == 0 and got["passed"] is True and got["max_rel_err"] <= 1e-5
    window = got["sft_window"]
    assert set(window["widths"]) <= {8, 16, 32, 64} and len(window["widths"]) > 1
    assert sum(window["rows"]) < window["examples"]  # rows holding several examples


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


def _window(packing: str, rows: list[int], widths: list[int], targets: list[int]) -> SFTWindow:
    return SFTWindow(
        micro_batches=[],
        source="sft.jsonl",
        data_format="messages",
        tokenizer="built-in byte tokenizer",
        examples=9,
        targets=targets,
        widths=widths,
        rows=rows,
        tokens=200,
        truncated=0,
        packing=packing,
    )


def test_the_window_line_says_each_micro_batch_s_rows_width_and_targets():
    line = _window("padding-free", [2, 1], [64, 32], [73, 6]).describe()
    assert (
        "--packing padding-free, k = 2 micro-batches: 2 padding-free rows of 64 tokens holding "
        "73 targets, 1 padding-free row of 32 tokens holding 6 targets (79 target tokens of 200)"
    ) in line
    line = _window("window", [4, 1], [30, 61], [40, 1]).describe()
    assert (
        "k = 2 micro-batches: 4 examples padded to 30 tokens holding 40 targets, 1 example "
        "padded to 61 tokens holding 1 target (41 target tokens of 200)"
    ) in line
    # past 8 micro-batches, the range of each count
    many = _window("padding-free", [2] * 8 + [1], [64] * 9, list(range(1, 10))).describe()
    assert (
        "k = 9 micro-batches of 1..2 padding-free rows of 64 tokens holding 1..9 targets each"
        in many
    )
