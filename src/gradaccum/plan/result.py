"""A plan: every number of a run its inputs determine (`make_plan` fills it in)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gradaccum.plan.communication import Communication
from gradaccum.plan.schedule_plan import SchedulePlan
from gradaccum.plan.sync import SyncPlan


@dataclass
class MemoryReport:
    """Per-device memory in GB (1e9 bytes); None where the inputs do not determine it."""

    params_gb: float | None = None
    grads_gb: float | None = None
    accum_buffer_gb: float | None = None
    optimizer_gb: float | None = None
    activations_gb: float | None = None
    logits_gb: float | None = None
    total_gb: float | None = None
    device_memory_gb: float | None = None
    fits: bool | None = None
    max_micro_batch: int | None = None
    frozen_base_gb: float | None = None
    """With --base-bits: the frozen base's part stored at those bits (of params_gb)."""
    frozen_base_16bit_gb: float | None = None
    """The same parameters in bf16/fp16 (2 bytes each), for comparison."""


@dataclass
class Plan:
    """Every number of a run that the inputs determine; None for the rest."""

    world_size: int
    """Data-parallel devices."""
    micro_batch: int | None
    """Sequences per device per micro-step."""
    seq_len: int | None
    """Tokens per sequence."""
    micro_tokens: int | None
    """Tokens per device per micro-step: micro_batch x seq_len."""
    accum_steps: int | None
    """k: micro-steps per optimizer step."""
    global_batch_sequences: int | None
    """Sequences per optimizer step: micro_batch x k x world."""
    global_batch_tokens: int | None
    """Tokens per optimizer step: micro_tokens x k x world."""
    target_tokens: int | None
    """The global batch asked for, in tokens (from --target-sequences x --seq-len too)."""
    target_sequences: int | None
    """The global batch asked for, in sequences, where it is a whole number of them."""
    target_deviation: float | None
    """(global - target) / target, a signed fraction, in the target's unit."""
    steps: int | None
    """Optimizer steps of the run."""
    total_tokens: int | None
    """Tokens the run trains on: steps x global_batch_tokens."""
    total_tokens_requested: int | None
    """--total-tokens as given, before rounding up to whole steps."""
    micro_step_time_s: float | None
    step_time_s: float | None
    """Seconds per optimizer step: k x micro-step time, or from FLOPs / (peak x MFU)."""
    total_time_h: float | None
    """Wall-clock hours: steps x step time."""
    device_hours: float | None
    """total_time_h x world."""
    flops_per_step: int | None
    """6 x params x global_batch_tokens (the active parameters for a mixture of experts)."""
    flops_total: int | None
    """6 x params x total_tokens (the active parameters for a mixture of experts)."""
    mfu_implied: float | None
    """The MFU a measured micro-step time means, given --peak-tflops."""
    lr: float | None
    """--base-lr scaled to the global batch by lr_rule."""
    lr_rule: str | None
    lr_scale: float | None
    """c = global_batch_tokens / --base-batch-tokens."""
    model: str | None
    params: int | None
    """Parameter count."""
    trainable_params: int | None
    """Parameters that train, when not all do (--trainable-params, or LoRA adapters)."""
    precision: str
    optimizer: str
    zero: int
    checkpointing: str
    flash_attention: bool
    memory: MemoryReport
    communication: Communication | None
    """Gradient traffic per step for the two ways to sync; None on one device."""
    sync: SyncPlan | None
    """The gradient-sync policies side by side (window, micro, hsdp), and --sync's; None on
    one device, or without a model size or k."""
    micro_batch_from: str | None
    """Which flag set the micro-batch, or 'largest that fits --device-memory'."""
    accum_steps_from: str | None
    """'--accum-steps' or 'target'."""
    time_from: str | None
    """'--micro-step-time' or 'FLOPs / (peak x MFU)'."""
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    batch_schedule: SchedulePlan | None = None
    """With --batch-schedule: the run phase by phase (the batch rows above are its first)."""
    world_size_assumed: bool = False
    """True when --gpus was not given and one device was assumed."""
    base_bits: int | None = None
    """--base-bits: bits of the frozen base's stored weights; None: the parameter dtype."""
    active_params: int | None = None
    """--active-params: the parameters each token runs through (a mixture of experts), which
    the FLOPs count; None: all of them."""

    def to_dict(self) -> dict:
        return asdict(self)
