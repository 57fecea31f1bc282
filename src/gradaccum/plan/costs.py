"""What a plan's batch costs: memory per device term by term, time, FLOPs, and the LR.

Pure arithmetic, no torch.
- step time = k x micro-step time; total time = steps x step time; device-hours = time x world.
- FLOPs = 6 x params x tokens (Kaplan et al. 2020); with --peak-tflops and --mfu the time
  comes from FLOPs / (peak x MFU) when no micro-step time is measured.
- LR for a batch c times the base batch: linear, lr x c (SGD; Goyal et al. 2017), or square
  root, lr x sqrt(c) (Adam; Malladi et al. 2022), or none.
- A batch schedule: steps, tokens and time are the whole run's, phase by phase
  (`schedule_plan`), each phase's step time from its own k.
"""

from __future__ import annotations

from gradaccum.plan import memory as mem
from gradaccum.plan.batch import accum_steps_for
from gradaccum.plan.batch_schedule import lr_multiplier
from gradaccum.plan.inputs import PlanInputs
from gradaccum.plan.quantized import QuantizedBase, held_in_fp32
from gradaccum.plan.result import MemoryReport
from gradaccum.plan.schedule_plan import SchedulePlan, plan_schedule
from gradaccum.utils.sizes import fmt_bytes, fmt_int


def _gb(n_bytes: int | None) -> float | None:
    return None if n_bytes is None else n_bytes / 1e9


def memory_setup(
    i: PlanInputs, world: int, trainable: int | None, quantized: QuantizedBase | None = None
) -> mem.MemorySetup:
    """How the run holds its state: the choices given, MemorySetup's defaults for the rest."""
    chosen = ("precision", "optimizer", "zero", "checkpointing")
    given = {name: getattr(i, name) for name in chosen if getattr(i, name) is not None}
    return mem.MemorySetup(
        **given,
        world_size=world,
        flash_attention=bool(i.flash_attention),
        sync_every_micro_batch=bool(i.sync_every_micro_batch),
        trainable_params=trainable,
        quantized_base=quantized,
    )


def memory_report(i, shape, params, held, setup, batch, fit_cap, global_seq, warnings):
    """Memory per device, term by term, and whether it fits --device-memory."""
    memory = MemoryReport(device_memory_gb=_gb(i.device_memory), max_micro_batch=fit_cap)
    if params is None:
        return memory
    est = mem.estimate(held, shape, setup, batch.micro_batch, i.seq_len)
    memory.params_gb, memory.grads_gb = _gb(est.params), _gb(est.grads)
    memory.accum_buffer_gb, memory.optimizer_gb = _gb(est.accum_buffer), _gb(est.optimizer)
    memory.activations_gb, memory.logits_gb = _gb(est.activations), _gb(est.logits)
    memory.total_gb = _gb(est.total)
    if setup.quantized_base is not None:
        memory.frozen_base_gb = _gb(setup.quantized_base.bytes)
        memory.frozen_base_16bit_gb = _gb(2 * setup.quantized_base.params)
    if i.device_memory and est.total is not None:
        memory.fits = est.total <= i.device_memory
    if i.device_memory and (fit_cap == 0 or memory.fits is not None):
        per_seq = mem.activation_bytes(shape, 1, i.seq_len, setup)[0] if fit_cap == 0 else None
        warnings += _fit_warnings(
            est, i.device_memory, batch, fit_cap, i.gpus or 1, global_seq, per_seq, setup
        )
    return memory


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


def trainable_note(i: PlanInputs, trainable: int) -> str:
    what = f"{fmt_int(trainable)} trainable parameters"
    if i.lora_rank is not None:
        what += f" (LoRA rank {i.lora_rank} on every linear layer of every block, added)"
    state = "gradients, the fp32 buffer and optimizer state"
    if held_in_fp32(i.base_bits):  # the trainer's adapters are fp32 over a k-bit base
        state = "fp32 weights, fp32 gradients (no buffer) and optimizer state (no master copy)"
    held = "in the parameter dtype" if i.base_bits is None else f"as --base-bits {i.base_bits} says"
    return (
        f"{state} for {what}; the frozen weights are held {held}, and activations cover the "
        "whole model"
    )


def base_bits_note(q: QuantizedBase) -> str:
    """What --base-bits stores, its bytes per parameter, and what training it needs."""
    if q.bits == 16:
        return f"the frozen base's {fmt_int(q.params)} parameters stored in 16 bits (2 bytes each)"
    per = q.bytes / q.params if q.params else 0.0
    return (
        f"frozen base in {q.bits} bits ({q.scheme}, {per:.4g} bytes a parameter): the "
        f"{fmt_int(q.params)} weights of the blocks' linear layers; embeddings, output head, "
        "norms and biases in fp32, as peft's k-bit preparation casts them. gradaccum train "
        f"--lora-rank R --base-bits {q.bits} trains on it (bitsandbytes: pip install "
        "'gradaccum[qlora]')"
    )


def memory_notes(i, shape, params, trainable, setup, world, micro_batch, warnings, notes):
    if trainable is not None:
        notes.append(trainable_note(i, trainable))
    if setup.quantized_base is not None:
        notes.append(base_bits_note(setup.quantized_base))
    if params is not None and shape is None:
        notes.append("gradients and activations need a model shape (--model, or --layers ...)")
    elif params is not None and (micro_batch is None or i.seq_len is None):
        notes.append("activations need a micro-batch and --seq-len")
    if setup.zero >= 2 and world > 1 and not setup.sync_every_micro_batch and params:
        whole = mem.unsharded_grad_bytes(params)
        warnings.append(
            f"--zero {setup.zero} with one gradient sync per window holds the whole accumulated "
            f"gradient ({_gb(whole):,.2f} GB) on each device until the window's end; "
            f"--sync micro keeps it sharded ({_gb(-(-whole // world)):,.2f} GB) "
            f"for k x the gradient traffic"
        )
    if setup.zero and world == 1:
        warnings.append(f"--zero {setup.zero} shards nothing on one device (--gpus 1)")


def scheduled_run(i: PlanInputs, params, micro_tokens, world: int) -> SchedulePlan | None:
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


def run_length(i: PlanInputs, global_tok, scheduled: SchedulePlan | None):
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


def timing(i, params, global_tok, total_tokens, k, steps, world, notes, scheduled) -> dict:
    """FLOPs and time: a measured micro-step time wins over peak x MFU; a scheduled run's
    time is its phases' summed. A mixture of experts' FLOPs count the parameters a token runs
    through (`PlanInputs.active_params`)."""
    params = i.active_params or params
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


def learning_rate(i: PlanInputs, global_tok, micro_tokens, world, setup, notes: list[str]):
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
