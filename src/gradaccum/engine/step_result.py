"""What one window did (`StepResult`): its loss and tokens, its gradient's norm and traffic, and
whether the optimizer stepped. Made by `Window.finish`, returned by `Accumulator.step`."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.engine.noise import NoiseEstimate


@dataclass
class StepResult:
    """What one window did. Losses are per token; counts are summed over ranks."""

    loss: float
    """Mean loss per valid token over the window (all micro-batches, all ranks)."""
    tokens: int
    """Valid tokens in the window over all ranks (N)."""
    micro_steps: int
    """Forward/backward passes this rank ran (equal on every rank)."""
    grad_norm: float
    """L2 norm of the window's gradient before clipping; nan when skipped."""
    skipped: bool
    """True when the optimizer did not step (non-finite loss or gradient, or no tokens)."""
    lr: float | None
    """Learning rate of the first parameter group for this step; None for an optimizer
    whose parameter groups have no "lr" (one that sets its own step size)."""
    step: int
    """Optimizer steps taken so far, this one included."""
    skipped_total: int
    """Windows skipped so far."""
    loss_scale: float | None = None
    """fp16 loss scale used in this window; None in fp32/bf16."""
    peak_memory_bytes: int | None = None
    """Peak device memory since the window began; None where the device does not track it."""
    grad_collectives: int = 0
    """Gradient collectives launched in the window on this rank: DDP bucket all-reduces,
    FSDP2 reduce-scatters (one per `fully_shard` unit per sync: per window under
    sync="window", per micro-batch under "micro" and "hsdp") and HSDP's all-reduces across
    replicas, or the engine's own all-reduce of its fp32 buffer (bf16/fp16 parameters under
    DDP) and of parameters outside the model. 0 on one device; -1 when they could not be
    counted (a DDP model that already had a communication hook: see
    `parallel.backends.count_grad_traffic`)."""
    grad_bytes: int = 0
    """Bytes of gradient this rank handed to those collectives (-1 when not counted): per
    `fully_shard` unit and reduce-scatter, its whole padded gradient in FSDP2's reduce dtype;
    per HSDP all-reduce, its reduced shard."""
    grad_replica_collectives: int = 0
    """Of `grad_collectives`, HSDP's all-reduces across replicas (a 2-D mesh; 0 otherwise,
    -1 when not counted)."""
    grad_replica_bytes: int = 0
    """Of `grad_bytes`, those handed to HSDP's all-reduces across replicas (the inter-node
    part where the replica dimension spans nodes)."""
    noise: NoiseEstimate | None = None
    """The gradient noise scale after this window (`Accumulator(noise_scale=True)`); None
    when off, or before the first window of at least 2 micro-batches over all ranks."""
    aux_loss: float | None = None
    """The auxiliary terms given to `Window.backward(..., aux=)` (already normalized for the
    window, e.g. the MoE load-balancing loss), summed over micro-batches and ranks (weight-0
    repeats left out); None when no rank gave one. Not part of `loss`."""
