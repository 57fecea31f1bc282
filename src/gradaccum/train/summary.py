"""What a run says: the lines it starts with, and how it ends (`finish`): the export, the stop
line, the critical-batch line, loss.png and its title, and the summary (the --json object)."""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Protocol

from gradaccum.parallel import sharding
from gradaccum.train import adapters, moe, parts
from gradaccum.train.rundir.best import BEST_FOLDER
from gradaccum.train.rundir.metrics import plot_loss, read_metrics
from gradaccum.train.rundir.outputs import Outputs
from gradaccum.train.settings import optimizer_defaults
from gradaccum.utils.errors import DiskFull
from gradaccum.utils.sizes import fmt_count

if TYPE_CHECKING:
    import torch

    from gradaccum.engine.accumulator import Accumulator
    from gradaccum.models.info import ModelInfo
    from gradaccum.parallel.process_group import RankInfo
    from gradaccum.train.batch_state import BatchState
    from gradaccum.train.config import TrainConfig
    from gradaccum.train.console import Clock, Console
    from gradaccum.train.moe import MoETraining
    from gradaccum.train.resolve import Resolved
    from gradaccum.train.rundir.payload import RunState
    from gradaccum.train.tasks import Task, TaskData


class Reported(Protocol):
    """What the opening lines and the end of a run read of it (`train.loop.Run` is one)."""

    config: TrainConfig
    rank_info: RankInfo
    device: torch.device
    console: Console
    clock: Clock
    model: torch.nn.Module
    model_info: ModelInfo
    data: TaskData
    task: Task
    acc: Accumulator
    batch: BatchState
    resolved: Resolved
    outputs: Outputs
    state: RunState
    moe: MoETraining | None
    sharded: bool
    """The model is sharded with FSDP2 (micro or hsdp)."""
    is_main: bool


def sync_line(sync: str, world: int) -> str:
    """What --sync micro or hsdp does with the model on `world` ranks, in one line."""
    if sync == "micro":
        return (
            f"sync   micro: FSDP2 shards the model over {world} ranks, a reduce-scatter into "
            "an fp32 shard after every micro-batch"
        )
    replicas, shards = sharding.hsdp_shape(world, sharding.per_node(world))
    return (
        f"sync   hsdp: FSDP2 over {replicas} nodes x {shards} ranks, a reduce-scatter within "
        "the node after every micro-batch, one all-reduce across nodes per window"
    )


def opening_lines(run: Reported, table: str, length: str) -> list[str]:
    """The plan's `table` (the task's, or the batch's), the run's `length` line, the model,
    the data, the device and where the run starts (the step a resume continues from)."""
    config, model_info, device = run.config, run.model_info, run.device
    info, floor = run.data.info, run.data.info.entropy_floor
    resumed = run.outputs.resumed_at is not None
    at = f", resuming at step {run.acc.steps}" if resumed else ""
    lines = [
        table,
        f"model  {model_info.source}: {model_info.params:,} parameters",
        f"data   {info.source}: vocab {info.vocab_size}, ln V = {math.log(info.vocab_size):.3f}"
        + (f", entropy floor {floor:.3f} nats/token" if floor is not None else ""),
        f"device {device}, precision {config.precision}, out {config.out}{at}",
    ]
    lines[1:1] = [length]  # after the table: the run's steps in epochs
    lines[3:3] = adapters.opening_lines(model_info)  # LoRA: targets, trainable parameters
    lines[3:3] = pretrained_lines(config, model_info)
    if config.micro_batch == "auto" and not resumed:  # a resume keeps the one it trained with
        lines.append(auto_micro_batch_line(run.batch.micro_batch))
    if run.resolved.sync_why is not None:  # --sync auto
        lines.append(f"sync   auto chose {run.resolved.sync}: {run.resolved.sync_why}")
    if run.sharded:  # micro or hsdp
        lines.append(sync_line(run.resolved.sync, run.rank_info.world_size))
    if device.type == "cpu" and config.precision != "fp32":
        lines.append(
            f"note: {config.precision} on CPU is usually several times slower than fp32 "
            "(few CPUs have fast low-precision matmuls); fp32 is the faster choice here"
        )
    return lines


def auto_micro_batch_line(micro_batch: int) -> str:
    """`--micro-batch auto` settled: the size, and that a run given auto again (from this
    run's config.yaml, which keeps auto) settles it again, maybe elsewhere at another size."""
    return (
        f"micro  --micro-batch auto settled at {micro_batch}; a run given auto (as from a "
        f"config.yaml that says auto) measures it again: --micro-batch {micro_batch} pins it"
    )


def pretrained_lines(config, model_info) -> list[str]:
    """A Hugging Face model from --init-from: its lr and weight decay and where they come
    from, since a pretrained model's defaults are not the built-in GPT's
    (`train.settings.optimizer_defaults`)."""
    if config.init_from is None or model_info.kind != "hf":
        return []
    defaults = optimizer_defaults(config.task, config.lora_rank is not None, pretrained=True)
    words = []
    for name, flag in (("lr", "--lr"), ("weight_decay", "--weight-decay")):
        value = getattr(config, name)
        why = f"the pretrained-model default; {flag} to change" if value == defaults[name] else flag
        words.append(f"{name.replace('_', ' ')} {value:g} ({why})")
    return ["optim  " + ", ".join(words)]


def stopped_line(stopped: str, step: int, total: int, outputs: Outputs) -> str:
    """A run stopped by `stopped` (SIGTERM, SIGINT, a request) after `step` of `total`
    steps: what was saved, and how to go on."""
    head = f"stopped by {stopped} at step {step}/{total}"
    if outputs.saved_step == step:
        return (
            f"{head}; checkpoint saved, continue with: gradaccum train --resume "
            f"--out {outputs.config.out}"
        )
    return f"{head}, before its first window: nothing to save; {outputs.kept()}"


def plot(records: list[dict], outputs: Outputs, entropy_floor: float | None, title: str):
    """loss.png: ["loss.png"] once written, else [] and why in `outputs.not_written`."""
    try:
        written = plot_loss(
            records, os.path.join(outputs.config.out, "loss.png"), entropy_floor, title=title
        )
    except DiskFull as err:
        outputs.not_written["loss.png"] = err.reason
        return []
    if not written:
        outputs.not_written["loss.png"] = "matplotlib not installed: pip install 'gradaccum[plot]'"
    return ["loss.png"] if written else []


def critical_tokens(noise) -> float | None:
    """The last noise-scale estimate of the critical batch, in tokens; None before a
    finite one (`noise`: the accumulator's `NoiseScale.last`, or None)."""
    if noise is None or not math.isfinite(noise.b_simple_tokens):
        return None
    return noise.b_simple_tokens


def critical_batch_line(noise, tokens_per_step: int) -> str | None:
    """With --noise-scale: the estimated critical batch against this run's, in one line;
    None before the first estimate."""
    critical, here = critical_tokens(noise), tokens_per_step
    if critical is None or critical <= 0:
        return None
    if here < critical / 2:
        meaning = (
            "below it, larger batches buy about proportionally fewer steps: the next run "
            "can take more tokens per step for little more compute"
        )
    elif here > 2 * critical:
        meaning = (
            "far above it, much of each step's compute is wasted: the next run can take "
            "fewer tokens per step and more steps for the same loss"
        )
    else:
        meaning = (
            "near it; below it larger batches buy proportionally fewer steps, far above it "
            "compute is wasted"
        )
    return (
        f"critical batch about {fmt_count(critical)} tokens (noise scale), this run "
        f"{fmt_count(here)} tokens per step: {meaning}"
    )


def best_line(run: Reported, exported: bool) -> str | None:
    """With --save-best: the best step, its eval loss and where its model is (`exported` as
    best/, else its checkpoint); None without --save-best."""
    config, best = run.config, run.outputs.best
    if not config.save_best or not run.is_main:
        return None
    if best.step is None:
        return "best   none: no evaluation gave a finite eval loss"
    only_end = config.eval_every == 0 and best.step == run.batch.total
    final = " = the final model (--eval-every 0: only the end is evaluated)" * only_end
    where = f"exported to {BEST_FOLDER}/" if exported else f"checkpoint {best.folder(config.out)}"
    return (
        f"best   step {best.step}/{run.batch.total}{final}, lowest eval loss "
        f"{best.eval_loss:.4f}: {where}"
    )


def summary(run: Reported, records: list[dict], stopped: str | None, wall_s: float) -> dict:
    """The --json object of `run` after its `acc.steps` optimizer steps, `stopped` by what
    (None: finished); `records`: metrics.jsonl's. Losses are nats per token: initial_loss of
    the run's first window, final_loss of its last, final_eval_loss on the held-out split.
    tokens_per_s counts only time inside training windows (not eval, saving or start-up);
    wall_s is this process's whole time. best_step and best_eval_loss: --save-best's
    checkpoint (None without it, or before a finite eval loss). Ranks other than 0 read no metrics and report no
    losses."""
    config, state, batch, steps = run.config, run.state, run.batch, run.acc.steps
    data_info, noise = run.data.info, run.acc.noise.last if run.acc.noise is not None else None
    best = run.outputs.best  # --save-best's, known to rank 0
    train_lines = [r for r in records if "loss" in r]
    eval_lines = [r for r in records if "eval_loss" in r]
    return {
        "initial_loss": state.initial_loss,
        "final_loss": train_lines[-1]["loss"] if train_lines else None,
        "final_eval_loss": eval_lines[-1]["eval_loss"] if eval_lines else None,
        "final_exact_match": eval_lines[-1].get("exact_match") if eval_lines else None,
        "final_reward": train_lines[-1].get("reward") if train_lines else None,  # --task grpo
        "task": config.task,
        "entropy_floor": data_info.entropy_floor,
        "ln_vocab": math.log(data_info.vocab_size),
        "steps": steps,
        "total_steps": batch.total,
        "tokens": batch.tokens,
        "tokens_per_s": batch.tokens / max(state.train_s, 1e-9),
        "skipped": sum(1 for x in train_lines if x.get("skipped")),
        "wall_s": wall_s,
        "micro_batch": batch.micro_batch,
        "accum_steps": batch.k,
        "world_size": batch.world_size,
        "sync": run.resolved.sync,
        "examples_per_step": config.target_examples_per_step,
        "batch_schedule": config.batch_schedule,
        "params": run.model_info.params,
        "lora": adapters.record_of(run.model_info),  # rank, targets, trainable count; None: no LoRA
        "device": str(run.device),
        "precision": config.precision,
        "stopped": stopped,
        "noise_scale_tokens": critical_tokens(noise),
        "best_step": best.step if config.save_best else None,
        "best_eval_loss": best.eval_loss if config.save_best else None,
        "out": config.out,
        "plan": None,  # --task sft: what its steps hold
        **run.task.summary_fields(records, batch, steps),  # tokens_per_step among them
    }


def finish(run: Reported, stopped: str | None) -> dict:
    """Export the model (a finished run only), plot the losses, return the summary, with
    the files written (`files`) and those not, and why (`not_written`). No room for the
    export ends the run in one line (RunFailed) naming the checkpoint still there."""
    config, outputs, step, task = run.config, run.outputs, run.acc.steps, run.task
    if stopped:
        run.console.say(stopped_line(stopped, step, run.batch.total, outputs))
    records, files = [], []
    model = parts.unwrapped(run.model)
    if run.sharded and stopped is None:  # gathered by every rank into rank 0's copy
        model = parts.whole_model(run.model, config, run.data.info, run.is_main)
    if run.is_main:
        outputs.metrics.close()
        records = read_metrics(os.path.join(config.out, "metrics.jsonl"))
        files = ["metrics.jsonl", "config.yaml"]
        if stopped is None:  # model.pt (and out/hf), or LoRA's adapter/ (and merged/)
            at = f"step {step}/{run.batch.total}"
            files += outputs.export_model(model, run.model_info, task.tokenizer_dir, at)
            line = adapters.merge_line(model, config) if "merged/" in files else None
            if line:  # --merge-lora on a base in 4 or 8 bits: what the merge changed
                run.console.say(line)
            if config.save_best:  # after the final export: its weights are loaded over
                files += outputs.export_best(model, run.model_info, task.tokenizer_dir, step, at)
        title = task.plot_title(records, run.model_info, run.batch)
        files += plot(records, outputs, run.data.info.entropy_floor, title)
        files += outputs.finish_trackers(run.console.say)  # the plots to them, closed
        files += ["checkpoints/"] if outputs.saved_step is not None else []
    noise = run.acc.noise.last if run.acc.noise is not None else None
    for line in (critical_batch_line(noise, run.batch.tokens_per_step),
                 best_line(run, f"{BEST_FOLDER}/" in files)):  # fmt: skip
        if line:
            run.console.say(line)
    result = summary(run, records, stopped, time.perf_counter() - run.clock.started)
    result.update(moe.summary_fields(run.moe, records))
    result["files"] = files
    result["not_written"] = dict(outputs.not_written)
    return result
