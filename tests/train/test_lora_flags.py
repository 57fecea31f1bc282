"""`gradaccum train --lora-rank`: every bad --lora-* value is one line, exit 2, nothing
written; a LoRA run's start names its targets and trainable parameters (count and fraction,
derived by hand from the preset's shape) and plans the frozen-base memory; `--micro-batch
auto` probes the frozen base."""

from __future__ import annotations

import builtins
import re

import pytest

from gradaccum.cli import main
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.train import micro_batch
from gradaccum.utils.choices import BUILTIN_MODELS

from .helpers import one_line_error

pytest.importorskip("peft")

RUN = [
    "train",
    "--seq-len",
    "16",
    "--micro-batch",
    "2",
    "--accum-steps",
    "2",
    "--max-steps",
    "1",
    "--eval-every",
    "0",
    "--device",
    "cpu",
]
BUILTIN_VOCAB = 512  # the built-in Markov corpus


def tiny_adapters(rank: int) -> int:
    """r x (in + out) over the built-in GPT's linear layers, by hand: per block c_attn h -> 3h,
    the attention's c_proj h -> h, c_fc h -> 4h, the MLP's c_proj 4h -> h."""
    shape = BUILTIN_MODELS["tiny"]
    h = shape["n_embd"]
    per_block = (h + 3 * h) + (h + h) + (h + 4 * h) + (4 * h + h)
    return shape["n_layer"] * rank * per_block


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--lora-rank", "0"], "--lora-rank 0: must be a whole number >= 1"),
        (["--lora-rank", "-3"], "--lora-rank -3: must be a whole number >= 1"),  # as 0
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha 0: must be a positive number"),
        (["--lora-rank", "4", "--lora-alpha", "-2"], "--lora-alpha -2: must be a positive number"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout 1: must be in [0, 1)"),
        (["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout 1.5: must be in [0, 1)"),
        (["--lora-rank", "4", "--lora-dropout", "-0.1"], "--lora-dropout -0.1: must be in [0, 1)"),
        (["--lora-alpha", "8"], "--lora-alpha 8: needs --lora-rank"),
        (["--lora-dropout", "0.1"], "--lora-dropout 0.1: needs --lora-rank"),
        (["--lora-targets", "c_fc"], "--lora-targets c_fc: needs --lora-rank"),
        (["--merge-lora"], "--merge-lora: needs --lora-rank"),
    ],
)
def test_a_bad_lora_flag_is_one_line_and_writes_nothing(capsys, tmp_path, extra, line):
    out = tmp_path / "run"
    got = one_line_error(capsys, [*RUN, "--out", str(out), *extra])
    assert got.endswith(line), got
    assert not out.exists()


@pytest.mark.parametrize("targets, missing", [("q_proj", "q_proj"), ("c_attn,nope", "nope")])
def test_targets_that_match_nothing_are_named_with_what_exists(capsys, tmp_path, targets, missing):
    out = tmp_path / "run"
    line = one_line_error(
        capsys, [*RUN, "--out", str(out), "--lora-rank", "4", "--lora-targets", targets]
    )
    assert line.endswith(
        f"--lora-targets {targets}: {missing} matches no module of GPT; its linear layers are "
        "c_attn, c_proj, c_fc (e.g. blocks.0.attn.c_attn, blocks.0.attn.c_proj)"
    ), line
    assert not out.exists()


def test_without_peft_the_error_names_the_extra(capsys, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    out = tmp_path / "run"
    line = one_line_error(capsys, [*RUN, "--out", str(out), "--lora-rank", "4"])
    assert line.endswith("--lora-rank 4: needs peft (pip install 'gradaccum[lora]')"), line
    assert not out.exists()


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def _row(output: str, name: str) -> float:
    match = re.search(rf"memory: {name}\s*│\s*([\d.]+ [kMG]?B)", output)
    assert match, f"no 'memory: {name}' row in:\n{output}"
    return _bytes(match.group(1))


@pytest.mark.parametrize(
    "precision",
    ["fp32", pytest.param("bf16", marks=pytest.mark.slow)],  # bf16 on CPU: 14 s for one step
)
def test_the_start_names_targets_and_trainable_count_and_plans_the_frozen_base(
    capsys, tmp_path, precision
):
    code = main(
        [*RUN, "--out", str(tmp_path / "run"), "--lora-rank", "4", "--precision", precision]
    )
    output = "".join(capsys.readouterr())
    assert code == 0, output
    trainable = tiny_adapters(4)
    base = GPT(GPTConfig(vocab_size=BUILTIN_VOCAB, seq_len=16, **BUILTIN_MODELS["tiny"]))
    total = sum(p.numel() for p in base.parameters()) + trainable
    assert (
        f"lora   LoRA rank 4, alpha 8, dropout 0 on c_attn, c_proj, c_fc (16 layers): "
        f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%), "
        "the base frozen"
    ) in output
    assert f"model  preset tiny: {total:,} parameters" in output
    # AdamW's two fp32 moments (and in bf16 the fp32 master copy) for the adapters alone;
    # the table shows 5 significant digits.
    moments = (8 if precision == "fp32" else 12) * trainable
    assert _row(output, "optimizer state") == pytest.approx(moments, rel=1e-4)
    buffer = 0 if precision == "fp32" else 4 * trainable
    assert _row(output, "fp32 accum buffer") == pytest.approx(buffer, rel=1e-4)
    # .grad and the one tensor in flight: at most twice the adapters' fp32 bytes, far below the
    # base's 4 bytes per parameter.
    assert 0 < _row(output, "gradients") <= 8 * trainable < 4 * (total - trainable)


def test_micro_batch_auto_probes_the_frozen_base(capsys, tmp_path, monkeypatch):
    seen = {}
    real = micro_batch.fit.find_micro_batch

    def spy(model, *args, make_optimizer, **kwargs):
        seen["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
        seen["numel"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt = make_optimizer(model)
        seen["optimized"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
        return real(model, *args, make_optimizer=make_optimizer, **kwargs)

    monkeypatch.setattr(micro_batch.fit, "find_micro_batch", spy)
    argv = [
        "train",
        "--seq-len",
        "16",
        "--tokens-per-step",
        "256",
        "--max-steps",
        "1",
        "--eval-every",
        "0",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "run"),
        "--lora-rank",
        "2",
    ]
    code = main(argv)
    output = "".join(capsys.readouterr())
    assert code == 0, output
    assert seen["trainable"] and all(".lora_" in n for n in seen["trainable"])
    assert seen["numel"] == seen["optimized"] == tiny_adapters(2)


@pytest.mark.slow  # a probe at --seq-len 128, then 500 held-out examples answered greedily
def test_sft_micro_batch_auto_probes_the_frozen_base_at_full_width(capsys, tmp_path, monkeypatch):
    """--task sft with --micro-batch auto measures (it does not take the estimate): the probe
    sees the adapters alone trainable and micro-batches of full --seq-len rows, the widest a
    window can pad to; the run then trains with the size the probe chose."""
    seen = {"widths": set()}
    real = micro_batch.fit.find_micro_batch

    def spy(model, make_batch, *args, make_optimizer, **kwargs):
        seen["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
        seen["numel"] = sum(p.numel() for p in model.parameters() if p.requires_grad)

        def recorded(size):
            batch = make_batch(size)
            seen["widths"].add(batch["input_ids"].shape[1])
            return batch

        result = real(model, recorded, *args, make_optimizer=make_optimizer, **kwargs)
        seen["chosen"] = result.micro_batch
        return result

    monkeypatch.setattr(micro_batch.fit, "find_micro_batch", spy)
    out = tmp_path / "run"
    argv = ["train", "--task", "sft", "--micro-batch", "auto", "--examples-per-step", "8"]
    argv += ["--max-steps", "1", "--eval-every", "0", "--device", "cpu", "--out", str(out)]
    argv += ["--lora-rank", "2", "--json"]
    code = main(argv)
    output = "".join(capsys.readouterr())
    assert code == 0, output
    assert seen["trainable"] and all(".lora_" in n for n in seen["trainable"])
    assert seen["numel"] == tiny_adapters(2)
    assert seen["widths"] == {128}  # the SFT default --seq-len
    # the plan states the size chosen; the probe's table no k nor target, which a fine-tuning
    # window's examples settle
    assert f"--micro-batch {seen['chosen']} x --seq-len 128" in output
    assert "vs target" not in output and "from the target" not in output
