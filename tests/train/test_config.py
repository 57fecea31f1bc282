"""TrainConfig: one source per flag, values read and checked once, nothing else touched."""

import subprocess
import sys
from dataclasses import fields

import pytest

from gradaccum.cli import build_parser
from gradaccum.settings.docs import field_docs
from gradaccum.train.config import COMPONENTS, FLAGS, TrainConfig, merge_settings
from gradaccum.train.settings import TASK_DEFAULTS
from gradaccum.utils.errors import BadInput


@pytest.mark.slow  # a Python process
def test_building_a_config_touches_no_file_clock_or_torch():
    script = (
        "import sys, time\n"
        "time.strftime = time.time = None  # any clock read would fail\n"
        "import builtins; builtins.open = None  # so would any file\n"
        "from gradaccum.train.config import TrainConfig\n"
        "c = TrainConfig(data='/no/such.npy', model_config='/no/such.json', device='banana')\n"
        "assert c.out is None and 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_field_is_a_flag_whose_help_is_its_docstring_and_nothing_else_is():
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    dests = {a.dest: a for a in train._actions if a.dest not in ("help", "config_file")}
    assert set(dests) == {f.name for f in fields(TrainConfig)} == set(FLAGS)
    docs = {}
    for component in COMPONENTS:
        docs.update(field_docs(component))
    for name, action in dests.items():
        assert docs[name] and action.help.startswith(docs[name].replace("%", "%%")), name
        assert action.option_strings == ["--" + name.replace("_", "-")]


def test_task_defaults_are_stated_from_the_one_table():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    helps = {a.dest: " ".join(a.help.split()) for a in train._actions}
    for name, value in TASK_DEFAULTS["sft"].items():
        pretrain = TASK_DEFAULTS["pretrain"].get(name)
        if pretrain is not None:
            assert f"(default {pretrain:g}" in helps[name] if isinstance(pretrain, float) else (
                f"(default {pretrain}" in helps[name]), name  # fmt: skip
        shown = f"{value:g}" if isinstance(value, float) else value
        assert f"--task sft {shown}" in helps[name], name


def test_strings_and_typed_values_read_the_same():
    a = TrainConfig(tokens_per_step="262k", lr="3e-4", micro_batch="auto", seed="7")
    b = TrainConfig(tokens_per_step=262_000, lr=3e-4, micro_batch="auto", seed=7)
    assert a == b
    assert TrainConfig(max_tokens=1.5e6).max_tokens == 1_500_000


@pytest.mark.parametrize(
    "kw, line",
    [
        ({"seq_len": 0}, "--seq-len 0: must be a whole number >= 1"),
        ({"lr": -1e-3}, "--lr -0.001: must be a positive number"),
        ({"precision": "fp8"}, "--precision fp8: choose one of fp32, bf16, fp16"),
        ({"compile": "yes"}, "--compile yes: must be true or false"),
        ({"seed": 2**63}, "--seed 9223372036854775808: must be below 2**63"),
        ({"keep_checkpoints": 0}, "--keep-checkpoints 0: must be a whole number >= 1"),
        ({"dist_timeout": 0}, "--dist-timeout 0: must be a positive number"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag(kw, line):
    with pytest.raises(BadInput) as err:
        TrainConfig(**kw)
    assert str(err.value) == line


def test_the_upper_layer_replaces_a_whole_exclusive_group():
    # max_steps in a TOML file, --max-tokens on the command line: the command line wins
    merged = merge_settings({"max_steps": 10, "lr": 1e-3}, {"max_tokens": "1M"})
    assert merged == {"lr": 1e-3, "max_tokens": "1M"}
    assert TrainConfig(**merged).max_tokens == 1_000_000
    with pytest.raises(BadInput, match="give either"):
        TrainConfig(max_steps=10, max_tokens=100)  # both at the same level: refused


def test_chosen_leaves_out_what_was_not_chosen():
    chosen = TrainConfig(tokens_per_step=4096, out="x", resume=True).chosen()
    assert chosen["tokens_per_step"] == 4096
    assert "accum_steps" not in chosen and "out" not in chosen and "resume" not in chosen
