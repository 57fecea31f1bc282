"""What one `gradaccum bench` run measures, checked before anything is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gradaccum.bench.settings import BENCH_DEFAULTS
from gradaccum.utils.choices import DEFAULT_MODEL, check_builtin_model
from gradaccum.utils.errors import BadInput, flag_name

PEERS = ("accelerate", "trainer", "lightning")
"""The peers a user would pick, by the name `--peers` takes."""

_LARGEST = 1 << 20  # no count here past a million means anything on one device

COUNTS = (
    ("micro_batch", 1),
    ("accum_steps", 1),
    ("seq_len", 2),
    ("rounds", 1),
    ("windows", 1),
    ("seed", 0),
)
"""The whole-number fields every bench config has (`BenchConfig`, `SFTBenchConfig`), each
with the least value it takes."""


@dataclass
class BenchConfig:
    """One model, one data set with ragged valid lengths, one (micro-batch, k)."""

    model: str | None = None
    """Preset of the built-in GPT (`BUILTIN_MODELS`); DEFAULT_MODEL when no --model-config."""
    model_config: str | None = None
    """A Hugging Face causal-LM config.json (or its folder), built from config, random init."""
    micro_batch: int = BENCH_DEFAULTS["pretrain"]["micro_batch"]
    """Sequences per micro-batch."""
    accum_steps: int = BENCH_DEFAULTS["pretrain"]["accum_steps"]
    """Micro-batches per optimizer step (k)."""
    seq_len: int = BENCH_DEFAULTS["pretrain"]["seq_len"]
    """Tokens per sequence; each row holds 1 to seq_len valid labels (the rest are -100)."""
    rounds: int = BENCH_DEFAULTS["pretrain"]["rounds"]
    """Timing rounds; the contestants' order alternates from one round to the next."""
    windows: int = BENCH_DEFAULTS["pretrain"]["windows"]
    """Optimizer steps timed per contestant per round (after one untimed step)."""
    device: str = "auto"
    """cpu, cuda, cuda:1, npu, mps, xpu or auto."""
    seed: int = 0
    """Seed of the initial weights and of the data."""
    peers: tuple[str, ...] = field(default=PEERS)
    """Peers to run besides gradaccum and the hand-written loop."""

    def __post_init__(self):
        check_counts(self)
        if self.model is not None and self.model_config is not None:
            raise BadInput("--model", self.model, "give --model or --model-config, not both")
        if self.model_config is None:
            self._check_preset()
        else:
            self._check_model_config()
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise BadInput(
                "--peers",
                ",".join(self.peers),
                f"unknown {unknown[0]!r}; choose from {', '.join(PEERS)} or none",
            )
        if not isinstance(self.device, str) or not self.device.strip():
            raise BadInput("--device", repr(self.device), "expected a device name")

    def _check_preset(self) -> None:
        if self.model is None:
            self.model = DEFAULT_MODEL
        check_builtin_model(self.model, "--model")

    def _check_model_config(self) -> None:
        path = self.model_config
        if not isinstance(path, str) or not path.strip():
            raise BadInput("--model-config", repr(path), "expected a path to a config.json")
        target = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(target):
            raise BadInput("--model-config", path, "no such file")

    @property
    def model_name(self) -> str:
        """The model in words, as the table and the JSON name it."""
        return self.model if self.model_config is None else f"hf:{self.model_config}"


def check_counts(config) -> None:
    """Every field of `COUNTS` on `config` a whole number from its least value to a million;
    else BadInput naming the field's flag and the value."""
    for name, least in COUNTS:
        check_int(name, getattr(config, name), least)


def check_int(name: str, value, least: int) -> None:
    """Field `name` (its flag `--name`) a whole number from `least` to a million."""
    flag = flag_name(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(flag, value, "expected a whole number")
    if value < least:
        raise BadInput(flag, value, f"must be at least {least}")
    if value > _LARGEST:
        raise BadInput(flag, value, f"too large for a benchmark (at most {_LARGEST:,})")
