"""Plan a run: global batch = micro-batch x k x world, and what it costs in memory and time.

Pure arithmetic, no torch. `make_plan(PlanInputs(...))` resolves every number the inputs
determine and leaves the rest None; `render_table(plan)` prints it for people.

Rules:
- k = round(target / (micro x world)), at least 1. A tie (exactly x.5) goes to the larger k,
  so at a tie the batch is never below the target. global = micro x k x world exactly.
- step time = k x micro-step time; total time = steps x step time; device-hours = time x world.
- FLOPs = 6 x params x tokens (Kaplan et al. 2020); with --peak-tflops and --mfu the time
  comes from FLOPs / (peak x MFU) when no micro-step time is measured.
- LR for a batch c times the base batch: linear, lr x c (SGD; Goyal et al. 2017), or square
  root, lr x sqrt(c) (Adam; Malladi et al. 2022), or none.
- A batch schedule: the batch rows describe its first phase; steps, tokens and time are the
  whole run's, phase by phase (`schedule_plan`), each phase's step time from its own k.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..utils.errors import BadInput
from . import memory as mem
from .batch_schedule import lr_multiplier
from .communication import Communication, traffic
from .inputs import LR_RULES, PlanInputs, show_value
from .presets import ModelShape, custom, preset
from .schedule_plan import SchedulePlan, plan_schedule
from .sizes import fmt_bytes, fmt_int

_SEARCH = 65536  # micro-batches tried, from the top down, when looking for the best landing


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
    """6 x params x global_batch_tokens."""
    flops_total: int | None
    """6 x params x total_tokens."""
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

    def to_dict(self) -> dict:
        return asdict(self)


def accum_steps_for(target: int, per_micro_step: int) -> int:
    """k = round(target / per_micro_step), at least 1, a tie rounding up (exact integers)."""
    return max(1, (2 * target + per_micro_step) // (2 * per_micro_step))


@dataclass
class _Batch:
    """The batch arithmetic while it is being resolved; None where not determined."""

    micro_batch: int | None = None
    micro_tokens: int | None = None
    micro_from: str | None = None
    target: int | None = None
    unit: str | None = None
    """'tokens' or 'sequences': the unit of the target."""
    target_flag: str | None = None
    target_seq: int | None = None
    """The target in sequences, where it is a whole number of them."""
    accum_steps: int | None = None
    k_from: str | None = None

    @property
    def micro_in_unit(self) -> int | None:
        return self.micro_tokens if self.unit == "tokens" else self.micro_batch


def _model(i: PlanInputs) -> tuple[ModelShape | None, int | None]:
    if i.model is not None:
        shape = preset(i.model)
        return shape, shape.params
    if i.layers is not None:
        shape = custom(i.layers, i.hidden, i.heads, i.vocab)
        return shape, i.params if i.params is not None else shape.params
    return None, i.params


def _trainable(i: PlanInputs, shape: ModelShape | None, params: int | None):
    """(parameters that train or None for all, parameters held in memory). LoRA adds its
    adapters to the model; --trainable-params names a part of it."""
    if i.lora_rank is not None:
        adapters = mem.lora_params(shape, i.lora_rank)
        return adapters, None if params is None else params + adapters
    if i.trainable_params is not None and params is not None and i.trainable_params > params:
        raise BadInput(
            "--trainable-params",
            show_value(i.trainable_params),
            f"more than the model's {fmt_int(params)} parameters",
        )
    return i.trainable_params, params


def _trainable_note(i: PlanInputs, trainable: int) -> str:
    what = f"{fmt_int(trainable)} trainable parameters"
    if i.lora_rank is not None:
        what += f" (LoRA rank {i.lora_rank} on every linear layer of every block, added)"
    return (
        f"gradients, the fp32 buffer and optimizer state for {what}; the frozen weights are "
        "held in the parameter dtype, and activations cover the whole model"
    )


def _micro_and_target(i: PlanInputs) -> _Batch:
    """The micro-batch in sequences and tokens, and the target with its unit."""
    batch, seq_len = _Batch(micro_batch=i.micro_batch, micro_tokens=i.micro_tokens), i.seq_len
    if i.micro_batch is not None:
        batch.micro_from = "--micro-batch"
        batch.micro_tokens = i.micro_batch * seq_len if seq_len else None
    elif i.micro_tokens is not None:
        batch.micro_from = "--micro-tokens"
        if seq_len:
            if i.micro_tokens % seq_len:
                raise BadInput(
                    f"--micro-tokens {show_value(i.micro_tokens)}: not a whole number of sequences "
                    f"of --seq-len {seq_len}"
                )
            batch.micro_batch = i.micro_tokens // seq_len
    tokens, flag = i.target_tokens, "--target-tokens"
    if i.batch_schedule is not None:  # the plan's batch rows describe the first phase
        tokens, flag = i.batch_schedule.points[0][1], "--batch-schedule"
    if tokens is not None:
        batch.target, batch.unit, batch.target_flag = tokens, "tokens", flag
        if seq_len and tokens % seq_len == 0:
            batch.target_seq = tokens // seq_len
    elif i.target_sequences is not None:
        batch.target, batch.unit = i.target_sequences, "sequences"
        batch.target_flag, batch.target_seq = "--target-sequences", i.target_sequences
    return batch


def _pick_micro_batch(batch: _Batch, seq_len: int, world: int, fit_cap: int) -> int:
    """The micro-batch <= fit_cap whose global batch lands closest to the target; the larger
    one on a tie (fewer micro-steps). Scans down from the top and stops at an exact landing."""
    if batch.unit == "tokens" and batch.target < seq_len:
        raise BadInput(
            f"{batch.target_flag} {show_value(batch.target)}: below one sequence of --seq-len {seq_len}"
        )
    whole = batch.target_seq if batch.target_seq is not None else batch.target // seq_len
    top = min(fit_cap, whole)
    best, best_error = top, None
    for b in range(top, max(0, top - _SEARCH), -1):
        error = abs(b * accum_steps_for(whole, b * world) * world - whole)
        if best_error is None or error < best_error:
            best, best_error = b, error
        if error == 0:
            break
    return best


def _exact_micro_batch(target_seq: int, world: int, top: int) -> int | None:
    """Largest micro-batch <= top with micro x k x world equal to target_seq for a whole k."""
    for b in range(top, max(0, top - _SEARCH), -1):
        if target_seq % (b * world) == 0:
            return b
    return None


def _accum_steps(batch: _Batch, i: PlanInputs, world: int) -> None:
    """k from the target and the micro-batch (in the target's unit), or from --accum-steps."""
    micro = batch.micro_in_unit
    if batch.target is None:
        if i.accum_steps is not None:
            batch.accum_steps, batch.k_from = i.accum_steps, "--accum-steps"
        return
    if micro is None:
        if batch.micro_from is not None:  # given, but in the other unit and no --seq-len
            other = "tokens" if batch.unit == "tokens" else "sequences"
            raise BadInput(
                f"{batch.target_flag} {show_value(batch.target)}: needs --seq-len to turn "
                f"{batch.micro_from} into {other}"
            )
        return
    if micro > batch.target:
        given = i.micro_batch if batch.micro_from == "--micro-batch" else i.micro_tokens
        at = ""
        if batch.micro_from == "--micro-batch" and batch.unit == "tokens":
            at = f" ({fmt_int(micro)} tokens at --seq-len {i.seq_len})"
        raise BadInput(
            f"{batch.micro_from} {show_value(given)}: above the target of "
            f"{fmt_int(batch.target)} {batch.unit}{at}"
        )
    batch.accum_steps, batch.k_from = accum_steps_for(batch.target, micro * world), "target"


def _gb(n_bytes: int | None) -> float | None:
    return None if n_bytes is None else n_bytes / 1e9


def make_plan(i: PlanInputs) -> Plan:
    """Resolve every number the inputs determine. Raises BadInput for inputs that make none."""
    world = i.gpus or 1
    assumed = i.gpus is None
    shape, params = _model(i)
    trainable, held = _trainable(i, shape, params)
    setup = _memory_setup(i, world, trainable)
    seq_len = i.seq_len
    warnings: list[str] = []
    notes: list[str] = []
    if assumed:
        notes.append(
            "one device assumed (--gpus not given): the global batch, k and the time are for "
            "1 device; give --gpus N to plan for N"
        )
    batch, fit_cap = _choose_micro_batch(i, shape, held, setup, world, notes)
    micro_batch, micro_tokens = batch.micro_batch, batch.micro_tokens
    if i.batch_schedule is not None:
        _check_schedule_micro(i, batch, world)

    # k, and the global batch it gives: micro x k x world, exactly.
    _accum_steps(batch, i, world)
    k = batch.accum_steps
    global_seq = micro_batch * k * world if micro_batch and k else None
    global_tok = micro_tokens * k * world if micro_tokens and k else None
    deviation = None
    if batch.target is not None and k is not None:
        landed = global_tok if batch.unit == "tokens" else global_seq
        deviation = (landed - batch.target) / batch.target
        if abs(deviation) > 0.01:
            first = "first phase: " if i.batch_schedule is not None else ""
            warnings.append(first + _deviation_warning(batch, landed, world, fit_cap))
    if k is None:
        notes.append(
            "k needs a global batch (--target-tokens or --target-sequences) and a micro-batch "
            "(--micro-batch, --micro-tokens, or --device-memory with a model), or --accum-steps"
        )
    memory = _memory_report(i, shape, params, held, setup, batch, fit_cap, global_seq, warnings)
    _memory_notes(i, shape, params, trainable, setup, world, micro_batch, warnings, notes)
    scheduled = _schedule(i, params, micro_tokens, world)
    steps, total_tokens = _length(i, global_tok, scheduled)
    timing = _timing(i, params, global_tok, total_tokens, k, steps, world, notes, scheduled)
    lr, lr_scale, lr_rule = _learning_rate(i, global_tok, micro_tokens, world, setup, notes)
    target_tokens = batch.target if batch.unit == "tokens" else None
    if target_tokens is None and i.target_sequences and seq_len:
        target_tokens = i.target_sequences * seq_len
    return Plan(
        world_size=world,
        micro_batch=micro_batch,
        seq_len=seq_len,
        micro_tokens=micro_tokens,
        accum_steps=k,
        global_batch_sequences=global_seq,
        global_batch_tokens=global_tok,
        target_tokens=target_tokens,
        target_sequences=batch.target_seq,
        target_deviation=deviation,
        steps=steps,
        total_tokens=total_tokens,
        total_tokens_requested=i.total_tokens,
        micro_step_time_s=i.micro_step_time,
        **timing,
        lr=lr,
        lr_rule=lr_rule,
        lr_scale=lr_scale,
        model=shape.name if shape else None,
        params=params,
        trainable_params=trainable,
        precision=setup.precision,
        optimizer=setup.optimizer,
        zero=setup.zero,
        checkpointing=setup.checkpointing,
        flash_attention=setup.flash_attention,
        memory=memory,
        communication=traffic(params, setup, k),
        micro_batch_from=batch.micro_from,
        accum_steps_from=batch.k_from,
        warnings=warnings,
        notes=notes,
        batch_schedule=scheduled,
        world_size_assumed=assumed,
    )


def _memory_setup(i: PlanInputs, world: int, trainable: int | None) -> mem.MemorySetup:
    return mem.MemorySetup(
        precision=i.precision or "bf16",
        optimizer=i.optimizer or "adamw",
        zero=i.zero or 0,
        world_size=world,
        checkpointing=i.checkpointing or "none",
        flash_attention=bool(i.flash_attention),
        sync_every_micro_batch=bool(i.sync_every_micro_batch),
        trainable_params=trainable,
    )


def _choose_micro_batch(i: PlanInputs, shape, held, setup, world: int, notes: list[str]):
    """The micro-batch: given, or the best that fits the device when there is a target.
    Returns the batch and the largest micro-batch that fits (None when not known)."""
    batch = _micro_and_target(i)
    seq_len = i.seq_len
    fit_cap = None
    if shape is not None and seq_len and i.device_memory:
        fit_cap = mem.max_micro_batch(held, shape, setup, seq_len, i.device_memory)
    if batch.micro_from is None and batch.target is not None and fit_cap:
        aim, cap, what = batch, fit_cap, "the target"
        if i.batch_schedule is not None:  # every phase must hold one micro-batch per device
            smallest = i.batch_schedule.smallest_target()
            whole = smallest // seq_len
            aim = replace(
                batch, target=smallest, target_seq=whole if whole * seq_len == smallest else None
            )
            cap, what = max(1, min(fit_cap, whole // world)), "the schedule's smallest target"
        batch.micro_batch = _pick_micro_batch(aim, seq_len, world, cap)
        batch.micro_tokens = batch.micro_batch * seq_len
        batch.micro_from = "largest that fits --device-memory"
        notes.append(
            f"micro-batch {batch.micro_batch}: of the micro-batches that fit --device-memory "
            f"(at most {fit_cap}), the largest that lands closest to {what}"
        )
    return batch, fit_cap


def _check_schedule_micro(i: PlanInputs, batch: _Batch, world: int) -> None:
    """A schedule needs the micro-batch in tokens, and its smallest target must hold one
    micro-batch on every device (k cannot go below 1)."""
    schedule = i.batch_schedule
    if batch.micro_tokens is None:
        need = "a micro-batch: --micro-batch, --micro-tokens, or --device-memory with a model"
        if batch.micro_from == "--micro-batch":
            need = "--seq-len to turn --micro-batch into tokens"
        raise BadInput("--batch-schedule", schedule, f"needs {need}")
    per_micro_step, smallest = batch.micro_tokens * world, schedule.smallest_target()
    if smallest < per_micro_step:
        raise BadInput(
            "--batch-schedule",
            schedule,
            f"its smallest target, {fmt_int(smallest)} tokens per step, is below one micro-batch "
            f"x world ({fmt_int(batch.micro_tokens)} x {world} = {fmt_int(per_micro_step)} "
            f"tokens); give a smaller micro-batch or fewer --gpus",
        )


def _memory_report(i, shape, params, held, setup, batch, fit_cap, global_seq, warnings):
    """Memory per device, term by term, and whether it fits --device-memory."""
    memory = MemoryReport(device_memory_gb=_gb(i.device_memory), max_micro_batch=fit_cap)
    if params is None:
        return memory
    est = mem.estimate(held, shape, setup, batch.micro_batch, i.seq_len)
    memory.params_gb, memory.grads_gb = _gb(est.params), _gb(est.grads)
    memory.accum_buffer_gb, memory.optimizer_gb = _gb(est.accum_buffer), _gb(est.optimizer)
    memory.activations_gb, memory.logits_gb = _gb(est.activations), _gb(est.logits)
    memory.total_gb = _gb(est.total)
    if i.device_memory and est.total is not None:
        memory.fits = est.total <= i.device_memory
    if i.device_memory and (fit_cap == 0 or memory.fits is not None):
        per_seq = mem.activation_bytes(shape, 1, i.seq_len, setup)[0] if fit_cap == 0 else None
        warnings += _fit_warnings(
            est, i.device_memory, batch, fit_cap, setup.world_size, global_seq, per_seq, setup
        )
    return memory


def _memory_notes(i, shape, params, trainable, setup, world, micro_batch, warnings, notes):
    if trainable is not None:
        notes.append(_trainable_note(i, trainable))
    if params is not None and shape is None:
        notes.append("gradients and activations need a model shape (--model, or --layers ...)")
    elif params is not None and (micro_batch is None or i.seq_len is None):
        notes.append("activations need a micro-batch and --seq-len")
    if setup.zero >= 2 and world > 1 and not setup.sync_every_micro_batch and params:
        whole = mem.unsharded_grad_bytes(params)
        warnings.append(
            f"--zero {setup.zero} with one gradient sync per window holds the whole accumulated "
            f"gradient ({_gb(whole):,.2f} GB) on each device until the window's end; "
            f"--sync-every-micro-batch keeps it sharded ({_gb(-(-whole // world)):,.2f} GB) "
            f"for k x the gradient traffic"
        )
    if setup.zero and world == 1:
        warnings.append(f"--zero {setup.zero} shards nothing on one device (--gpus 1)")


def _schedule(i: PlanInputs, params, micro_tokens, world: int) -> SchedulePlan | None:
    """The scheduled run phase by phase, each phase's step time at its own k."""
    if i.batch_schedule is None:
        return None
    return plan_schedule(
        i.batch_schedule,
        i.total_tokens,
        micro_tokens,
        world,
        lr_rule=i.lr_rule or "none",
        base_lr=i.base_lr,
        step_time=lambda k, tokens_per_step: _step_time(i, params, world, k, tokens_per_step),
    )


def _length(i: PlanInputs, global_tok, scheduled: SchedulePlan | None):
    """Steps and tokens: --total-tokens rounds the steps up, so the run reaches it; with a
    schedule, phase by phase."""
    if scheduled is not None:
        return scheduled.total_steps, scheduled.total_tokens
    steps, total_tokens, requested = i.steps, None, i.total_tokens
    if steps is not None and global_tok is not None:
        total_tokens = steps * global_tok
    elif requested is not None:
        if global_tok is not None:
            steps = -(-requested // global_tok)
            total_tokens = steps * global_tok
        else:
            total_tokens = requested
    return steps, total_tokens


def _step_time(i: PlanInputs, params, world: int, k, tokens_per_step) -> float | None:
    """Seconds per optimizer step at k: k x the measured micro-step, else 6 N D over
    (world x peak x MFU); None when neither is known."""
    if i.micro_step_time is not None:
        return None if k is None else k * i.micro_step_time
    if i.peak_tflops and i.mfu and params and tokens_per_step:
        peak = i.peak_tflops * 1e12
        return 6 * params * tokens_per_step / (world * peak * i.mfu)
    return None


def _timing(i, params, global_tok, total_tokens, k, steps, world, notes, scheduled) -> dict:
    """FLOPs and time: a measured micro-step time wins over peak x MFU; a scheduled run's
    time is its phases' summed."""
    flops_step = 6 * params * global_tok if params and global_tok else None
    flops_total = 6 * params * total_tokens if params and total_tokens else None
    step_time = _step_time(i, params, world, k, global_tok)
    total_s = mfu_implied = time_from = None
    peak = i.peak_tflops * 1e12 if i.peak_tflops else None
    if i.micro_step_time is not None and k is not None:
        time_from = "--micro-step-time"
        if peak and flops_step:
            mfu_implied = flops_step / (step_time * world * peak)
            if i.mfu is not None:
                notes.append(
                    f"the measured --micro-step-time means MFU {mfu_implied:.3f}; "
                    f"time uses it, not --mfu {i.mfu}"
                )
    elif peak and i.mfu and (flops_step or flops_total):
        time_from = "FLOPs / (peak x MFU)"
        if flops_total:
            total_s = flops_total / (world * peak * i.mfu)
    if scheduled is not None:
        total_s = scheduled.total_time_s
    elif step_time is not None and steps is not None:
        total_s = steps * step_time
    total_h = None if total_s is None else total_s / 3600
    return {
        "step_time_s": step_time,
        "total_time_h": total_h,
        "device_hours": None if total_h is None else total_h * world,
        "flops_per_step": flops_step,
        "flops_total": flops_total,
        "mfu_implied": mfu_implied,
        "time_from": time_from,
    }


def _learning_rate(i: PlanInputs, global_tok, micro_tokens, world, setup, notes: list[str]):
    """LR for the new global batch: (lr, scale, rule), all None without --base-lr. With a
    schedule the LR belongs to its last batch, and the rule is none unless given."""
    if i.base_lr is None or global_tok is None:
        return None, None, None
    if i.batch_schedule is not None:
        rule = i.lr_rule or "none"
        base_tokens = i.batch_schedule.final_tokens_per_step(micro_tokens, world)
    else:
        rule = i.lr_rule or ("sqrt" if setup.optimizer == "adamw" else "linear")
        if i.lr_rule is None:
            notes.append(f"LR rule {rule}: the default for {setup.optimizer} (--lr-rule)")
        base_tokens = i.base_batch_tokens
    scale = global_tok / base_tokens
    return i.base_lr * lr_multiplier(scale, rule), scale, rule


def _deviation_warning(batch: _Batch, landed: int, world: int, fit_cap: int | None) -> str:
    target, unit, k, micro = batch.target, batch.unit, batch.accum_steps, batch.micro_in_unit
    text = (
        f"global batch {fmt_int(landed)} {unit} is {(landed - target) / target:+.1%} "
        f"from the target {fmt_int(target)} {unit} (k = {k})"
    )
    if k == 1 and micro * world > target:
        text += f"; micro-batch x {world} devices alone is {fmt_int(micro * world)} {unit}"
    top = fit_cap or batch.micro_batch
    if batch.target_seq is not None and top:
        exact = _exact_micro_batch(batch.target_seq, world, top)
        if exact is not None:
            k_exact = batch.target_seq // (exact * world)
            text += f"; --micro-batch {exact} lands exactly (k = {k_exact})"
    return text


def _fit_warnings(est, device_memory, batch, fit_cap, world, global_seq, per_seq, setup):
    """Over the device: say why, which micro-batch fits, and which k keeps the global batch."""
    limit = f"--device-memory {fmt_bytes(device_memory)}"
    total, state = est.total, est.model_state
    if total is not None and total <= device_memory:
        if total > 0.9 * device_memory:
            return [
                f"uses {total / device_memory:.0%} of {limit}: the runtime and allocator "
                "fragmentation often take a few GB more"
            ]
        return []
    parts = []
    if total is not None:
        parts.append(f"micro-batch {batch.micro_batch} needs {fmt_bytes(total)} per device")
    if fit_cap == 0 and state > device_memory:
        hint = "--zero 3 over more --gpus" if setup.zero < 3 else "more --gpus"
        parts.append(f"the model state alone needs {fmt_bytes(state)}, over {limit} (try {hint})")
    elif fit_cap == 0:
        tries = ["--flash-attention"] if not setup.flash_attention else []
        tries += ["--checkpointing full"] if setup.checkpointing != "full" else []
        parts.append(
            f"not one sequence fits {limit}: its activations need {fmt_bytes(per_seq)}, the "
            f"model state leaves {fmt_bytes(device_memory - state)} "
            f"(try {', '.join(tries + ['a shorter --seq-len'])})"
        )
    else:
        parts[-1] += f", over {limit}"
        keep = batch.target_seq if batch.target_seq is not None else global_seq
        fits = f"micro-batch {fit_cap} fits"
        if keep is not None:
            new_k = accum_steps_for(keep, fit_cap * world)
            landed = fit_cap * new_k * world
            how = "keeps"
            if landed != keep:
                how = f"gives {fmt_int(landed)} ({(landed - keep) / keep:+.1%}) instead of"
            fits += f", and k = {new_k} {how} the global batch of {fmt_int(keep)} sequences"
        parts.append(fits)
    return ["; ".join(parts)]


def render_table(plan: Plan) -> str:
    """The plan as a table for people, units on every row, then warnings and notes."""
    from .table import render

    return render(plan)


__all__ = [
    "LR_RULES",
    "MemoryReport",
    "Plan",
    "PlanInputs",
    "accum_steps_for",
    "make_plan",
    "render_table",
]
