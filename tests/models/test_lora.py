"""LoRA on a frozen base: the base stays bit for bit, the adapters' state holds no base tensor
and comes back bit for bit, peft's own loading and the merged export give the trained model's
logits, and the trainable count is the hand-derived r x (in + out) per adapted layer."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields

import pytest
import torch

from gradaccum.models import lora
from gradaccum.models.build import build_model
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.plan import memory, presets
from gradaccum.utils.errors import BadInput

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 320
DEFAULTS = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt": ("c_attn", "c_proj", "c_fc"),
}


def gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, seq_len=32, n_layer=2, n_head=2, n_embd=16)


def base_model(arch: str, make_hf_folder, seed: int = 0):
    """(model, folder or None): a tiny HF model loaded from its folder, or the built-in GPT."""
    if arch == "gpt":
        torch.manual_seed(seed)
        return GPT(gpt_config()), None
    folder = make_hf_folder(arch, seed=seed)
    return build_model(init_from=folder)[0], folder


def out_logits(model, ids):
    with torch.no_grad():
        out = model.eval()(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def ids(seed=7, b=3, t=20):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g)


def train(model, steps=4, lr=1e-2, seed=1):
    """AdamW on the trainable parameters over random token batches; returns the optimizer."""
    opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, 17), generator=g)
        loss, n = causal_lm_loss(model, {"input_ids": x[:, :-1], "labels": x[:, 1:]})
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    return opt


def hand_count(arch: str, r: int) -> int:
    """r x (in + out) over every adapted layer, from the tiny configs' sizes by hand."""
    if arch == "llama":  # h 32, kv 2 heads x 8, MLP 64, 2 layers
        h, kv, f = 32, 16, 64
        per_layer = (h + h) + (h + kv) + (h + kv) + (h + h) + 3 * (h + f)
        return 2 * r * per_layer
    h = 32 if arch == "gpt2" else 16  # GPT-2's fused c_attn h -> 3h; MLP 4h
    per_layer = (h + 3 * h) + (h + h) + (h + 4 * h) + (4 * h + h)
    return 2 * r * per_layer


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt"])
def test_default_targets_and_the_trainable_count(make_hf_folder, arch):
    model, _ = base_model(arch, make_hf_folder)
    assert lora.default_targets(model) == DEFAULTS[arch]
    total_before = sum(p.numel() for p in model.parameters())
    info = lora.apply_lora(model, lora.LoraSpec(rank=4))
    assert info.targets == DEFAULTS[arch]
    assert info.trainable == hand_count(arch, 4)
    assert sum(p.numel() for p in lora.trainable_parameters(model)) == info.trainable
    assert info.total == total_before + info.trainable
    assert info.fraction == pytest.approx(info.trainable / info.total)
    assert info.layers == 2 * len(DEFAULTS[arch]) + (2 if arch != "llama" else 0)  # 2 c_proj
    assert ", ".join(DEFAULTS[arch]) in info.describe()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt"])
def test_the_count_for_planning_needs_no_weights(make_hf_folder, arch):
    if arch == "gpt":
        config = gpt_config()
    else:  # the config alone, as a planner would have it
        config = transformers.AutoConfig.from_pretrained(
            make_hf_folder(arch), local_files_only=True
        )
    for r in (1, 4, 16):
        assert lora.lora_trainable_params(config, r) == hand_count(arch, r)
    one = "up_proj" if arch == "llama" else "c_fc"  # h -> MLP width, in each of 2 layers
    h, f = (32, 64) if arch == "llama" else (32, 128) if arch == "gpt2" else (16, 64)
    assert lora.lora_trainable_params(config, 2, targets=(one,)) == 2 * 2 * (h + f)


def test_the_planner_formula_agrees_on_llama_2_7b():
    # plan.memory.lora_params counts separate q, k, v and a gated MLP: Llama's real layers.
    shape = presets.preset("llama2-7b")
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    )
    measured = lora.lora_trainable_params(config, 16)
    assert measured == memory.lora_params(shape, 16) == 32 * 16 * (4 * 8192 + 3 * (4096 + 11008))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt"])
def test_training_leaves_the_base_bit_for_bit_and_the_state_holds_adapters_only(
    make_hf_folder, arch
):
    model, _ = base_model(arch, make_hf_folder)
    base = {n: t.clone() for n, t in model.state_dict().items()}
    lora.apply_lora(model, lora.LoraSpec(rank=4, alpha=8))
    before = out_logits(model, ids())
    opt = train(model)
    after = out_logits(model, ids())
    assert (after - before).abs().max().item() > 1e-3  # the adapters did train
    # every base tensor unchanged, under its name inside the LoRA layer
    state = model.state_dict()
    for name, tensor in base.items():
        inside = (
            name
            if name in state
            else name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        )
        assert torch.equal(state[inside], tensor), name
    adapters = lora.adapter_state_dict(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(adapters) == trainable and all(".lora_" in n for n in adapters)
    assert sum(t.numel() for t in adapters.values()) == hand_count(arch, 4)
    base_ptrs = {t.data_ptr() for t in base.values()} | {
        p.data_ptr() for n, p in model.named_parameters() if not p.requires_grad
    }
    assert not any(t.data_ptr() in base_ptrs for t in adapters.values())
    # the optimizer state: two AdamW moments per adapter element, nothing for the base
    moments = [v for s in opt.state_dict()["state"].values() for k, v in s.items() if k != "step"]
    assert sum(m.numel() for m in moments) == 2 * hand_count(arch, 4)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt"])
def test_adapters_save_and_load_bit_for_bit(make_hf_folder, tmp_path, arch):
    model, folder = base_model(arch, make_hf_folder)
    base_state = {n: t.clone() for n, t in model.state_dict().items()}
    spec = lora.LoraSpec(rank=4)
    lora.apply_lora(model, spec)
    train(model)
    path = tmp_path / "adapters.pt"
    torch.save(lora.adapter_state_dict(model), path)
    torch.manual_seed(123)  # other random A matrices in the fresh copy
    if folder is None:
        fresh = GPT(gpt_config())
        fresh.load_state_dict(base_state)
    else:
        fresh = build_model(init_from=folder)[0]
    lora.apply_lora(fresh, spec)
    assert not torch.equal(out_logits(fresh, ids()), out_logits(model, ids()))
    lora.load_adapter_state_dict(fresh, torch.load(path, weights_only=True))
    for name, t in lora.adapter_state_dict(model).items():
        assert torch.equal(lora.adapter_state_dict(fresh)[name], t), name
    assert torch.equal(out_logits(fresh, ids()), out_logits(model, ids()))


def test_loading_adapters_of_another_rank_is_refused(make_hf_folder):
    model, _ = base_model("llama", make_hf_folder)
    lora.apply_lora(model, lora.LoraSpec(rank=4))
    other, _ = base_model("llama", make_hf_folder)
    lora.apply_lora(other, lora.LoraSpec(rank=2))
    with pytest.raises(ValueError, match=r"saved \(4, 32\)"):
        lora.load_adapter_state_dict(other, lora.adapter_state_dict(model))
    few = lora.adapter_state_dict(model)
    few.pop(next(iter(few)))
    with pytest.raises(ValueError, match="1 missing"):
        lora.load_adapter_state_dict(model, few)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_peft_loads_the_adapter_folder_and_the_merged_export(make_hf_folder, tmp_path, arch):
    model, folder = base_model(arch, make_hf_folder)
    lora.apply_lora(model, lora.LoraSpec(rank=4, alpha=16))
    train(model)
    want = out_logits(model, ids())
    adapter = str(tmp_path / "out" / "adapter")
    lora.export_adapter(model, adapter, base=folder, tokenizer=folder)
    names = set(os.listdir(adapter))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        saved = json.load(f)
    assert (saved["r"], saved["lora_alpha"], saved["task_type"]) == (4, 16, "CAUSAL_LM")
    assert saved["base_model_name_or_path"] == folder
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    loaded = peft.PeftModel.from_pretrained(fresh, adapter)
    assert (out_logits(loaded, ids()) - want).abs().max().item() <= 1e-5
    merged = str(tmp_path / "out" / "merged")
    lora.export_merged(model, merged, tokenizer=folder)
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    assert (out_logits(plain, ids()) - want).abs().max().item() <= 1e-5
    # the model keeps its adapters and its logits after both exports
    assert torch.equal(out_logits(model, ids()), want)


def test_the_built_in_gpt_exports_peft_form_and_a_merged_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = GPT(gpt_config())
    base_state = {n: t.clone() for n, t in model.state_dict().items()}
    lora.apply_lora(model, lora.LoraSpec(rank=4))
    train(model)
    want = out_logits(model, ids())
    adapter = str(tmp_path / "adapter")
    lora.export_adapter(model, adapter)
    assert sorted(os.listdir(adapter)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "base_config.json",
    ]
    with open(os.path.join(adapter, "base_config.json")) as f:
        saved = json.load(f)
    assert saved["model_type"] == "gradaccum-gpt"
    names = {f.name for f in fields(GPTConfig)}
    base = GPT(GPTConfig(**{k: v for k, v in saved.items() if k in names}))
    base.load_state_dict(base_state)
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    assert (out_logits(loaded, ids()) - want).abs().max().item() <= 1e-5
    merged = str(tmp_path / "merged")
    lora.export_merged(model, merged)
    plain, info = build_model(init_from=merged)
    assert info.kind == "gpt" and type(plain) is GPT
    assert (out_logits(plain, ids()) - want).abs().max().item() <= 1e-5


def test_a_bf16_base_keeps_fp32_adapters(make_hf_folder):
    folder = make_hf_folder("llama", dtype=torch.bfloat16)
    model, _ = build_model(init_from=folder)
    base = {n: t.clone() for n, t in model.state_dict().items()}
    lora.apply_lora(model, lora.LoraSpec(rank=4))
    assert {p.dtype for p in lora.trainable_parameters(model)} == {torch.float32}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    train(model, steps=2)
    assert out_logits(model, ids()).isfinite().all()
    state = model.state_dict()
    for name, tensor in base.items():
        inside = name if name in state else name.replace(".weight", ".base_layer.weight")
        assert torch.equal(state[inside], tensor), name
    same = build_model(init_from=folder)[0]
    lora.apply_lora(same, lora.LoraSpec(rank=4), adapter_dtype=None)
    assert {p.dtype for p in lora.trainable_parameters(same)} == {torch.bfloat16}


def one_line(err) -> str:
    line = str(err.value)
    assert "\n" not in line and len(line) < 400, line
    return line


def test_targets_that_match_no_module(make_hf_folder):
    model, _ = base_model("llama", make_hf_folder)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(BadInput) as err:
        lora.apply_lora(model, lora.LoraSpec(rank=4, targets="q_proj,qkv"))
    assert one_line(err) == (
        "--lora-targets q_proj,qkv: qkv matches no module of LlamaForCausalLM; its linear "
        "layers are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj "
        "(e.g. model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj)"
    )
    # nothing was changed: no adapter, every parameter still trains
    assert not lora.has_lora(model)
    assert set(model.state_dict()) == set(before)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    "target, needle",
    [("ln_1", "ln_1 matches LayerNorm blocks.0.ln_1, not a linear layer"), ("blocks.0.attn", "")],
)
def test_targets_that_are_not_linear_layers(target, needle):
    model = GPT(gpt_config())
    with pytest.raises(BadInput) as err:
        lora.apply_lora(model, lora.LoraSpec(rank=2, targets=(target,)))
    line = one_line(err)
    assert line.startswith(f"--lora-targets {target}: {needle or target + ' matches'}")


def test_lora_without_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now fails
    model = GPT(gpt_config())
    with pytest.raises(BadInput) as err:
        lora.apply_lora(model, lora.LoraSpec(rank=8))
    assert one_line(err) == "--lora-rank 8: needs peft (pip install 'gradaccum[lora]')"
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, line",
    [
        ({"rank": 0}, "--lora-rank 0: must be an integer >= 1"),
        ({"rank": -3}, "--lora-rank -3: must be an integer >= 1"),
        ({"rank": 2.5}, "--lora-rank 2.5: must be an integer >= 1"),
        ({"rank": 4, "dropout": 1.0}, "--lora-dropout 1.0: must be in [0, 1)"),
        ({"rank": 4, "dropout": -0.1}, "--lora-dropout -0.1: must be in [0, 1)"),
        ({"rank": 4, "alpha": 0}, "--lora-alpha 0: must be a number > 0"),
        (
            {"rank": 4, "targets": "q_proj,,v_proj"},
            "--lora-targets q_proj,,v_proj: empty module name",
        ),
    ],
)
def test_bad_lora_settings_are_one_line(kwargs, line):
    with pytest.raises(BadInput) as err:
        lora.LoraSpec(**kwargs)
    assert one_line(err) == line


def test_dropout_and_alpha_reach_peft(make_hf_folder):
    model, _ = base_model("gpt2", make_hf_folder)
    lora.apply_lora(model, lora.LoraSpec(rank=4, alpha=12, dropout=0.25))
    layer = model.transformer.h[0].attn.c_attn
    assert layer.scaling[lora.ADAPTER] == pytest.approx(12 / 4)
    assert layer.lora_dropout[lora.ADAPTER].p == 0.25
