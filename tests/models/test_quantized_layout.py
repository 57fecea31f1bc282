"""A 4-bit base keeps the layout it trains in, whatever mode it runs in and whatever the CPU.

On a CPU with AVX512-BF16 bitsandbytes repacks a `Linear4bit`'s weight for bf16 inference the
first time it runs in eval mode without grad, and every call after it, in training too, goes
through that kernel. The suite forces that path on every CPU (tests/avx512bf16.py); these
tests show the forcing is live (a layer left to bitsandbytes repacks itself here) and that a
model gradaccum quantises or loads does not: its stored bytes and quantisation constants after
an evaluation are those training left, and eval mode computes what train mode does."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradaccum.models import hf_folder, quantized

bnb = pytest.importorskip("bitsandbytes")

IN, OUT = 128, 64
"""A layer the inference layout takes (it needs rows in blocks of 32 and columns past one
quantisation block of 64)."""


def _stored(layer) -> list[torch.Tensor]:
    return [layer.weight.data.clone(), *(t.clone() for t in quantized.quant_state_tensors(layer))]


def _quantised_block(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, OUT))
    quantized.quantize_linears(model, quantized.QuantSpec(4))
    return model


def test_the_suite_takes_the_avx512bf16_path():
    """A layer made by bitsandbytes alone believes the CPU has AVX512-BF16 and repacks its
    weight in eval mode: the path an Intel Xeon takes, here on any CPU."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(IN, OUT, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(
        torch.randn(OUT, IN), requires_grad=False, quant_type="nf4", module=layer
    )
    layer = layer.to("cpu")
    assert getattr(layer, quantized.INFERENCE_LAYOUT) is True
    before = layer.weight.data.clone()
    with torch.no_grad():
        layer.eval()(torch.randn(2, IN))
    assert layer.weight.quant_state.packing_format_for_cpu is True
    assert layer.weight.data.shape != before.shape or not torch.equal(layer.weight.data, before)
    with pytest.raises(RuntimeError, match="repacked this 4-bit layer"):
        quantized.keep_training_layout(nn.Sequential(layer))


def test_an_evaluation_leaves_the_stored_base_and_computes_what_training_does():
    model = _quantised_block()
    layers = [m for _, m in quantized.quantized_layers(model)]
    stored = [_stored(m) for m in layers]
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model.train()(x)
        evaluated = model.eval()(x)
    assert torch.equal(evaluated, trained)
    for layer, before in zip(layers, stored, strict=True):
        assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
        after = _stored(layer)
        assert len(after) == len(before)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # What the layers compute is x @ W^T + b with W their dequantised weight, in eval too.
    first = layers[0]
    want = x @ quantized.dequantized_weight(first).T + first.bias
    with torch.no_grad():
        assert torch.allclose(first(x), want, rtol=1e-6, atol=1e-6)


def test_the_gradient_after_an_evaluation_is_the_one_before():
    model = _quantised_block()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def grad() -> torch.Tensor:
        x.grad = None
        model.train()(x).square().sum().backward()
        return x.grad.clone()

    before = grad()
    with torch.no_grad():
        model.eval()(x.detach())
    assert torch.equal(grad(), before)


def test_a_folder_loaded_in_4_bits_is_kept_in_its_training_layout(make_hf_folder):
    """transformers makes the folder's Linear4bit layers itself (each believing the CPU has the
    feature here); load_model turns the repacking off before its first forward."""
    folder = make_hf_folder("llama")
    model = hf_folder.load_model(folder, dtype="fp32", quant=quantized.QuantSpec(4))
    layers = [m for _, m in quantized.quantized_layers(model)]
    assert layers and not any(getattr(m, quantized.INFERENCE_LAYOUT) for m in layers)
    stored = [_stored(m) for m in layers]
    with torch.no_grad():
        model.eval()(torch.tensor([[5, 17, 42, 9]]))
    for layer, before in zip(layers, stored, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(_stored(layer), before, strict=True))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_generation_leaves_the_stored_base_as_training_left_it(arch, make_hf_folder):
    """GRPO samples its completions in eval mode without grad (a KV cache for the built-in GPT,
    transformers' generate for a folder): the 4-bit base after it is the one before, and the
    training forward computes what it did."""
    from gradaccum.grpo.sampling import sample
    from gradaccum.models.gpt import GPT, GPTConfig

    if arch == "gpt":
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, n_embd=64))
        quantized.quantize_linears(model, quantized.QuantSpec(4))
    else:
        folder = make_hf_folder("llama")
        model = hf_folder.load_model(folder, dtype="fp32", quant=quantized.QuantSpec(4))
    layers = [m for _, m in quantized.quantized_layers(model)]
    stored = [_stored(m) for m in layers]
    ids = torch.tensor([[5, 17, 42, 9, 33, 7]])

    def logits() -> torch.Tensor:
        with torch.no_grad():
            out = model.train()(ids)
        return out if isinstance(out, torch.Tensor) else out.logits

    before = logits()
    sample(model, [[5, 17, 42], [9, 33]], num_generations=2, max_new_tokens=4,
           temperature=1.0, eos_id=3, seed=0)  # fmt: skip
    for layer, kept in zip(layers, stored, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(_stored(layer), kept, strict=True))
    assert torch.equal(logits(), before)
