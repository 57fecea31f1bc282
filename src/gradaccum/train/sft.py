"""`gradaccum train --task sft`: the data of a fine-tuning run, its windows and its evaluation.

What differs from pretraining, and only that, is here; the loop (`gradaccum.train.loop`) runs
both tasks:
- the data (`load_data`): the rows of --data (.jsonl, .json, .parquet, a save_to_disk folder,
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
- the plan (`plan_config`): the window's examples as sequences of --seq-len (the memory
  bound: no micro-batch is wider), k = ceil(examples per rank / micro-batch);
- the evaluation (`evaluate`): the held-out loss over completion tokens, and on the built-in
  set exact match by greedy generation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch

from gradaccum.data.sft.builtin import SOURCE, builtin_rows, check, solve
from gradaccum.data.sft.evaluation import exact_match, heldout_loss
from gradaccum.data.sft.examples import IGNORE_INDEX, Example
from gradaccum.data.sft.load import SFTData, load_sft, tokenize_rows
from gradaccum.data.sft.packed import Packing, packed_window
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.sft.windows import SFTBatches, split_heldout
from gradaccum.data.tokenizers import ByteTokenizer, load_tokenizer
from gradaccum.data.tokens import DataInfo
from gradaccum.engine.precision import autocast_dtype
from gradaccum.models.gpt import GPT_MODEL_TYPE
from gradaccum.parallel import devices
from gradaccum.train import eval_set
from gradaccum.train.config import TrainConfig
from gradaccum.train.epochs import epoch_stop
from gradaccum.train.epochs import length_line as epochs_length_line
from gradaccum.train.settings import TASK_DEFAULTS
from gradaccum.utils.errors import BadInput

HELDOUT_MAX = 500
"""Most examples held out by the default --eval-fraction (`eval_set.DEFAULT_FRACTION`):
enough for an exact-match rate to two decimals, quick to generate."""
PLAN_WINDOWS = 64
"""Windows of the data order read ahead to state a --tokens-per-step run's examples per step."""
SAMPLES = 3
"""Held-out answers printed with each exact-match figure."""


@dataclass
class SFTParts:
    """A fine-tuning run's data: the examples to train on and to evaluate on, and what they
    are. `train`, `val` and `info` are what the loop reads of any run's data."""

    train: list[Example]
    val: list[Example]
    """The examples to evaluate on: --eval-data's, or those held out of --data (none when it
    holds a single example, or with --eval-fraction 0)."""
    info: DataInfo
    """Source, vocabulary (the tokenizer's), token counts and the fingerprint a resume checks."""
    tokenizer: object
    """The `gradaccum.data.tokenizers.Tokenizer` the examples were made with."""
    tokenizer_dir: str | None
    """The folder the tokenizer was read from (its files go beside an export); None: bytes."""
    sft: SFTData
    """What was read: rows, bad rows, truncated and dropped examples, lengths."""
    builtin: bool
    """Whether this is the built-in instruction set (whose answers a program checks)."""
    eval_sft: SFTData | None = None
    """What was read of --eval-data; None: the eval set is held out of --data."""

    def summary_lines(self) -> list[str]:
        """The start-of-run lines about the data (`SFTData.summary_lines`), the eval data's
        and the split."""
        lines, held = self.sft.summary_lines(), "held out"
        if self.eval_sft is not None:
            lines += ["eval " + line if i == 0 else line
                      for i, line in enumerate(self.eval_sft.summary_lines())]  # fmt: skip
            held = "to evaluate on (--eval-data)"
        return lines + [
            f"  {len(self.train)} examples to train on, {len(self.val)} {held}; "
            f"tokenizer {self.tokenizer.origin}"
        ]


def tokenizer_for(config: TrainConfig):
    """The tokenizer of the run's model: bytes for the built-in GPT (a preset or this
    project's checkpoint of one), else the tokenizer in the --init-from folder, or in the
    folder of --model-config. BadInput when that folder holds none."""
    if config.init_from is not None:
        if _model_type(config.init_from) == GPT_MODEL_TYPE:
            return ByteTokenizer(), None
        return load_tokenizer(config.init_from, flag="--init-from"), config.init_from
    if config.model_config is not None:
        path = config.model_config
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        return load_tokenizer(folder, flag="--model-config"), folder
    return ByteTokenizer(), None


def _model_type(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None  # build_model says what is wrong with the folder, naming the flag
    return saved.get("model_type", GPT_MODEL_TYPE) if isinstance(saved, dict) else None


def load_data(config: TrainConfig) -> SFTParts:
    """The run's examples: read, tokenized, split by --eval-fraction, or all of --data to
    train on and --eval-data's to evaluate on. BadInput (one line naming --data or
    --eval-data and the row, or the folder of the tokenizer) on bad input."""
    tokenizer, tokenizer_dir = tokenizer_for(config)
    options = dict(
        seq_len=config.seq_len,
        data_format=config.data_format,
        train_on_prompt=config.train_on_prompt,
        drop_long=config.drop_long,
        skip_bad_rows=config.skip_bad_rows,
    )
    if config.data is None:
        rows = rows_from_dicts(builtin_rows(config.seed), SOURCE)
        data = tokenize_rows(rows, tokenizer, source=SOURCE, **options)
    else:
        data = load_sft(config.data, tokenizer, config.data_split, config.task, **options)
    held = None  # --eval-data's examples: read and tokenized as --data's
    if config.eval_data is not None:
        with eval_set.reading_eval_data():
            held = load_sft(config.eval_data, tokenizer, config.data_split, config.task, **options)
        train, val = data.examples, held.examples
    else:
        count = eval_set.heldout_count(config, len(data.examples), HELDOUT_MAX)
        train, val = split_heldout(data.examples, count, seed=config.seed, flag="--data")
    if config.save_best and not val:
        raise BadInput(
            "--save-best",
            None,
            f"needs an eval set: --data {config.data} holds a single example, none held "
            "out; give --eval-data",
        )
    info = DataInfo(
        source=data.source,
        vocab_size=tokenizer.vocab_size,
        entropy_floor=None,
        num_tokens=sum(e.length for e in train + val),
        train_tokens=sum(e.length for e in train),
        val_tokens=sum(e.length for e in val),
        eod_token=tokenizer.eos_id,
        fingerprint=fingerprint(train, val),
    )
    # answers a program can check: the built-in set, or --data of its tasks' rows
    builtin = held is None and (config.data is None or builtin_tasks(data.examples, tokenizer))
    return SFTParts(train, val, info, tokenizer, tokenizer_dir, data, builtin, held)


def builtin_tasks(examples: list[Example], tokenizer) -> bool:
    """Whether every example is a built-in task's prompt with its right answer (a subset of
    the built-in set written to a file): exact match can be measured on them too."""
    for e in examples:
        first = int(np.argmax(e.labels != IGNORE_INDEX))
        answer = [int(i) for i in e.input_ids[first:] if int(i) != tokenizer.eos_id]
        try:
            if solve(tokenizer.decode(e.input_ids[:first].tolist())) != tokenizer.decode(answer):
                return False
        except (ValueError, ZeroDivisionError):
            return False
    return bool(examples)


def fingerprint(train: list[Example], val: list[Example]) -> str:
    """A hash of every example's ids and labels, both splits in order: equal for the same
    examples however they were read."""
    digest = hashlib.sha256()
    for part in (train, val):
        digest.update(len(part).to_bytes(8, "little"))
        for e in part:
            digest.update(len(e.input_ids).to_bytes(8, "little"))
            digest.update(e.input_ids.tobytes())
            digest.update(e.labels.tobytes())
    return digest.hexdigest()


def builtin_gpt(config: TrainConfig) -> bool:
    """Whether the run trains the built-in GPT (a preset, or this project's checkpoint of one)."""
    if config.init_from is not None:
        return _model_type(config.init_from) == GPT_MODEL_TYPE
    return config.model_config is None


def hf_masks_packed(path: str) -> bool:
    """Whether the Hugging Face causal LM of `path` (a folder or its config.json) keeps the
    examples of a padding-free row apart: its attention mask comes from transformers' masking
    utilities, which read position ids restarting at 0 as packed sequences (sdpa, eager and
    flex; flash attention takes them as its varlen boundaries) when no attention mask is given."""
    try:
        from transformers import CONFIG_MAPPING, masking_utils
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError:
        return False
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return False  # older transformers: restarting position ids do not mask
    file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            model_type = json.load(f)["model_type"]
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # build_model says what is wrong with the folder
    module = sys.modules.get(cls.__module__)
    return getattr(module, "create_causal_mask", None) is masking_utils.create_causal_mask


def packing_of(config: TrainConfig) -> str:
    """--packing, or where not given: padding-free when the run's model keeps packed examples
    apart (the built-in GPT; a Hugging Face model, `hf_masks_packed`), else window."""
    if config.packing is not None:
        return config.packing
    if builtin_gpt(config) or hf_masks_packed(config.init_from or config.model_config):
        return "padding-free"
    return "window"


def check_packing(config: TrainConfig) -> str:
    """The run's packing (`packing_of`); BadInput for a budget it cannot take."""
    mode, budget = packing_of(config), config.micro_batch_tokens
    if mode == "padding-free" and budget is not None and budget < config.seq_len:
        given = "" if config.packing else " (the default for this model)"
        raise BadInput(
            "--micro-batch-tokens",
            budget,
            f"below --seq-len {config.seq_len}: a padding-free row{given} is --seq-len "
            f"positions, the longest example's; give at least {config.seq_len} or --packing "
            "window",
        )
    return mode


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


def plan_config(
    config: TrainConfig,
    examples: list[Example],
    world_size: int,
    micro_batch: int | str | None = None,
) -> TrainConfig:
    """The config `resolve_plan` plans an SFT run with, in sequences of --seq-len tokens (no
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
    return replace(
        config,
        examples_per_step=None,
        tokens_per_step=sequences * config.seq_len,
        micro_batch=micro,
        max_steps=total_steps(config, examples),
        max_tokens=None,
    )


def resume_plan_config(config: TrainConfig, ckpt, examples: list[Example], world_size: int):
    """`plan_config` of a resumed run: the micro-batch it trained with unless --micro-batch
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
    return plan_config(config, examples, world_size, micro)


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
