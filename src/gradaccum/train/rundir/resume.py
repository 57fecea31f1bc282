"""Resuming a run: which checkpoint, which settings, and what a resume may change.

On --resume every setting comes from the checkpoint, or is changed on purpose and then
applied, recorded (train_config.json, config.yaml, the next checkpoint) and printed in one line
("lr 0.003 -> 0.001 from step 10"); a change that would make the continuation something the
run never was is refused naming its flag. In particular:
- the model is rebuilt from the checkpoint's config.json, never from --model-config's file;
- the data must be the same tokens, and the eval set the same (one fingerprint covers both:
  --eval-data's file, or the split --eval-fraction makes), unless --allow-data-change;
- the batch per optimizer step stays the checkpoint's, in tokens. The number of devices and
  the micro-batch may change, k following: the data order is one stream of sequences
  whatever the layout, so the continuation reads the same windows. Where the tokens per step
  do not split into the new layout, the resume is refused naming the numbers;
- a longer or shorter run keeps the part of the lr schedule already trained and stretches
  the rest over the new length (`Schedule.stretched`).
"""

from __future__ import annotations

import os

from gradaccum.train import micro_batch
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.checks import holds_sft_stage
from gradaccum.train.config import FLAGS, TrainConfig, merge_settings
from gradaccum.train.rundir import checkpoint
from gradaccum.train.rundir.lock import refuse_if_held
from gradaccum.train.rundir.metrics import read_metrics_text
from gradaccum.train.rundir.settings import RESUME_AUTO, read_resume
from gradaccum.train.schedule import Schedule
from gradaccum.train.settings import DEFAULT_EXAMPLES_PER_STEP
from gradaccum.train.tasks.registry import rules_of
from gradaccum.utils.choices import DEFAULT_MODEL
from gradaccum.utils.errors import BadInput, flag_name

INVOCATION = ("resume", "json", "out", "allow_data_change")
"""Fields that steer one invocation and are never taken from a checkpoint."""

REFUSED = {
    "seq_len": "other sequence lengths are another data stream",
    "precision": "resume with the same precision",
    "seed": "the seed fixes the data order; resume with the same seed",
    "schedule": "a resume keeps its lr schedule (--max-steps may stretch it)",
    "warmup_steps": "a resume keeps the warmup it was trained with",
    "model": "a resume takes its model from the checkpoint",
    "model_config": "a resume takes its model from the checkpoint's config.json",
    "init_from": "a resume takes its weights from the checkpoint",
    "batch_schedule": "a resume continues its batch schedule",
    "lr_rule": "a resume continues its batch schedule's lr rule",
    "min_tokens_per_step": "a resume continues its batch schedule",
    "max_tokens_per_step": "a resume continues its batch schedule",
    "batch_double_every": "a resume continues its batch schedule",
    "task": "a resume continues the run's task",
    "examples_per_step": "the examples per step fix the data's windows; a resume keeps them",
    "data_format": "the format fixes what the examples are; a resume keeps it",
    "train_on_prompt": "what the loss counts stays as trained",
    "drop_long": "which examples are trained on stays as trained",
    "document_mask": "what each token attends to stays as trained",
    "eod_id": "the documents the mask keeps apart stay as trained",
}
"""Fields a resume may not change, and why."""

SPECIAL = (
    "tokens_per_step",
    "micro_batch",
    "accum_steps",
    "max_steps",
    "max_tokens",
    "data",
    "eval_data",
    "eval_fraction",
    "moe_balance",
)
"""Fields whose change is judged by what it does (the batch, the length, the tokens; the
MoE balance's mode as trained, a default included: `train.moe`, applied and said)."""


RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of the times it has restarted the group: 0 on its first start."""


def continues(given: dict) -> tuple[bool, str | None]:
    """Whether the invocation asking `given` continues the run in --out, and the line that
    says so when a torchrun restart decided it. --resume alone: always; --resume auto: when
    --out holds a checkpoint; no --resume in a group torchrun restarted: auto, so that a
    restart continues from the newest intact checkpoint instead of refusing its own folder."""
    value, out, restart = given.get("resume"), given.get("out"), restart_count()
    if value is None and restart:
        value = RESUME_AUTO
    value = read_resume(False if value is None else value, "--resume")
    if value != RESUME_AUTO:
        return value, None
    if out is None or not checkpoint.step_folders(out):
        return False, None
    if not restart:
        return True, None
    path, _ = checkpoint.newest_intact(out)
    at = "its newest checkpoint" if path is None else f"step {checkpoint_step(path)}"
    return True, f"restart {restart} of the group: continuing from {at}"


def restart_count() -> int:
    """How many times torchrun has restarted this group (`RESTART_COUNT`); 0 outside it."""
    try:
        return max(0, int(os.environ.get(RESTART_COUNT, "0")))
    except ValueError:
        return 0


def checkpoint_step(path: str) -> int:
    """The optimizer step of checkpoint folder `path` (step-00000200: 200)."""
    return int(os.path.basename(path).removeprefix("step-"))


def settings_to_resume(given: dict) -> dict:
    """For the command line: the newest intact checkpoint's settings under the `given` ones."""
    out = given.get("out")
    if out is None:
        raise BadInput("--resume: needs --out naming the run to continue")
    refuse_if_held(out)  # a live run may not have written its first checkpoint yet
    path, skipped = checkpoint.newest_intact(out)
    if path is None and not skipped and holds_sft_stage(out):
        return given  # --task grpo stopped in its SFT stage, or before GRPO's first checkpoint
    if path is None:
        _no_checkpoint(out, skipped)
    saved = checkpoint.read_run_config(path)
    saved = {k: v for k, v in saved.items() if k in FLAGS and k not in INVOCATION}
    return merge_settings(saved, given)


def _no_checkpoint(out: str, skipped: list[str]):
    if not skipped:
        raise BadInput("--resume", out, "no checkpoint in this folder to resume from")
    raise BadInput("--resume", out, f"no intact checkpoint ({'; '.join(skipped)})")


def open_checkpoint(config: TrainConfig, say) -> checkpoint.Checkpoint:
    """The newest intact checkpoint in --out, after refusing the changes no resume may make.
    Each damaged or unverifiable newer checkpoint is named in one line through `say`, and so
    is resuming from one without its manifest (no verified one left)."""
    path, skipped = checkpoint.newest_intact(config.out)
    if path is None:
        _no_checkpoint(config.out, skipped)
    for line in skipped:
        say(f"checkpoint {line}: skipped, resuming from {os.path.basename(path)}")
    if not checkpoint.verifiable(path):
        say(
            f"checkpoint {os.path.basename(path)}: no {checkpoint.MANIFEST}, so it cannot be "
            "verified; resuming from it since it loads and no verified checkpoint is left"
        )
    ckpt = checkpoint.load(path)
    saved = ckpt.trainer_state["config"]
    for name, why in REFUSED.items():
        if name in saved and _changes(name, config, saved):
            raise BadInput(
                flag_name(name),
                getattr(config, name),
                f"the run in {config.out} was trained with {as_trained(name, ckpt)}; {why}",
            )
    return ckpt


def _changes(name: str, config: TrainConfig, saved: dict) -> bool:
    """Whether `config` changes setting `name` from the checkpoint's `saved` settings, as the
    runs use it: an SFT step left to its default examples is DEFAULT_EXAMPLES_PER_STEP (saved
    None), the same step as that number given."""
    if name != "examples_per_step":
        return getattr(config, name) != saved[name]
    then = saved[name]
    counted = rules_of(saved.get("task", "pretrain")).counts_examples
    if then is None and counted and saved.get("tokens_per_step") is None:
        then = DEFAULT_EXAMPLES_PER_STEP
    return config.target_examples_per_step != then


def as_trained(name: str, ckpt) -> str:
    """What the checkpoint's run had for setting `name`, in the words of the command line:
    `--seq-len 16`, or for a setting left to its default what that default was."""
    saved = ckpt.trainer_state["config"]
    value = saved.get(name)
    if value is not None:
        return f"{flag_name(name)} {value}"
    if name in ("model", "model_config", "init_from"):
        return _model_as_trained(saved)
    if name == "warmup_steps":
        warmup = ckpt.trainer_state.get("schedule", {}).get("warmup_steps")
        unit = "tokens" if saved.get("batch_schedule") is not None else "steps"
        return "the default warmup" + ("" if warmup is None else f" ({warmup:,} {unit})")
    if name == "batch_schedule":
        tokens = ckpt.trainer_state.get("plan", {}).get("tokens_per_step")
        each = "" if tokens is None else f" ({tokens:,} tokens per step)"
        return f"no --batch-schedule: one batch throughout{each}"
    return f"no {flag_name(name)} (its default)"


def _model_as_trained(saved: dict) -> str:
    """Where the run's model came from, for a refusal of --model, --model-config or
    --init-from."""
    if saved.get("init_from") is not None:
        return f"the weights of --init-from {saved['init_from']}"
    if saved.get("model_config") is not None:
        return f"the model of --model-config {saved['model_config']}"
    if saved.get("model") is not None:
        return f"--model {saved['model']}"
    return f"the built-in default model (--model {DEFAULT_MODEL}), initialised at random"


def check_data(config: TrainConfig, ckpt, data_info) -> list[str]:
    """Refuse other tokens or another eval set than the checkpoint's unless
    --allow-data-change; the lines to print."""
    state, saved = ckpt.trainer_state, ckpt.trainer_state["config"]
    before = state.get("data_fingerprint")
    was, now = _data_words(saved), _data_words(config.to_dict())
    if before is None or before == data_info.fingerprint:
        return [] if was == now else [f"data {was} -> {now}: the same tokens"]
    if not config.allow_data_change:
        evaluated = " or evaluated" if " --eval-" in was + now else ""
        raise BadInput(
            "--resume",
            config.out,
            f"--data {now} does not fit the checkpoint: other tokens than the run was trained"
            f"{evaluated} on ({was}); add --allow-data-change to continue on them",
        )
    return [f"data {was} -> {now} from step {ckpt.step} (--allow-data-change)"]


def _data_words(settings: dict) -> str:
    """--data's value in a line, with --eval-data or --eval-fraction where given."""
    words = settings.get("data") or "(built-in)"
    if settings.get("eval_data") is not None:
        return f"{words} --eval-data {settings['eval_data']}"
    if settings.get("eval_fraction") is not None:
        return f"{words} --eval-fraction {settings['eval_fraction']:g}"
    return words


def batch_request(config: TrainConfig, ckpt, world_size: int) -> BatchRequest:
    """The batch to plan the resumed run with: the checkpoint's tokens per step, its
    micro-batch unless --micro-batch changed it (`micro_batch.on_resume`), and k for this
    number of devices. With a batch schedule, k follows the schedule for the micro-batch and
    devices of the resume."""
    saved, plan = ckpt.trainer_state["config"], ckpt.trainer_state["plan"]
    if config.batch_schedule is not None:
        given = micro_batch.changed_on_resume(config, saved)
        micro = config.micro_batch if given else plan["micro_batch"]
        return BatchRequest.of(config).but(micro_batch=micro)
    seq = plan["seq_len"]
    tokens = plan.get("tokens_per_step") or (
        plan["micro_batch"] * seq * plan["accum_steps"] * plan["world_size"]
    )
    if config.tokens_per_step not in (None, saved.get("tokens_per_step"), tokens):
        raise BadInput(
            "--tokens-per-step",
            config.tokens_per_step,
            f"the run in {config.out} trains at {tokens} tokens per step; a resume keeps it",
        )
    per_rank, rest = divmod(tokens, seq * world_size)
    if rest or per_rank < 1:
        raise BadInput(
            "--resume",
            config.out,
            f"{tokens} tokens per step (trained on {plan['world_size']} device(s)) do not split "
            f"into whole {seq}-token sequences on {world_size} device(s); use a number of "
            f"devices that divides {tokens // seq} sequences",
        )
    micro = micro_batch.on_resume(config, saved, plan, per_rank)
    return BatchRequest.of(config).but(
        tokens_per_step=None, micro_batch=micro, accum_steps=per_rank // micro
    )


def batch_lines(ckpt, batch) -> list[str]:
    """A line saying how the batch layout changed, if it did (`batch`: the resumed run's
    BatchState, as planned)."""
    line = _batch_line(ckpt, batch)
    return [line] if line else []


def _batch_line(ckpt, batch) -> str | None:
    plan, saved = ckpt.trainer_state["plan"], ckpt.trainer_state["config"]
    # k is not the layout's with a batch schedule (it follows the tokens seen) nor with
    # --task sft (each window's examples fix it), so the checkpoint's k, the last window's,
    # is no change to report.
    follows = (
        "the batch schedule"
        if saved.get("batch_schedule") is not None
        else "each window's examples"
        if rules_of(saved.get("task", "pretrain")).reads_rows
        else None
    )
    if follows is not None:
        old = (plan["micro_batch"], plan["world_size"])
        new = (batch.micro_batch, batch.world_size)
        if old == new:
            return None
        return (
            f"micro-batch {old[0]} x {old[1]} device(s) -> {new[0]} x {new[1]} from step "
            f"{ckpt.step}: k follows {follows}"
        )
    old = (plan["micro_batch"], plan["accum_steps"], plan["world_size"])
    new = (batch.micro_batch, batch.k, batch.world_size)
    if old == new:
        return None
    what = f"devices {old[2]} -> {new[2]}" if old[2] != new[2] else "micro-batch"
    return (
        f"{what} from step {ckpt.step}: micro-batch {old[0]} x k {old[1]}"
        f" x {old[2]} -> {new[0]} x k {new[1]} x {new[2]}, {batch.tokens_per_step:,} tokens "
        "per step as before"
    )


def lr_schedule(config: TrainConfig, ckpt, resolved, batch) -> tuple[Schedule, list[str]]:
    """The lr schedule to continue on, and a line if the run's length changed it: over
    optimizer steps, or over tokens seen when the batch varies (`batch`, a BatchState)."""
    if batch.varies:
        return token_schedule(config, ckpt, batch.total_tokens)
    return schedule(config, ckpt, resolved)


def schedule(config: TrainConfig, ckpt, resolved) -> tuple[Schedule, list[str]]:
    """The lr schedule to continue on, and a line if the run's length changed it."""
    state = ckpt.trainer_state
    if resolved.total_steps < ckpt.step:
        flag = "--max-tokens" if config.max_tokens is not None else "--max-steps"
        value = config.max_tokens if config.max_tokens is not None else resolved.total_steps
        raise BadInput(
            flag, value, f"the checkpoint in {config.out} is already at step {ckpt.step}"
        )
    if "schedule" not in state:  # a checkpoint from before schedules were saved
        return Schedule(resolved.total_steps, resolved.warmup_steps, config.schedule), []
    old = Schedule.from_state_dict(state["schedule"])
    new = old.stretched(ckpt.step, resolved.total_steps)
    if new is old:
        return old, []
    head = f"run length {old.end} -> {new.end} steps from step {ckpt.step}: "
    if old.end <= ckpt.step:
        tail = f"the lr schedule had ended; the lr stays at {old(ckpt.step) * config.lr:.3g}"
    else:
        tail = (
            f"steps 1-{ckpt.step} as trained, the rest of the lr schedule (to step {old.end}) "
            f"stretched to end at step {new.end}"
        )
    return new, [head + tail]


def token_schedule(config: TrainConfig, ckpt, total_tokens: int) -> tuple[Schedule, list[str]]:
    """A batch-schedule run's lr schedule (over tokens seen) to continue on, and a line if
    the run's length changed it."""
    old = Schedule.from_state_dict(ckpt.trainer_state["schedule"])
    seen = int(ckpt.trainer_state["progress"]["tokens"])
    if total_tokens < seen:
        raise BadInput(
            "--max-tokens", total_tokens, f"the run in {config.out} has trained on {seen} tokens"
        )
    new = old.stretched(seen, total_tokens)
    if new is old:
        return old, []
    return new, [
        f"run length {old.end:,} -> {new.end:,} tokens from {seen:,}: the rest of the lr "
        "schedule stretched to end there"
    ]


def applied_changes(config: TrainConfig, ckpt) -> list[str]:
    """One line per other setting changed on purpose (each is applied by the run)."""
    saved = ckpt.trainer_state["config"]
    lines = []
    for name in FLAGS:
        if name in INVOCATION or name in REFUSED or name in SPECIAL or name not in saved:
            continue
        old, new = _shown(name, saved[name]), _shown(name, getattr(config, name))
        if new != old:
            label = flag_name(name).removeprefix("--")
            lines.append(f"{label} {old} -> {new} from step {ckpt.step}")
    return lines


def _shown(name: str, value):
    """A setting's value as a resume line says it: a choice left unset as its default
    (--sync: window)."""
    spec = FLAGS[name]
    if value is None and spec.kind == "choice" and spec.default_text in spec.choices:
        return spec.default_text
    return value


def check_metrics(config: TrainConfig, ckpt) -> None:
    """metrics.jsonl must still hold every line the checkpoint saw."""
    path = os.path.join(config.out, "metrics.jsonl")
    lines = len(read_metrics_text(path)) if os.path.exists(path) else 0
    if lines < ckpt.trainer_state["metrics_lines"]:
        raise BadInput(
            "--resume",
            config.out,
            f"metrics.jsonl holds {lines} lines, the checkpoint saw "
            f"{ckpt.trainer_state['metrics_lines']}; restore it or start a new --out",
        )
