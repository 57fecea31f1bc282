"""The model `gradaccum train` trains: a small GPT of its own, or any Hugging Face causal LM.

The GPT is nanoGPT's: token and position embeddings, pre-LayerNorm blocks of causal
self-attention (`F.scaled_dot_product_attention`) and a GELU MLP, a final LayerNorm and an
output head tied to the token embedding. Its parameter count is

    V*C + T*C + L*(12*C*C + 13*C) + 2*C        (V vocab, T seq_len, L layers, C width)

with the tied head counted once.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..utils.errors import BadInput
from . import hf_folder
from .hf_folder import sees_only_the_past  # noqa: F401  (importable from here too)
from .hf_folder import short_error as _short

# Layers, heads and width of each preset; vocab and seq_len come from the data.
PRESETS: dict[str, dict] = {
    "tiny": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "small": {"n_layer": 6, "n_head": 4, "n_embd": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768},
}

# The `model_type` written into config.json for this GPT, so a checkpoint folder says which
# kind of model it holds (Hugging Face configs carry their own model_type).
GPT_MODEL_TYPE = "gradaccum-gpt"


@dataclass
class GPTConfig:
    vocab_size: int
    """Tokens in the vocabulary, the end-of-document token included."""
    seq_len: int
    """Longest sequence the model reads, in tokens (size of the position embedding)."""
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block; must divide n_embd."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and MLP outputs (0 keeps runs exact)."""

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd {self.n_embd} not divisible by n_head {self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer: `model(input_ids (b, T) long) -> logits (b, T, vocab)`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.activation_checkpointing = False
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down so the residual stream's variance does not
        # grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations in backward instead of keeping them."""
        self.activation_checkpointing = bool(enabled)

    def num_params(self) -> int:
        """Parameters, the tied output head counted once (it is the token embedding)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        # The head is the token embedding itself (tied), so there is no second V x C matrix.
        return F.linear(self.ln_f(x), self.wte.weight)


def causal_lm_loss(model: nn.Module, batch: dict, ignore_index: int = -100):
    """Cross-entropy summed over the batch's labels that are not `ignore_index`, in fp32.

    `batch` holds "input_ids" and "labels", both (b, T) long, labels already shifted (the
    label at position t is the token after input t). Works for GPT and for Hugging Face causal
    LMs (their output's `.logits`). Returns (loss_sum: 0-dim fp32 tensor, num_tokens: 0-dim
    int64 tensor).
    """
    out = model(batch["input_ids"])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    labels = batch["labels"]
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss_sum, (labels != ignore_index).sum()


@dataclass
class ModelInfo:
    source: str
    """What was built, in words: "preset tiny", "HF gpt2 from PATH", "checkpoint DIR"."""
    kind: str
    """"gpt" (this module's GPT) or "hf" (a transformers model)."""
    params: int
    """Parameters (tied weights counted once)."""
    layers: int
    """Transformer blocks."""
    hidden: int
    """Width of the residual stream."""
    heads: int
    """Attention heads per block."""
    vocab_size: int
    """Tokens the model can read and predict."""
    seq_len: int
    """Longest sequence the model reads, in tokens."""
    config: dict
    """What to write to a checkpoint's config.json so `init_from` can rebuild the model."""

    def to_dict(self) -> dict:
        return asdict(self)


def _check_fits(flag: str, value, model_vocab: int, model_seq: int, vocab_size, seq_len) -> None:
    if vocab_size is not None and vocab_size > model_vocab:
        raise BadInput(
            f"{flag} {value}: the data has {vocab_size} token ids but the model's vocabulary "
            f"holds {model_vocab}"
        )
    if seq_len is not None and seq_len > model_seq:
        raise BadInput(
            f"{flag} {value}: sequences of {seq_len} tokens exceed the model's {model_seq} positions"
        )


def _gpt_info(model: GPT, source: str) -> ModelInfo:
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
    )


def _hf_model(flag: str, path: str, source: str, vocab_size, seq_len):
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise BadInput(f"{flag} {path}: needs transformers (pip install 'gradaccum[hf]')") from None
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise BadInput(flag, path, f"not a readable model config ({_short(err)})") from None
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise BadInput(
            flag, path, f"not a causal LM config (model_type {config.model_type} has no vocabulary)"
        )
    _check_fits(
        flag, path, config.vocab_size, _max_positions(config) or 1 << 62, vocab_size, seq_len
    )
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise BadInput(flag, path, f"not a causal LM config ({_short(err)})") from None
    hf_folder.refuse_non_causal(model, flag, path)
    return model, _hf_info(model, config, source, seq_len)


def _max_positions(config) -> int | None:
    """The longest sequence an HF config allows, in tokens (None: it does not say)."""
    return next(
        (
            getattr(config, a)
            for a in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
            if isinstance(getattr(config, a, None), int)
        ),
        None,
    )


def _hf_info(model: nn.Module, config, source: str, seq_len) -> ModelInfo:
    get = lambda *names: next((getattr(config, n) for n in names if hasattr(config, n)), 0)  # noqa: E731
    max_pos = _max_positions(config)
    return ModelInfo(
        source=source,
        kind="hf",
        params=sum(p.numel() for p in model.parameters()),
        layers=int(get("num_hidden_layers", "n_layer")),
        hidden=int(get("hidden_size", "n_embd", "d_model")),
        heads=int(get("num_attention_heads", "n_head")),
        vocab_size=int(config.vocab_size),
        seq_len=int(max_pos if max_pos else seq_len or 0),
        config=config.to_dict(),
    )


def _from_hf_folder(directory: str, vocab_size, seq_len, dtype: str):
    """A folder as transformers' save_pretrained writes it (gradaccum.models.hf_folder)."""
    folder = hf_folder.read_folder(directory, flag="--init-from")
    config = folder.config
    _check_fits(
        "--init-from",
        directory,
        config.vocab_size,
        _max_positions(config) or 1 << 62,
        vocab_size,
        seq_len,
    )
    model = hf_folder.load_model(folder, dtype=dtype)
    # model.config, not the folder's: it records the dtype loaded (fp32 when upcast), which a
    # checkpoint's config.json must carry for from_config to rebuild the same model.
    source = f"HF {folder.describe()} from {directory}"
    return model, _hf_info(model, model.config, source, seq_len)


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
    elif os.path.exists(pt_path):
        try:
            state = torch.load(pt_path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises many kinds for a file that is not a state_dict
            raise BadInput(
                "--init-from", directory, f"model.pt is not a readable state_dict ({_short(err)})"
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


def _from_checkpoint(directory: str, vocab_size, seq_len, dropout: float, dtype: str):
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
            flag, directory, f"config.json is not readable JSON ({_short(err)})"
        ) from None
    if not isinstance(saved, dict):
        raise BadInput(flag, directory, "config.json does not hold a JSON object")
    source = f"checkpoint {directory}"
    if saved.get("model_type", GPT_MODEL_TYPE) == GPT_MODEL_TYPE:
        names = {f.name for f in fields(GPTConfig)}
        kwargs = {k: v for k, v in saved.items() if k in names}
        kwargs.setdefault("dropout", dropout)
        try:
            cfg = GPTConfig(**kwargs)
        except (TypeError, ValueError) as err:
            raise BadInput(f"{flag} {directory}: config.json is not a GPT config ({err})") from None
        _check_fits(flag, directory, cfg.vocab_size, cfg.seq_len, vocab_size, seq_len)
        model, info = GPT(cfg), None
    elif not os.path.exists(os.path.join(directory, "model.pt")):
        return _from_hf_folder(directory, vocab_size, seq_len, dtype)
    else:  # this project's own checkpoint of a Hugging Face model: config.json and model.pt
        model, info = _hf_model(flag, directory, source, vocab_size, seq_len)
    try:
        model.load_state_dict(_load_state_dict(directory))
    except RuntimeError as err:
        raise BadInput(
            flag, directory, f"weights do not match config.json ({_short(err)})"
        ) from None
    return model, info or _gpt_info(model, source)


def build_model(
    preset: str | None = None,
    config_path: str | None = None,
    init_from: str | None = None,
    vocab_size: int | None = None,
    seq_len: int | None = None,
    dropout: float = 0.0,
    dtype: str = "auto",
) -> tuple[nn.Module, ModelInfo]:
    """Build the model to train, from exactly one of a preset, an HF config or a checkpoint.

    preset: a key of PRESETS; vocab_size and seq_len (tokens) are then required.
    config_path: a Hugging Face config.json (or its folder), built with transformers, random
        init, nothing downloaded; vocab and positions come from the config.
    init_from: a checkpoint folder of this project (config.json and model.safetensors or
        model.pt, a state_dict), or a Hugging Face folder as save_pretrained writes it (single
        or sharded safetensors, pytorch_model.bin; gradaccum.models.hf_folder).
    For the last two, vocab_size and seq_len, when given, are checked to fit the model.
    dtype: for a Hugging Face folder, "auto" keeps the stored dtype (bf16 stays bf16), "fp32"
        upcasts. Other models are built as their config says (the built-in GPT in fp32).
    Raises BadInput naming the flag on bad input.
    """
    given = [x for x in (preset, config_path, init_from) if x is not None]
    if len(given) != 1:
        raise ValueError("build_model: give exactly one of preset, config_path, init_from")
    if init_from is not None:
        return _from_checkpoint(init_from, vocab_size, seq_len, dropout, dtype)
    if config_path is not None:
        if not os.path.exists(config_path):
            raise BadInput(f"--model-config {config_path}: no such file")
        return _hf_model(
            "--model-config", config_path, f"HF config {config_path}", vocab_size, seq_len
        )
    if preset not in PRESETS:
        raise BadInput(f"--model {preset}: unknown preset; choose one of {', '.join(PRESETS)}")
    if vocab_size is None or seq_len is None:
        raise ValueError("build_model: a preset needs vocab_size and seq_len")
    model = GPT(
        GPTConfig(vocab_size=vocab_size, seq_len=seq_len, dropout=dropout, **PRESETS[preset])
    )
    return model, _gpt_info(model, f"preset {preset}")
