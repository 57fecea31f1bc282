"""What a `gradaccum train` run is asked to do: one field per command-line flag.

Validation happens when the config is built, before anything is written: a bad value raises
TrainConfigError whose message names the flag and the value, which the command prints as one
line with exit code 2.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, fields

from ..precision import PRECISIONS
from . import checkpoint
from .schedule import SCHEDULES

# The default run: sized so that `gradaccum train` ends within 3 minutes on 2 CPU cores.
DEFAULT_TOKENS_PER_STEP = 8192
"""Tokens per optimizer step when neither --tokens-per-step nor --accum-steps is given."""
DEFAULT_MAX_TOKENS = 1_572_864
"""Training tokens when neither --max-steps nor --max-tokens is given (192 steps of 8192)."""
DEFAULT_PRESET = "tiny"
"""Model when none of --model, --model-config, --init-from is given."""


class TrainConfigError(ValueError):
    """A flag with a value that cannot work; the message is `--flag value: why`."""


def _bad(flag: str, value, why: str) -> TrainConfigError:
    return TrainConfigError(f"{flag} {value}: {why}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def flag_of(name: str) -> str:
    """The command-line flag of a config field: micro_batch -> --micro-batch."""
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    tokens_per_step: int | None = None
    """Target tokens per optimizer step over all ranks (the recipe's batch size). None:
    8192, unless --accum-steps fixes the batch as micro-batch x k x world size."""
    seq_len: int = 128
    """Tokens per training sequence (the model reads seq_len, predicts seq_len)."""
    micro_batch: int | str = "auto"
    """Sequences per forward/backward on each rank, or "auto": the largest power of two the
    memory estimate fits on the device (on CPU: at most 2048 tokens per micro-batch) that
    still leaves k >= 1."""
    accum_steps: int | None = None
    """Micro-batches per optimizer step (k). None: chosen from --tokens-per-step."""
    max_steps: int | None = None
    """Optimizer steps to train for (exclusive with --max-tokens)."""
    max_tokens: int | None = None
    """Tokens to train on, rounded up to whole steps. With neither: 1,572,864 tokens."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int | None = None
    """Optimizer steps of linear warmup. None: a tenth of the run, at most 100."""
    schedule: str = "cosine"
    """LR decay after warmup, counted in optimizer steps: cosine, linear or constant."""
    weight_decay: float = 0.1
    """AdamW weight decay, on matrices and embeddings only (not on biases or norms)."""
    max_grad_norm: float = 1.0
    """Clip the window's gradient to this L2 norm; 0 turns clipping off."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast and loss scaling)."""
    activation_checkpointing: bool = False
    """Recompute activations in backward: less memory, about a third more compute."""
    compile: bool = False
    """torch.compile the model (needs a working compiler toolchain)."""
    seed: int = 0
    """Seed of the model's initialisation, the built-in corpus and the data order."""
    out: str | None = None
    """Folder of the run's outputs. None: runs/<date>-<time> under the current folder."""
    save_every: int = 100
    """Save a checkpoint every this many optimizer steps; 0: only at the end and on a stop."""
    resume: bool = False
    """Continue the run in --out from its newest checkpoint, exactly."""
    json: bool = False
    """Print the final summary as one JSON object on stdout (other text goes to stderr)."""
    eval_every: int = 50
    """Held-out loss every this many optimizer steps; 0: only at the end."""
    data: str | None = None
    """Training text or tokens: PATH.txt (bytes), PATH.bin or PATH.npy (token ids) or
    hf:NAME[:SPLIT]. None: the built-in Markov corpus, whose entropy is the loss floor."""
    model: str | None = None
    """Model preset: tiny, small or gpt2-124m. None: tiny, unless --model-config or
    --init-from is given."""
    model_config: str | None = None
    """A Hugging Face config.json to build a causal LM from (random init, no download)."""
    init_from: str | None = None
    """A folder with config.json and model.pt (a checkpoint) to start from."""
    device: str = "auto"
    """cpu, cuda, cuda:1, npu, xpu, mps, or auto (the best one present)."""

    def __post_init__(self):
        if self.out is None:
            self.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        self._check_counts()
        self._check_numbers()
        self._check_choices()
        self._check_paths()

    def _check_counts(self) -> None:
        for name, least in (
            ("tokens_per_step", 1),
            ("accum_steps", 1),
            ("max_steps", 1),
            ("max_tokens", 1),
            ("warmup_steps", 0),
        ):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < least):
                raise _bad(flag_of(name), value, f"must be a whole number >= {least}")
        for name, least in (("seq_len", 1), ("save_every", 0), ("eval_every", 0), ("seed", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < least:
                raise _bad(flag_of(name), value, f"must be a whole number >= {least}")
        if self.seed >= 2**63:
            raise _bad("--seed", self.seed, "must be below 2**63")
        if self.micro_batch != "auto" and (not _is_int(self.micro_batch) or self.micro_batch < 1):
            raise _bad("--micro-batch", self.micro_batch, "must be a whole number >= 1 or auto")
        if self.max_steps is not None and self.max_tokens is not None:
            raise _bad(
                "--max-tokens",
                self.max_tokens,
                f"give either --max-steps ({self.max_steps}) or --max-tokens, not both",
            )
        if (
            self.warmup_steps is not None
            and self.max_steps is not None
            and self.warmup_steps > self.max_steps
        ):
            raise _bad(
                "--warmup-steps",
                self.warmup_steps,
                f"longer than the run (--max-steps {self.max_steps})",
            )

    def _check_numbers(self) -> None:
        if not _is_number(self.lr) or self.lr <= 0:
            raise _bad("--lr", self.lr, "must be a positive number")
        for name in ("weight_decay", "max_grad_norm"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise _bad(flag_of(name), value, "must be a number >= 0")
        for name in ("activation_checkpointing", "compile", "resume", "json"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(flag_of(name), getattr(self, name), "must be true or false")

    def _check_choices(self) -> None:
        from ..devices import available
        from .model import PRESETS

        if self.schedule not in SCHEDULES:
            raise _bad("--schedule", self.schedule, f"choose one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise _bad("--precision", self.precision, f"choose one of {', '.join(PRECISIONS)}")
        if self.model is not None and self.model not in PRESETS:
            raise _bad("--model", self.model, f"unknown preset; choose one of {', '.join(PRESETS)}")
        given = [n for n in ("model", "model_config", "init_from") if getattr(self, n) is not None]
        if len(given) > 1:
            raise _bad(
                flag_of(given[1]),
                getattr(self, given[1]),
                f"give only one of --model, --model-config, --init-from "
                f"(also got {flag_of(given[0])})",
            )
        if not isinstance(self.device, str):
            raise _bad("--device", self.device, "expected a device name such as cpu or cuda:0")
        if self.device != "auto":
            import torch

            try:
                kind = torch.device(self.device).type
            except (RuntimeError, ValueError):
                raise _bad(
                    "--device", self.device, "not a device (cpu, cuda, cuda:1, npu, mps, xpu, auto)"
                ) from None
            try:
                ok = available(kind)
            except ValueError:
                ok = False
            if not ok:
                raise _bad("--device", self.device, "not available on this machine")

    def _check_paths(self) -> None:
        for name in ("data", "model_config", "init_from", "out"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise _bad(flag_of(name), repr(value), "expected a path")
        if self.data is not None and not self.data.startswith("hf:"):
            if not os.path.isfile(self.data):
                raise _bad("--data", self.data, "no such file")
        if self.model_config is not None and not os.path.exists(self.model_config):
            raise _bad("--model-config", self.model_config, "no such file")
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise _bad("--init-from", self.init_from, "no such folder")
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise _bad("--out", self.out, "exists and is not a folder")
        holds_run = checkpoint.find_latest(self.out) is not None or os.path.exists(
            os.path.join(self.out, "metrics.jsonl")
        )
        if self.resume and checkpoint.find_latest(self.out) is None:
            raise _bad("--resume", self.out, "no checkpoint in this folder to resume from")
        if not self.resume and holds_run:
            raise _bad(
                "--out",
                self.out,
                "holds a previous run; add --resume to continue it or choose another folder",
            )

    @property
    def preset(self) -> str | None:
        """The preset to build: --model, or tiny when no other model source is given."""
        if self.model_config is None and self.init_from is None:
            return self.model or DEFAULT_PRESET
        return self.model

    def to_dict(self) -> dict:
        return asdict(self)


FIELDS = tuple(f.name for f in fields(TrainConfig))


def to_toml(values: dict) -> str:
    """Flat key = value TOML of the given fields (None values are left out)."""
    lines = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
