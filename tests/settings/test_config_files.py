"""`--config FILE` on every command (YAML, TOML or JSON; flat keys or a section per
component; the command line wins) and a run's config.yaml taken back as it is: the same
runs as the same flags, bit for bit."""

from __future__ import annotations

import json

import pytest
import yaml

from gradaccum.cli import build_parser, main
from gradaccum.settings.command import namespace
from tests.train.helpers import one_line_error, train_records

TRAIN = ["--seq-len", "16", "--micro-batch", "2", "--accum-steps", "3", "--max-steps", "2",
         "--lr", "2e-3", "--eval-every", "0", "--save-every", "0", "--model", "tiny"]  # fmt: skip


def as_settings(argv: list[str]) -> dict:
    """The flags of `argv` as config keys: --seq-len 16 -> {"seq_len": "16"}."""
    settings, i = {}, 0
    while i < len(argv):
        key = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            settings[key], i = argv[i + 1], i + 2
        else:
            settings[key], i = True, i + 1
    return settings


@pytest.mark.slow  # trains end to end, twice
def test_a_yaml_file_trains_the_same_first_steps_as_the_same_flags(tmp_path, capsys):
    flags_out, file_out = tmp_path / "flags", tmp_path / "file"
    assert main(["train", *TRAIN, "--out", str(flags_out)]) == 0
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(as_settings(TRAIN)))
    assert main(["train", "--config", str(config), "--out", str(file_out)]) == 0
    capsys.readouterr()
    first, second = train_records(flags_out), train_records(file_out)
    assert len(first) == 2 and first == second  # loss, grad norm, lr: bit for bit


@pytest.mark.slow  # trains end to end, twice
def test_a_runs_config_yaml_reproduces_its_first_step_bit_for_bit(tmp_path, capsys):
    run, again = tmp_path / "run", tmp_path / "again"
    argv = ["--task", "sft", "--examples-per-step", "8", "--micro-batch", "4", "--seq-len", "64",
            "--max-steps", "2", "--eval-every", "0", "--save-every", "0", "--seed", "3"]  # fmt: skip
    assert main(["train", *argv, "--out", str(run)]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["run"]["task"] == "sft" and saved["batch"]["examples_per_step"] == 8
    assert saved["run"]["seed"] == 3 and "out" not in saved["run"]
    assert main(["train", "--config", str(run / "config.yaml"), "--out", str(again)]) == 0
    capsys.readouterr()
    first, second = train_records(run), train_records(again)
    assert first[0]["loss"] == second[0]["loss"] and first == second


@pytest.mark.parametrize("kind", ["yaml", "toml", "json"])
def test_plan_takes_every_file_kind_and_the_command_line_wins(tmp_path, capsys, kind):
    flags = ["--target-tokens", "1M", "--seq-len", "2048", "--micro-batch", "4", "--gpus", "8",
             "--model", "llama2-7b", "--precision", "bf16"]  # fmt: skip
    assert main(["plan", *flags, "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    settings = as_settings(flags)
    settings["gpus"] = 2  # the command line says 8
    nested = {"target": {"target_tokens": "1M"}, "batch": {"seq_len": 2048, "micro_batch": 4}}
    flat = {
        k: v for k, v in settings.items() if k not in ("target_tokens", "seq_len", "micro_batch")
    }
    path = tmp_path / f"plan.{kind}"
    text = {
        "yaml": lambda: yaml.safe_dump({**flat, **nested}),
        "json": lambda: json.dumps({**flat, **nested}),
        "toml": lambda: (
            "\n".join(f'{k} = "{v}"' for k, v in flat.items())
            + '\n[target]\ntarget-tokens = "1M"\n[batch]\nseq_len = 2048\nmicro_batch = 4\n'
        ),
    }[kind]()
    path.write_text(text)
    assert main(["plan", "--config", str(path), "--gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--k", "3", "--micro-batch", "2", "--seq-len", "16", "--precision", "bf16"],
        [
            "fit",
            "--seq-len",
            "64",
            "--tokens-per-step",
            "2k",
            "--batch-tolerance",
            "10%",
            "--memory-budget",
            "1GB",
            "--lora-rank",
            "4",
        ],  # fmt: skip
        [
            "bench",
            "--task",
            "sft",
            "--micro-batch",
            "2",
            "--packing",
            "none,window",
            "--peers",
            "none",
            "--rounds",
            "1",
        ],  # fmt: skip
    ],
)
def test_every_command_reads_a_file_as_its_flags(tmp_path, argv):
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(as_settings(argv[1:])))
    parser = build_parser()
    from_flags = namespace(parser.parse_args(argv))
    from_file = namespace(parser.parse_args([argv[0], "--config", str(path)]))
    assert vars(from_flags) == vars(from_file)
    assert any(value not in (None, False) for value in vars(from_file).values())


def test_verify_runs_from_a_file_as_from_its_flags(tmp_path, capsys):
    argv = ["--k", "3", "--micro-batch", "2", "--seq-len", "16", "--seed", "1"]
    assert main(["verify", *argv, "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    path = tmp_path / "verify.yaml"
    path.write_text(yaml.safe_dump({"check": {"k": 3}, **as_settings(argv[2:])}))
    assert main(["verify", "--config", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["max_rel_err"] == expected["max_rel_err"] and got["passed"]


def test_a_key_no_setting_of_the_command_has_is_named(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("seq_len: 16\nbatch:\n  micro_batches: 2\nlearning_rate: 1\n")
    line = one_line_error(capsys, ["verify", "--config", str(path)])
    assert line.endswith("unknown keys batch.micro_batches, learning_rate")
    path.write_text("- a list\n")
    assert "expected keys and values" in one_line_error(capsys, ["plan", "--config", str(path)])
    path.write_text("k: [unclosed\n")
    assert "not a readable YAML file" in one_line_error(capsys, ["verify", "--config", str(path)])


def test_a_bad_value_from_a_file_names_the_file_and_its_key(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("batch:\n  micro_batch: 0\n")
    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", "--config", str(path), "--out", str(out)])
    assert f"--config {path}, key batch.micro_batch: --micro-batch 0: " in line, line
    assert not out.exists()
    # found once the settings are read together: still the file's key
    path.write_text("optimizer:\n  warmup-steps: 10\nmax_steps: 5\n")
    line = one_line_error(capsys, ["train", "--config", str(path), "--out", str(out)])
    assert f"--config {path}, key optimizer.warmup-steps: --warmup-steps 10: " in line, line
    # the command line's value is the command line's, the file not named
    path.write_text("micro-batch: 2\n")
    line = one_line_error(capsys, ["plan", "--config", str(path), "--micro-batch", "0"])
    assert "--config" not in line and "--micro-batch 0" in line
