"""What a --task grpo run plans and says before it starts: the config its batch is planned
with (`batch_request`), the lines that say what a step holds and how the loss divides
(`plan_lines`), and its length (`length_line`)."""

from __future__ import annotations

import math

from gradaccum.grpo.rewards import RewardFn
from gradaccum.grpo.settings import DEFAULT_PROMPTS_PER_STEP
from gradaccum.train import epochs
from gradaccum.train.batch_request import BatchRequest
from gradaccum.train.config import TrainConfig
from gradaccum.train.epochs import epoch_stop


def prompts_per_step(config: TrainConfig) -> int:
    """--prompts-per-step, or its default."""
    return config.prompts_per_step or DEFAULT_PROMPTS_PER_STEP


def batch_request(config: TrainConfig, world_size: int, prompts: int) -> BatchRequest:
    """The batch `resolve_plan` plans a GRPO run over `prompts` training prompts with: each
    step's prompts x completions as sequences of --seq-len (no row is wider), k =
    ceil(completions per rank / micro-batch); with --epochs, the steps that many passes over
    the prompts take (`epoch_steps`), or --max-steps where it ends first."""
    micro = config.micro_batch
    rows = prompts_per_step(config) * config.num_generations
    k = max(1, math.ceil(rows / (micro * world_size)))
    planned = BatchRequest.of(config).but(tokens_per_step=k * micro * world_size * config.seq_len)
    if config.epochs is not None:
        steps = epoch_steps(config, prompts)
        planned = planned.but(max_steps=min(steps, config.max_steps or steps))
    return planned


def epoch_steps(config: TrainConfig, prompts: int) -> int:
    """Steps of --epochs passes over `prompts` prompts, --prompts-per-step a step: the steps
    that reach round(epochs x prompts) prompts of the stream (each pass a new order)."""
    return -(-epoch_stop(config.epochs, prompts) // prompts_per_step(config))


def plan_lines(config: TrainConfig, rewards: list[RewardFn], world_size: int) -> list[str]:
    """The start-of-run lines of a GRPO run: what a step holds, how the loss divides, the
    rewards, the sampling."""
    p, g = prompts_per_step(config), config.num_generations
    per_rank = math.ceil(p / world_size) * g
    k = math.ceil(per_rank / config.micro_batch)
    count = {
        "grpo": "the window's completions (each completion's token mean, averaged)",
        "bnpo": "the window's completion tokens",
        "dapo": "the window's completion tokens",
        "dr_grpo": f"completions x --max-completion-length {config.max_completion_length}",
    }[config.loss_type]
    clip = f"[{1 - config.epsilon:g}, {1 + (config.epsilon_high or config.epsilon):g}]"
    policy = ("on-policy (the ratio is 1; the clip never acts)" if config.steps_per_generation == 1
              else f"{config.steps_per_generation} steps per generation, sampling log-probs kept, "
              f"ratio clipped to {clip}")  # fmt: skip
    reward = " + ".join(f"{r.weight:g} x {r.name}" for r in rewards)
    lines = [
        f"grpo   {p} prompts x {g} completions = {p * g} completions per step over "
        f"{world_size} rank(s): up to {per_rank} per rank in {k} micro-batch(es) of "
        f"{config.micro_batch}, longest first, each padded to its longest",
        f"grpo   --loss-type {config.loss_type}: summed over completion tokens, divided once "
        f"by {count} over every micro-batch and rank",
        f"grpo   reward {reward}; advantages per group "
        + ("over the group's std" if config.scale_rewards == "group" else "centred only"),
        f"grpo   sampling at temperature {config.temperature:g}, at most "
        f"{config.max_completion_length} tokens per completion, {policy}"
        + (f"; KL to the starting model x {config.beta:g}" if config.beta else ""),
    ]
    return lines


def length_line(config: TrainConfig, prompts: int, steps: int) -> str:
    """The run's length: its steps, and the passes over the prompts they make."""
    taken = steps * prompts_per_step(config)
    if config.epochs is not None:
        found = {"--epochs": epoch_steps(config, prompts)}
        given = {"--epochs": f"{config.epochs:g}"}
        if config.max_steps is not None:
            found["--max-steps"], given["--max-steps"] = config.max_steps, str(config.max_steps)
        if min(found.values()) != steps:  # a resume's length as planned from its checkpoint
            found, given = {"the plan": steps}, {"the plan": f"({steps} steps)"}
        return epochs.length_line(found, given, prompts, "prompts", taken)
    return (f"length {steps:,} steps (--max-steps), {taken:,} prompts: {taken / prompts:.2f} "
            f"passes over the {prompts:,} prompts, each in a new order")  # fmt: skip
