"""The model a run trains, from exactly one of: a built-in preset (`--model`), a Hugging Face
config (`--model-config`), or a folder (`--init-from`: this project's checkpoint, or a folder
as transformers' save_pretrained writes it). Shared by train, fit, verify and bench."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields

import torch
import torch.nn as nn

from gradaccum.models import hf_folder
from gradaccum.models.gpt import GPT, GPT_MODEL_TYPE, GPTConfig
from gradaccum.models.hf_config import UNBOUNDED, from_config, hf_info, max_positions
from gradaccum.models.hf_folder import short_error
from gradaccum.models.info import ModelInfo, check_fits
from gradaccum.utils.choices import BUILTIN_MODELS, check_builtin_model
from gradaccum.utils.errors import BadInput


def build_model(
    preset: str | None = None,
    config_path: str | None = None,
    init_from: str | None = None,
    vocab_size: int | None = None,
    seq_len: int | None = None,
    dropout: float = 0.0,
    dtype: str = "auto",
    quant=None,
    device="cpu",
    weights: bool = True,
) -> tuple[nn.Module, ModelInfo]:
    """Build the model to train, from exactly one of a preset, an HF config or a checkpoint.

    preset: a key of BUILTIN_MODELS; vocab_size and seq_len (tokens) are then required.
    config_path: a Hugging Face config.json (or its folder), built with transformers, random
        init, nothing downloaded; vocab and positions come from the config.
    init_from: a checkpoint folder of this project (config.json and model.safetensors or
        model.pt, a state_dict), or a Hugging Face folder as save_pretrained writes it (single
        or sharded safetensors, pytorch_model.bin; gradaccum.models.hf_folder).
    For the last two, vocab_size and seq_len, when given, are checked to fit the model.
    weights: False builds a checkpoint folder's model from its config.json alone, at random
        init (a sharded checkpoint, whose weights the run reads into the placed model).
    dtype: for a Hugging Face folder, "auto" keeps the stored dtype (bf16 stays bf16), "fp32"
        upcasts. Other models are built as their config says (the built-in GPT in fp32).
    quant: a `QuantSpec` (--base-bits): the blocks' linear layers stored in 4 or 8 bits on
        `device`, a Hugging Face folder loaded so by transformers' BitsAndBytesConfig, any
        other model quantised from the weights it was built with (`models.quantized`); the
        ModelInfo counts the parameters as they were before.
    Raises BadInput naming the flag on bad input.
    """
    if quant is not None:
        return _quantized(preset, config_path, init_from, vocab_size, seq_len, dropout, dtype,
                          quant, device)  # fmt: skip
    given = [x for x in (preset, config_path, init_from) if x is not None]
    if len(given) != 1:
        raise ValueError("build_model: give exactly one of preset, config_path, init_from")
    if init_from is not None:
        return _from_checkpoint(init_from, vocab_size, seq_len, dropout, dtype, weights)
    if config_path is not None:
        if not os.path.exists(config_path):
            raise BadInput(f"--model-config {config_path}: no such file")
        return from_config(
            "--model-config", config_path, f"HF config {config_path}", vocab_size, seq_len
        )
    check_builtin_model(preset, "--model")
    if vocab_size is None or seq_len is None:
        raise ValueError("build_model: a preset needs vocab_size and seq_len")
    model = GPT(
        GPTConfig(vocab_size=vocab_size, seq_len=seq_len, dropout=dropout, **BUILTIN_MODELS[preset])
    )
    return model, gpt_info(model, f"preset {preset}")


def _quantized(preset, config_path, init_from, vocab_size, seq_len, dropout, dtype, quant, device):
    """build_model's --base-bits path (see there)."""
    from gradaccum.models import quantized

    quantized.require_bitsandbytes(quant.bits)
    quantized.silence()
    if init_from is not None and is_hf_folder(init_from):
        folder = hf_folder.read_folder(init_from, flag="--init-from")
        config = folder.config
        # Computed in fp32, a bf16 folder is loaded in fp32 before it is quantised: else
        # bitsandbytes' backward would use the bf16 weights its forward does not.
        loaded = "fp32" if quant.compute_dtype == "fp32" else dtype
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        model = hf_folder.load_model(folder, dtype=loaded, quant=quant, device=device)
        _check_fits_folder(folder, vocab_size, seq_len)
        model.base_dtype = stored  # what --merge-lora saves in (models.lora.base_dtype)
        source = f"HF {folder.describe()} from {init_from}"
        return model, hf_info(model, model.config, source, seq_len)
    model, info = build_model(preset, config_path, init_from, vocab_size, seq_len, dropout, dtype)
    quantized.quantize_linears(model, quant, device)
    return model, info


def _check_fits_folder(folder: hf_folder.HFFolder, vocab_size, seq_len) -> None:
    """`check_fits` for a Hugging Face folder, called once `load_model` has refused an encoder:
    a model that cannot train here (BERT) is refused as such, whatever its vocabulary."""
    config = folder.config
    positions = max_positions(config) or UNBOUNDED
    check_fits("--init-from", folder.path, config.vocab_size, positions, vocab_size, seq_len)


def is_hf_folder(directory: str) -> bool:
    """Whether --init-from names a Hugging Face folder rather than this project's checkpoint."""
    config = _read_config(directory)
    if config.get("model_type", GPT_MODEL_TYPE) == GPT_MODEL_TYPE:
        return False
    return not _holds_weights(directory)


def gpt_info(model: GPT, source: str) -> ModelInfo:
    """The ModelInfo of a built-in GPT; its config is what a checkpoint's config.json holds."""
    cfg = model.config
    return ModelInfo(
        source=source,
        kind="gpt",
        params=model.num_params(),
        layers=cfg.n_layer,
        hidden=cfg.n_embd,
        heads=cfg.n_head,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        config={"model_type": GPT_MODEL_TYPE, **asdict(cfg)},
        active_params=model.active_params() if cfg.n_expert else None,
    )


def _from_hf_folder(directory: str, vocab_size, seq_len, dtype: str):
    """A folder as transformers' save_pretrained writes it (gradaccum.models.hf_folder)."""
    folder = hf_folder.read_folder(directory, flag="--init-from")
    model = hf_folder.load_model(folder, dtype=dtype)
    _check_fits_folder(folder, vocab_size, seq_len)
    # model.config, not the folder's: it records the dtype loaded (fp32 when upcast), which a
    # checkpoint's config.json must carry for from_config to rebuild the same model.
    source = f"HF {folder.describe()} from {directory}"
    return model, hf_info(model, model.config, source, seq_len)


def _load_state_dict(directory: str) -> dict:
    st_path = os.path.join(directory, "model.safetensors")
    pt_path = os.path.join(directory, "model.pt")
    if os.path.exists(st_path):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise BadInput(
                f"--init-from {directory}: model.safetensors needs safetensors (pip install safetensors)"
            ) from None
        state = load_file(st_path)
    elif os.path.isdir(os.path.join(directory, "sharded")):  # a sharded run's checkpoint
        from gradaccum.models.sharded_state import read_sharded_model

        state = read_sharded_model(os.path.join(directory, "sharded"))
    elif os.path.exists(pt_path):
        try:
            state = torch.load(pt_path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises many kinds for a file that is not a state_dict
            raise BadInput(
                "--init-from",
                directory,
                f"model.pt is not a readable state_dict ({short_error(err)})",
            ) from None
        if not isinstance(state, dict):
            raise BadInput("--init-from", directory, "model.pt does not hold a state_dict")
    else:
        raise BadInput(f"--init-from {directory}: holds neither model.safetensors nor model.pt")
    # Checkpoints written from a compiled or DDP-wrapped model carry these prefixes.
    clean = {}
    for key, value in state.items():
        for prefix in ("_orig_mod.", "module."):
            while key.startswith(prefix):
                key = key[len(prefix) :]
        clean[key] = value
    return clean


def _read_config(directory: str) -> dict:
    """The checkpoint folder's config.json as a dict; BadInput naming --init-from otherwise."""
    flag = "--init-from"
    config_path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise BadInput(f"{flag} {directory}: no such folder")
    if not os.path.exists(config_path):
        raise BadInput(f"{flag} {directory}: no config.json in it")
    try:
        with open(config_path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:  # malformed JSON, not UTF-8
        raise BadInput(
            flag, directory, f"config.json is not readable JSON ({short_error(err)})"
        ) from None
    if not isinstance(saved, dict):
        raise BadInput(flag, directory, "config.json does not hold a JSON object")
    return saved


def _holds_weights(directory: str) -> bool:
    """Whether a folder holds this project's checkpoint weights: model.pt, or a sharded run's
    sharded/ (torch.distributed.checkpoint's files)."""
    return any(os.path.exists(os.path.join(directory, n)) for n in ("model.pt", "sharded"))


def _from_checkpoint(directory: str, vocab_size, seq_len, dropout: float, dtype: str, weights=True):
    flag = "--init-from"
    saved = _read_config(directory)
    source = f"checkpoint {directory}"
    if saved.get("model_type", GPT_MODEL_TYPE) == GPT_MODEL_TYPE:
        names = {f.name for f in fields(GPTConfig)}
        kwargs = {k: v for k, v in saved.items() if k in names}
        kwargs.setdefault("dropout", dropout)
        try:
            cfg = GPTConfig(**kwargs)
        except (TypeError, ValueError) as err:
            raise BadInput(f"{flag} {directory}: config.json is not a GPT config ({err})") from None
        check_fits(flag, directory, cfg.vocab_size, cfg.seq_len, vocab_size, seq_len)
        model, info = GPT(cfg), None
    elif weights and not _holds_weights(directory):
        return _from_hf_folder(directory, vocab_size, seq_len, dtype)
    else:  # this project's own checkpoint of a Hugging Face model: config.json and model.pt
        model, info = from_config(flag, directory, source, vocab_size, seq_len)
    if not weights:
        return model, info or gpt_info(model, source)
    try:
        model.load_state_dict(_load_state_dict(directory))
    except RuntimeError as err:
        raise BadInput(
            flag, directory, f"weights do not match config.json ({short_error(err)})"
        ) from None
    return model, info or gpt_info(model, source)
