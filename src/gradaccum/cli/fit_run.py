"""`gradaccum fit` once its flags are read (`cli/fit.py`): the data and model as `gradaccum
train` builds them, the ranks under torchrun, the probe, the table or JSON."""

from __future__ import annotations

import argparse
import sys

import numpy as np
from torch.nn.parallel import DistributedDataParallel

from gradaccum import fit
from gradaccum.cli.common import print_json
from gradaccum.data.tokens import DEFAULT_CORPUS_TOKENS, load_tokens
from gradaccum.models import lora
from gradaccum.models.build import build_model
from gradaccum.models.loss import causal_lm_loss
from gradaccum.models.quantized_spec import QuantSpec, check_base_flags, spec_of
from gradaccum.models.settings import model_source
from gradaccum.parallel import process_group
from gradaccum.parallel.devices import check_device
from gradaccum.settings.command import namespace
from gradaccum.utils.errors import BadInput, flag_name


def _one_line(err: BaseException, flag: str, value) -> BadInput:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return BadInput(text) if text.startswith("--") else BadInput(flag, value, text)


def _build(args: argparse.Namespace, source: tuple, device, quant: QuantSpec | None = None):
    """Data and model (`source`: preset, config.json) as `gradaccum train` builds them, with
    `quant` its linear layers in 4 or 8 bits on `device`; `make_batch(b)` on `device`."""
    preset, config_path = source
    # Probing reads at most one global batch: the built-in corpus need not be longer.
    tokens = min(DEFAULT_CORPUS_TOKENS, 2 * args.tokens_per_step + 4 * args.seq_len)
    try:
        train, _, info = load_tokens(args.data, args.seq_len, args.seed, corpus_tokens=tokens)
    except (ValueError, OSError, ImportError) as err:
        raise _one_line(err, "--data", args.data or "(built-in)") from None
    try:
        model, _ = build_model(
            preset=preset,
            config_path=config_path,
            vocab_size=info.vocab_size,
            seq_len=args.seq_len,
            quant=quant,
            device=device,
        )
    except (ValueError, OSError, ImportError) as err:
        flag = "--model-config" if config_path else "--model"
        raise _one_line(err, flag, config_path or preset) from None

    def make_batch(micro_batch: int) -> dict:
        rows = train.batch(np.arange(micro_batch) % len(train)).to(device)
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    if len(train) < 1:
        raise BadInput("--data", args.data or "(built-in)", "holds no whole sequence")
    return model.to(device), make_batch


def lora_spec(args: argparse.Namespace) -> lora.LoraSpec | None:
    """The LoRA the probe's model gets (None without --lora-rank); the other --lora-* flags
    need --lora-rank."""
    others = ("lora_alpha", "lora_dropout", "lora_targets")
    if args.lora_rank is None:
        for name in others:
            if getattr(args, name) is not None:
                value = getattr(args, name)
                shown = f"{value:g}" if isinstance(value, float) else value
                raise BadInput(flag_name(name), shown, "needs --lora-rank")
        return None
    return lora.LoraSpec(
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        dropout=0.0 if args.lora_dropout is None else args.lora_dropout,
        targets=args.lora_targets,
    )


def quant_spec(args: argparse.Namespace, device) -> QuantSpec | None:
    """The quantised base --base-bits asks for (None without it), computed in fp32 on the CPU
    and bf16 on an accelerator unless --precision says otherwise, as train's; it needs
    --lora-rank (only adapters train on it), and --base-quant needs --base-bits 4."""
    check_base_flags(args.base_bits, args.base_quant, args.lora_rank)
    return spec_of(args, device.type)


def base_record(args: argparse.Namespace, model, device) -> dict | None:
    """With --base-bits: the quantisation probed (`QuantSpec.record`), its layers in fewer
    bits and the bytes `model` holds (`models.quantized.stored_bytes`); None without."""
    quant = quant_spec(args, device)
    if quant is None:
        return None
    from gradaccum.models import quantized

    layers = len(quantized.quantized_layers(model))
    return {**quant.record(), "layers": layers, "stored_bytes": quantized.stored_bytes(model)}


def probe_model(args: argparse.Namespace, source: tuple, device):
    """The model fit probes and `make_batch(b)`: as `gradaccum train` builds them. With
    --base-bits the linear layers in 4 or 8 bits and the base prepared for k-bit training
    (`models.quantized`, as train's `adapters.quantized_base`); with --lora-rank the adapters
    applied and the base frozen (`models.lora.apply_lora`, as train applies them before
    `--micro-batch auto` probes), so gradients, fp32 buffers and optimizer state exist for
    the adapters only. Returns (model, make_batch, LoraInfo or None)."""
    spec = lora_spec(args)
    quant = quant_spec(args, device)
    model, make_batch = _build(args, source, device, quant)
    if quant is not None:
        from gradaccum.models import quantized

        quantized.prepare_for_kbit_training(model, checkpointing=not args.no_checkpointing)
    info = None if spec is None else lora.apply_lora(model, spec)
    return model, make_batch, info


def run(args: argparse.Namespace) -> int:
    args = namespace(args)
    check_device(args.device)
    source = model_source(args)
    try:
        info = process_group.init_distributed(args.device)
    except (ValueError, RuntimeError) as err:
        raise _one_line(err, "--device", args.device) from None
    try:
        if args.tokens_per_step < args.seq_len * info.world_size:
            raise BadInput(
                "--tokens-per-step",
                args.tokens_per_step,
                f"below one sequence of --seq-len {args.seq_len} on each of "
                f"{info.world_size} rank(s)",
            )
        model, make_batch, adapters = probe_model(args, source, info.device)
        if info.world_size > 1:
            ids = [info.device.index] if info.device.type not in ("cpu", "mps") else None
            model = DistributedDataParallel(model, device_ids=ids)
        tolerance = args.batch_tolerance
        result = fit.find_micro_batch(
            model,
            make_batch,
            causal_lm_loss,
            seq_len=args.seq_len,
            tokens_per_step=args.tokens_per_step,
            world_size=info.world_size,
            precision=args.precision,
            memory_budget=args.memory_budget,
            try_checkpointing=not args.no_checkpointing,
            max_seconds=args.max_seconds,
            batch_tolerance=fit.BATCH_TOLERANCE if tolerance is None else tolerance,
        )
    finally:
        process_group.teardown(info)
    if adapters is not None:
        result.lora = adapters.to_dict()
    result.base_quant = base_record(args, model, info.device)
    if info.rank == 0:
        if args.json:
            print_json(result.to_dict())
        else:
            sys.stdout.write(fit.render_table(result))
    return 0
