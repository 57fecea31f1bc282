"""The plan's parameter memory for a base stored in 4 or 8 bits against the bytes the loaded
quantised model holds, on the CPU: a tiny Llama folder (a gated MLP, grouped key/value heads,
an untied head) and the built-in GPT (fused q, k, v with biases, a 4h MLP, learned positions),
each with LoRA rank 4 on every linear layer, as `gradaccum train --lora-rank 4 --base-bits N`
holds it. Linear weights, output rows and parameters are counted by hand from the configs; the
bytes held are bitsandbytes' own tensors (`models.quantized.stored_bytes`)."""

from __future__ import annotations

import pytest
import torch

from gradaccum.models.build import build_model
from gradaccum.models.quantized import stored_bytes
from gradaccum.models.quantized_spec import QuantSpec
from gradaccum.parallel.process_group import RankInfo
from gradaccum.plan import PlanInputs, make_plan
from gradaccum.plan.presets import custom
from gradaccum.plan.quantized import linear_weights
from gradaccum.plan.table import memory_rows
from gradaccum.train import adapters
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.config import TrainConfig
from gradaccum.train.resolve import base_linear_weights, resolve_run

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RANK = 4

# The Llama folder: L blocks of width H, A heads of which KV key/value heads, MLP width F.
L, H, A, KV, F, V = 2, 256, 4, 2, 512, 512
KV_W = KV * H // A  # the width of k and v
LLAMA_LINEAR = L * (H * H + 2 * H * KV_W + H * H + 3 * H * F)  # q, k, v, o; gate, up, down
LLAMA_ROWS = L * (H + 2 * KV_W + H + 2 * F + H)
LLAMA_PARAMS = 2 * V * H + LLAMA_LINEAR + (2 * L + 1) * H  # embedding, head, RMSNorms
LLAMA_ADAPTERS = L * RANK * ((H + H) + 2 * (H + KV_W) + (H + H) + 2 * (H + F) + (F + H))

# The built-in tiny GPT: 4 blocks of width 128, read at seq_len 64 with a 512-token vocabulary.
GL, GH, GV, GS = 4, 128, 512, 64
GPT_LINEAR = GL * (GH * 3 * GH + GH * GH + GH * 4 * GH + 4 * GH * GH)  # c_attn, c_proj, MLP
GPT_ROWS = GL * (3 * GH + GH + 4 * GH + GH)
GPT_BIASES_NORMS = GL * (9 * GH + 4 * GH) + 2 * GH  # the linears' biases, LayerNorms, ln_f
GPT_PARAMS = GV * GH + GS * GH + GPT_LINEAR + GPT_BIASES_NORMS  # tied head
GPT_ADAPTERS = GL * RANK * ((GH + 3 * GH) + (GH + GH) + (GH + 4 * GH) + (4 * GH + GH))


def _llama_config():
    """The tiny Llama both bases are made from (module constants: its shape by hand)."""
    return transformers.LlamaConfig(
        hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=A,
        num_key_value_heads=KV, vocab_size=V, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    config = _llama_config()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _built(which: str, folder: str, bits: int):
    """(model, ModelInfo) as a QLoRA run builds them: quantised, LoRA on, the base frozen."""
    if which == "llama":
        model, info = build_model(init_from=folder, quant=QuantSpec(bits), device="cpu")
    else:
        model, info = build_model(
            preset="tiny", vocab_size=GV, seq_len=GS, quant=QuantSpec(bits), device="cpu"
        )
    config = TrainConfig(lora_rank=RANK, base_bits=bits, precision="fp32", seq_len=GS)
    return adapters.attach(model, info, config)


def _plan_bytes(which: str, bits: int) -> int:
    """The plan's parameter memory from the hand counts, fp32 for what is not quantised."""
    linear, rows, params, added = {
        "llama": (LLAMA_LINEAR, LLAMA_ROWS, LLAMA_PARAMS, LLAMA_ADAPTERS),
        "gpt": (GPT_LINEAR, GPT_ROWS, GPT_PARAMS, GPT_ADAPTERS),
    }[which]
    shape = dict(layers=L, hidden=H, heads=A, vocab=V)
    if which == "gpt":
        shape = dict(layers=GL, hidden=GH, heads=4, vocab=GV)
    plan = make_plan(
        PlanInputs(
            **shape, params=params + added, trainable_params=added, precision="fp32",
            base_bits=bits, base_linear_weights=(linear, rows), seq_len=GS, micro_batch=1,
        )
    )  # fmt: skip
    return round(plan.memory.params_gb * 1e9)


def test_hand_counts():
    assert (LLAMA_LINEAR, LLAMA_ROWS, LLAMA_ADAPTERS) == (1_179_648, 4096, 32_768)
    assert (GPT_LINEAR, GPT_ROWS, GPT_ADAPTERS) == (786_432, 4608, 32_768)
    # NF4 with double-quantised constants, 2113/4096 bytes a weight; the rest fp32
    assert _plan_bytes("llama", 4) == -(-LLAMA_LINEAR * 2113 // 4096) + 4 * (
        LLAMA_PARAMS + LLAMA_ADAPTERS - LLAMA_LINEAR
    )
    # LLM.int8: a byte a weight and an fp32 scale per output row
    assert _plan_bytes("gpt", 8) == GPT_LINEAR + 4 * GPT_ROWS + 4 * (
        GPT_PARAMS + GPT_ADAPTERS - GPT_LINEAR
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("which", ["llama", "gpt"])
def test_planned_bytes_within_10_percent_of_the_loaded_model(llama_folder, which, bits):
    model, info = _built(which, llama_folder, bits)
    linear, params = (LLAMA_LINEAR, LLAMA_PARAMS) if which == "llama" else (GPT_LINEAR, GPT_PARAMS)
    adapters_n = LLAMA_ADAPTERS if which == "llama" else GPT_ADAPTERS
    assert info.params == params + adapters_n  # counted as before quantisation
    held = stored_bytes(model)
    planned = _plan_bytes(which, bits)
    print(f"\n{which} {bits}-bit: planned {planned:,} bytes, held {held:,} bytes")
    assert abs(planned - held) <= 0.10 * held
    # far below the same model in fp32, which the plan would say without --base-bits
    assert held < 0.6 * 4 * (params + adapters_n)


@pytest.mark.parametrize("which", ["llama", "gpt"])
def test_the_run_plans_its_own_model_s_linear_layers(llama_folder, which):
    """`gradaccum train`'s plan counts the linear layers on the model itself: a Llama's
    gated MLP and narrow k, v, which its width, heads and layers alone would take for a GPT
    block's (4h MLP, full-width k, v: 33% more weights here). Its table has the 4-bit row and
    its parameter memory is the loaded model's within 10%."""
    model, info = _built(which, llama_folder, 4)
    expected = (LLAMA_LINEAR, LLAMA_ROWS) if which == "llama" else (GPT_LINEAR, GPT_ROWS)
    assert base_linear_weights(info) == expected
    if which == "llama":  # what the width, heads and layers alone would count
        assert linear_weights(custom(L, H, A, V))[0] == 4 * LLAMA_LINEAR // 3
    config = TrainConfig(
        lora_rank=RANK, base_bits=4, precision="fp32", seq_len=GS, micro_batch=1,
        accum_steps=2, max_steps=3,
    )  # fmt: skip
    rank = RankInfo(0, 1, 0, torch.device("cpu"), None, False)
    plan = resolve_run(config, BatchRequest.of(config), info, rank).plan
    assert plan.base_bits == 4
    assert round(plan.memory.frozen_base_gb * 1e9) == -(-expected[0] * 2113 // 4096)
    held = stored_bytes(model)
    assert abs(plan.memory.params_gb * 1e9 - held) <= 0.10 * held
    rows = {quantity: how for quantity, _, _, how in memory_rows(plan)}
    assert "memory: 4-bit frozen base" in rows
    assert rows["memory: 4-bit frozen base"].startswith("0.258 x the")


@pytest.mark.parametrize("bits", [4, 8])
def test_a_bf16_run_holds_the_rest_and_the_adapters_in_fp32(tmp_path, bits):
    """A bf16 folder trained under --precision bf16, as `gradaccum train` builds it: peft's k-bit
    preparation casts the embeddings, head and norms to fp32 and the adapters are created in
    fp32, so the plan counts 4 bytes for each (2 would fall 25-33% short here), the
    adapters' gradient as an fp32 .grad with no buffer, and AdamW's moments without a master
    copy. Its parameter memory is the loaded model's bytes within 1%."""
    config = _llama_config()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    spec = QuantSpec(bits, compute_dtype="bf16")
    model, info = build_model(init_from=str(tmp_path), quant=spec, device="cpu")
    run = TrainConfig(
        lora_rank=RANK, base_bits=bits, precision="bf16", seq_len=GS, micro_batch=1,
        accum_steps=2, max_steps=3,
    )  # fmt: skip
    model, info = adapters.attach(model, info, run)
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert floats == {torch.float32}  # nothing left in bf16
    rank = RankInfo(0, 1, 0, torch.device("cpu"), None, False)
    memory = resolve_run(run, BatchRequest.of(run), info, rank).plan.memory
    rest = LLAMA_PARAMS + LLAMA_ADAPTERS - LLAMA_LINEAR
    packed = -(-LLAMA_LINEAR * 2113 // 4096) if bits == 4 else LLAMA_LINEAR + 4 * LLAMA_ROWS
    assert round(memory.params_gb * 1e9) == packed + 4 * rest
    held = stored_bytes(model)
    assert abs(memory.params_gb * 1e9 - held) <= 0.01 * held
    assert held - (packed + 2 * rest) > 0.2 * held  # the rest in bf16 would miss this much
    assert memory.accum_buffer_gb == 0
    assert round(memory.optimizer_gb * 1e9) == 8 * LLAMA_ADAPTERS
