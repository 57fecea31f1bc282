"""`gradaccum fit --lora-rank R --base-bits 4|8`: the model fit probes is the one train builds,
its linear layers bitsandbytes' 4- or 8-bit layers, and the parameters' memory it measures is
the quantised base's (packed weights, their constants, the rest in fp32), counted by hand
from the tiny preset's shape. `gradaccum train --micro-batch auto --base-bits 4` probes the
same quantised model. Bad --base-bits input is one line, exit 2."""

from __future__ import annotations

import json

import pytest

from gradaccum import fit
from gradaccum.cli import main
from gradaccum.models import quantized
from gradaccum.train import micro_batch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

RANK = 4
H, LAYERS, VOCAB, SEQ = 128, 4, 512, 32  # the tiny preset on the built-in corpus at seq 32
LINEAR = LAYERS * (H * 3 * H + H * H + H * 4 * H + 4 * H * H)  # c_attn, c_proj, c_fc, c_proj
ROWS = LAYERS * (3 * H + H + 4 * H + H)
BIASES_NORMS = LAYERS * (9 * H + 4 * H) + 2 * H
PARAMS = VOCAB * H + SEQ * H + LINEAR + BIASES_NORMS  # the head tied to the embedding
ADAPTERS = LAYERS * RANK * ((H + 3 * H) + (H + H) + (H + 4 * H) + (4 * H + H))
FIT = ["fit", "--seq-len", str(SEQ), "--tokens-per-step", "256", "--device", "cpu"]
LAYER = {4: "Linear4bit", 8: "Linear8bitLt"}


def _spy(monkeypatch, module) -> dict:
    """Record the model `module.fit.find_micro_batch` is given, then run the real one."""
    seen = {}
    real = fit.find_micro_batch

    def spy(model, *args, **kwargs):
        seen["layers"] = {type(m).__name__ for _, m in quantized.quantized_layers(model)}
        seen["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
        return real(model, *args, **kwargs)

    monkeypatch.setattr(module.fit, "find_micro_batch", spy)
    return seen


def test_hand_counts():
    assert (LINEAR, ROWS, ADAPTERS) == (786_432, 4608, 32_768)


@pytest.mark.parametrize("bits", [4, 8])
def test_fit_probes_and_measures_the_quantised_base(capsys, monkeypatch, bits):
    from gradaccum.cli import fit_run

    seen = _spy(monkeypatch, fit_run)
    argv = [*FIT, "--lora-rank", str(RANK), "--base-bits", str(bits), "--max-seconds", "3"]
    assert main([*argv, "--no-checkpointing", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert seen["layers"] == {LAYER[bits]}
    assert seen["trainable"] and all(".lora_" in n for n in seen["trainable"])
    assert got["lora"]["trainable"] == ADAPTERS and got["lora"]["total"] == PARAMS + ADAPTERS
    assert got["base_quant"]["bits"] == bits and got["base_quant"]["layers"] == 4 * LAYERS
    rest = 4 * (PARAMS + ADAPTERS - LINEAR)  # embeddings, norms, biases, adapters in fp32
    params = got["memory"]["params"]
    if bits == 8:  # an int8 weight, and an fp32 scale per output row
        assert params == LINEAR + 4 * ROWS + rest
    else:  # 4-bit weights packed two to a byte, a 1-byte absmax per 64, the code tables
        least = LINEAR // 2 + LINEAR // 64 + rest
        assert least < params < 1.05 * least
    assert params < 0.6 * 4 * (PARAMS + ADAPTERS)  # the same model in fp32


def test_table_names_the_quantised_base(capsys):
    argv = [*FIT, "--lora-rank", str(RANK), "--base-bits", "4", "--max-seconds", "2"]
    assert main([*argv, "--no-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "base in 4 bits (NF4, bitsandbytes): 16 linear layers" in out


def test_train_micro_batch_auto_probes_the_quantised_base(capsys, monkeypatch, tmp_path):
    seen = _spy(monkeypatch, micro_batch)
    argv = ["train", "--seq-len", "16", "--tokens-per-step", "64", "--max-steps", "1"]
    argv += ["--eval-fraction", "0", "--device", "cpu", "--out", str(tmp_path / "run")]
    argv += ["--lora-rank", "2", "--base-bits", "4", "--json"]
    code = main(argv)
    output = "".join(capsys.readouterr())
    assert code == 0, output
    assert seen["layers"] == {"Linear4bit"}
    assert seen["trainable"] and all(".lora_" in n for n in seen["trainable"])


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--base-bits", "4"], "--base-bits 4: a quantised base cannot be trained in full"),
        (["--lora-rank", "4", "--base-bits", "3"], "--base-bits 3: expected 4"),
        (["--lora-rank", "4", "--base-bits", "8", "--base-quant", "fp4"], "needs --base-bits 4"),
        (["--lora-rank", "4", "--base-quant", "fp4"], "--base-quant fp4: needs --base-bits 4"),
    ],
)
def test_bad_base_bits_one_line_exit_2(capsys, extra, words):
    assert main([*FIT, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err
