"""`gradaccum train` on the command line: every flag checked, one line and exit 2 when bad."""

import json
import os

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.data.corpus import MarkovCorpus

from .helpers import one_line_error

SMALL = [
    "--seq-len",
    "32",
    "--micro-batch",
    "4",
    "--accum-steps",
    "2",
    "--max-steps",
    "2",
    "--eval-every",
    "0",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    path = folder / "markov.npy"
    np.save(path, MarkovCorpus().generate(50_000, seed=2).astype(np.uint16))
    (folder / "notes.csv").write_text("a,b\n")
    (folder / "short.txt").write_text("too short")
    return folder


BAD = [
    # (extra arguments, text the error line must contain)
    (["--tokens-per-step", "0"], "--tokens-per-step 0"),
    (["--tokens-per-step", "lots"], "--tokens-per-step lots"),
    (["--tokens-per-step", "-5"], "--tokens-per-step -5"),
    (["--tokens-per-step", "8q"], "--tokens-per-step 8q"),
    (["--seq-len", "0"], "--seq-len 0"),
    (["--seq-len", "1.5"], "--seq-len 1.5"),
    (["--micro-batch", "0"], "--micro-batch 0"),
    (["--micro-batch", "many"], "--micro-batch many"),
    (["--accum-steps", "0"], "--accum-steps 0"),
    (["--max-steps", "0"], "--max-steps 0"),
    (["--max-tokens", "0"], "--max-tokens 0"),
    (["--max-steps", "5", "--max-tokens", "1M"], "--max-tokens 1000000"),
    (["--lr", "0"], "--lr 0"),
    (["--lr=-1e-3"], "--lr -0.001"),
    (["--lr", "fast"], "--lr fast"),
    (["--lr", "nan"], "--lr nan"),
    (["--lr", "inf"], "--lr inf"),
    (["--warmup-steps", "-1"], "--warmup-steps -1"),
    (["--warmup-steps", "10", "--max-steps", "5"], "--warmup-steps 10"),
    (["--schedule", "step"], "--schedule step"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1"),
    (["--max-grad-norm", "-1"], "--max-grad-norm -1"),
    (["--precision", "fp8"], "--precision fp8"),
    (["--seed", "-1"], "--seed -1"),
    (["--save-every", "-2"], "--save-every -2"),
    (["--eval-every", "often"], "--eval-every often"),
    (["--data", "/no/such/file.txt"], "--data /no/such/file.txt"),
    (["--model", "huge"], "--model huge"),
    (["--model", "tiny", "--init-from", "/tmp"], "--init-from /tmp"),
    (["--model-config", "/no/such/config.json"], "--model-config /no/such/config.json"),
    (["--init-from", "/no/such/folder"], "--init-from /no/such/folder"),
    (["--device", "banana"], "--device banana"),
    (["--device", "cuda"], "--device cuda"),
    (["--bogus-flag", "1"], "--bogus-flag"),
]


@pytest.mark.parametrize("extra, needle", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_values_exit_2_with_one_line_and_write_nothing(capsys, tmp_path, extra, needle):
    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", "--out", str(out), *extra])
    assert needle in line
    assert not out.exists()


def test_bad_values_found_after_reading_the_data_write_nothing(capsys, tmp_path, data):
    cases = [
        (["--data", str(data / "notes.csv")], f"--data {data / 'notes.csv'}"),
        (["--data", str(data / "short.txt")], f"--data {data / 'short.txt'}"),
        (
            ["--data", str(data / "markov.npy"), "--tokens-per-step", "16", "--seq-len", "32"],
            "--tokens-per-step 16",
        ),
        (
            [
                "--data",
                str(data / "markov.npy"),
                "--tokens-per-step",
                "1000",
                "--micro-batch",
                "4",
                "--accum-steps",
                "2",
                "--seq-len",
                "32",
            ],
            "--accum-steps 2",
        ),
        (
            [
                "--data",
                str(data / "markov.npy"),
                "--tokens-per-step",
                "1000",
                "--accum-steps",
                "3",
                "--seq-len",
                "32",
            ],
            "--tokens-per-step 1000",
        ),
    ]
    for extra, needle in cases:
        out = tmp_path / "run"
        assert needle in one_line_error(capsys, ["train", "--out", str(out), *extra])
        assert not out.exists()


def test_a_seq_len_past_the_default_step_is_named_with_its_bound(capsys, tmp_path):
    # No --tokens-per-step given: the default 8192 stands, and --seq-len is what overflows it
    # (the built-in corpus is long enough for the sequence).
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--seq-len", "100000"]
    line = one_line_error(capsys, argv).removeprefix("gradaccum: error: ")
    assert line.startswith("--seq-len 100000: one sequence on each of 1 rank(s) is 100000 "), line
    assert "--tokens-per-step 8192 (the default)" in line and "at most 8192" in line
    assert not out.exists()


def test_out_that_is_a_file_or_holds_a_run(capsys, tmp_path, data):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert f"--out {a_file}" in one_line_error(capsys, ["train", "--out", str(a_file)])
    run = tmp_path / "run"
    args = ["train", "--data", str(data / "markov.npy"), *SMALL, "--out", str(run)]
    assert main(args) == 0
    capsys.readouterr()
    line = one_line_error(capsys, args)
    assert f"--out {run}" in line and "--resume" in line


def test_resume_without_a_checkpoint_names_the_folder(capsys, tmp_path):
    empty = tmp_path / "empty"
    line = one_line_error(capsys, ["train", "--resume", "--out", str(empty)])
    assert line.endswith(f"--resume {empty}: no checkpoint in this folder to resume from")
    assert not empty.exists()
    assert "--out" in one_line_error(capsys, ["train", "--resume"])


def test_config_file_keys_are_flags_and_the_command_line_wins(capsys, tmp_path, data):
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'data = "{data / "markov.npy"}"\nseq-len = 32\nmicro_batch = 4\naccum-steps = 2\n'
        'max_steps = 5\neval-every = 0\nlr = 1e-3\ntokens-per-step = "256"\n'
    )
    out = tmp_path / "run"
    code = main(["train", "--config", str(toml), "--max-steps", "2", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)  # stdout holds the summary object and nothing else
    assert summary["steps"] == 2 and summary["tokens"] == 2 * 4 * 2 * 32
    assert summary["micro_batch"] == 4 and summary["accum_steps"] == 2
    for key in (
        "initial_loss",
        "final_loss",
        "entropy_floor",
        "steps",
        "tokens",
        "tokens_per_s",
        "out",
    ):
        assert key in summary
    assert summary["entropy_floor"] is None  # a token file has no known floor
    assert summary["out"] == str(out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in lines if "loss" in r][0] == pytest.approx(1e-3)  # from the file
    for name in ("config.yaml", "loss.png", "model.pt", "config.json"):
        assert (out / name).exists(), name


def test_config_file_errors(capsys, tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("lr = 1e-3\nlearning_rate = 2\nbatch = 3\n")
    line = one_line_error(capsys, ["train", "--config", str(toml), "--out", str(tmp_path / "o")])
    assert f"--config {toml}" in line and "batch, learning_rate" in line
    toml.write_text('lr = "fast"\n')
    assert "--lr fast" in one_line_error(capsys, ["train", "--config", str(toml)])
    toml.write_text('compile = "yes"\n')
    assert "--compile yes" in one_line_error(capsys, ["train", "--config", str(toml)])
    toml.write_text("lr = = 1\n")
    assert f"--config {toml}" in one_line_error(capsys, ["train", "--config", str(toml)])
    missing = tmp_path / "missing.toml"
    assert f"--config {missing}" in one_line_error(capsys, ["train", "--config", str(missing)])
    assert not os.path.exists(tmp_path / "o")


def test_resume_takes_the_saved_settings(capsys, tmp_path, data):
    out = tmp_path / "run"
    first = ["train", "--data", str(data / "markov.npy"), *SMALL, "--lr", "2e-3", "--out", str(out)]
    assert main(first) == 0
    capsys.readouterr()
    # only --resume, --out and a longer run: everything else comes from the checkpoint
    code = main(["train", "--resume", "--out", str(out), "--max-steps", "3", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["steps"] == 3 and summary["micro_batch"] == 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3]
    # the 2-step cosine had ended at step 2 (0.1 x the saved --lr 2e-3): a longer run keeps
    # the schedule it trained on, so the third step stays there instead of jumping back up
    # the cosine of a 3-step run (2e-3 * (0.1 + 0.9 * (1 + cos(2 pi / 3)) / 2) = 6.5e-4)
    third = [r["lr"] for r in lines if "loss" in r][2]
    assert third == pytest.approx(2e-3 * 0.1)
    assert "run length 2 -> 3 steps from step 2" in captured.err


def test_init_from_a_finished_run_starts_from_its_weights(capsys, tmp_path, data):
    import torch

    first = tmp_path / "first"
    assert main(["train", "--data", str(data / "markov.npy"), *SMALL, "--out", str(first)]) == 0
    # lr 1e-12: AdamW moves each weight by about 1e-12, so what comes out is what was read in;
    # a fresh init would differ from the trained weights by about lr x steps = 6e-3
    second = tmp_path / "second"
    argv = [
        "train",
        "--data",
        str(data / "markov.npy"),
        *SMALL,
        "--lr",
        "1e-12",
        "--init-from",
        str(first),
        "--out",
        str(second),
    ]
    assert main(argv) == 0, capsys.readouterr().err
    a = torch.load(first / "model.pt", weights_only=True)
    b = torch.load(second / "model.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-9)


def test_out_below_a_file_is_refused_before_anything_runs(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = one_line_error(capsys, ["train", "--out", str(a_file / "run")])
    assert f"--out {a_file / 'run'}" in line and "is a file" in line


def test_resume_refuses_what_would_make_it_wrong_and_rewrites_nothing(capsys, tmp_path, data):
    out = tmp_path / "run"
    args = ["train", "--data", str(data / "markov.npy"), *SMALL, "--out", str(out)]
    assert main([*args[:-4], "--max-steps", "4", "--out", str(out)]) == 0  # a run at step 4
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    line = one_line_error(capsys, ["train", "--resume", "--out", str(out), "--max-steps", "2"])
    assert "--max-steps 2" in line and "already at step 4" in line
    line = one_line_error(capsys, ["train", "--resume", "--out", str(out), "--precision", "fp16"])
    assert "--precision fp16" in line and "fp32" in line
    other_vocab = tmp_path / "bytes.txt"
    other_vocab.write_text("some text of bytes " * 2000)
    line = one_line_error(
        capsys, ["train", "--resume", "--out", str(out), "--data", str(other_vocab)]
    )
    assert f"--resume {out}" in line and "does not fit" in line
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines()[0] + "\n")
    line = one_line_error(capsys, ["train", "--resume", "--out", str(out), "--max-steps", "6"])
    assert f"--resume {out}" in line and "metrics.jsonl holds 1 lines" in line
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {k: v for k, v in after.items() if k != "metrics.jsonl"} == {
        k: v for k, v in before.items() if k != "metrics.jsonl"
    }


def test_a_sentinel_token_id_is_refused_not_allocated(capsys, tmp_path):
    ids = np.arange(5000, dtype=np.uint32) % 100
    ids[17] = 2**32 - 1
    path = tmp_path / "ids.npy"
    np.save(path, ids)
    line = one_line_error(capsys, ["train", "--data", str(path), "--out", str(tmp_path / "o")])
    assert f"--data {path}" in line and "4294967295" in line


def test_tensorboard_without_its_package_exits_2_naming_the_extra(capsys, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails
    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", "--out", str(out), *SMALL, "--tensorboard"])
    assert "--tensorboard" in line and "gradaccum[tensorboard]" in line
    assert not out.exists()
