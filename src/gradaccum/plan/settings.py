"""What `gradaccum plan` takes besides the batch, model and precision every command shares:
settings components, read by `gradaccum.plan.inputs.PlanInputs`. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.plan.memory import CHECKPOINTING, OPTIMIZERS
from gradaccum.settings.field import setting
from gradaccum.utils.sizes import (
    parse_bandwidth,
    parse_bytes,
    parse_count,
    parse_float,
    parse_seconds,
)


def _count(value, flag: str) -> int:
    return parse_count(str(value), flag)


def _bytes(value, flag: str) -> int:
    return parse_bytes(str(value), flag, bare_unit=10**9)


def _bandwidth(value, flag: str) -> float:
    return parse_bandwidth(str(value), flag)


def _seconds(value, flag: str) -> float:
    return parse_seconds(str(value), flag)


def _number(value, flag: str) -> float:
    return parse_float(str(value), flag)


def _fraction(value, flag: str) -> float:
    return parse_float(str(value), flag, allow_percent=True)


def _stage(value, flag: str) -> int:
    return _count(value, flag) if str(value).strip() != "0" else 0


@dataclass
class PlanTargetSettings:
    """global batch and devices"""

    SECTION = "target"

    target_tokens: int | None = setting(None, parse=_count)
    """Global batch wanted per optimizer step, in tokens (1M, 4Mi)."""
    target_sequences: int | None = setting(None, parse=_count)
    """Global batch wanted per optimizer step, in sequences."""
    micro_tokens: int | None = setting(None, parse=_count)
    """Tokens per device per micro-step."""
    gpus: int | None = setting(None, parse=_count, aliases=("--devices",), default_text="1")
    """World size, the data-parallel devices."""


@dataclass
class PlanTimeSettings:
    """time"""

    SECTION = "time"

    micro_step_time: float | None = setting(None, parse=_seconds, metavar="T")
    """Measured seconds of one micro-step (forward and backward of one micro-batch): 300ms,
    1.5s."""
    steps: int | None = setting(None, parse=_count)
    """Optimizer steps of the run."""
    total_tokens: int | None = setting(None, parse=_count)
    """Tokens to train on; steps round up to reach it."""


@dataclass
class PlanModelSettings:
    """model size and cost"""

    SECTION = "cost"

    params: int | None = setting(None, parse=_count)
    """Parameter count (7B), when no model shape is given."""
    active_params: int | None = setting(None, parse=_count, default_text="all")
    """Parameters each token runs through, for a mixture of experts (47B total, 13B active):
    FLOPs and time count these, memory every parameter."""
    layers: int | None = setting(None, parse=_count)
    """Model shape: blocks."""
    hidden: int | None = setting(None, parse=_count)
    """Model shape: width."""
    heads: int | None = setting(None, parse=_count)
    """Model shape: attention heads."""
    vocab: int | None = setting(None, parse=_count)
    """Model shape: vocabulary size."""
    peak_tflops: float | None = setting(None, parse=_number, metavar="X")
    """Peak dense TFLOP/s of one device at the training precision."""
    mfu: float | None = setting(None, parse=_fraction, metavar="X")
    """Model FLOPs utilisation, a fraction in (0, 1]: 0.4 or 40%."""


@dataclass
class PlanMemorySettings:
    """memory per device and gradient sync"""

    SECTION = "memory"

    optimizer: str | None = setting(None, "choice", choices=OPTIMIZERS, default_text="adamw")
    """adamw or sgd."""
    zero: int | None = setting(None, parse=_stage, metavar="{0,1,2,3}", default_text="0")
    """ZeRO stage over --gpus."""
    checkpointing: str | None = setting(None, "choice", choices=CHECKPOINTING,
                                        default_text="none")  # fmt: skip
    """full: keep each block's input only and recompute one block in backward."""
    flash_attention: bool | None = setting(None, "bool")
    """Fused attention: the s x s scores are never stored."""
    sync_every_micro_batch: bool | None = setting(None, "bool")
    """Sync gradients after every micro-batch (ZeRO-2/3 then keep them sharded, k x the
    traffic); default: once per window."""
    gpus_per_node: int | None = setting(None, parse=_count,
                                        default_text="the largest divisor of --gpus up to 8")  # fmt: skip
    """Devices per node: hsdp's shard group, and where a sync leaves the node."""
    intra_node_bw: float | None = setting(None, parse=_bandwidth, metavar="SIZE",
                                          default_text="300GB/s")  # fmt: skip
    """Bytes per second a device sends within its node, per direction (NVLink, HCCS): 300GB/s;
    a small b counts bits (400Gb/s is 50 GB/s); a bare number is GB/s."""
    inter_node_bw: float | None = setting(None, parse=_bandwidth, metavar="SIZE",
                                          default_text="400Gb/s = 50GB/s")  # fmt: skip
    """Bytes per second a device sends to other nodes, per direction: its share of the
    network, one 400 Gb/s NIC per device by default."""
    device_memory: int | None = setting(None, parse=_bytes, metavar="SIZE")
    """Memory of one device: 80GB (1e9 bytes), 64GiB; a bare number is GB."""
    trainable_params: int | None = setting(None, parse=_count)
    """Parameters that train, the rest frozen (40M): gradients, fp32 buffer and optimizer
    state for these only; activations for the whole model."""


@dataclass
class PlanLRSettings:
    """learning rate"""

    SECTION = "lr"

    base_lr: float | None = setting(None, parse=_number, metavar="X")
    """LR tuned at --base-batch-tokens (with --batch-schedule: at its last batch)."""
    base_batch_tokens: int | None = setting(None, parse=_count)
    """Global batch of --base-lr, in tokens."""
