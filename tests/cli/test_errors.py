"""One bad-input type: BadInput, a one-line message naming the flag and the value, exit 2."""

import json

import pytest

from gradaccum.cli import main
from gradaccum.utils.errors import BadInput, first_line, flag_name


def test_the_message_is_one_line_naming_the_flag_and_value():
    err = BadInput("--micro-batch", 0, "must be >= 1")
    assert str(err) == "--micro-batch 0: must be >= 1"
    assert (err.flag, err.value, err.why) == ("--micro-batch", 0, "must be >= 1")
    assert isinstance(err, ValueError)
    assert str(BadInput("--resume", None, "needs --out")) == "--resume: needs --out"
    ready = BadInput("--out x: in use")
    assert str(ready) == "--out x: in use" and ready.flag == "--out"
    assert BadInput("a plain line").flag is None


def test_flag_name_and_first_line():
    assert flag_name("micro_batch") == "--micro-batch"
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(KeyError()) == "KeyError"


def test_every_part_raises_the_one_type():
    from gradaccum.data.tokens import load_tokens
    from gradaccum.models.build import build_model
    from gradaccum.plan import PlanError, PlanInputs
    from gradaccum.train.config import TrainConfig
    from gradaccum.utils.sizes import parse_count

    assert PlanError is BadInput
    cases = [
        lambda: PlanInputs(micro_batch=0),
        lambda: parse_count("4Q", "--target-tokens"),
        lambda: TrainConfig(lr=0),
        lambda: load_tokens("/no/such.npy", 8),
        lambda: build_model(preset="huge", vocab_size=8, seq_len=8),
    ]
    for case in cases:
        with pytest.raises(BadInput) as err:
            case()
        assert str(err.value).startswith("--")


@pytest.mark.parametrize(
    "argv, start",
    [
        (["nosuch"], "gradaccum: error: argument COMMAND"),
        (["train", "--bogus-flag", "1"], "gradaccum: error: unrecognized arguments"),
        (["train", "--lr"], "gradaccum train: error: argument --lr: expected one argument"),
        (["plan", "--micro-batch", "0"], "gradaccum: error: --micro-batch 0"),
        (["train", "--lr", "0"], "gradaccum: error: --lr 0"),
    ],
)
def test_the_command_says_its_name_once(capsys, argv, start):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), lines
    assert lines[0].count("gradaccum") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--micro-batch", "0"],
        ["fit", "--seq-len", "0"],
        ["verify", "--k", "0"],
        ["train", "--lr", "0"],
        ["bench", "--rounds", "0"],
        ["plan", "--bogus-flag"],  # refused before the flags are read: --json still heard
    ],
)
def test_with_json_stdout_carries_the_error_as_one_object(capsys, argv):
    assert main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    said = json.loads(captured.out)  # one object, nothing else
    assert said == {"error": lines[0].split(": error: ", 1)[1], "exit_code": 2}
