"""LoRA checkpoints and --resume: the checkpoint holds the adapters and their optimizer state
only; a run stopped after 2 of 4 steps and resumed ends bit for bit where the straight run
does (adapter weights, losses), with the base bit-identical to the weights it started from;
a resume against other base weights, or with another LoRA, is one line, exit 2."""

from __future__ import annotations

import os

import pytest
import torch

from gradaccum.cli import main
from gradaccum.models.gpt import GPT, GPT_MODEL_TYPE, GPTConfig
from gradaccum.train import adapters
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint

from .helpers import markov_npy, one_line_error, train_records
from .small_run import latest_checkpoint, small_config, train_until
from .test_lora_flags import tiny_adapters

pytest.importorskip("peft")

RANK = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return markov_npy(tmp_path_factory.mktemp("data") / "markov.npy", 20_000, seed=1)


def config(out, data, **kw) -> TrainConfig:
    lora = dict(
        max_steps=4,
        device="cpu",
        lora_rank=RANK,
        lora_dropout=0.1,  # the dropout masks draw from the RNG: a resume must restore it
    )
    return small_config(out, data, **{**lora, **kw})


def base_tensors(model) -> dict:
    """The base's tensors under their names before LoRA, copied."""
    state = model.state_dict()
    return {
        k.replace(".base_layer.", "."): v.detach().clone()
        for k, v in state.items()
        if ".lora_" not in k
    }


@pytest.mark.slow  # trains past a few steps
def test_checkpoint_holds_adapters_only_and_resume_is_bit_for_bit(tmp_path, data, monkeypatch):
    seen = {}
    real_attach, real_export = adapters.attach, adapters.export

    def attach(model, info, cfg):
        seen.setdefault("initial", {k: v.clone() for k, v in model.state_dict().items()})
        return real_attach(model, info, cfg)

    def export(model, cfg, tokenizer=None):
        seen["final"] = base_tensors(model)
        return real_export(model, cfg, tokenizer)

    monkeypatch.setattr(adapters, "attach", attach)
    monkeypatch.setattr(adapters, "export", export)
    straight = tmp_path / "straight"
    train(config(straight, data))
    # The base after 4 steps: every tensor bit for bit the one it was built with.
    assert seen["final"].keys() == seen["initial"].keys()
    for name, tensor in seen["initial"].items():
        assert torch.equal(seen["final"][name], tensor), name

    # The checkpoint: adapter tensors only, their count derived by hand, and optimizer state
    # for exactly those tensors.
    ckpt = latest_checkpoint(straight)
    assert ckpt.model_state and all(".lora_" in k for k in ckpt.model_state)
    assert sum(t.numel() for t in ckpt.model_state.values()) == tiny_adapters(RANK)
    opt_state = ckpt.trainer_state["optimizer"]["state"]
    shapes = sorted(tuple(s["exp_avg"].shape) for s in opt_state.values())
    assert shapes == sorted(tuple(t.shape) for t in ckpt.model_state.values())

    # Stopped after 2 of 4 steps, then resumed: the same losses and adapters, bit for bit.
    halves = tmp_path / "halves"
    train_until(config(halves, data), 2)
    assert latest_checkpoint(halves).step == 2
    train(config(halves, data, resume=True))
    assert train_records(halves) == train_records(straight)
    resumed = latest_checkpoint(halves)
    assert resumed.step == 4 and resumed.model_state.keys() == ckpt.model_state.keys()
    for name, tensor in ckpt.model_state.items():
        assert torch.equal(resumed.model_state[name], tensor), name


def gpt_folder(folder, seed: int, bump: float = 0.0) -> str:
    """A checkpoint folder of a built-in GPT (config.json + model.pt) for --init-from."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=512, seq_len=16, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg)
    state = model.state_dict()
    state["wte.weight"][0, 0] += bump
    os.makedirs(folder, exist_ok=True)
    checkpoint.save_model(str(folder), state, {"model_type": GPT_MODEL_TYPE, **cfg.__dict__})
    return str(folder)


def cli(out, data, *extra) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
        "--accum-steps",
        "2",
        "--eval-every",
        "0",
        "--save-every",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]


def test_resume_against_another_base_or_lora_is_one_line(tmp_path, data, capsys):
    base = gpt_folder(tmp_path / "base", seed=3)
    out = tmp_path / "run"
    assert main(cli(out, data, "--init-from", base, "--lora-rank", "4", "--max-steps", "2")) == 0
    capsys.readouterr()
    before = sorted(os.listdir(out))

    line = one_line_error(
        capsys,
        cli(out, data, "--resume", "--max-steps", "4", "--lora-rank", "8"),
        stdout_empty=False,
    )
    assert line.endswith(
        f"--lora-rank 8: the run in {out} trained its adapters with --lora-rank 4; "
        "a resume keeps them"
    ), line
    line = one_line_error(
        capsys, cli(out, data, "--resume", "--lora-targets", "c_fc"), stdout_empty=False
    )
    assert "--lora-targets c_fc: the run in" in line and "c_attn,c_proj,c_fc" in line, line

    # The same folder with one base weight changed by 2**-10: not the base it was trained on.
    gpt_folder(tmp_path / "base", seed=3, bump=2**-10)
    line = one_line_error(
        capsys, cli(out, data, "--resume", "--max-steps", "4"), stdout_empty=False
    )
    assert (
        f"--resume {out}: the base model (checkpoint {base}) is not the one the adapters " in line
    )
    assert "sha256" in line, line
    assert sorted(os.listdir(out)) == before  # nothing written

    # Put back, the resume goes on.
    gpt_folder(tmp_path / "base", seed=3)
    assert main(cli(out, data, "--resume", "--max-steps", "4")) == 0
    assert latest_checkpoint(out).step == 4


def test_a_base_rebuilt_from_the_seed_is_the_same_base(tmp_path, data):
    """The built-in model of a resumed run is built from the seed again: its fingerprint is
    the one the new run recorded (and another seed's is not)."""
    out = tmp_path / "run"
    train(config(out, data, max_steps=2))
    recorded = latest_checkpoint(out).model_config[adapters.RECORD]["base_sha256"]
    for seed, same in ((0, True), (1, False)):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=512, seq_len=16, **_tiny()))
        assert (adapters.base_fingerprint(model) == recorded) is same


def _tiny() -> dict:
    from gradaccum.utils.choices import BUILTIN_MODELS

    return BUILTIN_MODELS["tiny"]


def test_the_fingerprint_is_of_the_base_alone():
    """Independent of the adapters: the same with LoRA injected and trained as before it."""
    from gradaccum.models import lora

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, n_embd=8))
    before = adapters.base_fingerprint(model)
    lora.apply_lora(model, lora.LoraSpec(rank=2))
    with torch.no_grad():
        for p in lora.trainable_parameters(model):
            p.add_(1.0)
    assert adapters.base_fingerprint(model) == before
    with torch.no_grad():
        w = model.wte.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))  # one ulp
    assert adapters.base_fingerprint(model) != before
