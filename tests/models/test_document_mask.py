"""Document masking: a padding-free row (`gradaccum.data.sft.packing.collate_packed`) gives each of
its examples the logits the example has run alone, through the built-in GPT (document_ids, a
block-causal SDPA mask) and Hugging Face Llama and GPT-2 built from config (restarting
position_ids, transformers' packed-sequence masks); and the loss helpers pass what each needs."""

from __future__ import annotations

import pytest
import torch

from gradaccum import hf
from gradaccum.data.sft.examples import make_example
from gradaccum.data.sft.packing import collate_packed
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss, packed_inputs, token_sum_loss
from tests.conftest import tiny_config

VOCAB = 50
LENGTHS = [9, 5, 12, 3, 7]
ROW = 20


def examples(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(4, VOCAB, (n,), generator=g).tolist()
        out.append(make_example(ids, ids, i))
    return out


# rows of ROW positions: [9 + 7 (+ padding)], [12 + 5 + 3] and an empty row
ROWS = [[0, 4], [2, 1, 3]]


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=2, n_embd=32))


def spans(exs, layout):
    """(row, start, stop, example) of every example of ROWS, in the layout's positions."""
    out = []
    for r, row in enumerate(ROWS):
        at = 0
        for i in row:
            n = exs[i].length - (layout == "shifted")
            out.append((r, at, at + n, exs[i]))
            at += n
    return out


def alone(model, e, layout, **kw) -> torch.Tensor:
    ids = e.input_ids[:-1] if layout == "shifted" else e.input_ids
    return hf.logits_of(model(torch.as_tensor(ids, dtype=torch.long)[None], **kw))[0]


def test_gpt_packed_row_logits_equal_each_example_alone():
    model, exs = gpt().eval(), examples()
    batch = collate_packed(exs, ROWS, ROW, pad_id=0, layout="shifted", num_rows=3)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        assert torch.isfinite(logits).all()  # padding and the empty row included
        worst = 0.0
        for r, a, b, e in spans(exs, "shifted"):
            worst = max(worst, (logits[r, a:b] - alone(model, e, "shifted")).abs().max().item())
        # the premise: without the mask, the second example of a row sees the first
        plain = model(batch["input_ids"][:1, :16])
    assert worst <= 1e-5
    assert (plain[0, 8:14] - alone(model, exs[4], "shifted")).abs().max().item() > 1e-3


def test_gpt_positions_follow_the_documents_when_not_given():
    model, exs = gpt().eval(), examples()
    batch = collate_packed(exs, ROWS, ROW, pad_id=0, layout="shifted")
    with torch.no_grad():
        given = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        derived = model(batch["input_ids"], document_ids=batch["document_ids"])
    real = batch["document_ids"] >= 0  # padding's positions are 0 given, counted derived
    assert torch.equal(given[real], derived[real])


def test_gpt_without_documents_is_causal_as_before():
    """No document_ids: plain causal attention, the logits of a one-document mask."""
    model = gpt().eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        one_doc = model(ids, document_ids=torch.zeros_like(ids))
    assert (plain - one_doc).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="longer than seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_activation_checkpointing_keeps_the_packed_gradient():
    exs = examples()
    batch = collate_packed(exs, ROWS, ROW, pad_id=0, layout="shifted", num_rows=3)
    grads = []
    for checkpointing in (False, True):
        model = gpt()
        model.set_activation_checkpointing(checkpointing)
        loss, _ = causal_lm_loss(model, batch)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_gpt_packed_loss_equals_the_examples_summed_alone():
    model, exs = gpt(), examples()
    batch = collate_packed(exs, ROWS, ROW, pad_id=0, layout="shifted", num_rows=3)
    loss, n = causal_lm_loss(model, batch)
    want = 0.0
    for e in exs:
        labels = torch.as_tensor(e.labels[1:], dtype=torch.long)[None]
        want += token_sum_loss(alone(model, e, "shifted")[None], labels)[0].item()
    assert n.item() == sum(e.num_targets for e in exs)
    assert abs(loss.item() - want) <= 1e-5 * abs(want)


def hf_model(arch: str, impl: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(arch, VOCAB, seq_len=32)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_packed_row_logits_equal_each_example_alone(arch, impl):
    model, exs = hf_model(arch, impl).eval(), examples()
    batch = collate_packed(exs, ROWS, ROW, pad_id=0, layout="unshifted", num_rows=3)
    with torch.no_grad():
        out = model(batch["input_ids"], **packed_inputs(model, batch)).logits
        worst = 0.0
        for r, a, b, e in spans(exs, "unshifted"):
            worst = max(worst, (out[r, a:b] - alone(model, e, "unshifted")).abs().max().item())
        # the premise: with the model's default cache the examples are not kept apart
        leaky = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
    assert torch.isfinite(out).all()
    assert worst <= 1e-5
    assert (leaky[0, 9:16] - alone(model, exs[4], "unshifted")).abs().max().item() > 1e-3
    assert hf.packed_positions_supported(model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_loss_fn_on_packed_rows_equals_the_examples_alone(arch):
    """hf.loss_fn on a padding-free row: the summed loss of each example run alone (it must
    turn the model's cache off, or transformers skips the packed-sequence mask)."""
    model, exs = hf_model(arch, "sdpa"), examples()
    batch = collate_packed(exs, ROWS, ROW, pad_id=0, layout="unshifted", num_rows=3)
    loss, n = hf.loss_fn(model, batch)
    want = 0.0
    for e in exs:
        labels = torch.as_tensor(e.labels, dtype=torch.long)[None]
        want += token_sum_loss(alone(model, e, "unshifted")[None], labels, shift=True)[0].item()
    assert n.item() == hf.count_tokens(batch).item() == sum(e.num_targets for e in exs)
    assert abs(loss.item() - want) <= 1e-5 * abs(want)


def test_packed_positions_unsupported_is_detected(monkeypatch):
    """transformers that ignores packed position ids (simulated: no packed sequence found)."""
    from transformers import masking_utils

    model = hf_model("llama", "sdpa")
    assert hf.packed_positions_supported(model)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    assert not hf.packed_positions_supported(model)


def test_packed_inputs_per_model():
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long),
             "position_ids": torch.zeros(1, 4, dtype=torch.long),
             "document_ids": torch.zeros(1, 4, dtype=torch.long)}  # fmt: skip
    assert set(packed_inputs(gpt(), batch)) == {"position_ids", "document_ids"}
    compiled = torch.compile(gpt(), backend="eager")
    assert set(packed_inputs(compiled, batch)) == {"position_ids", "document_ids"}
    got = packed_inputs(hf_model("gpt2", "sdpa"), batch)
    assert set(got) == {"position_ids", "use_cache"} and got["use_cache"] is False
    assert packed_inputs(gpt(), {"input_ids": batch["input_ids"]}) == {}
    with pytest.raises(ValueError, match="needs position_ids"):
        packed_inputs(torch.nn.Linear(2, 2), {"document_ids": batch["document_ids"]})
