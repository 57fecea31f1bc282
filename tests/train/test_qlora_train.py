"""QLoRA in `gradaccum train`: LoRA adapters on a base whose block linear layers bitsandbytes
stores in 4 bits (NF4) or 8 (LLM.int8), on the CPU, for a tiny Llama folder and the built-in
GPT. The run trains (loss down over 30 steps) with the base's layers really quantised; its
first step is the same at micro-batch 1 and 8; its checkpoints hold the adapters only and a
resume ends bit for bit where the straight run does; peft loads its adapter folder onto the
same 4-bit base with the trained model's logits; and what cannot be is one line, exit 2."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gradaccum.cli import main
from gradaccum.models import quantized
from gradaccum.train import adapters
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

from .helpers import one_line_error, train_records
from .small_run import latest_checkpoint, train_until

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

ROWS = [
    {"prompt": f"reverse: {w}\n", "completion": "the quick brown fox"}
    for w in (
        "fox", "quick brown", "lazy dog", "over", "the", "jumps", "sort and add", "count",
        "brown fox", "dog", "quick", "lazy", "add", "sort", "reverse", "jumps over",
    )
]  # fmt: skip
"""Prompts with one answer, which adapters on a random tiny base start to learn within 30 steps."""


def _jsonl(path) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    return str(path)


def _config(tmp_path, arch, folder, bits, name="run", **kw) -> TrainConfig:
    source = {"init_from": folder} if arch == "llama" else {"model": "tiny"}
    base = dict(
        task="sft",
        data=_jsonl(tmp_path / "sft.jsonl"),
        out=str(tmp_path / name),
        seq_len=48,
        examples_per_step=4,
        micro_batch=2,
        max_steps=30,
        eval_every=0,
        save_every=15,
        lr=5e-2,
        weight_decay=0.1,  # the rate the 30-step drop below was measured at
        lora_rank=4,
        base_bits=bits,
        device="cpu",
        **source,
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture
def spied(monkeypatch) -> dict:
    """The model each run trains (the object LoRA went onto), captured."""
    seen = {}
    real = adapters.attach

    def attach(model, info, config):
        seen["model"] = model
        return real(model, info, config)

    monkeypatch.setattr(adapters, "attach", attach)
    return seen


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), quantized.quiet():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


@pytest.mark.slow  # 30 steps
@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("bits", [4, 8])
def test_trains_on_a_quantised_base_and_exports_for_peft(
    tmp_path, make_hf_folder, spied, arch, bits
):
    folder = make_hf_folder("llama") if arch == "llama" else None
    config = _config(tmp_path, arch, folder, bits, examples_per_step=8, micro_batch=4)
    summary = train(config)
    assert summary["steps"] == 30 and "adapter/" in summary["files"]

    # The base's block linear layers are bitsandbytes' quantised modules, under the adapters.
    model = spied["model"]
    layers = quantized.quantized_layers(model)
    kind = "Linear4bit" if bits == 4 else "Linear8bitLt"
    assert layers and all(type(m).__name__ == kind for _, m in layers)
    assert all(n.endswith(".base_layer") for n, _ in layers)
    stored = layers[0][1].weight
    assert stored.dtype == (torch.uint8 if bits == 4 else torch.int8)

    # It trained: the mean loss of the last 5 steps at least 0.15 nats under that of the first
    # 5 (three times the spread of a 5-step mean here; measured drops 0.3 to 0.7).
    losses = [r["loss"] for r in train_records(config.out)]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.15, losses

    # The checkpoint: adapter tensors only, no base tensor, quantised or not.
    ckpt = latest_checkpoint(config.out)
    assert ckpt.step == 30 and ckpt.model_state
    assert all(".lora_" in k for k in ckpt.model_state), sorted(ckpt.model_state)[:3]
    with open(os.path.join(config.out, "checkpoints", "step-00000030", "config.json")) as f:
        record = json.load(f)[adapters.RECORD]["base_quant"]
    assert record["bits"] == bits and record["layers"] == len(layers)

    if arch != "llama":
        return
    # peft's own loading of the adapter folder onto the same 4- or 8-bit base (transformers'
    # BitsAndBytesConfig, fp32 as the run computed, in the layout it trained in: docs) gives
    # the trained model's logits.
    import peft

    spec = quantized.QuantSpec(bits)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        local_files_only=True,
        dtype=torch.float32,
        quantization_config=quantized.quantization_config(spec),
        device_map={"": "cpu"},
    )
    quantized.keep_training_layout(base)
    loaded = peft.PeftModel.from_pretrained(base, os.path.join(config.out, "adapter"))
    ids = torch.tensor([[5, 17, 42, 9, 33, 7, 21, 60, 11, 3]])
    want = _logits(model, ids)
    assert torch.allclose(_logits(loaded, ids), want, rtol=0, atol=1e-5)
    start = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        local_files_only=True,
        dtype=torch.float32,
        quantization_config=quantized.quantization_config(spec),
        device_map={"": "cpu"},
    )
    quantized.keep_training_layout(start)
    assert (_logits(start, ids) - want).abs().max() > 1e-3  # the adapters moved it


def _first_step(tmp_path, arch, folder, bits, micro) -> dict:
    config = _config(
        tmp_path, arch, folder, bits, name=f"mb{micro}", max_steps=1, micro_batch=micro,
        examples_per_step=8, packing="none",
    )  # fmt: skip
    train(config)
    return train_records(config.out)[0]


@pytest.mark.parametrize(("arch", "bits"), [("llama", 4), ("gpt", 8)])
def test_first_step_is_the_same_at_micro_batch_1_and_8(tmp_path, make_hf_folder, arch, bits):
    folder = make_hf_folder("llama") if arch == "llama" else None
    one = _first_step(tmp_path, arch, folder, bits, 1)
    eight = _first_step(tmp_path, arch, folder, bits, 8)
    assert one["accum_steps"] == 8 and eight["accum_steps"] == 1
    assert one["loss"] == pytest.approx(eight["loss"], rel=1e-5)
    assert one["grad_norm"] == pytest.approx(eight["grad_norm"], rel=1e-5)


def test_activation_checkpointing_gives_the_same_first_step(tmp_path, make_hf_folder):
    """Recomputing the 4-bit blocks in backward (after the k-bit preparation) changes the
    time, not the step."""
    folder = make_hf_folder("llama")
    plain = _first_step(tmp_path, "llama", folder, 4, 4)
    config = _config(
        tmp_path, "llama", folder, 4, name="ckpt", max_steps=1, micro_batch=4,
        examples_per_step=8, packing="none", activation_checkpointing=True,
    )  # fmt: skip
    train(config)
    recomputed = train_records(config.out)[0]
    assert recomputed["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


@pytest.mark.slow  # trains past a few steps
def test_resume_is_bit_for_bit(tmp_path, make_hf_folder):
    folder = make_hf_folder("llama")
    straight = _config(tmp_path, "llama", folder, 4, name="straight", max_steps=4, save_every=2)
    train(straight)
    halves = _config(tmp_path, "llama", folder, 4, name="halves", max_steps=4, save_every=2)
    train_until(halves, 2)
    assert latest_checkpoint(halves.out).step == 2
    train(_config(tmp_path, "llama", folder, 4, name="halves", max_steps=4, save_every=2,
                  resume=True))  # fmt: skip
    assert train_records(halves.out) == train_records(straight.out)
    want, got = latest_checkpoint(straight.out), latest_checkpoint(halves.out)
    assert got.step == 4 and got.model_state.keys() == want.model_state.keys()
    for name, tensor in want.model_state.items():
        assert torch.equal(got.model_state[name], tensor), name


def _cli(tmp_path, *extra) -> list[str]:
    argv = ["train", "--task", "sft", "--data", _jsonl(tmp_path / "sft.jsonl"), "--seq-len", "48"]
    argv += ["--examples-per-step", "4", "--micro-batch", "2", "--eval-every", "0"]
    return argv + ["--device", "cpu", "--out", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--base-bits", "4"], "--base-bits 4: a quantised base cannot be trained in full"),
        (["--lora-rank", "4", "--base-bits", "3"], "--base-bits 3: expected 4 (NF4, QLoRA) or 8"),
        (["--lora-rank", "4", "--base-bits", "8", "--base-quant", "fp4"], "needs --base-bits 4"),
        (["--lora-rank", "4", "--base-bits", "4", "--base-quant", "int3"], "--base-quant int3"),
    ],
)
def test_bad_quantisation_flags_are_one_line(tmp_path, capsys, extra, words):
    line = one_line_error(capsys, _cli(tmp_path, "--max-steps", "1", *extra))
    assert words in line, line
    assert not (tmp_path / "run").exists()


def test_a_model_with_no_linear_layer_is_refused():
    class Embedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(10, 8)

    with pytest.raises(quantized.BadInput) as err:
        quantized.quantize_linears(Embedding(), quantized.QuantSpec(4))
    assert "Embedding has no linear layer to quantise" in str(err.value)


def test_resume_on_other_quantisation_is_refused_merge_included(tmp_path, capsys):
    argv = _cli(tmp_path, "--lora-rank", "4", "--base-bits", "4", "--save-every", "1")
    assert main([*argv, "--max-steps", "1"]) == 0
    capsys.readouterr()
    before = sorted(os.listdir(tmp_path / "run"))
    checkpoints = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    resumed = [*argv, "--max-steps", "2", "--resume", "--merge-lora", "--base-quant", "fp4"]
    line = one_line_error(capsys, resumed)
    assert "--base-quant fp4: the run in" in line and "4-bit nf4 base" in line, line
    assert "4-bit fp4 base" in line
    line = one_line_error(capsys, [*argv[:-2], "--base-bits", "8", "--max-steps", "2", "--resume"])
    assert "--base-bits 8: the run in" in line and "an 8-bit (LLM.int8) base" in line, line
    # Nothing written: no merged model, no new checkpoint, the run folder as it was.
    assert sorted(os.listdir(tmp_path / "run")) == before
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == checkpoints


def test_merge_into_a_gpt2_folder_transposes_back_to_conv1d(
    tmp_path, make_hf_folder, spied, capsys
):
    """transformers loads GPT-2's Conv1D layers (in x out) as Linear4bit (out x in); the merged
    export gives them back as Conv1D, with the trained model's logits."""
    folder = make_hf_folder("gpt2")
    config = _config(tmp_path, "llama", folder, 4, max_steps=2, merge_lora=True)
    summary = train(config)
    assert "merged/" in summary["files"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(config.out, "merged"), local_files_only=True
    )
    assert type(merged.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    ids = torch.tensor([[5, 17, 42, 9, 33, 7, 21, 60, 11, 3]])
    assert torch.allclose(_logits(merged, ids), _logits(spied["model"], ids), rtol=0, atol=1e-5)
    said = capsys.readouterr().out
    assert "merged/: the adapters folded into the dequantised base, saved in float32" in said


@pytest.mark.slow  # trains past a few steps
@pytest.mark.parametrize(("arch", "bits"), [("gpt", 4), ("gpt", 8), ("llama", 4), ("llama", 8)])
def test_an_evaluation_changes_nothing_training_computes(tmp_path, make_hf_folder, arch, bits):
    """Evaluating runs the base in eval mode, where bitsandbytes on an AVX512-BF16 CPU repacks
    a 4-bit layer for bf16 inference (taken here on any CPU: tests/avx512bf16.py). Every step
    of a run evaluated every 2 steps, and of one stopped after its evaluation at step 2 and
    resumed, is bit for bit that of the run evaluated only at its end."""
    folder = make_hf_folder("llama") if arch == "llama" else None
    held_out = _jsonl(tmp_path / "held_out.jsonl")

    def run(name, **kw) -> TrainConfig:
        return _config(tmp_path, arch, folder, bits, name=name, max_steps=4, save_every=2,
                       eval_data=held_out, **kw)  # fmt: skip

    train(quiet := run("end"))
    train(often := run("often", eval_every=2))
    evaluated = [
        r for r in read_metrics(os.path.join(often.out, "metrics.jsonl")) if "eval_loss" in r
    ]
    assert [r["step"] for r in evaluated][:2] == [2, 4], evaluated
    assert train_records(often.out) == train_records(quiet.out)
    train_until(run("resumed", eval_every=2), 2)
    train(run("resumed", eval_every=2, resume=True))
    assert train_records(str(tmp_path / "resumed")) == train_records(quiet.out)
