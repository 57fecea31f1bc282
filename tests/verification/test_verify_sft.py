"""`gradaccum verify --task sft`: the check on a window of SFT examples (the built-in
instruction set or --data), where dividing each micro-batch's mean by k shows its real size;
bad input in one line."""

import json

import pytest

from gradaccum.cli import main
from gradaccum.data.sft.builtin import builtin_rows

ARGS = ["verify", "--task", "sft", "--seq-len", "128"]  # 128 holds every built-in example


def _run(capsys, *argv):
    code = main([*ARGS, *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def builtin_json():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*ARGS, "--json"])
    return code, json.loads(out.getvalue())


def test_builtin_sft_window_passes_and_mean_over_k_is_off(builtin_json):
    code, got = builtin_json
    assert code == 0 and got["passed"] is True and got["task"] == "sft"
    assert got["max_rel_err"] <= 1e-5
    assert got["wrong_ways"]["mean_over_k"] >= 1e-2


def test_the_window_is_the_built_in_rows_targets_counted_by_hand(builtin_json):
    _, got = builtin_json
    rows = builtin_rows(seed=0, n=16)  # the window is 4 x 4 examples: every row drawn
    # each completion's bytes and its EOS are the targets; the prompt is not one
    assert got["tokens"] == sum(len(r["completion"].encode()) + 1 for r in rows)
    window = got["sft_window"]
    assert window["examples"] == 16 and len(window["targets"]) == 4
    assert sum(window["targets"]) == got["tokens"]
    assert len(set(window["targets"])) > 1  # ragged: the premise of the /k mistake
    every = sum(len((r["prompt"] + r["completion"]).encode()) + 1 for r in rows)
    assert window["tokens"] == every


def test_sft_table(capsys):
    code, out, _ = _run(capsys)
    assert code == 0
    assert "SFT examples from the built-in instruction set" in out and "PASS" in out
    line = next(x for x in out.splitlines() if "mean loss divided by k" in x)
    assert float(line.split()[-1]) >= 1e-2


def test_data_file_through_the_same_path(capsys, tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"q{i}: ", "completion": "x" * (1 + (i * 7) % 23)} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = _run(capsys, "--data", str(path), "--k", "4", "--micro-batch", "2", "--json")
    got = json.loads(out)
    assert code == 0 and got["passed"] is True
    assert got["tokens"] == sum(len(r["completion"]) + 1 for r in rows)
    assert got["sft_window"]["source"] == str(path)
    assert got["wrong_ways"]["mean_over_k"] >= 1e-2


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--data", "tokens.bin"],
            "--data tokens.bin: a .bin file is text or tokens for pretraining",
        ),
        (["--data", "nowhere.jsonl"], "--data nowhere.jsonl: no such file"),
        (["--world-size", "2"], "--world-size 2: runs on --task pretrain only"),
        (["--precision-study"], "--precision-study: runs on --task pretrain only"),
    ],
)
def test_bad_sft_input_one_line_exit_2(capsys, argv, words):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err


def test_unknown_task_and_data_without_sft(capsys, tmp_path):
    assert main(["verify", "--task", "dpo"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "--task" in err and "dpo" in err
    assert main(["verify", "--data", "sft.jsonl"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "--data sft.jsonl: needs --task sft" in err


def test_too_few_examples_for_the_window(capsys, tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' * 3)
    code, out, err = _run(capsys, "--data", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "3 examples, fewer than the window's --k 4" in err
