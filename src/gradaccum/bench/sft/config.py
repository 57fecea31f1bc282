"""What one `gradaccum bench --task sft` run measures, checked before anything is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gradaccum.bench.pretrain.config import check_counts, check_int
from gradaccum.bench.settings import BENCH_DEFAULTS
from gradaccum.bench.sft.loops import PEERS
from gradaccum.models.lora import LoraSpec
from gradaccum.models.quantized_spec import DEFAULT_QUANT, QuantSpec, check_base_flags
from gradaccum.utils.choices import PACKINGS
from gradaccum.utils.errors import BadInput

QLORA_RANK = 8
"""--lora-rank when --base-bits is given without it (a quantised base trains adapters only):
peft's LoraConfig default."""


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
    lora_rank: int | None = None
    """LoRA adapters of this rank on every linear layer but the head, the base frozen, for
    every contestant; None: the whole model trains (QLORA_RANK with base_bits)."""
    base_bits: int | None = None
    """The frozen base stored in 4 (NF4, QLoRA) or 8 bits (LLM.int8) through bitsandbytes,
    computed in fp32 like every contestant; None: fp32 weights."""
    base_quant: str | None = None
    """With base_bits 4: nf4 (None) or fp4."""

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
        self._check_adapters()

    def _check_adapters(self) -> None:
        self.lora_rank = check_base_flags(
            self.base_bits, self.base_quant, self.lora_rank, QLORA_RANK
        )
        if self.lora_rank is not None:
            LoraSpec(rank=self.lora_rank)  # a whole number >= 1

    @property
    def quant_spec(self) -> QuantSpec | None:
        """How the base is stored (None: not quantised); fp32 compute, as every contestant."""
        if self.base_bits is None:
            return None
        return QuantSpec(self.base_bits, self.base_quant or DEFAULT_QUANT, compute_dtype="fp32")

    @property
    def model_name(self) -> str:
        name = "tiny Llama" if self.model_config is None else f"hf:{self.model_config}"
        if self.base_bits is not None:
            return f"{name}, LoRA rank {self.lora_rank}, base in {self.quant_spec.describe()}"
        if self.lora_rank is not None:
            return f"{name}, LoRA rank {self.lora_rank}, base in fp32"
        return name

    @property
    def examples_per_step(self) -> int:
        return self.micro_batch * self.accum_steps


def _check_names(flag: str, names, known) -> None:
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BadInput(
            flag, ",".join(names), f"unknown {unknown[0]!r}; choose from {', '.join(known)}"
        )
