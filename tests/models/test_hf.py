"""`gradaccum.hf`: the loss and token count of Hugging Face causal LMs, label shift included,
against the model's own loss (which shifts the labels itself and averages them)."""

from __future__ import annotations

import pytest
import torch

from gradaccum import Accumulator, hf, verify
from gradaccum.testing import GradRecorder, max_rel_error
from gradaccum.verification.check import concat_batches, sample_batches

transformers = pytest.importorskip("transformers")


def gpt2(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(config)


def data(k: int = 4, seed: int = 1) -> list[dict]:
    return sample_batches(k, 3, 24, 64, seed=seed, shifted=False)


def test_count_tokens_counts_targets_after_the_shift():
    labels = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100], [1, 2, 3, 4]])
    # row 0: targets 6, 7 (the first label is no position's target); row 1: none; row 2: 2, 3, 4
    assert int(hf.count_tokens({"labels": labels})) == 2 + 0 + 3


def test_loss_fn_is_the_models_own_mean_loss_times_its_targets():
    model = gpt2().eval()
    batch = data(1)[0]
    with torch.no_grad():
        loss_sum, n = hf.loss_fn(model, batch)
        own = model(**batch).loss  # transformers shifts and averages itself
    assert int(n) == int((batch["labels"][:, 1:] != -100).sum())
    assert float(loss_sum) == pytest.approx(float(own) * int(n), rel=1e-5)


def test_accumulator_with_hf_loss_equals_the_models_big_batch_loss():
    model = gpt2()
    micro = data(4)
    recorder = GradRecorder(model.parameters())
    Accumulator(model, recorder, count_tokens=hf.count_tokens).step(micro, hf.loss_fn)
    # the reference: the model's own mean loss over all micro-batches as one padded batch
    big = gpt2()
    big(**concat_batches(micro)).loss.backward()
    want = [p.grad for p in big.parameters()]
    assert max_rel_error(recorder.seen[0], want) <= 1e-5


def test_counting_without_the_shift_is_refused():
    model = gpt2()
    acc = Accumulator(model, GradRecorder(model.parameters()))  # counts labels != -100 as is
    with pytest.raises(ValueError, match="count_tokens"):
        acc.step(data(2), hf.loss_fn)


def test_verify_passes_on_gpt2_through_hf_and_fixes_dropout():
    model = gpt2(dropout=0.1)
    report = verify(model, data(4), hf.loss_fn, count_tokens=hf.count_tokens)
    assert report.passed, report.to_dict()
    assert report.max_rel_err <= 1e-5
    assert report.reference == "float64"
    # the GPT-2 dropout layers were turned off for the check, and the report says so
    assert any("RNG fixed" in note for note in report.notes)
    notes = [f for f in report.lint if f.severity == "note"]
    assert notes and "transformer.drop" in notes[0].module
    # the model handed in is left in training mode, dropout and all
    assert all(m.training for m in model.modules())
