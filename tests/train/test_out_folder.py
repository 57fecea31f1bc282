"""--out into a folder that exists: an empty one and one of our runs are taken as before; any
other (a copied Hugging Face model, a data folder) is refused in one line, exit 2, with
nothing in it touched."""

from __future__ import annotations

import os

import pytest

from gradaccum.cli import main
from gradaccum.settings.files import to_yaml
from gradaccum.train.rundir.lock import LOCK_FILE

from .helpers import markov_folder, one_line_error


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return markov_folder(tmp_path_factory, 20_000, seed=2) / "markov.npy"


SMALL = ["--seq-len", "16", "--micro-batch", "2", "--accum-steps", "1", "--eval-every", "0"]


def cli(out, data, *extra) -> list[str]:
    return ["train", "--data", str(data), *SMALL, "--out", str(out), *extra]


def snapshot(folder) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder`: its bytes and modification time (ns)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_mtime_ns)
    return found


def test_a_folder_of_the_users_is_refused_and_left_untouched(tmp_path, data, capsys):
    model = tmp_path / "my_hf_model"  # `cp -a my_hf_model f5` of the report
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64}\n')
    (model / "model.safetensors").write_bytes(b"\x00weights" * 100)
    (model / "tokenizer.json").write_text("{}\n")
    (model / "notes").mkdir()
    (model / "notes" / "a.txt").write_text("mine\n")
    before = snapshot(model)
    line = one_line_error(capsys, cli(model, data, "--max-steps", "1"))
    assert line == (
        f"gradaccum: error: --out {model}: holds files that are not a gradaccum run "
        "(config.json, model.safetensors, notes and 1 more); choose an empty or new folder"
    )
    assert snapshot(model) == before
    assert sorted(os.listdir(model)) == [
        "config.json",
        "model.safetensors",
        "notes",
        "tokenizer.json",
    ]


def test_files_named_like_a_runs_but_not_ours_are_refused(tmp_path, data, capsys):
    other = tmp_path / "logs"
    other.mkdir()
    (other / "metrics.jsonl").write_text("epoch 1: loss 2.3\n")  # another tool's log
    (other / "train.toml").write_text("[model]\nname = 'llama'\n")  # another tool's config
    (other / "config.yaml").write_text("model:\n  name: llama\n")
    (other / "checkpoints").mkdir()
    (other / "checkpoints" / "epoch-1.ckpt").write_bytes(b"x")
    before = snapshot(other)
    line = one_line_error(capsys, cli(other, data, "--max-steps", "1"))
    assert line.startswith(f"gradaccum: error: --out {other}: holds files that are not a ")
    assert snapshot(other) == before


def test_an_empty_folder_is_taken(tmp_path, data):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(cli(out, data, "--max-steps", "1")) == 0
    assert (out / "model.pt").exists()


@pytest.mark.slow
def test_our_runs_are_taken_as_before(tmp_path, data, capsys):
    # a start cut short after taking the lock (a kill between the lock and config.yaml)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / LOCK_FILE).write_text("pid 1 on host, started 2024-01-01 00:00:00\n")  # nobody holds it
    assert main(cli(cut, data, "--max-steps", "1")) == 0
    # a run stopped before its first checkpoint (a double Ctrl-C at the start): starts over
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.yaml").write_text(to_yaml({"batch": {"seq_len": 16}, "run": {"max_steps": 4}}))
    (early / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2, "tokens": 32}\n')
    assert main(cli(early, data, "--max-steps", "1")) == 0
    # a finished run: refused as before, and with a note of the user's beside it, resumed
    done = tmp_path / "done"
    assert main(cli(done, data, "--max-steps", "2", "--save-every", "1")) == 0
    (done / "notes.txt").write_text("lr looked high\n")
    capsys.readouterr()
    line = one_line_error(capsys, cli(done, data, "--max-steps", "3"))
    assert "holds a previous run; add --resume to continue it" in line
    assert main(["train", "--resume", "--out", str(done), "--max-steps", "3"]) == 0
    assert (done / "notes.txt").read_text() == "lr looked high\n"
