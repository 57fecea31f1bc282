"""`gradaccum train --init-from` a local Hugging Face folder (made in the test: a tiny GPT-2 and
a tiny Llama from config, a tokenizer trained with `tokenizers`, a chat template): fine-tuned,
exported with save_pretrained, and loaded back by transformers with the trained logits."""

import json
import os

import pytest
import torch
import yaml

from gradaccum.models.build import build_model
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

transformers = pytest.importorskip("transformers")

ROWS = [
    {"prompt": f"reverse: {w}\n", "completion": w[::-1]}
    for w in ("fox", "quick brown", "lazy dog", "over", "the", "jumps", "sort and add", "count")
]
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"sort {w}"},
            {"role": "assistant", "content": "".join(sorted(w))},
        ]
    }
    for w in ("fox", "dog", "quick", "lazy", "brown", "over")
]


def _jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _fine_tune(tmp_path, folder, rows=ROWS, **kw):
    out = tmp_path / "run"
    data = _jsonl(tmp_path / "sft.jsonl", rows)
    base = dict(
        task="sft",
        init_from=folder,
        data=data,
        out=str(out),
        seq_len=48,
        examples_per_step=4,
        micro_batch=2,
        max_steps=3,
        eval_every=0,
        lr=1e-2,
    )
    return out, train(TrainConfig(**{**base, **kw}))


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fine_tune_export_and_load_back(tmp_path, make_hf_folder, arch):
    folder = make_hf_folder(arch)
    out, summary = _fine_tune(tmp_path, folder)
    assert summary["steps"] == 3 and "hf/" in summary["files"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(out / "hf"), local_files_only=True
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / "hf"), local_files_only=True)
    assert tokenizer.chat_template  # the folder's template went with the weights
    trained, _ = build_model(init_from=str(out))  # model.pt: the run's own export
    start = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    ids = torch.tensor([tokenizer("reverse: quick brown\nnworb")["input_ids"]])
    want = _logits(trained, ids)
    assert torch.allclose(_logits(exported, ids), want, rtol=0, atol=1e-5)
    assert (_logits(start, ids) - want).abs().max() > 1e-3  # it did train


def test_messages_through_the_folders_chat_template(tmp_path, make_hf_folder):
    out, summary = _fine_tune(tmp_path, make_hf_folder("gpt2"), rows=CHATS, max_steps=2)
    lines = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]
    assert len(lines) == 2 and all(r["counted_tokens"] > 0 for r in lines)
    assert summary["final_eval_loss"] is not None


@pytest.mark.parametrize(
    "kw, layout",
    [
        ({"max_shard_size": "20KB"}, "sharded safetensors"),
        ({"safe_serialization": False}, "pytorch_model.bin"),
    ],
)
def test_other_weight_layouts_load(tmp_path, make_hf_folder, capsys, kw, layout):
    folder = make_hf_folder("llama", **kw)
    if "max_shard_size" in kw:
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    out, summary = _fine_tune(tmp_path, folder, max_steps=1)
    assert f"HF llama, {layout}" in capsys.readouterr().out
    assert summary["steps"] == 1 and os.path.isdir(out / "hf")


def test_bf16_weights_stay_bf16(tmp_path, make_hf_folder):
    folder = make_hf_folder("gpt2", dtype=torch.bfloat16)
    out, _ = _fine_tune(tmp_path, folder, max_steps=2)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(out / "hf"), local_files_only=True, dtype="auto"
    )
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    start = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    moved = [
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(exported.parameters(), start.parameters(), strict=True)
    ]
    assert max(moved) > 0  # the bf16 weights were stepped


def test_pretraining_from_a_folder_exports_it_too(tmp_path, make_hf_folder):
    folder = make_hf_folder("gpt2")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = tmp_path / "pre"
    config = TrainConfig(
        init_from=folder,
        data=str(text),
        out=str(out),
        seq_len=16,
        micro_batch=2,
        accum_steps=2,
        max_steps=2,
        eval_every=0,
    )
    summary = train(config)
    assert "hf/" in summary["files"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(out / "hf"), local_files_only=True
    )
    trained, _ = build_model(init_from=str(out))
    ids = torch.tensor([list(b"the quick brown fox")])
    assert torch.allclose(_logits(exported, ids), _logits(trained, ids), rtol=0, atol=1e-5)


# ---- issue 38 item 2: a pretrained model's lr and weight decay -------------------------------


def _settings(out) -> dict:
    """config.yaml's values, the sections flattened."""
    with open(out / "config.yaml", encoding="utf-8") as f:
        return {k: v for section in yaml.safe_load(f).values() for k, v in section.items()}


@pytest.mark.parametrize(
    "kw, lr, weight_decay, words",
    [
        # TRL's learning_rate for full fine-tuning; transformers' weight_decay default
        ({}, 2e-5, 0.0, "lr 2e-05 (the pretrained-model default; --lr to change), weight decay "
         "0 (the pretrained-model default; --weight-decay to change)"),
        # LoRA: TRL's PEFT examples' 2e-4; a weight decay given is kept
        ({"lora_rank": 4, "weight_decay": 0.05}, 2e-4, 0.05, "lr 0.0002 (the pretrained-model "
         "default; --lr to change), weight decay 0.05 (--weight-decay)"),
    ],
)  # fmt: skip
def test_a_pretrained_folder_trains_at_a_pretrained_models_defaults(
    tmp_path, make_hf_folder, capsys, kw, lr, weight_decay, words
):
    out, summary = _fine_tune(tmp_path, make_hf_folder("llama"), max_steps=1, lr=None, **kw)
    assert f"optim  {words}\n" in capsys.readouterr().out
    saved = _settings(out)
    assert saved["lr"] == lr and saved["weight_decay"] == weight_decay  # what it trained with
    first = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r][0]
    assert first["lr"] == pytest.approx(lr)  # one step, no warmup: the peak
