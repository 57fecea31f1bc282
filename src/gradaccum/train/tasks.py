"""The tasks of `gradaccum train` (--task pretrain | sft | grpo): the settings only some of them
take (their defaults are `gradaccum.train.settings.TASK_DEFAULTS`). No torch, no file."""

from __future__ import annotations

from dataclasses import fields

from gradaccum.data.settings import DEFAULT_SPLIT
from gradaccum.grpo.settings import RLSettings
from gradaccum.utils.errors import BadInput, flag_name

GRPO_STEP = "a --task grpo step is --prompts-per-step prompts x --num-generations completions"
GRPO_REFUSES = {
    "examples_per_step": GRPO_STEP,
    "tokens_per_step": GRPO_STEP,
    "packing": "not with --task grpo yet: its micro-batches are --micro-batch completions, "
    "each padded to its longest",
    "micro_batch_tokens": "not with --task grpo yet; give --micro-batch",
    "epochs": "not with --task grpo yet; give --max-steps",
    "max_tokens": "not with --task grpo; give --max-steps",
    "train_on_prompt": "not with --task grpo (the loss is over the sampled completions)",
}
"""Settings --task grpo does not take (beyond those SFT refuses), and why."""


def check_task(config) -> None:
    """BadInput for a setting of `config` (a TrainConfig) that its task does not take."""
    _check_rl(config)
    if config.examples_per_step is not None and config.tokens_per_step is not None:
        raise BadInput(
            "--examples-per-step",
            config.examples_per_step,
            "give either --examples-per-step or --tokens-per-step "
            f"({config.tokens_per_step}), not both",
        )
    if config.task == "pretrain":
        sft_only = {
            "examples_per_step": None,
            "data_format": "auto",
            "skip_bad_rows": False,
            "drop_long": False,
            "train_on_prompt": False,
            "packing": None,
            "micro_batch_tokens": None,
        }
        for name, unset in sft_only.items():
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
        return
    if config.document_mask or config.eod_id is not None:
        name = "document_mask" if config.document_mask else "eod_id"
        raise BadInput(
            flag_name(name),
            config.eod_id if name == "eod_id" else None,
            "only with --task pretrain (--task sft keeps examples apart with --packing "
            "padding-free)",
        )
    why = {
        "accum_steps": "an SFT step is --examples-per-step examples (or --tokens-per-step "
        "counted tokens), k follows from --micro-batch",
        "batch_schedule": "not with --task sft; give --examples-per-step",
        "noise_scale": "not with --task sft yet",
    }
    if config.task == "grpo":
        why.update(GRPO_REFUSES)
    for name, text in why.items():
        if getattr(config, name) not in (None, False):
            raise BadInput(flag_name(name), getattr(config, name), text)
    if config.packing == "none" and config.micro_batch_tokens is not None:
        raise BadInput(
            "--micro-batch-tokens",
            config.micro_batch_tokens,
            "needs --packing window or padding-free (--packing none cuts runs of "
            "--micro-batch examples)",
        )


def _check_rl(config) -> None:
    """The RL settings only with --task grpo; --micro-batch a number with it."""
    if config.task != "grpo":
        for f in fields(RLSettings):
            if getattr(config, f.name) != f.default:
                raise BadInput(flag_name(f.name), getattr(config, f.name), "only with --task grpo")
        return
    if config.micro_batch == "auto":
        raise BadInput("--micro-batch", "auto", "not with --task grpo yet; give a number")
