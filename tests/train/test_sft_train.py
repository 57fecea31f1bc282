"""`gradaccum train --task sft` end to end on CPU: the loss over completion tokens against a
float64 computation by hand, what a metrics line counts, the step independent of the
micro-batch, and a resumed run equal bit for bit to an uninterrupted one."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from gradaccum.cli import main
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.models.build import build_model
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import plot_loss, read_metrics
from gradaccum.train.rundir.resume import settings_to_resume

from .helpers import train_records

PROMPT, COMPLETION = "sort: dcab\n", "abcd"


def _jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _config(out, data, **kw) -> TrainConfig:
    base = dict(task="sft", out=str(out), data=data, seq_len=64, max_steps=1, eval_every=0)
    return TrainConfig(**{**base, **kw})


def _window_lines(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


def _reference_loss(text_ids: list[int], first_target: int) -> tuple[float, int]:
    """Mean cross-entropy, float64, of the run's initial model (seed 0, preset tiny, byte
    vocabulary) over tokens first_target.. of `text_ids`, each predicted from those before."""
    torch.manual_seed(0)
    model, _ = build_model(preset="tiny", vocab_size=257, seq_len=64)
    model = model.double().eval()
    ids = torch.tensor([text_ids])
    with torch.no_grad():
        logits = model(ids[:, :-1])[0]
    targets = ids[0, 1:].clone()
    targets[: first_target - 1] = -100
    loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    n = int((targets != -100).sum())
    return float(loss) / n, n


@pytest.mark.parametrize("on_prompt", [False, True])
def test_first_step_loss_is_the_mean_over_completion_tokens(tmp_path, on_prompt):
    data = _jsonl(tmp_path / "one.jsonl", [{"prompt": PROMPT, "completion": COMPLETION}])
    out = tmp_path / "run"
    train(_config(out, data, examples_per_step=1, micro_batch=1, train_on_prompt=on_prompt))
    ids = list(PROMPT.encode()) + list(COMPLETION.encode()) + [256]  # EOS after the completion
    first = 1 if on_prompt else len(PROMPT)
    want, n = _reference_loss(ids, first)
    (line,) = _window_lines(out)
    assert n == (len(ids) - 1 if on_prompt else len(COMPLETION) + 1)
    assert line["counted_tokens"] == line["tokens_per_step"] == n
    assert line["examples"] == 1
    assert line["loss"] == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory) -> str:
    """60 rows of the built-in tasks: prompts and answers of very different lengths."""
    rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in builtin_rows(3, 60)]
    return _jsonl(tmp_path_factory.mktemp("sft") / "ragged.jsonl", rows)


def test_step_does_not_depend_on_the_micro_batch(tmp_path, ragged):
    lines = {}
    for micro in (1, 8):
        out = tmp_path / f"micro-{micro}"
        # --packing none: the assertion on k is about runs of --micro-batch examples
        train(_config(out, ragged, examples_per_step=16, micro_batch=micro, packing="none"))
        (lines[micro],) = _window_lines(out)
    one, eight = lines[1], lines[8]
    assert one["accum_steps"] == 16 and eight["accum_steps"] == 2
    assert one["counted_tokens"] == eight["counted_tokens"]
    assert eight["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert eight["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)


def test_tokens_per_step_fills_the_window_up_to_the_budget(tmp_path, ragged):
    out = tmp_path / "budget"
    train(_config(out, ragged, tokens_per_step=40, micro_batch=4, max_steps=4))
    for line in _window_lines(out):
        # whole examples while their targets fit; one example alone may exceed the budget
        assert line["counted_tokens"] <= 40 or line["examples"] == 1
        assert line["counted_tokens"] == line["tokens_per_step"]


def test_a_budget_below_one_example_is_said_at_the_start(tmp_path, capsys):
    """Before: --tokens-per-step 3 ran silently at 5 counted tokens per step."""
    rows = [{"prompt": f"copy: {c}bcd\n", "completion": f"{c}bcd"} for c in "abcdefgh"]
    data = _jsonl(tmp_path / "same.jsonl", rows)  # each: 4 completion bytes + EOS = 5 targets
    train(_config(tmp_path / "small", data, tokens_per_step=3, micro_batch=2))
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warning.startswith("warning: --tokens-per-step 3 is below")
    assert "the smallest example holds 5" in warning
    train(_config(tmp_path / "enough", data, tokens_per_step=5, micro_batch=2))
    assert "warning" not in capsys.readouterr().out


@pytest.mark.slow  # trains past a few steps
def test_resume_is_bit_for_bit(tmp_path, ragged):
    def run(out, **kw):
        return train(
            _config(out, ragged, examples_per_step=6, micro_batch=4, max_steps=6, save_every=3),
            **kw,
        )

    straight, parted = tmp_path / "straight", tmp_path / "parted"
    run(straight)
    stopped = run(parted, should_stop=lambda step: step == 3)
    assert stopped["stopped"] == "request" and stopped["steps"] == 3
    resumed = train(TrainConfig(out=str(parted), resume=True, **_settings(parted)))
    assert resumed["steps"] == 6
    assert train_records(parted) == train_records(straight)
    a = torch.load(straight / "model.pt", weights_only=True)
    b = torch.load(parted / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _resume_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")]


def test_resume_prints_only_what_changed(tmp_path, ragged, capsys):
    """Each window's examples set its k, so the checkpoint's k (its last window's) differing
    from the first window's is no change; before the fix every resume printed one."""
    out = tmp_path / "run"
    # the default --packing cuts ragged windows into different numbers of micro-batches
    train(_config(out, ragged, examples_per_step=6, micro_batch=2, max_steps=2, save_every=1))
    # the checkpoint's k (its last window's, 2) is not the first window's plan (1): the
    # case that printed a change
    assert _window_lines(out)[-1]["accum_steps"] == 2
    assert not (out / ".lock").exists()  # a finished run leaves no lock behind
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "3"]) == 0
    assert [line for line in _resume_lines(capsys) if "micro-batch" in line] == []
    again = ["train", "--resume", "--out", str(out), "--max-steps", "4", "--micro-batch", "1"]
    assert main(again) == 0
    want = "resume: micro-batch 2 x 1 device(s) -> 1 x 1 from step 3: k follows each window's"
    assert any(line.startswith(want) for line in _resume_lines(capsys))


def _settings(out) -> dict:
    values = settings_to_resume({"out": str(out), "resume": True})
    return {k: v for k, v in values.items() if k not in ("out", "resume")}


def test_cli_prints_the_data_and_each_window(capsys, tmp_path, ragged):
    out = tmp_path / "cli"
    argv = ["train", "--task", "sft", "--data", ragged, "--out", str(out), "--seq-len", "64"]
    assert main([*argv, "--examples-per-step", "8", "--max-steps", "2", "--eval-every", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"data: {ragged} (prompt-completion): 60 rows, 60 examples, seq_len 64" in printed
    assert "57 examples to train on, 3 held out" in printed
    assert "step 2/2" in printed and "8 ex, " in printed
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2] and all(r["eval_tokens"] > 0 for r in evals)


def test_builtin_default_data_reports_exact_match(capsys, tmp_path):
    out = tmp_path / "builtin"
    summary = train(TrainConfig(task="sft", out=str(out), max_steps=2, eval_every=0))
    printed = capsys.readouterr().out
    assert "data: built-in instruction set (prompt-completion): 20000 rows" in printed
    assert "19500 examples to train on, 500 held out" in printed
    assert "exact match " in printed and "/500" in printed
    (last,) = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert 0 <= last["exact_match"] <= 1 and summary["final_exact_match"] == last["exact_match"]
    assert summary["examples_per_step"] == 32 and "loss.png" in summary["files"]


def test_exact_match_gets_its_own_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image  # matplotlib's own dependency

    train_lines = [{"step": s, "tokens": 100 * s, "loss": 3.0 / s} for s in range(1, 5)]
    evals = [{"step": 4, "tokens": 400, "eval_loss": 1.0}]
    sizes = {}
    for name, extra in (("plain", {}), ("matched", {"exact_match": 0.25})):
        path = tmp_path / f"{name}.png"
        assert plot_loss(train_lines + [{**evals[0], **extra}], str(path))
        sizes[name] = Image.open(path).size
    # 7 x 4.2 inches at 120 dpi for the loss alone, 7 x 6.4 with a second panel below
    assert sizes == {"plain": (840, 504), "matched": (840, 768)}


def test_the_closing_lines_give_the_exact_match(capsys, tmp_path):
    out = tmp_path / "closing"
    argv = ["train", "--task", "sft", "--max-steps", "1", "--eval-every", "0", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    (last,) = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert f"held-out exact match {last['exact_match']:.3f}" in printed.splitlines()[-2]
