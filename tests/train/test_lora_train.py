"""LoRA inside the trainer: activation checkpointing and LoRA compose (the adapters get the
same gradients with and without recomputation, for the built-in GPT and a Hugging Face
Llama), and `--task sft --lora-rank` trains, saves the adapters only and resumes bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gradaccum.cli import main
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint

from .helpers import train_records

pytest.importorskip("peft")

TEXT = "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump.\n" * 40


def first_records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run(out, extra) -> list[dict]:
    argv = ["train", "--seq-len", "16", "--micro-batch", "2", "--accum-steps", "2"]
    argv += ["--max-steps", "2", "--eval-every", "0", "--device", "cpu", "--lr", "1e-2"]
    assert main([*argv, "--out", str(out), "--lora-rank", "4", *extra]) == 0
    return first_records(out)


@pytest.mark.slow  # two models trained with and without checkpointing
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_activation_checkpointing_gives_the_adapters_the_same_gradients(
    tmp_path, make_hf_folder, capsys, arch
):
    extra = []
    if arch != "gpt":
        text = tmp_path / "text.txt"
        text.write_text(TEXT)
        extra = ["--init-from", make_hf_folder(arch), "--data", str(text)]
    plain = run(tmp_path / "plain", extra)
    recomputed = run(tmp_path / "recomputed", [*extra, "--activation-checkpointing"])
    capsys.readouterr()
    # Recomputation changes what is stored, not the arithmetic: the same loss and gradient
    # norm at every step (the second step after an update made from those gradients).
    for a, b in zip(plain, recomputed, strict=True):
        assert a["grad_norm"] > 0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def sft_config(out, **kw) -> TrainConfig:
    base = dict(
        task="sft",
        out=str(out),
        examples_per_step=8,
        micro_batch=4,
        max_steps=4,
        eval_every=0,
        save_every=2,
        device="cpu",
        lora_rank=4,
        lora_dropout=0.1,
    )
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow  # trains past a few steps
def test_sft_with_lora_saves_adapters_only_and_resumes_bit_for_bit(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    train(sft_config(straight))
    train(sft_config(halves), should_stop=lambda step: step == 2)
    train(sft_config(halves, resume=True))
    assert train_records(halves) == train_records(straight)
    a = checkpoint.load(checkpoint.find_latest(str(straight)))
    b = checkpoint.load(checkpoint.find_latest(str(halves)))
    assert a.step == b.step == 4
    assert a.model_state and all(".lora_" in k for k in a.model_state)
    assert a.model_state.keys() == b.model_state.keys()
    for name, tensor in a.model_state.items():
        assert torch.equal(b.model_state[name], tensor), name
    assert os.path.isdir(straight / "adapter")
