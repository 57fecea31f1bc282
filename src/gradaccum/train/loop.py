"""`gradaccum train`: a causal LM trained at a fixed tokens-per-step budget.

The training step is straight-line code around `Accumulator.step`: fetch the window's k
micro-batches, let the engine run their forwards and backwards and take one optimizer step,
write a metrics line. Everything before the loop (data, model, plan, optimizer, resume) and
after it (checkpoint, plot, summary) is spelled out in the order it happens.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import devices, sync
from ..atomic import write_text_atomic
from ..distributed import RankInfo, init_distributed, teardown
from ..engine import Accumulator
from . import checkpoint
from .config import FIELDS, TrainConfig, TrainConfigError, to_toml
from .console import Console, Progress, StopSignals
from .metrics import MetricsWriter, plot_loss, read_metrics, read_metrics_text
from .model import ModelError, build_model, causal_lm_loss
from .resolve import resolve_plan
from .schedule import Schedule, make_scheduler

__all__ = ["TrainConfig", "TrainConfigError", "train"]

EVAL_TOKENS = 32768
"""Held-out tokens the eval loss is measured on (fewer if the split is smaller)."""


def _init_distributed(config: TrainConfig) -> RankInfo:
    try:
        return init_distributed(device=config.device)
    except ValueError as err:  # a bad torchrun environment or a device the backend cannot use
        raise TrainConfigError(f"--device {config.device or 'auto'}: {err}") from None


def _check_out_folder(out: str) -> None:
    """--out must be a folder or creatable as one: checked before anything is read or written."""
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise TrainConfigError(f"--out {out}: {path} is a file, not a folder")
    if not os.access(path, os.W_OK):
        raise TrainConfigError(f"--out {out}: {path} is not writable")


def _check_resume(config: TrainConfig, ckpt, total_steps: int) -> None:
    """What would make a resume wrong, found before anything in --out is rewritten."""
    saved = ckpt.trainer_state["config"]
    if saved.get("precision") != config.precision:
        raise TrainConfigError(
            f"--precision {config.precision}: the checkpoint in {config.out} was trained in "
            f"{saved.get('precision')}; resume with the same precision"
        )
    if ckpt.step > total_steps:
        raise TrainConfigError(
            f"--max-steps {total_steps}: the checkpoint in {config.out} is already at step "
            f"{ckpt.step}"
        )
    path = os.path.join(config.out, "metrics.jsonl")
    lines = len(read_metrics_text(path)) if os.path.exists(path) else 0
    if lines < ckpt.trainer_state["metrics_lines"]:
        raise TrainConfigError(
            f"--resume {config.out}: metrics.jsonl holds {lines} lines, the checkpoint saw "
            f"{ckpt.trainer_state['metrics_lines']}; restore it or start a new --out"
        )


def _load_data(config: TrainConfig):
    from .data import load_tokens

    try:
        return load_tokens(config.data, config.seq_len, config.seed)
    except (ValueError, OSError, ImportError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if text.startswith("--"):
            raise TrainConfigError(text) from None
        raise TrainConfigError(f"--data {config.data or '(built-in)'}: {text}") from None


def _optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    # Decay matrices and embeddings, not biases and norm gains (nanoGPT, GPT-3).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, val, micro_batch: int, device: torch.device, precision: str
) -> float:
    """Mean loss per token over the first EVAL_TOKENS tokens of the held-out split (the same
    sequences every time, so eval losses of a run compare with each other)."""
    from ..precision import autocast_dtype
    from .data import eval_batches

    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in eval_batches(val, micro_batch, max(1, EVAL_TOKENS // val.seq_len)):
        with devices.autocast(device, autocast_dtype(precision)):
            s, n = causal_lm_loss(model, _to_device(batch, device))
        loss_sum += float(s)
        tokens += int(n)
    model.train(was_training)
    return loss_sum / max(tokens, 1)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself, under DDP's `module` and torch.compile's `_orig_mod`."""
    model = getattr(model, "module", model) if sync.is_ddp(model) else model
    return getattr(model, "_orig_mod", model)


def _stop_everywhere(stop: bool) -> bool:
    # Signals reach ranks at different moments: all ranks must leave at the same window, or
    # the ones still training wait forever for the ones that left.
    return bool(sync.max_over_ranks(int(stop)))  # no collective when alone


def train(config: TrainConfig, should_stop: Callable[[int], bool] | None = None) -> dict:
    """Run the training `config` describes; return the summary (the --json object).

    should_stop(step) is asked after every window, like a signal: True saves and stops.
    Raises TrainConfigError (a one-line `--flag value: why`) for input found bad only once
    the data or model is read; nothing is written to --out before that point.
    """
    rank_info = _init_distributed(config)
    try:
        return _train(config, rank_info, rank_info.device, should_stop)
    finally:
        teardown(rank_info)


def _train(
    config: TrainConfig,
    rank_info: RankInfo,
    device: torch.device,
    should_stop: Callable[[int], bool] | None,
) -> dict:
    started = time.perf_counter()
    is_main = rank_info.rank == 0
    _check_out_folder(config.out)
    console = Console(enabled=is_main, quiet=config.json)

    # ---- data, model, plan: everything that can still reject the input ------------------
    torch.manual_seed(config.seed)
    train_set, val_set, data_info = _load_data(config)
    try:
        model, model_info = build_model(
            preset=config.preset,
            config_path=config.model_config,
            init_from=config.init_from,
            vocab_size=data_info.vocab_size,
            seq_len=config.seq_len,
        )
    except ModelError as err:
        raise TrainConfigError(str(err)) from None
    resolved = resolve_plan(config, model_info, rank_info.world_size, device)
    ckpt = None
    if config.resume:
        ckpt = checkpoint.load(checkpoint.find_latest(config.out))
        resolved.check_matches(ckpt.trainer_state["plan"], config.out)
        _check_resume(config, ckpt, resolved.total_steps)

    # ---- build the run ----------------------------------------------------------------------
    model.to(device)
    if config.activation_checkpointing:
        if hasattr(model, "set_activation_checkpointing"):
            model.set_activation_checkpointing(True)
        else:
            model.gradient_checkpointing_enable()
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt.model_state)
        except RuntimeError as err:  # another vocabulary, another model
            first = str(err).strip().splitlines()[-1].strip()
            raise TrainConfigError(
                f"--resume {config.out}: the checkpoint's model does not fit this one ({first})"
            ) from None
    if config.compile:  # before DDP, so the engine still sees DDP and its no_sync
        model = torch.compile(model)
    if rank_info.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type not in ("cpu", "mps") else None
        model = DistributedDataParallel(model, device_ids=ids)
    optimizer = _optimizer(model, config)
    schedule = Schedule(resolved.total_steps, resolved.warmup_steps, config.schedule)
    scheduler = make_scheduler(optimizer, schedule)
    acc = Accumulator(
        model,
        optimizer,
        scheduler,
        max_grad_norm=config.max_grad_norm or None,
        precision=config.precision,
    )
    from .data import Batches

    batches = Batches(
        train_set,
        resolved.micro_batch,
        config.seed,
        rank=rank_info.rank,
        world_size=rank_info.world_size,
    )
    progress_state = {"tokens": 0, "elapsed_s": 0.0, "train_s": 0.0, "initial_loss": None}
    if ckpt is not None:
        state = ckpt.trainer_state
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        # The saved lr follows the saved schedule; a resume with another --lr or --max-steps
        # continues on the new one from the step reached.
        scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"] = config.lr
            group["lr"] = config.lr * schedule(scheduler.last_epoch)
        acc.load_state_dict(state["accumulator"])
        try:
            batches.load_state_dict(state["data"])
        except ValueError as err:
            raise TrainConfigError(f"--resume {config.out}: {err}") from None
        checkpoint.set_rng_state(state["rng"])
        progress_state = dict(state["progress"])
    step = acc.steps

    # ---- say what is about to happen, then write the run's folder -----------------------
    console.say(resolved.table)
    console.say(f"model  {model_info.source}: {model_info.params:,} parameters")
    floor = data_info.entropy_floor
    console.say(
        f"data   {data_info.source}: vocab {data_info.vocab_size}, "
        f"ln V = {math.log(data_info.vocab_size):.3f}"
        + (f", entropy floor {floor:.3f} nats/token" if floor is not None else "")
    )
    console.say(
        f"device {device}, precision {config.precision}, out {config.out}"
        + (f", resuming at step {step}" if ckpt is not None else "")
    )
    metrics_path = os.path.join(config.out, "metrics.jsonl")
    metrics = None
    if is_main:
        os.makedirs(config.out, exist_ok=True)
        resolved_values = {**config.to_dict(), **resolved.config_values()}
        resolved_values = {
            k: v for k, v in resolved_values.items() if k in FIELDS and k not in ("resume", "json")
        }
        write_text_atomic(os.path.join(config.out, "train.toml"), to_toml(resolved_values))
        keep = ckpt.trainer_state["metrics_lines"] if ckpt is not None else None
        metrics = MetricsWriter(metrics_path, keep_lines=keep)

    def save() -> None:
        if is_main:
            state = {
                "step": step,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "accumulator": acc.state_dict(),
                "data": batches.state_dict(),
                "rng": checkpoint.rng_state(),
                "config": config.to_dict(),
                "plan": resolved.summary(),
                "metrics_lines": metrics.lines,
                "progress": dict(progress_state),
            }
            checkpoint.save(
                config.out,
                step,
                _unwrapped(model).state_dict(),
                model_info.config,
                state,
                run_config=config.to_dict(),
            )
        if rank_info.world_size > 1:
            dist.barrier()

    # ---- the loop: one window, one optimizer step -----------------------------------------
    k, total = resolved.accum_steps, resolved.total_steps
    progress = Progress(console, total, step, k)
    first_step, last_saved, stopped, skipped_in_a_row = step, step, None, 0
    here = time.perf_counter()  # this process's start, for the ETA
    loop_start = here - progress_state["elapsed_s"]
    with StopSignals() as signals:
        try:
            while step < total:
                t0 = time.perf_counter()
                micro_batches = [_to_device(next(batches), device) for _ in range(k)]
                result = acc.step(micro_batches, causal_lm_loss)
                devices.synchronize(device)
                dt = time.perf_counter() - t0
                step = result.step
                progress_state["tokens"] += result.tokens
                progress_state["train_s"] += dt
                progress_state["elapsed_s"] = time.perf_counter() - loop_start
                if progress_state["initial_loss"] is None:
                    progress_state["initial_loss"] = result.loss
                skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
                if skipped_in_a_row >= 50:
                    raise RuntimeError(
                        f"50 windows in a row had a non-finite loss or gradient "
                        f"(last loss {result.loss}); training diverged"
                    )
                if is_main:
                    metrics.write(
                        {
                            "step": step,
                            "loss": result.loss,
                            "tokens": progress_state["tokens"],
                            "tokens_per_s": result.tokens / dt,
                            "lr": result.lr,
                            "grad_norm": result.grad_norm,
                            "accum_steps": k,
                            "micro_batch": resolved.micro_batch,
                            "skipped": result.skipped,
                            "elapsed_s": progress_state["elapsed_s"],
                        }
                    )
                progress.update(
                    step,
                    result.loss,
                    result.tokens / dt,
                    result.lr,
                    time.perf_counter() - here,
                    step - first_step,
                )
                if (
                    is_main
                    and not result.skipped
                    and (step == total or (config.eval_every and step % config.eval_every == 0))
                ):
                    eval_loss = evaluate(
                        _unwrapped(model), val_set, resolved.micro_batch, device, config.precision
                    )
                    metrics.write(
                        {
                            "step": step,
                            "tokens": progress_state["tokens"],
                            "eval_loss": eval_loss,
                            "elapsed_s": time.perf_counter() - loop_start,
                        }
                    )
                    progress.note(f"step {step}: eval loss {eval_loss:.4f}")
                stop = signals.requested or (
                    "request" if should_stop and should_stop(step) else None
                )
                if _stop_everywhere(stop is not None):
                    stopped = stop or "another rank"
                    break
                if config.save_every and step % config.save_every == 0 and step != last_saved:
                    save()
                    last_saved = step
        finally:
            progress.close()
        if step != last_saved:
            save()
        if stopped:
            console.say(
                f"stopped by {stopped} at step {step}/{total}; checkpoint saved, "
                f"continue with: gradaccum train --resume --out {config.out}"
            )

    # ---- results -----------------------------------------------------------------------
    records = []
    if is_main:
        metrics.close()
        records = read_metrics(metrics_path)
        if stopped is None:
            checkpoint.save_model(config.out, _unwrapped(model).state_dict(), model_info.config)
        plot_loss(
            records,
            os.path.join(config.out, "loss.png"),
            floor,
            title=f"{model_info.source}, {resolved.tokens_per_step:,} tokens/step "
            f"(b {resolved.micro_batch} x k {k} x world {rank_info.world_size})",
        )
    return _summary(
        records,
        progress_state,
        resolved,
        data_info,
        model_info,
        config,
        step,
        stopped,
        time.perf_counter() - started,
        device,
    )


def _summary(
    records, progress_state, resolved, data_info, model_info, config, step, stopped, wall_s, device
) -> dict:
    """The --json object. Losses are nats per token: initial_loss of the run's first window,
    final_loss of its last, final_eval_loss on the held-out split. tokens_per_s counts only
    time inside training windows (not eval, saving or start-up); wall_s is this process's
    whole time. Ranks other than 0 read no metrics and report no losses."""
    train_lines = [r for r in records if "eval_loss" not in r]
    eval_lines = [r for r in records if "eval_loss" in r]
    return {
        "initial_loss": progress_state["initial_loss"],
        "final_loss": train_lines[-1]["loss"] if train_lines else None,
        "final_eval_loss": eval_lines[-1]["eval_loss"] if eval_lines else None,
        "entropy_floor": data_info.entropy_floor,
        "ln_vocab": math.log(data_info.vocab_size),
        "steps": step,
        "total_steps": resolved.total_steps,
        "tokens": progress_state["tokens"],
        "tokens_per_s": progress_state["tokens"] / max(progress_state["train_s"], 1e-9),
        "skipped": sum(1 for r in train_lines if r.get("skipped")),
        "wall_s": wall_s,
        "micro_batch": resolved.micro_batch,
        "accum_steps": resolved.accum_steps,
        "world_size": resolved.world_size,
        "tokens_per_step": resolved.tokens_per_step,
        "params": model_info.params,
        "device": str(device),
        "precision": config.precision,
        "stopped": stopped,
        "out": config.out,
    }
