"""LoRA in `gradaccum train`: `--lora-rank R` (with --lora-alpha, --lora-dropout,
--lora-targets, --merge-lora) trains low-rank adapters on a frozen base, for --task pretrain
and --task sft alike (`gradaccum.models.lora`, on peft: the `lora` extra).

Where a run meets it:
- building the model (`attach`, from `parts.new_model`): the base is fingerprinted (sha256 of
  its tensors, `base_fingerprint`), then the adapters go in and every base parameter is
  frozen. This is before `--micro-batch auto` probes the model (so the probe measures the
  frozen base: gradients and optimizer state for the adapters only) and before `parts.place`
  (activation checkpointing, torch.compile, DDP, in that order, all on the adapted model; the
  checkpointing is the non-reentrant kind, which gives the adapters their gradients although
  the frozen blocks' inputs need none). The run's ModelInfo counts every parameter, base and
  adapters, and its config carries the LoRA's record (`RECORD`: rank, alpha, dropout,
  targets, counts, the base's sha256), which the checkpoint's config.json keeps.
- the optimizer: `parts.optimizer`'s AdamW takes the parameters that require grad, the
  adapters alone.
- the plan (`trainable_params`, from `resolve_plan`): the frozen-base memory, gradients, fp32
  buffers and optimizer state counted for the adapters only.
- checkpoints (`checkpoint_state`, from `Outputs.save`): model.pt holds the adapters' tensors
  only, trainer.pt the optimizer state, which holds theirs only. No base tensor: a resume
  builds the base again as the new run did (`resumed_model`, from `parts.checkpoint_model`),
  re-read from --init-from or built from the seed (the same seed draws the same weights), and
  refuses, in one line, a base whose sha256 differs from the recorded one; the adapters then
  load bit for bit, and the RNG state is restored after them (apply_lora draws A from it).
- the end (`export`, from `Outputs.export`): --out/adapter, peft's adapter folder, which
  `PeftModel.from_pretrained(base, folder)` loads onto the base; with --merge-lora also
  --out/merged, the adapters folded into the weights (`models.lora.export_merged`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields, replace

import torch

from gradaccum.models import lora
from gradaccum.models.export import has_lora, unwrap
from gradaccum.models.info import ModelInfo
from gradaccum.models.quantized_spec import spec_of
from gradaccum.train.rundir import checkpoint
from gradaccum.utils.errors import BadInput

RECORD = "gradaccum_lora"
"""The key of the LoRA's record in a LoRA run's model config (and its checkpoints'
config.json)."""

ADAPTER_FOLDER = "adapter"
"""--out/adapter: peft's adapter folder, written when a LoRA run finishes."""

MERGED_FOLDER = "merged"
"""--out/merged: the merged model, written with --merge-lora."""

COMPARED = (("rank", "--lora-rank"), ("alpha", "--lora-alpha"), ("dropout", "--lora-dropout"))
"""Record fields a resume must keep, and their flags (targets are compared too)."""


def spec(config) -> lora.LoraSpec | None:
    """The LoRA `config` (a TrainConfig) asks for; None without --lora-rank."""
    if config.lora_rank is None:
        return None
    return lora.LoraSpec(
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout or 0.0,
        targets=config.lora_targets,
    )


def base_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the base's tensors (names as before LoRA, dtypes, shapes, bytes), in name
    order; the adapters, if injected, are left out. Reads every base byte once (a 7B bf16
    model: 13 GB, some seconds)."""
    model = unwrap(model)
    adapted = has_lora(model)
    state = {
        lora.base_key(name) if adapted else name: t
        for name, t in model.state_dict().items()
        if not (adapted and lora.is_adapter_key(name))
    }
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def attach(
    model: torch.nn.Module, model_info: ModelInfo, config
) -> tuple[torch.nn.Module, ModelInfo]:
    """`model` with the LoRA `config` asks for applied in place (the base frozen), and its
    ModelInfo: every parameter counted, RECORD in its config. Without --lora-rank, both as
    given. BadInput for targets that match no linear layer, or peft missing."""
    wanted = spec(config)
    if wanted is None:
        return model, model_info
    fingerprint = base_fingerprint(model)
    quant = quantized_base(model, config)
    info = lora.apply_lora(model, wanted)
    record = {
        **info.to_dict(),
        "targets": list(info.targets),
        "base_sha256": fingerprint,
        "base": model_info.source,
        "base_quant": quant,
    }
    config_dict = {**model_info.config, RECORD: record}
    return model, replace(model_info, params=info.total, config=config_dict)


def quantized_base(model: torch.nn.Module, config) -> dict | None:
    """With --base-bits: the base prepared for k-bit training as peft does (frozen, its
    unquantised bf16/fp16 parameters in fp32, input gradients for activation checkpointing),
    and the quantisation's record (bits, data type, compute dtype, layers quantised); None
    without --base-bits."""
    if config.base_bits is None:
        return None
    from gradaccum.models import quantized

    quantized.prepare_for_kbit_training(model, config.activation_checkpointing)
    device = next(model.parameters()).device.type
    record = spec_of(config, device).record()
    layers = len(quantized.quantized_layers(model))
    return {**record, "layers": layers, "stored_bytes": quantized.stored_bytes(model)}


def record_of(model_info: ModelInfo) -> dict | None:
    """The LoRA record of a run's model (None for a run without LoRA)."""
    return model_info.config.get(RECORD)


def trainable_params(model_info: ModelInfo) -> int | None:
    """Parameters that train, for the plan's frozen-base memory; None: all of them."""
    record = record_of(model_info)
    return None if record is None else int(record["trainable"])


def opening_lines(model_info: ModelInfo) -> list[str]:
    """The start-of-run line: rank, alpha, targets, trainable parameters (count, fraction)."""
    record = record_of(model_info)
    if record is None:
        return []
    names = {f.name for f in fields(lora.LoraInfo)}
    info = lora.LoraInfo(**{k: v for k, v in record.items() if k in names})
    lines = [f"lora   {replace(info, targets=tuple(info.targets)).describe()}"]
    quant = record.get("base_quant")
    if quant is not None:
        lines.append(
            f"base   {_quant_words(quant)}: its {quant['layers']} block linear layers in "
            f"{quant['bits']} bits (bitsandbytes), {quant['stored_bytes'] / 1e6:,.2f} MB held in "
            "all; embeddings, head, norms and biases unquantised, in fp32"
        )
    return lines


def checkpoint_state(model_state: dict, model_config: dict) -> dict:
    """What a checkpoint's model.pt holds: for a LoRA run the adapters' tensors only (the
    base is rebuilt on resume), else the whole state_dict."""
    if RECORD not in model_config:
        return model_state
    return {k: v for k, v in model_state.items() if lora.is_adapter_key(k)}


def _saved_record(path: str) -> dict | None:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f).get(RECORD)


def resumed_model(
    config, path: str, model: torch.nn.Module, model_info: ModelInfo
) -> tuple[torch.nn.Module, ModelInfo]:
    """The model of a LoRA run resumed from checkpoint folder `path`: `model` (the base built
    again as a new run builds it, with `attach`) given the checkpoint's adapters bit for bit.
    BadInput (one line) when the checkpoint's run had no LoRA or another one, or when the
    base is not the one the adapters were trained on (its sha256)."""
    saved, now = _saved_record(path), record_of(model_info)
    if saved is None:
        raise BadInput(
            "--lora-rank",
            config.lora_rank,
            f"the run in {config.out} trained without LoRA; a resume keeps its model",
        )
    for key, flag in (*COMPARED, ("targets", "--lora-targets")):
        was, is_ = saved[key], now[key]
        if key == "targets":
            was, is_ = ",".join(was), ",".join(is_)
        if was != is_:
            raise BadInput(
                flag,
                f"{is_:g}" if isinstance(is_, float) else is_,
                f"the run in {config.out} trained its adapters with {flag} "
                f"{f'{was:g}' if isinstance(was, float) else was}; a resume keeps them",
            )
    was_quant, is_quant = saved.get("base_quant"), now.get("base_quant")
    if was_quant != is_quant:
        same_bits = was_quant and is_quant and was_quant["bits"] == is_quant["bits"]
        flag, value = (
            ("--base-quant", config.base_quant) if same_bits else ("--base-bits", config.base_bits)
        )
        raise BadInput(
            flag,
            value,
            f"the run in {config.out} trained its adapters on {_quant_words(was_quant)}, not "
            f"{_quant_words(is_quant)}; a resume keeps the base as it was",
        )
    if saved["base_sha256"] != now["base_sha256"]:
        raise BadInput(
            "--resume",
            config.out,
            f"the base model ({model_info.source}) is not the one the adapters were trained "
            f"on: its weights' sha256 is {now['base_sha256'][:12]}..., the checkpoint's "
            f"{saved['base_sha256'][:12]}...; resume with the same base weights",
        )
    state = checkpoint.read_model_state(path)  # model.pt, or a sharded run's adapters whole
    try:
        lora.load_adapter_state_dict(model, state)
    except ValueError as err:
        raise BadInput("--resume", config.out, str(err)) from None
    return model, model_info


def _quant_words(record: dict | None) -> str:
    if record is None:
        return "an unquantised base"
    if record["bits"] == 8:
        return "an 8-bit (LLM.int8) base"
    double = ", double-quantised" if record.get("double_quant") else ""
    return f"a 4-bit {record['quant']} base ({record['compute_dtype']} compute{double})"


def tokenizer_source(config):
    """Where the exports take their tokenizer files from: the --init-from folder (those it
    holds are copied), else none."""
    return config.init_from


def export(model: torch.nn.Module, config, tokenizer=None) -> list[str]:
    """A finished LoRA run's exports into --out: adapter/ (peft's adapter folder; for the
    built-in GPT with base_config.json beside it, see `models.lora.export_adapter`) and, with
    --merge-lora, merged/ (`models.lora.export_merged`); the names written. `tokenizer`: a
    folder or a tokenizer object whose files go beside them (default `tokenizer_source`)."""
    model = unwrap(model)
    tokenizer = tokenizer_source(config) if tokenizer is None else tokenizer
    lora.export_adapter(
        model, os.path.join(config.out, ADAPTER_FOLDER), base=config.init_from, tokenizer=tokenizer
    )
    written = [ADAPTER_FOLDER + "/"]
    if config.merge_lora:
        folder = os.path.join(config.out, MERGED_FOLDER)
        lora.export_merged(model, folder, tokenizer=tokenizer)
        written.append(MERGED_FOLDER + "/")
    return written


def merge_line(model: torch.nn.Module, config) -> str | None:
    """With --merge-lora on a base in 4 or 8 bits: how far the merged model (--out/merged, the
    adapters folded into the dequantised base, in the base's own dtype) is from the model
    trained, measured: the largest logit difference on a fixed batch of 4 x 32 token ids. The
    merged weights are the ones the quantised layers computed with plus the adapters' update,
    rounded to that dtype (a bf16 base: bf16 rounding); None without --merge-lora or without
    --base-bits."""
    from gradaccum.models import quantized
    from gradaccum.models.build import build_model

    model = unwrap(model)
    if not config.merge_lora or not quantized.quantized_layers(model):
        return None
    folder = os.path.join(config.out, MERGED_FOLDER)
    merged, _ = build_model(init_from=folder, dtype="auto")
    device = next(model.parameters()).device
    vocab = merged.config.vocab_size
    ids = (torch.arange(4 * 32, device=device).reshape(4, 32) * 7919) % vocab
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), quantized.quiet():
            trained = _logits(model(ids)).float()
            folded = _logits(merged.to(device).eval()(ids)).float()
    finally:
        model.train(was_training)
    diff, scale = (trained - folded).abs().max().item(), trained.abs().max().item()
    dtype = str(next(merged.parameters()).dtype).removeprefix("torch.")
    return (
        f"{MERGED_FOLDER}/: the adapters folded into the dequantised base, saved in {dtype}; "
        f"its logits differ from the trained {config.base_bits}-bit model's by at most "
        f"{diff:.3g} (the logits reach {scale:.3g}) on a fixed batch of 4 x 32 tokens, "
        f"the rounding of W + (alpha / r) B A to {dtype}"
    )


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits
