"""The global batch of a plan: micro-batch x k x world, and how close it lands to the target.

Pure arithmetic, no torch. k = round(target / (micro x world)), at least 1; a tie (exactly
x.5) goes to the larger k, so at a tie the batch is never below the target; global = micro x
k x world exactly. With --device-memory and no micro-batch given, the micro-batch is the one
that fits and lands closest to the target.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gradaccum.plan import memory as mem
from gradaccum.plan.inputs import PlanInputs, show_value
from gradaccum.utils.errors import BadInput
from gradaccum.utils.sizes import fmt_int

_SEARCH = 65536  # micro-batches tried, from the top down, when looking for the best landing


def accum_steps_for(target: int, per_micro_step: int) -> int:
    """k = round(target / per_micro_step), at least 1, a tie rounding up (exact integers)."""
    return max(1, (2 * target + per_micro_step) // (2 * per_micro_step))


@dataclass
class Batch:
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


def _micro_and_target(i: PlanInputs) -> Batch:
    """The micro-batch in sequences and tokens, and the target with its unit."""
    batch, seq_len = Batch(micro_batch=i.micro_batch, micro_tokens=i.micro_tokens), i.seq_len
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


def _pick_micro_batch(batch: Batch, seq_len: int, world: int, fit_cap: int) -> int:
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


def resolve_accum_steps(batch: Batch, i: PlanInputs, world: int) -> None:
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


def choose_micro_batch(i: PlanInputs, shape, held, setup, world: int, notes: list[str]):
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


def check_schedule_micro(i: PlanInputs, batch: Batch, world: int) -> None:
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


def deviation_warning(batch: Batch, landed: int, world: int, fit_cap: int | None) -> str:
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
