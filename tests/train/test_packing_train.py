"""`gradaccum train --task sft --packing none|window|padding-free`: the first step's loss and
gradient norm, in each mode, against a float64 computation of every example of the window
run alone (no padding, no packing, no engine); the three modes against each other; a resumed
packed run equal bit for bit to an uninterrupted one; the default mode per model."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from gradaccum.cli import main
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.data.sft.windows import SFTBatches
from gradaccum.models.build import build_model
from gradaccum.train import sft
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.train.rundir.resume import settings_to_resume

from .helpers import train_records

MODES = ("none", "window", "padding-free")
SEQ_LEN = 64


def _jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory) -> str:
    """60 rows of the built-in tasks: prompts and answers of very different lengths."""
    rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in builtin_rows(3, 60)]
    return _jsonl(tmp_path_factory.mktemp("sft") / "ragged.jsonl", rows)


def _config(out, data, **kw) -> TrainConfig:
    base = dict(
        task="sft", out=str(out), data=data, seq_len=SEQ_LEN, max_steps=1, eval_every=0,
        examples_per_step=16, micro_batch=4,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _first_line(out) -> dict:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r][0]


def _reference(config: TrainConfig, model: torch.nn.Module) -> tuple[float, float, int]:
    """(loss, gradient norm, targets) of the run's first window in float64: each example of
    the window alone through `model` (inputs ids[:-1], targets labels[1:]), the
    cross-entropies summed over every target of the window and divided by their count."""
    parts = sft.load_data(config)
    window = SFTBatches(
        parts.train, micro_batch=1, pad_id=0, examples_per_step=config.examples_per_step,
        seed=config.seed,
    ).next_indices()  # fmt: skip
    model = model.double().train()
    total, n = 0.0, 0
    for i in window:
        e = parts.train[i]
        ids = torch.as_tensor(e.input_ids[:-1], dtype=torch.long)[None]
        labels = torch.as_tensor(e.labels[1:], dtype=torch.long)
        out = model(ids)
        logits = (out if isinstance(out, torch.Tensor) else out.logits)[0]
        total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        n += int((labels != -100).sum())
    (total / n).backward()
    norm = math.sqrt(
        sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    )
    return float(total.detach()) / n, norm, n


def _check_modes(lines: dict, want: tuple[float, float, int]) -> None:
    loss, norm, n = want
    for mode, line in lines.items():
        assert line["counted_tokens"] == n, mode
        assert line["loss"] == pytest.approx(loss, rel=1e-5), mode
        assert line["grad_norm"] == pytest.approx(norm, rel=1e-5), mode
    first = lines["none"]
    for mode in MODES[1:]:  # the modes against each other, as the trainer reports them
        assert abs(lines[mode]["loss"] - first["loss"]) <= 1e-5 * first["loss"], mode
        assert abs(lines[mode]["grad_norm"] - first["grad_norm"]) <= 1e-5 * first["grad_norm"]


def test_first_step_is_the_same_in_every_mode_builtin_gpt(tmp_path, ragged):
    lines = {}
    for mode in MODES:
        out = tmp_path / mode
        train(_config(out, ragged, packing=mode))
        lines[mode] = _first_line(out)
    # the modes really cut the window differently: k differs
    assert lines["none"]["accum_steps"] == 4
    assert lines["padding-free"]["accum_steps"] < lines["none"]["accum_steps"]
    torch.manual_seed(0)
    model, _ = build_model(preset="tiny", vocab_size=257, seq_len=SEQ_LEN)
    _check_modes(lines, _reference(_config(tmp_path / "ref", ragged), model))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_first_step_is_the_same_in_every_mode_hugging_face(tmp_path, make_hf_folder, arch):
    pytest.importorskip("transformers")
    folder = make_hf_folder(arch)
    words = "quick brown fox jumps over the lazy dog and counts sorted letters".split()
    rows = [
        {"prompt": f"reverse: {' '.join(words[: 1 + i % 9])}\n", "completion": words[i % 12][::-1]}
        for i in range(40)
    ]
    data = _jsonl(tmp_path / "hf.jsonl", rows)
    lines = {}
    for mode in MODES:
        out = tmp_path / mode
        train(_config(out, data, packing=mode, init_from=folder, seq_len=48))
        lines[mode] = _first_line(out)
    model, _ = build_model(init_from=folder)
    ref = _config(tmp_path / "ref", data, seq_len=48, init_from=folder)
    _check_modes(lines, _reference(ref, model))


@pytest.mark.slow  # trains past a few steps
@pytest.mark.parametrize("mode", ["window", "padding-free"])
def test_resume_with_packing_is_bit_for_bit(tmp_path, ragged, mode):
    def run(out, **kw):
        config = _config(
            out, ragged, examples_per_step=6, micro_batch=2, max_steps=6, save_every=3,
            packing=mode,
        )  # fmt: skip
        return train(config, **kw)

    straight, parted = tmp_path / "straight", tmp_path / "parted"
    run(straight)
    stopped = run(parted, should_stop=lambda step: step == 3)
    assert stopped["stopped"] == "request" and stopped["steps"] == 3
    values = settings_to_resume({"out": str(parted), "resume": True})
    assert values["packing"] == mode
    values = {k: v for k, v in values.items() if k not in ("out", "resume")}
    assert train(TrainConfig(out=str(parted), resume=True, **values))["steps"] == 6
    assert train_records(parted) == train_records(straight)
    a = torch.load(straight / "model.pt", weights_only=True)
    b = torch.load(parted / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_default_packing_is_padding_free_for_the_builtin_gpt(capsys, tmp_path, ragged):
    argv = ["train", "--task", "sft", "--data", ragged, "--out", str(tmp_path / "d")]
    assert main([*argv, "--seq-len", "64", "--max-steps", "1", "--eval-every", "0"]) == 0
    printed = capsys.readouterr().out
    assert "--packing padding-free (the default for this model)" in printed


def test_default_packing_of_a_hugging_face_model(make_hf_folder):
    transformers = pytest.importorskip("transformers")
    from transformers import masking_utils

    # padding-free exactly where transformers reads restarting position ids as packed
    # sequences (its masking utilities, which GPT-2 and Llama build their masks with)
    want = "padding-free" if hasattr(masking_utils, "find_packed_sequence_indices") else "window"
    for arch in ("llama", "gpt2"):
        config = TrainConfig(task="sft", init_from=make_hf_folder(arch))
        assert sft.packing_of(config) == want, (arch, transformers.__version__)
    assert sft.packing_of(TrainConfig(task="sft")) == "padding-free"
    assert sft.packing_of(TrainConfig(task="sft", packing="none")) == "none"


@pytest.mark.parametrize(
    "mode, holds",
    [
        ("padding-free", "sft    micro-batch 2 rows of 64 positions (padding-free: several "
         "examples a row; --micro-batch counts rows, not examples)"),
        ("window", "sft    micro-batch up to 128 positions, padding included (window: as many "
         "examples as fit; --micro-batch counts rows of --seq-len, not examples)"),
        ("none", "sft    micro-batch 2 examples, padded to their longest (none: --micro-batch "
         "counts examples)"),
    ],
)  # fmt: skip
def test_the_start_says_what_a_micro_batch_holds(capsys, tmp_path, ragged, mode, holds):
    # --micro-batch 1 --examples-per-step 32 gave k = 13 padding-free, read as examples
    argv = ["train", "--task", "sft", "--data", ragged, "--out", str(tmp_path / mode),
            "--packing", mode, "--micro-batch", "2", "--seq-len", str(SEQ_LEN),
            "--max-steps", "1", "--eval-every", "0"]  # fmt: skip
    assert main(argv) == 0
    assert holds in capsys.readouterr().out.splitlines()


def test_the_micro_batch_help_says_what_it_counts_in_each_packing_mode(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    help_text = text[text.index("--micro-batch N|auto ") :][:700]
    for mode, unit in (("padding-free", "rows of --seq-len positions, several examples a row"),
                       ("window", "--micro-batch x --seq-len positions"), ("none", "examples")):  # fmt: skip
        assert f"{mode}: {unit}" in help_text, (mode, help_text)
