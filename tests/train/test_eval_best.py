"""--eval-data, --eval-fraction and --save-best on tiny runs: the eval loss a run records
against a cross-entropy computed here on the eval file's examples with the exported model,
the best checkpoint kept, exported and named, the refusals, and the best across a resume."""

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradaccum.models.build import build_model
from gradaccum.models.gpt import GPT, GPT_MODEL_TYPE, GPTConfig
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.metrics import read_metrics

from .helpers import markov_npy, one_line_error
from .small_run import train_until

EOS = 256
"""The byte tokenizer's end-of-sequence id, after each completion."""


def _jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """24 training rows and 8 eval rows (reverse a word), no row in both; a 1-layer GPT of
    the byte vocabulary to fine-tune (--init-from)."""
    folder = tmp_path_factory.mktemp("eval-best")
    rng, words = random.Random(0), []
    while len(words) < 32:
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 5)))
        if word not in words:
            words.append(word)
    rows = [{"prompt": f"reverse: {w}\n", "completion": w[::-1]} for w in words]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=257, seq_len=32, n_layer=1, n_head=2, n_embd=32)
    gpt = folder / "gpt"
    os.makedirs(gpt)
    config = {"model_type": GPT_MODEL_TYPE, **cfg.__dict__}
    checkpoint.save_model(str(gpt), GPT(cfg).state_dict(), config)
    return {
        "train": _jsonl(folder / "train.jsonl", rows[:24]),
        "eval": _jsonl(folder / "eval.jsonl", rows[24:]),
        "eval_rows": rows[24:],
        "gpt": str(gpt),
    }


def _sft(out, files, **kw) -> TrainConfig:
    base = dict(
        task="sft",
        out=str(out),
        init_from=files["gpt"],
        data=files["train"],
        eval_data=files["eval"],
        seq_len=32,
        examples_per_step=8,
        micro_batch=8,
        packing="none",
    )
    return TrainConfig(**{**base, **kw})


def _reference_eval_loss(folder: str, rows: list[dict]) -> tuple[float, int]:
    """Mean cross-entropy (float64) of the model exported in `folder` over the completion
    bytes and EOS of `rows`, each predicted from the bytes before it; and their count."""
    model = build_model(init_from=folder)[0].double().eval()
    total, count = 0.0, 0
    for row in rows:
        prompt = list(row["prompt"].encode())
        ids = torch.tensor([prompt + list(row["completion"].encode()) + [EOS]])
        with torch.no_grad():
            logits = model(ids[:, :-1])[0]
        targets = ids[0, 1:].clone()
        targets[: len(prompt) - 1] = -100  # the prompt's bytes are not targets
        total += float(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    return total / count, count


def _records(out) -> list[dict]:
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def test_eval_data_is_what_the_run_evaluates_on(tmp_path, files):
    out = tmp_path / "run"
    summary = train(_sft(out, files, epochs=1, eval_every=0))
    records = _records(out)
    windows = [r for r in records if "loss" in r]
    (evaluated,) = [r for r in records if "eval_loss" in r]
    assert sum(r["examples"] for r in windows) == 24  # one epoch over all of --data
    want, targets = _reference_eval_loss(str(out), files["eval_rows"])
    assert evaluated["eval_tokens"] == targets
    assert evaluated["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert summary["final_eval_loss"] == evaluated["eval_loss"]


BEST = dict(
    max_steps=6,
    eval_every=1,
    save_every=0,
    keep_checkpoints=1,
    save_best=True,
    lr=0.6,
    schedule="constant",
    warmup_steps=6,
)
"""A run whose lr grows to 0.6 over its 6 steps: the eval loss falls, then rises as the lr
gets too high. Only the end is a save step: the best is saved because it is the best."""


@pytest.fixture(scope="module")
def best_run(tmp_path_factory, files) -> tuple:
    out = tmp_path_factory.mktemp("best") / "run"
    return out, train(_sft(out, files, **BEST))


def _evals(out) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in _records(out) if "eval_loss" in r}


def _state(folder) -> dict:
    return torch.load(os.path.join(folder, "model.pt"), weights_only=True)


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # trains past a few steps
def test_save_best_exports_the_step_of_the_lowest_eval_loss(best_run, files):
    out, summary = best_run
    evals = _evals(out)
    low = min(evals, key=evals.get)
    assert sorted(evals) == [1, 2, 3, 4, 5, 6] and 1 < low < 6  # a new best replaced step 1
    assert summary["best_step"] == low and summary["best_eval_loss"] == evals[low]
    # the newest checkpoint and the best one, none other (--keep-checkpoints 1, save at 6)
    folders = [os.path.basename(f) for f in checkpoint.step_folders(str(out))]
    assert folders == [f"step-{low:08d}", "step-00000006"]
    kept = os.path.join(out, checkpoint.CHECKPOINTS, f"step-{low:08d}")
    assert _same_weights(_state(out / "best"), _state(kept))
    assert not _same_weights(_state(out / "best"), _state(out))  # not the final model
    recomputed, _ = _reference_eval_loss(str(out / "best"), files["eval_rows"])
    assert recomputed == pytest.approx(evals[low], rel=1e-5)


def test_the_closing_line_names_the_best_step(tmp_path, files, capsys):
    quick = {**BEST, "eval_every": 0, "max_steps": 2, "warmup_steps": 0, "lr": 0.01}
    train(_sft(tmp_path / "end", files, **quick))
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("best ")]
    assert line.startswith("best   step 2/2 = the final model (--eval-every 0")
    assert line.endswith("exported to best/")


@pytest.mark.slow  # trains past a few steps
def test_a_resumed_run_keeps_the_best(tmp_path, files, best_run):
    straight, summary = best_run
    out = tmp_path / "parted"
    low = summary["best_step"]
    stopped = train_until(_sft(out, files, **BEST), low + 1)
    assert stopped["steps"] == low + 1 and stopped["best_step"] == low
    resumed = train(_sft(out, files, **BEST, resume=True))
    assert resumed["steps"] == 6 and resumed["best_step"] == low
    assert resumed["best_eval_loss"] == summary["best_eval_loss"]
    assert _evals(out) == _evals(straight)  # the steps after the resume are no better
    assert _same_weights(_state(out / "best"), _state(straight / "best"))


def test_eval_settings_refused_in_one_line(tmp_path, files, capsys):
    base = ["train", "--task", "sft", "--init-from", files["gpt"], "--data", files["train"]]
    out = str(tmp_path / "refused")
    line = one_line_error(capsys, [*base, "--out", out, "--eval-fraction", "0", "--save-best"])
    assert line.startswith("gradaccum: error: --save-best: needs an eval set")
    both = ["--eval-data", files["eval"], "--eval-fraction", "0.1"]
    line = one_line_error(capsys, [*base, "--out", out, *both])
    assert line.startswith("gradaccum: error: --eval-fraction 0.1: give either --eval-data")
    missing = str(tmp_path / "missing.jsonl")
    line = one_line_error(capsys, [*base, "--out", out, "--eval-data", missing])
    assert line.startswith(f"gradaccum: error: --eval-data {missing}")
    assert not os.path.exists(out)


def test_pretraining_evaluates_on_the_eval_file(tmp_path):
    data = markov_npy(tmp_path / "train.npy", 4096, seed=1)
    held = markov_npy(tmp_path / "held.npy", 16 * 10 + 1, seed=2)  # 10 sequences of 16
    out = tmp_path / "run"
    config = dict(data=str(data), eval_data=str(held), seq_len=16, micro_batch=2)
    train(TrainConfig(out=str(out), accum_steps=1, max_steps=1, eval_every=0, **config))
    (evaluated,) = [r for r in _records(out) if "eval_loss" in r]
    model = build_model(init_from=str(out))[0].double().eval()
    tokens = torch.from_numpy(np.load(held).astype(np.int64))
    rows = torch.stack([tokens[i * 16 : i * 16 + 17] for i in range(10)])
    with torch.no_grad():
        logits = model(rows[:, :-1])
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    assert evaluated["eval_loss"] == pytest.approx(float(want), rel=1e-5)
