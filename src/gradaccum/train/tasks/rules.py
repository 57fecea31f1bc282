"""What each --task takes before anything is built: its per-task defaults, the settings it
refuses and why, and the few facts the settings' own checks ask of it. No torch, no file: a
config is checked from these alone (`TrainConfig.__post_init__`).

A task's rules are a class (`TaskRules` and its subclasses), the `rules` of its `Task`
(`gradaccum.train.tasks.protocol`); a task defined outside the package inherits `TaskRules`
or gives its own."""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

from gradaccum.data.settings import DEFAULT_SPLIT
from gradaccum.grpo.settings import RLSettings
from gradaccum.utils.errors import BadInput, flag_name

ROW_FLAGS = {
    "examples_per_step": None,
    "data_format": "auto",
    "skip_bad_rows": False,
    "drop_long": False,
    "train_on_prompt": False,
    "packing": None,
    "micro_batch_tokens": None,
}
"""The settings of a task that reads rows of examples (SFT's), at their unset values."""


class TaskRules:
    """The rules of a task that reads its own data: the defaults below, the RL settings
    refused, nothing else."""

    defaults: ClassVar[dict] = {"micro_batch": 8, "lr": 1e-3, "eval_every": 50, "max_steps": 100}
    """`gradaccum train`'s defaults for the fields left None when not given."""
    reads_rows: ClassVar[bool] = False
    """Whether --data is rows of examples (.jsonl, a save_to_disk folder) rather than text
    or tokens."""
    counts_examples: ClassVar[bool] = False
    """Whether a step is counted in examples (--examples-per-step and its default) and
    --data's length in epochs by default (TRL's num_train_epochs)."""
    takes_rl: ClassVar[bool] = False
    """Whether the RL settings (`RLSettings`: --num-generations, --reward, ...) apply."""
    not_sharded: ClassVar[str | None] = None
    """Why the task's model cannot be sharded by FSDP2 (--sync micro, hsdp); None: it can."""

    @classmethod
    def check(cls, config) -> None:
        """BadInput for a setting of `config` (a TrainConfig) that the task does not take."""
        if not cls.takes_rl:
            for f in fields(RLSettings):
                if getattr(config, f.name) != f.default:
                    raise BadInput(
                        flag_name(f.name), getattr(config, f.name), "only with --task grpo"
                    )
        if config.examples_per_step is not None and config.tokens_per_step is not None:
            raise BadInput(
                "--examples-per-step",
                config.examples_per_step,
                "give either --examples-per-step or --tokens-per-step "
                f"({config.tokens_per_step}), not both",
            )


class PretrainRules(TaskRules):
    """--task pretrain: --tokens-per-step of a token stream."""

    defaults = {"micro_batch": "auto", "lr": 3e-3, "eval_every": 50}

    @classmethod
    def check(cls, config) -> None:
        super().check(config)
        for name, unset in ROW_FLAGS.items():
            if getattr(config, name) != unset:
                raise BadInput(
                    flag_name(name),
                    getattr(config, name),
                    "only with --task sft (pretraining batches --tokens-per-step of a "
                    "token stream)",
                )
        if config.data_split != DEFAULT_SPLIT:
            raise BadInput(
                "--data-split",
                config.data_split,
                "only with --task sft (pretraining names its split as hf:NAME:SPLIT)",
            )
        if config.eod_id is not None and not config.document_mask:
            raise BadInput("--eod-id", config.eod_id, "needs --document-mask")


class SFTRules(TaskRules):
    """--task sft: --examples-per-step examples (or --tokens-per-step counted tokens)."""

    defaults = {"micro_batch": 16, "lr": 2e-3, "eval_every": 300, "max_steps": 1200}
    reads_rows = True
    counts_examples = True
    refuses: ClassVar[dict] = {
        "accum_steps": "an SFT step is --examples-per-step examples (or --tokens-per-step "
        "counted tokens), k follows from --micro-batch",
        "batch_schedule": "not with --task sft; give --examples-per-step",
        "noise_scale": "not with --task sft yet",
    }
    """Settings the task does not take, and why."""

    @classmethod
    def check(cls, config) -> None:
        super().check(config)
        if config.document_mask or config.eod_id is not None:
            name = "document_mask" if config.document_mask else "eod_id"
            raise BadInput(
                flag_name(name),
                config.eod_id if name == "eod_id" else None,
                "only with --task pretrain (--task sft keeps examples apart with --packing "
                "padding-free)",
            )
        for name, text in cls.refuses.items():
            if getattr(config, name) not in (None, False):
                raise BadInput(flag_name(name), getattr(config, name), text)
        if config.packing == "none" and config.micro_batch_tokens is not None:
            raise BadInput(
                "--micro-batch-tokens",
                config.micro_batch_tokens,
                "needs --packing window or padding-free (--packing none cuts runs of "
                "--micro-batch examples)",
            )


GRPO_STEP = "a --task grpo step is --prompts-per-step prompts x --num-generations completions"


class GRPORules(SFTRules):
    """--task grpo: --prompts-per-step prompts x --num-generations sampled completions."""

    defaults = {"micro_batch": 16, "lr": 2e-4, "eval_every": 20, "max_steps": 100}
    counts_examples = False
    takes_rl = True
    not_sharded = (
        "each rank generates its own completions, which a sharded model cannot; use --sync window"
    )
    refuses = {
        **SFTRules.refuses,
        "examples_per_step": GRPO_STEP,
        "tokens_per_step": GRPO_STEP,
        "packing": "not with --task grpo yet: its micro-batches are --micro-batch completions, "
        "each padded to its longest",
        "micro_batch_tokens": "not with --task grpo yet; give --micro-batch",
        "max_tokens": "not with --task grpo; give --max-steps",
        "train_on_prompt": "not with --task grpo (the loss is over the sampled completions)",
    }

    @classmethod
    def check(cls, config) -> None:
        if config.micro_batch == "auto":
            raise BadInput("--micro-batch", "auto", "not with --task grpo yet; give a number")
        super().check(config)
