"""Exports that transformers loads back with the same logits, written whole or not at all: a
real kill in the middle of an export leaves the previous one whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from gradaccum.models import export
from gradaccum.models.build import build_model

transformers = pytest.importorskip("transformers")


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


def ids(vocab=320, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (3, 20), generator=g)


def trained(folder: str, steps: int = 3, seed: int = 0):
    """The folder's model after a few AdamW steps on random tokens (so it is not the file)."""
    model, _ = build_model(init_from=folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 320, (2, 16), generator=g)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_an_export_loads_back_in_transformers_with_equal_logits(
    make_hf_folder, tmp_path, arch, shard
):
    source = make_hf_folder(arch)
    model = trained(source)
    out = str(tmp_path / "out" / "hf")
    kwargs = {} if shard is None else {"max_shard_size": shard}
    assert export.export_hf_model(model, out, tokenizer=source, **kwargs) == out
    names = set(os.listdir(out))
    assert "config.json" in names and "tokenizer.json" in names and "chat_template.jinja" in names
    if shard is not None:
        assert "model.safetensors.index.json" in names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    x = ids()
    assert (logits(loaded, x) - logits(model, x)).abs().max().item() <= 1e-5
    assert (logits(loaded, x) - logits(trained(source, steps=0), x)).abs().max().item() > 1e-3
    # the tokenizer comes back whole, chat template included
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    ref = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    text = "reverse 123 and count"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    msgs = [{"role": "user", "content": "add 2 3"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(
        msgs, tokenize=False
    )


def test_a_tokenizer_object_is_saved(make_hf_folder, hf_tokenizer_dir, tmp_path):
    source = make_hf_folder("llama", tokenizer=False)
    tok = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir, local_files_only=True)
    out = str(tmp_path / "hf")
    export.export_hf_model(build_model(init_from=source)[0], out, tokenizer=tok)
    again = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert again("sort 9 1 4")["input_ids"] == tok("sort 9 1 4")["input_ids"]


def test_export_over_a_previous_export_replaces_it_and_leaves_nothing_aside(
    make_hf_folder, tmp_path, monkeypatch
):
    source = make_hf_folder("gpt2")
    root = tmp_path / "out"
    out = str(root / "hf")
    x = ids()
    for use_exchange in (True, False):  # renameat2's swap, and the two renames elsewhere
        if not use_exchange:
            monkeypatch.setattr(export, "_exchange", lambda a, b: False)
        model = trained(source, steps=2, seed=int(use_exchange))
        export.export_hf_model(model, out, tokenizer=source)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        assert (logits(loaded, x) - logits(model, x)).abs().max().item() <= 1e-5
        assert os.listdir(root) == ["hf"]


def test_a_failure_part_way_leaves_the_previous_export(make_hf_folder, tmp_path):
    source = make_hf_folder("gpt2")
    root = tmp_path / "out"
    out = str(root / "hf")
    first = trained(source, steps=1)
    export.export_hf_model(first, out, tokenizer=source)
    before = sorted(os.listdir(out))

    class Broken:
        def save_pretrained(self, folder):
            raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        export.export_hf_model(trained(source, steps=3), out, tokenizer=Broken())
    assert sorted(os.listdir(out)) == before and os.listdir(root) == ["hf"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    x = ids()
    assert (logits(loaded, x) - logits(first, x)).abs().max().item() <= 1e-5


KILLED_EXPORT = textwrap.dedent(
    """
    import sys, time
    import torch
    from gradaccum.models import export
    from gradaccum.models.build import build_model

    source, out, marker = sys.argv[1:4]
    model, _ = build_model(init_from=source)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # another model than the previous export

    class Stalls:  # the weights are written aside; the tokenizer never finishes
        def save_pretrained(self, folder):
            open(marker, "w").close()
            time.sleep(600)

    export.export_hf_model(model, out, tokenizer=Stalls())
    """
)


@pytest.mark.slow  # an export in a process, killed
def test_a_kill_in_the_middle_of_an_export_leaves_the_previous_one_whole(make_hf_folder, tmp_path):
    source = make_hf_folder("llama")
    root = tmp_path / "out"
    out = str(root / "hf")
    previous = trained(source, steps=2)
    export.export_hf_model(previous, out, tokenizer=source)
    marker = tmp_path / "writing"
    script = tmp_path / "export.py"
    script.write_text(KILLED_EXPORT)
    proc = subprocess.Popen([sys.executable, str(script), source, out, str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, "the export ended before it was killed"
            assert time.monotonic() < deadline, "the export never started writing"
            time.sleep(0.05)
        aside = [n for n in os.listdir(root) if n.startswith(".tmp-hf.")]
        assert aside and "model.safetensors" in os.listdir(root / aside[0])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    x = ids()
    assert (logits(loaded, x) - logits(previous, x)).abs().max().item() <= 1e-5
    # the next export clears what the killed one left aside
    export.export_hf_model(previous, out, tokenizer=source)
    assert os.listdir(root) == ["hf"]


def test_a_model_with_adapters_or_no_save_pretrained_is_refused(tmp_path):
    model, _ = build_model(preset="tiny", vocab_size=40, seq_len=16)
    with pytest.raises(TypeError, match="not a transformers model"):
        export.export_hf_model(model, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


def test_unwrap_looks_through_ddp_and_compile_wrappers():
    inner = torch.nn.Linear(2, 2)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    compiled = torch.nn.Module()
    compiled._orig_mod = Wrapper(inner)
    assert export.unwrap(compiled) is inner
