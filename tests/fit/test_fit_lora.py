"""`gradaccum fit --lora-rank R`: the probe's model holds LoRA adapters on a frozen base, and
what fit measures is the frozen-base memory: gradients and AdamW state for the adapters only,
every parameter stored. Counts are derived by hand from the tiny preset's shape."""

from __future__ import annotations

import json

import pytest
import torch

from gradaccum import fit
from gradaccum.cli import build_parser, fit_run, main
from gradaccum.models.loss import causal_lm_loss
from gradaccum.models.settings import model_source
from gradaccum.settings.command import namespace

pytest.importorskip("peft")

RANK = 4
H, LAYERS = 128, 4  # the tiny preset: width 128, 4 blocks, MLP 4h
# per block r x (in + out) on c_attn (h -> 3h), attn c_proj (h -> h), c_fc (h -> 4h) and the
# MLP's c_proj (4h -> h); the output head is not adapted
ADAPTERS = LAYERS * RANK * ((H + 3 * H) + (H + H) + (H + 4 * H) + (4 * H + H))
ADAPTER_TENSORS = LAYERS * 4 * 2  # an A and a B per adapted layer
FIT = ["fit", "--seq-len", "32", "--tokens-per-step", "256", "--device", "cpu"]


def _probe(*extra):
    args = namespace(build_parser().parse_args([*FIT, *extra]))
    return fit_run.probe_model(args, model_source(args), torch.device("cpu"))


def test_hand_count():
    assert ADAPTERS == 32_768


def test_the_probe_model_trains_the_adapters_only():
    model, _, info = _probe("--lora-rank", str(RANK))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n, _ in trainable)
    assert len(trainable) == ADAPTER_TENSORS
    assert sum(p.numel() for _, p in trainable) == ADAPTERS == info.trainable
    base, _, none = _probe()
    assert none is None and all(p.requires_grad for p in base.parameters())
    total = sum(p.numel() for p in base.parameters())
    assert sum(p.numel() for p in model.parameters()) == total + ADAPTERS == info.total


def test_measured_memory_is_the_frozen_base_s():
    model, make_batch, _ = _probe("--lora-rank", str(RANK))
    use = fit.measure_step(model, make_batch, causal_lm_loss, 2)
    every = sum(p.numel() for p in model.parameters())
    assert use.params == 4 * every  # the frozen base is held, in fp32
    assert use.grads == 4 * ADAPTERS  # .grad for the adapters only
    # AdamW: two fp32 moments per adapter element and a 4-byte step count per tensor
    assert use.optimizer == 8 * ADAPTERS + 4 * ADAPTER_TENSORS
    full, full_batch, _ = _probe()
    whole = fit.measure_step(full, full_batch, causal_lm_loss, 2)
    n_full = sum(p.numel() for p in full.parameters())
    assert whole.grads == 4 * n_full and whole.optimizer > 8 * n_full


def test_cli_json_reports_the_adapters_and_their_memory(capsys):
    argv = [*FIT, "--lora-rank", str(RANK), "--max-seconds", "3", "--no-checkpointing", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["lora"]["trainable"] == ADAPTERS and got["lora"]["rank"] == RANK
    assert got["memory"]["grads"] == 4 * ADAPTERS
    assert got["memory"]["optimizer"] == 8 * ADAPTERS + 4 * ADAPTER_TENSORS


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lora-alpha", "3"], "--lora-alpha 3: needs --lora-rank"),
        (["--lora-targets", "c_fc"], "--lora-targets c_fc: needs --lora-rank"),
        (["--lora-rank", "4", "--lora-targets", "nope"], "--lora-targets nope: nope matches no"),
        (["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout 1.5: must be in [0, 1)"),
        (["--lora-rank", "0"], "--lora-rank 0"),
    ],
)
def test_bad_lora_flags_one_line_exit_2(capsys, extra, words):
    assert main([*FIT, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err
