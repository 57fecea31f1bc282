"""`gradaccum train --task sft`: the data of a fine-tuning run, its windows and its evaluation.

What differs from pretraining, and only that, is here; the loop (`gradaccum.train.loop`) runs
both tasks:
- the data (`load_data`, from `sft_data`): the rows of --data (.jsonl, .json, .parquet, a save_to_disk folder,
  hf:NAME) or the built-in instruction set (`gradaccum.data.sft.builtin`), tokenized by the
  model's tokenizer (the built-in byte tokenizer for the built-in GPT, the --init-from folder's
  own with its chat template for a Hugging Face folder) into examples whose targets are the
  completion tokens (`gradaccum.data.sft.load`), and the eval set: a held-out split
  (`split_heldout`, --eval-fraction) or the examples of --eval-data
  (`gradaccum.train.eval_set`);
- the windows (`SFTStream`): --examples-per-step examples, or whole examples up to
  --tokens-per-step counted target tokens, per optimizer step, over all ranks, dealt to the
  ranks and cut into micro-batches as --packing says (`packing_of`): runs of --micro-batch
  padded to their longest (`gradaccum.data.sft.windows`), or by --micro-batch-tokens, padded
  per micro-batch or packed into padding-free rows (`gradaccum.data.sft.packed`). The
  engine's N is the window's target tokens over every micro-batch and rank, so the step does
  not depend on the packing, the micro-batch or the number of ranks;
- the plan (`batch_request`): the window's examples as sequences of --seq-len (the memory
  bound: no micro-batch is wider), k = ceil(examples per rank / micro-batch);
- the evaluation (`evaluate`): the held-out loss over completion tokens, and on the built-in
  set exact match by greedy generation.
"""

from __future__ import annotations

import math

import torch

from gradaccum.data.sft.builtin import check
from gradaccum.data.sft.evaluation import exact_match, heldout_loss
from gradaccum.data.sft.examples import Example
from gradaccum.data.sft.packed import Packing, packed_window
from gradaccum.data.sft.windows import SFTBatches
from gradaccum.engine.precision import autocast_dtype
from gradaccum.parallel import devices
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.config import TrainConfig
from gradaccum.train.epochs import epoch_stop
from gradaccum.train.epochs import length_line as epochs_length_line
from gradaccum.train.settings import TASK_DEFAULTS
from gradaccum.train.sft_data import (  # noqa: F401 - the data of a fine-tuning run, here too
    HELDOUT_MAX,
    SFTParts,
    builtin_gpt,
    builtin_tasks,
    check_packing,
    fingerprint,
    hf_masks_packed,
    load_data,
    packing_of,
    tokenizer_for,
)
from gradaccum.utils.errors import BadInput

PLAN_WINDOWS = 64
"""Windows of the data order read ahead to state a --tokens-per-step run's examples per step."""
SAMPLES = 3
"""Held-out answers printed with each exact-match figure."""


class SFTStream:
    """The run's windows (`SFTBatches`, cut per --packing by `sft_packed.packed_window`) as
    the loop, its out-of-memory recovery and its checkpoint read them: `next` a window,
    `position` an opaque place in the data order to rewind to, `set_micro_batch`,
    `state_dict` / `load_state_dict`. fill_rows: with --compile, fill window micro-batches
    with empty rows to one shape per bucket; False for a mixture of experts, whose balance
    would count an empty row's tokens (attention_mask 1, so that it attends to something) as
    routed ones."""

    def __init__(
        self,
        config: TrainConfig,
        examples: list[Example],
        pad_id: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        fill_rows: bool = True,
    ):
        self.inner = SFTBatches(
            examples,
            micro_batch=micro_batch,
            pad_id=pad_id,
            examples_per_step=config.target_examples_per_step,
            tokens_per_step=config.tokens_per_step,
            seed=config.seed,
            rank=rank,
            world_size=world_size,
            stop=stop_of(config, examples),
        )
        self.mode, self.seq_len = check_packing(config), config.seq_len
        budget = config.micro_batch_tokens or micro_batch * config.seq_len
        # Positions per example of the micro-batch: out-of-memory recovery shrinks the
        # micro-batch, and the budget with it.
        self._per_example = budget / micro_batch
        self._compile, self._fill_rows = config.compile, fill_rows

    @property
    def micro_batch(self) -> int:
        return self.inner.micro_batch

    @property
    def packing(self) -> Packing | None:
        """How the next windows are cut; None for --packing none (`SFTBatches`' own cut)."""
        if self.mode == "none":
            return None
        budget = max(1, round(self.micro_batch * self._per_example))
        return Packing.of_run(self.mode, budget, self.seq_len, self._compile, self._fill_rows)

    @property
    def position(self) -> tuple[int, int]:
        """(examples taken over all ranks, windows taken): where to rewind to."""
        return self.inner.position, self.inner.windows

    @position.setter
    def position(self, value: tuple[int, int]) -> None:
        self.inner.position, self.inner.windows = value

    def set_micro_batch(self, micro_batch: int) -> None:
        """Cut the next windows into micro-batches of `micro_batch` examples, or its share of
        the token budget (the windows themselves do not change)."""
        self.inner.micro_batch = micro_batch

    def __iter__(self):
        return self

    def __next__(self):
        packing = self.packing
        return next(self.inner) if packing is None else packed_window(self.inner, packing)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict, other_data: bool = False) -> None:
        """Continue after the checkpoint's last window; with `other_data`, other examples
        read on from the same place in the order."""
        if other_data:
            self.inner.position, self.inner.windows = int(state["position"]), int(state["windows"])
            return
        self.inner.load_state_dict(state)


def stop_of(config: TrainConfig, examples: list[Example]) -> int | None:
    """Examples of the data order a run of --epochs trains on (`epochs.epoch_stop`); None
    without --epochs."""
    epochs = config.run_epochs
    return None if epochs is None else epoch_stop(epochs, len(examples))


def _ahead(config: TrainConfig, examples: list[Example], stop: int | None = None) -> SFTBatches:
    """A copy of the data order to read ahead in (the windows do not depend on the
    micro-batch or the ranks), ending after `stop` examples."""
    return SFTBatches(
        examples,
        micro_batch=1,
        pad_id=0,
        examples_per_step=config.target_examples_per_step,
        tokens_per_step=config.tokens_per_step,
        seed=config.seed,
        stop=stop,
    )


def lengths(config: TrainConfig, examples: list[Example]) -> dict[str, int]:
    """Optimizer steps of each length the run is given, by flag: --max-steps; the windows it
    takes the data order to hold --max-tokens counted (target) tokens; the windows of
    --epochs (the last one cut at the epoch boundary). The run ends at the fewest."""
    found = {} if config.max_steps is None else {"--max-steps": config.max_steps}
    stop = stop_of(config, examples)
    if stop is not None:
        ahead, steps = _ahead(config, examples, stop), 0
        while ahead.position < stop:
            ahead.position += len(ahead.next_indices())
            steps += 1
        found["--epochs"] = steps
    if config.max_tokens is not None:
        ahead, seen, steps = _ahead(config, examples, stop), 0, 0
        while seen < config.max_tokens and (stop is None or ahead.position < stop):
            indices = ahead.next_indices()
            seen += int(ahead.targets[indices].sum())
            ahead.position += len(indices)
            steps += 1
        found["--max-tokens"] = steps
    return found


def total_steps(config: TrainConfig, examples: list[Example]) -> int:
    """Optimizer steps of the run: the first reached of its lengths (`lengths`)."""
    return min(lengths(config, examples).values())


def length_line(config: TrainConfig, examples: list[Example]) -> str:
    """The plan's line on the run's length in steps and epochs, and what ends it."""
    found = lengths(config, examples)
    values = {"--epochs": config.run_epochs, "--max-tokens": config.max_tokens}
    given = {flag: f"{values.get(flag, config.max_steps):,}" for flag in found}
    if config.run_epochs is not None:
        given["--epochs"] = f"{config.run_epochs:g}"
        if config.epochs_defaulted:
            given["--epochs"] += (
                " (the default on --data when no --epochs, --max-steps or --max-tokens)"
            )
    default = TASK_DEFAULTS["sft"]["max_steps"]
    if list(found) == ["--max-steps"] and config.max_steps == default:
        given["--max-steps"] += " (the default when no --epochs, --max-steps or --max-tokens)"
    ahead, steps = _ahead(config, examples, stop_of(config, examples)), min(found.values())
    for _ in range(steps):
        ahead.position += len(ahead.next_indices())
    return epochs_length_line(found, given, len(examples), "examples", ahead.position)


def examples_per_step(config: TrainConfig, examples: list[Example]) -> float:
    """Examples per window: --examples-per-step, or the mean of the first PLAN_WINDOWS
    windows of a --tokens-per-step run."""
    if config.target_examples_per_step is not None:
        return config.target_examples_per_step
    ahead, taken = _ahead(config, examples), 0
    for _ in range(PLAN_WINDOWS):
        indices = ahead.next_indices()
        ahead.position += len(indices)
        taken += len(indices)
    return taken / PLAN_WINDOWS


def window_tokens(config: TrainConfig, examples: list[Example]) -> float:
    """Tokens (padding not counted) of the mean window over the first PLAN_WINDOWS."""
    ahead, tokens = _ahead(config, examples), 0
    for _ in range(PLAN_WINDOWS):
        indices = ahead.next_indices()
        ahead.position += len(indices)
        tokens += int(ahead.lengths[indices].sum())
    return tokens / PLAN_WINDOWS


def batch_request(
    config: TrainConfig,
    examples: list[Example],
    world_size: int,
    micro_batch: int | str | None = None,
) -> BatchRequest:
    """The batch `resolve_plan` plans an SFT run with, in sequences of --seq-len tokens (no
    micro-batch is wider, so the memory estimate bounds the run's): --packing none, each
    window's examples as sequences, k = ceil(examples per rank / micro-batch); window and
    padding-free, a micro-batch of --micro-batch-tokens // --seq-len sequences (--micro-batch
    without it) and k = ceil(the mean window's tokens per rank / the budget). And the run's
    steps."""
    micro = config.micro_batch if micro_batch is None else micro_batch
    if check_packing(config) == "none":
        per_step = max(math.ceil(examples_per_step(config, examples)), world_size)
        if micro != "auto":
            per_step = math.ceil(per_step / (micro * world_size)) * micro * world_size
        sequences = per_step
    else:
        if config.micro_batch_tokens is not None:
            micro = max(1, config.micro_batch_tokens // config.seq_len)
        budget = config.micro_batch_tokens or micro * config.seq_len
        k = max(1, math.ceil(window_tokens(config, examples) / (world_size * budget)))
        sequences = k * micro * world_size
    return BatchRequest.of(config).but(
        micro_batch=micro,
        tokens_per_step=sequences * config.seq_len,
        max_steps=total_steps(config, examples),
        total_tokens=None,
    )


def resume_batch_request(
    config: TrainConfig, ckpt, examples: list[Example], world_size: int
) -> BatchRequest:
    """`batch_request` of a resumed run: the micro-batch it trained with unless --micro-batch
    changes it (the windows are counted in examples, so any micro-batch and number of ranks
    continue them); a changed --tokens-per-step is refused (it would make other windows)."""
    saved = ckpt.trainer_state["config"]
    if config.tokens_per_step != saved.get("tokens_per_step"):
        raise BadInput(
            "--tokens-per-step",
            config.tokens_per_step,
            f"the run in {config.out} was trained with --tokens-per-step "
            f"{saved.get('tokens_per_step')}; the budget fixes the data's windows, a resume "
            "keeps it",
        )
    micro = ckpt.trainer_state["plan"]["micro_batch"]
    if config.micro_batch not in ("auto", saved.get("micro_batch")):
        micro = config.micro_batch
    return batch_request(config, examples, world_size, micro)


CUTS = {
    "none": "micro-batches of {micro} examples padded to their longest",
    "window": "micro-batches of up to {budget:,} positions (padding included), longest "
    "first, each padded to its longest{buckets}",
    "padding-free": "micro-batches of up to {rows} padding-free row(s) of {seq} positions{rowed}, "
    "attention kept within each example{full}",
}
"""--packing's cut of a window, in the words of the plan line."""


def plan_lines(config: TrainConfig, parts: SFTParts, micro_batch: int) -> list[str]:
    """How --packing cuts a window, after the plan's table (`sft_plan`), and a warning when
    the first window is over --tokens-per-step."""
    ahead = _ahead(config, parts.train)
    first = int(ahead.targets[ahead.next_indices()].sum())
    what = "prompt and completion" if config.train_on_prompt else "completion"
    mode = packing_of(config)
    budget = config.micro_batch_tokens or micro_batch * config.seq_len
    cut = CUTS[mode].format(
        micro=micro_batch,
        budget=budget,
        rows=max(1, budget // config.seq_len),
        seq=config.seq_len,
        buckets=" (rounded up to a length bucket, rows filled: --compile)" * config.compile,
        full=" (every one full, one shape: --compile)" if config.compile else "",
        rowed="" if config.compile else " (narrower rows for shorter examples: length buckets)",
    )
    given = "" if config.packing else " (the default for this model)"
    return [
        micro_batch_line(config, micro_batch),
        f"sft    --packing {mode}{given}: {cut}; the same update in every mode",
    ] + _over_budget_lines(config, ahead, first, what)


def micro_batch_line(config: TrainConfig, micro_batch: int) -> str:
    """What one micro-batch of `micro_batch` holds under the run's --packing. --micro-batch
    counts examples (as TRL's per_device_train_batch_size does) only under none; padding-free
    and window count rows of --seq-len, several examples each, so there k at --micro-batch 1
    is usually below the examples per step."""
    mode, seq = packing_of(config), config.seq_len
    if mode == "none":
        return (f"sft    micro-batch {_count(micro_batch, 'example')}, padded to their longest "
                "(none: --micro-batch counts examples)")  # fmt: skip
    budget = config.micro_batch_tokens or micro_batch * seq
    rows = "rows of --seq-len" if mode == "window" else "rows"
    counts = ("--micro-batch-tokens sets it" if config.micro_batch_tokens
              else f"--micro-batch counts {rows}, not examples")  # fmt: skip
    if mode == "window":
        return (f"sft    micro-batch up to {budget:,} positions, padding included (window: as "
                f"many examples as fit; {counts})")  # fmt: skip
    return (f"sft    micro-batch {_count(max(1, budget // seq), 'row')} of {seq} positions "
            f"(padding-free: several examples a row; {counts})")  # fmt: skip


def _count(n: int, unit: str) -> str:
    """`n` `unit`s, in the singular for one."""
    return f"{n:,} {unit}{'s' * (n != 1)}"


def _over_budget_lines(config: TrainConfig, ahead: SFTBatches, first: int, what: str) -> list:
    """A warning when the first window (`first` counted tokens) is over --tokens-per-step:
    a window takes at least one whole example, so such a run trains on more than its budget."""
    budget = config.tokens_per_step
    if budget is None or first <= budget:
        return []
    smallest = int(ahead.counts.min())
    return [
        f"warning: --tokens-per-step {budget:,} is below the first window's example(s) "
        f"({first:,} counted ({what}) tokens; the smallest example holds {smallest:,}): each "
        f"step takes at least one whole example, so steps go over the budget; use at least "
        f"--tokens-per-step {smallest:,}"
    ]


def evaluate(
    model: torch.nn.Module,
    parts: SFTParts,
    micro_batch: int,
    device,
    precision: str,
    answers: int | None = None,
) -> tuple[dict, list[str]]:
    """The held-out loss over the target tokens (nats per token) and, on the built-in set,
    exact match by greedy generation over the first `answers` held-out examples (None: all;
    0: none): the metrics record's fields and the lines to print."""
    with devices.autocast(device, autocast_dtype(precision)):
        loss = heldout_loss(model, parts.val, parts.tokenizer.pad_id, micro_batch=micro_batch)
        fields = {"eval_loss": loss.loss, "eval_tokens": loss.tokens}
        if not parts.builtin or answers == 0:
            return fields, [f"eval loss {loss.loss:.4f}"]
        em = exact_match(model, parts.val, parts.tokenizer, check=check, max_examples=answers,
                         samples=SAMPLES)  # fmt: skip
    fields["exact_match"] = em.rate
    lines = [f"eval loss {loss.loss:.4f}, exact match {em.correct}/{em.total} ({em.rate:.3f})"]
    for s in em.samples:
        lines.append(
            f"  {'ok ' if s.correct else 'no '} {s.prompt.strip()!r} -> {s.generated!r}"
            + ("" if s.correct else f" (expected {s.expected.strip()!r})")
        )
    return fields, lines
