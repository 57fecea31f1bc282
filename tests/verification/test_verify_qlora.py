"""`gradaccum verify --base-bits 4|8` (QLoRA): LoRA adapters on a base whose block linear layers
are bitsandbytes' 4- or 8-bit layers, on the CPU, checked against the same adapters on the
dequantised base in float64. The window PASSes in fp32 with the /k mistake far off; the
quantisation error is reported apart and equals bitsandbytes' own round trip of the original
weights; the model verified holds bitsandbytes layers under its adapters; bad input is one
line, exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from gradaccum.cli import build_parser, main
from gradaccum.cli.verify import parse_sizes
from gradaccum.settings.command import namespace
from gradaccum.verification.cases import build_case
from tests.conftest import train_tokenizer

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

HIDDEN, INTERMEDIATE, LAYERS, KV_WIDTH = 64, 128, 2, 32  # 4 heads of 16, 2 of them for k, v
WINDOW = ["--k", "4", "--micro-batch", "2", "--seq-len", "48"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A tiny Llama (hidden 64, 2 layers, fp32) saved with save_pretrained beside the test
    tokenizer and its chat template."""
    path = str(tmp_path_factory.mktemp("llama-qlora"))
    tok = train_tokenizer(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _verify(*argv) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["verify", *argv, "--json"])
    return code, json.loads(out.getvalue())


def _case(*argv):
    """The case `verify ARGV` checks, read as `verify_run.run` reads its flags."""
    args = namespace(build_parser().parse_args(["verify", *argv]))
    return build_case(args, parse_sizes(args))


def _projections() -> dict[str, tuple[int, int]]:
    """A Llama block's linear layers, (in, out), from the config above."""
    h, m = HIDDEN, INTERMEDIATE
    return {
        "q_proj": (h, h),
        "k_proj": (h, KV_WIDTH),
        "v_proj": (h, KV_WIDTH),
        "o_proj": (h, h),
        "gate_proj": (h, m),
        "up_proj": (h, m),
        "down_proj": (m, h),
    }


def _nf4_round_trip_errors(folder: str) -> dict[str, float]:
    """||dequantize(quantize(W)) - W|| / ||W|| per block linear layer of the folder's weights,
    by bitsandbytes' functions alone (NF4, blocks of 64, double-quantised constants)."""
    import bitsandbytes.functional as F

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    errs = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _projections():
            w = module.weight.detach().float()
            packed, state = F.quantize_4bit(
                w, blocksize=64, compress_statistics=True, quant_type="nf4"
            )
            back = F.dequantize_4bit(packed, state).double()
            errs[name] = float((back - w.double()).norm() / w.double().norm())
    return errs


def test_a_4_bit_folder_passes_and_its_quantisation_is_reported_apart(folder):
    code, got = _verify("--task", "sft", "--init-from", folder, "--base-bits", "4", *WINDOW)
    assert code == 0 and got["passed"] is True, got["checks"]
    assert got["precision"] == "fp32" and got["reference"] == "float64"
    assert got["max_rel_err"] <= 1e-5 and got["max_rel_err_check"] == "gradient"
    assert got["wrong_ways"]["mean_over_k"] > 1e-2  # the /k mistake on the same window
    # only the adapters train: rank 8 (the default) x (in + out) over every projection
    per_layer = sum(i + o for i, o in _projections().values())
    assert got["lora"]["rank"] == 8 and got["lora"]["trainable"] == 8 * per_layer * LAYERS
    assert got["params"] and all(".lora_" in p["name"] for p in got["params"])
    # the quantisation, as information: bitsandbytes' own NF4 round trip of the weights
    q = got["quantization"]
    assert q["part_of_verdict"] is False and q["bits"] == 4 and q["quant"] == "nf4"
    assert q["layer_type"] == "Linear4bit" and q["layers"] == len(_projections()) * LAYERS
    want = _nf4_round_trip_errors(folder)
    assert q["layer_rel_errs"].keys() == want.keys()
    for name, err in want.items():
        assert q["layer_rel_errs"][name] == pytest.approx(err, rel=1e-6)
    assert q["max_rel_err"] == max(want.values()) > 0
    assert q["worst_layer"] == max(want, key=want.get)


def test_a_bf16_folder_passes_in_fp32_compute(folder, tmp_path):
    """bf16 weights: quantised from them upcast to fp32, where bitsandbytes' 4-bit layer
    computes its forward and its backward with the same dequantised weight (from the bf16
    load its backward's weight is rounded to bf16 and no one reference matches both)."""
    half = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    half.save_pretrained(tmp_path)
    for name in os.listdir(folder):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(folder, name), tmp_path)
    argv = ["--task", "sft", "--init-from", str(tmp_path), "--base-bits", "4", *WINDOW]
    code, got = _verify(*argv)
    assert code == 0 and got["passed"] is True and got["max_rel_err"] <= 1e-5
    assert got["precision"] == "fp32"
    errs = got["quantization"]["layer_rel_errs"]
    for name, err in _nf4_round_trip_errors(str(tmp_path)).items():
        assert errs[name] == pytest.approx(err, rel=1e-6)


def test_the_model_verified_holds_bitsandbytes_layers_under_its_adapters(folder):
    case = _case("--task", "sft", "--init-from", folder, "--base-bits", "4", "--lora-rank", "2")
    adapted = {n: m for n, m in case.model.named_modules() if hasattr(m, "base_layer")}
    assert len(adapted) == len(_projections()) * LAYERS
    assert all(type(m.base_layer) is bnb.nn.Linear4bit for m in adapted.values())
    trains = [n for n, p in case.model.named_parameters() if p.requires_grad]
    assert trains and all(".lora_A." in n or ".lora_B." in n for n in trains)
    b = [p for n, p in case.model.named_parameters() if ".lora_B." in n]
    assert all(p.abs().max() > 0 for p in b)  # not zero, so every A has a gradient
    # the reference: the same adapters on plain float64 layers
    assert not any("bitsandbytes" in type(m).__module__ for m in case.reference.modules())
    assert {p.dtype for p in case.reference.parameters()} == {torch.float64}
    ref = dict(case.reference.named_parameters())
    assert all(
        torch.equal(ref[n].float(), p) for n, p in case.model.named_parameters() if n in trains
    )


def test_the_built_in_gpt_in_8_bits_passes_on_the_pretraining_window():
    argv = ["--model", "tiny", "--base-bits", "8", "--k", "2", "--micro-batch", "2"]
    code, got = _verify(*argv, "--seq-len", "16")
    assert code == 0 and got["passed"] is True and got["max_rel_err"] <= 1e-5
    assert got["wrong_ways"]["mean_over_k"] > 1e-2
    q = got["quantization"]
    assert q["layer_type"] == "Linear8bitLt" and q["scheme"] == "llm.int8"
    assert 0 < q["max_rel_err"] < 0.05  # int8 with one scale per row: about 1%


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--base-bits", "3"], "--base-bits 3: expected 4 (NF4, QLoRA) or 8 (LLM.int8)"),
        (["--base-bits", "8", "--base-quant", "fp4"], "--base-quant fp4: needs --base-bits 4"),
        (["--base-bits", "4", "--world-size", "2"], "--world-size 2: runs the full model"),
        (["--base-bits", "4", "--model", "tiny-moe"], "--base-bits 4: verify checks a quantised"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, argv, words):
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err and "Traceback" not in err
