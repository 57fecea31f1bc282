"""A finished `gradaccum train --lora-rank R --merge-lora` run exports --out/adapter, which
peft's own `PeftModel.from_pretrained(base, folder)` loads onto a fresh base, and --out/merged,
which transformers (or, for the built-in GPT, build_model) loads as a plain model: both give
the trained model's logits to <= 1e-5, for a tiny GPT-2, a tiny Llama and the built-in GPT."""

from __future__ import annotations

import json
import os
from dataclasses import fields

import pytest
import torch

from gradaccum.cli import main
from gradaccum.models.build import build_model
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.train import adapters

from .test_lora_resume import gpt_folder

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 40


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return str(path)


def logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def trained_run(monkeypatch, capsys, out, data, init_from, *extra):
    """Train 3 LoRA steps from `init_from` and return the trained model as the run ends."""
    seen = {}
    real = adapters.export

    def spy(model, config, tokenizer=None):
        seen["model"] = model
        return real(model, config, tokenizer)

    monkeypatch.setattr(adapters, "export", spy)
    argv = [
        "train",
        "--init-from",
        init_from,
        "--data",
        data,
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
        "--accum-steps",
        "2",
        "--max-steps",
        "3",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--lora-rank",
        "4",
        "--merge-lora",
        *extra,
    ]
    code = main(argv)
    output = "".join(capsys.readouterr())
    assert code == 0, output
    assert "adapter/, merged/" in output
    return seen["model"]


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


IDS = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_adapter_folder_and_merged_model_load_with_the_trained_logits(
    tmp_path, make_hf_folder, text_file, monkeypatch, capsys, arch
):
    folder = make_hf_folder(arch)
    out = tmp_path / "run"
    trained = trained_run(monkeypatch, capsys, out, text_file, folder)
    want = logits(trained, IDS)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert close(logits(fresh, IDS), want) > 1e-4  # the adapters did train
    loaded = peft.PeftModel.from_pretrained(fresh, str(out / "adapter"))
    assert close(logits(loaded, IDS), want) <= 1e-5
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(out / "merged"), local_files_only=True
    )
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert close(logits(merged, IDS), want) <= 1e-5
    with open(out / "adapter" / "adapter_config.json") as f:
        saved = json.load(f)
    assert (saved["r"], saved["lora_alpha"], saved["base_model_name_or_path"]) == (4, 8, folder)
    # the tokenizer of the --init-from folder beside both
    for name in ("adapter", "merged"):
        assert os.path.isfile(out / name / "tokenizer.json"), name


def test_built_in_gpt_adapter_folder_and_merged_checkpoint(
    tmp_path, text_file, monkeypatch, capsys
):
    base_dir = gpt_folder(tmp_path / "base", seed=2)
    out = tmp_path / "run"
    trained = trained_run(monkeypatch, capsys, out, text_file, base_dir)
    want = logits(trained, IDS)
    adapter = out / "adapter"
    assert sorted(os.listdir(adapter)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "base_config.json",
    ]
    with open(adapter / "base_config.json") as f:
        saved = json.load(f)
    names = {f.name for f in fields(GPTConfig)}
    base = GPT(GPTConfig(**{k: v for k, v in saved.items() if k in names}))
    base.load_state_dict(torch.load(os.path.join(base_dir, "model.pt"), weights_only=True))
    assert close(logits(base, IDS), want) > 1e-4  # the adapters did train
    loaded = peft.PeftModel.from_pretrained(base, str(adapter))
    assert close(logits(loaded, IDS), want) <= 1e-5
    plain, info = build_model(init_from=str(out / "merged"))
    assert type(plain) is GPT and info.kind == "gpt"
    assert close(logits(plain, IDS), want) <= 1e-5


def test_without_merge_lora_only_the_adapter_folder(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, "--seq-len", "16", "--micro-batch", "2"]
    argv += ["--accum-steps", "1", "--max-steps", "1", "--eval-every", "0", "--device", "cpu"]
    assert main([*argv, "--out", str(out), "--lora-rank", "2"]) == 0
    capsys.readouterr()
    assert os.path.isdir(out / "adapter") and not os.path.exists(out / "merged")
    assert not os.path.exists(out / "model.pt")  # no whole-model export of a LoRA run
