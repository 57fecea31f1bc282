"""A Hugging Face causal LM built from its config alone (random init, nothing downloaded),
and what it is in numbers: `--model-config`, and this project's checkpoints of such a model
(config.json and model.pt). transformers is an optional extra, imported when used."""

from __future__ import annotations

import torch.nn as nn

from gradaccum.models import hf_folder
from gradaccum.models.hf_folder import short_error
from gradaccum.models.info import ModelInfo, check_fits
from gradaccum.utils.errors import BadInput

UNBOUNDED = 1 << 62
"""The positions of a config that states none (rotary embeddings read any length)."""


def from_config(flag: str, path: str, source: str, vocab_size, seq_len):
    """(model, ModelInfo) of the config at `path` (a config.json or its folder), randomly
    initialised; vocab_size and seq_len, when given, must fit it. BadInput names `flag`."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise BadInput(f"{flag} {path}: needs transformers (pip install 'gradaccum[hf]')") from None
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise BadInput(flag, path, f"not a readable model config ({short_error(err)})") from None
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise BadInput(
            flag, path, f"not a causal LM config (model_type {config.model_type} has no vocabulary)"
        )
    check_fits(
        flag, path, config.vocab_size, max_positions(config) or UNBOUNDED, vocab_size, seq_len
    )
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise BadInput(flag, path, f"not a causal LM config ({short_error(err)})") from None
    hf_folder.refuse_non_causal(model, flag, path)
    return model, hf_info(model, config, source, seq_len)


def parameter_count(model: nn.Module) -> int:
    """Parameters as the model was before any quantisation: a 4-bit weight, stored packed two
    to a byte, counts its (out, in) shape."""
    total = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        total += state.shape.numel() if state is not None else p.numel()
    return total


def max_positions(config) -> int | None:
    """The longest sequence an HF config allows, in tokens (None: it does not say)."""
    return next(
        (
            getattr(config, a)
            for a in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
            if isinstance(getattr(config, a, None), int)
        ),
        None,
    )


def hf_info(model: nn.Module, config, source: str, seq_len) -> ModelInfo:
    """The ModelInfo of a transformers model and its config; seq_len where the config states
    no positions."""
    get = lambda *names: next((getattr(config, n) for n in names if hasattr(config, n)), 0)  # noqa: E731
    max_pos = max_positions(config)
    return ModelInfo(
        source=source,
        kind="hf",
        params=parameter_count(model),
        layers=int(get("num_hidden_layers", "n_layer")),
        hidden=int(get("hidden_size", "n_embd", "d_model")),
        heads=int(get("num_attention_heads", "n_head")),
        vocab_size=int(config.vocab_size),
        seq_len=int(max_pos if max_pos else seq_len or 0),
        config=config.to_dict(),
    )
