"""What one `gradaccum bench --task sft` run measures, checked before anything is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gradaccum.bench.pretrain.config import check_counts, check_int
from gradaccum.bench.settings import BENCH_DEFAULTS
from gradaccum.bench.sft.loops import PEERS
from gradaccum.utils.choices import PACKINGS
from gradaccum.utils.errors import BadInput


@dataclass
class SFTBenchConfig:
    """One Hugging Face causal LM, one ragged instruction set, the same examples per step."""

    model_config: str | None = None
    """A Hugging Face causal-LM config.json (or its folder), random init; None: a tiny
    Llama (4 layers of width 128, 4 heads) built here."""
    micro_batch: int = BENCH_DEFAULTS["sft"]["micro_batch"]
    """Examples per micro-batch where a contestant cuts by examples."""
    accum_steps: int = BENCH_DEFAULTS["sft"]["accum_steps"]
    """Micro-batches per optimizer step (k): each step is micro_batch x k examples."""
    seq_len: int = BENCH_DEFAULTS["sft"]["seq_len"]
    """Longest example, in tokens (longer ones are cut), and the padding-free row length."""
    micro_batch_tokens: int | None = None
    """Positions per micro-batch of gradaccum's window and padding-free modes, padding
    included; None: seq_len (one padding-free row per micro-batch)."""
    rounds: int = BENCH_DEFAULTS["sft"]["rounds"]
    """Timing rounds; the contestants' order alternates from one round to the next."""
    windows: int = BENCH_DEFAULTS["sft"]["windows"]
    """Optimizer steps timed per contestant per round (after one untimed step)."""
    device: str = "auto"
    seed: int = 0
    """Seed of the initial weights and of the data."""
    peers: tuple[str, ...] = field(default=PEERS)
    packings: tuple[str, ...] = field(default=PACKINGS)
    """gradaccum's --packing modes to run."""

    def __post_init__(self):
        check_counts(self)
        if self.micro_batch_tokens is None:
            self.micro_batch_tokens = self.seq_len
        check_int("micro_batch_tokens", self.micro_batch_tokens, self.seq_len)
        if self.model_config is not None:
            path = self.model_config
            target = os.path.join(path, "config.json") if os.path.isdir(path) else path
            if not os.path.isfile(target):
                raise BadInput("--model-config", path, "no such file")
        _check_names("--peers", self.peers, PEERS)
        _check_names("--packing", self.packings, PACKINGS)
        if not isinstance(self.device, str) or not self.device.strip():
            raise BadInput("--device", repr(self.device), "expected a device name")

    @property
    def model_name(self) -> str:
        return "tiny Llama" if self.model_config is None else f"hf:{self.model_config}"

    @property
    def examples_per_step(self) -> int:
        return self.micro_batch * self.accum_steps


def _check_names(flag: str, names, known) -> None:
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BadInput(
            flag, ",".join(names), f"unknown {unknown[0]!r}; choose from {', '.join(known)}"
        )
