"""`gradaccum train --document-mask` (pretraining on documents): the first step's loss against
a float64 computation of every document of the window run alone (the rows cut by hand at
their end-of-document ids, no mask, no engine); without the flag the loss of whole rows as
before; bad input refused in one line; a resumed masked run equal bit for bit to an
uninterrupted one."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradaccum.data.batches import Batches
from gradaccum.data.corpus import MarkovCorpus
from gradaccum.data.tokens import load_tokens
from gradaccum.models.build import build_model
from gradaccum.train import parts
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.resume import settings_to_resume

from . import helpers
from .helpers import train_records

SEQ_LEN = 16
CORPUS = MarkovCorpus(vocab_size=64, mean_doc_len=5.0)
"""Short documents (5 content tokens on average): every 16-token row holds several."""
EOD = CORPUS.eod_token


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("docs") / "docs.npy"
    np.save(path, CORPUS.generate(20_000, seed=3).astype(np.uint16))
    return str(path)


def _config(out, data, **kw) -> TrainConfig:
    base = dict(
        out=str(out), data=data, seq_len=SEQ_LEN, micro_batch=2, accum_steps=2, max_steps=1,
        eval_every=0,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _first_loss(out) -> float:
    return train_records(out)[0]["loss"]


def _segments(ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of a row of inputs, cut by hand: an end-of-document
    input opens the next document (its target is that document's first token)."""
    cuts = [0] + [t for t in range(1, len(ids)) if int(ids[t]) == EOD] + [len(ids)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _reference(data: str, model: torch.nn.Module, by_document: bool) -> tuple[float, int]:
    """(mean loss, pieces) of the first window (2 x 2 sequences) in float64: each document
    alone (or, by_document=False, each whole row), summed, divided by the target count."""
    train_set = load_tokens(data, SEQ_LEN, 0)[0]
    window = next(Batches(train_set, 4, seed=0))  # the stream's first 4 sequences
    model = model.double().train()
    total, count, pieces = 0.0, 0, 0
    with torch.no_grad():
        for ids, labels in zip(window["input_ids"], window["labels"], strict=True):
            spans = _segments(ids) if by_document else [(0, len(ids))]
            for a, b in spans:
                out = model(ids[a:b][None])
                logits = (out if isinstance(out, torch.Tensor) else out.logits)[0]
                total += float(F.cross_entropy(logits, labels[a:b], reduction="sum"))
                count, pieces = count + b - a, pieces + 1
    assert count == 4 * SEQ_LEN  # every token of the window is a target, once
    return total / count, pieces


def _model(data: str, init_from: str | None = None) -> torch.nn.Module:
    """The model the run starts from: the same seed, the same build."""
    torch.manual_seed(0)
    if init_from is not None:
        return build_model(init_from=init_from)[0]
    return build_model(preset="tiny", vocab_size=CORPUS.vocab_size, seq_len=SEQ_LEN)[0]


def test_first_step_loss_is_each_document_alone(tmp_path, docs):
    train(_config(tmp_path / "run", docs, document_mask=True, eod_id=EOD))
    want, pieces = _reference(docs, _model(docs), by_document=True)
    assert pieces > 8  # the 4 rows really are cut into documents
    whole, _ = _reference(docs, _model(docs), by_document=False)
    assert abs(want - whole) > 1e-3  # so the mask is what the comparison measures
    assert abs(_first_loss(tmp_path / "run") - want) <= 1e-5 * want


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_first_step_loss_of_a_hugging_face_model(tmp_path, docs, make_hf_folder, arch):
    pytest.importorskip("transformers")
    folder = make_hf_folder(arch)
    train(_config(tmp_path / "run", docs, document_mask=True, eod_id=EOD, init_from=folder))
    want, _ = _reference(docs, _model(docs, folder), by_document=True)
    assert abs(_first_loss(tmp_path / "run") - want) <= 1e-5 * want


def test_without_the_flag_the_rows_are_whole_as_before(tmp_path, docs):
    train(_config(tmp_path / "run", docs))
    want, _ = _reference(docs, _model(docs), by_document=False)
    assert abs(_first_loss(tmp_path / "run") - want) <= 1e-5 * want
    train_set = load_tokens(docs, SEQ_LEN, 0)[0]
    assert set(next(Batches(train_set, 2))) == {"input_ids", "labels"}  # the unchanged path


def test_the_built_in_corpus_ends_its_documents(tmp_path):
    data = parts.load_data(TrainConfig(document_mask=True, seq_len=SEQ_LEN))
    assert data.eod_id == MarkovCorpus().eod_token
    batch = next(Batches(data.train, 64, eod_id=data.eod_id))
    assert int(batch["document_ids"].max()) >= 1  # documents end inside the rows
    assert parts.load_data(TrainConfig(seq_len=SEQ_LEN)).eod_id is None


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--task", "sft", "--document-mask"], "--document-mask: only with --task pretrain"),
        (["--eod-id", "63"], "--eod-id 63: needs --document-mask"),
        (["--document-mask"], "marks no document ends; give --eod-id N"),
        (["--document-mask", "--eod-id", "64"], "--eod-id 64: outside the data's vocabulary"),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, docs, extra, words):
    out = tmp_path / "run"
    argv = ["train", "--data", docs, "--seq-len", "16", "--out", str(out), *extra]
    assert words in helpers.one_line_error(capsys, argv)
    assert not os.path.exists(out)


def test_a_model_that_ignores_packed_positions_is_refused(
    capsys, tmp_path, docs, make_hf_folder, monkeypatch
):
    pytest.importorskip("transformers")
    folder = make_hf_folder("llama")
    monkeypatch.setattr(parts, "packed_positions_supported", lambda model: False)
    capsys.readouterr()  # what saving the folder printed
    out = tmp_path / "run"
    argv = ["train", "--data", docs, "--seq-len", "16", "--init-from", folder, "--out", str(out)]
    line = helpers.one_line_error(capsys, [*argv, "--document-mask", "--eod-id", "63"])
    assert "--document-mask: LlamaForCausalLM does not keep packed documents apart" in line
    assert not os.path.exists(out)


@pytest.mark.slow  # trains past a few steps
def test_resume_with_the_mask_is_bit_for_bit(capsys, tmp_path, docs):
    def run(out, **kw):
        config = _config(out, docs, max_steps=6, save_every=3, document_mask=True, eod_id=EOD)
        return train(config, **kw)

    straight, parted = tmp_path / "straight", tmp_path / "parted"
    run(straight)
    assert run(parted, should_stop=lambda step: step == 3)["steps"] == 3
    values = settings_to_resume({"out": str(parted), "resume": True})
    assert values["document_mask"] is True and values["eod_id"] == EOD
    values = {k: v for k, v in values.items() if k not in ("out", "resume")}
    assert train(TrainConfig(out=str(parted), resume=True, **values))["steps"] == 6
    assert train_records(parted) == train_records(straight)
    a = torch.load(straight / "model.pt", weights_only=True)
    b = torch.load(parted / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_changed_mask(capsys, tmp_path, docs):
    out = tmp_path / "run"
    train(_config(out, docs, max_steps=2, save_every=1))
    argv = ["train", "--out", str(out), "--resume", "--document-mask", "--eod-id", "63"]
    line = helpers.one_line_error(capsys, argv, stdout_empty=False)
    assert (
        "--document-mask True: the run in" in line and "trained with --document-mask False" in line
    )
