"""The settings of RL fine-tuning (`--task grpo`), a component of train, verify and bench.
No torch."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting
from gradaccum.utils.choices import LOSS_TYPES, SCALE_REWARDS

DEFAULT_PROMPTS_PER_STEP = 32
"""--prompts-per-step when not given."""


@dataclass
class RLSettings:
    """RL fine-tuning (--task grpo)"""

    SECTION = "rl"

    prompts_per_step: int | None = setting(None, least=1,
                                           default_text=f"{DEFAULT_PROMPTS_PER_STEP}")  # fmt: skip
    """Prompts per optimizer step over all ranks; the window holds prompts x
    --num-generations completions, each prompt's group on one rank."""
    num_generations: int = setting(8, least=2, metavar="G")
    """Completions sampled per prompt (the group its advantages are taken in)."""
    max_completion_length: int = setting(32, least=1)
    """Most tokens sampled per completion (dr_grpo divides by it)."""
    temperature: float = setting(1.0, "float", above=True)
    """Sampling temperature; the log-probs of the loss are taken at the same temperature."""
    loss_type: str = setting("dapo", "choice", choices=LOSS_TYPES)
    """The loss's normalisation, over the whole window on every rank: grpo (each completion's
    token mean, averaged over completions), bnpo and dapo (summed over completion tokens,
    over their count), dr_grpo (summed, over completions x --max-completion-length)."""
    epsilon: float = setting(0.2, "float", above=True)
    """Clip range of the ratio to the sampling policy: [1 - epsilon, 1 + epsilon]."""
    epsilon_high: float | None = setting(None, "float", above=True, default_text="--epsilon")
    """Upper clip range (DAPO's clip-higher): [1 - epsilon, 1 + epsilon_high]."""
    beta: float = setting(0.0, "float")
    """Weight of the KL term to the frozen starting model (k3 estimator); 0: no reference
    model is kept."""
    scale_rewards: str = setting("group", "choice", choices=SCALE_REWARDS)
    """Advantages: reward minus the group's mean, over the group's std (group) or not
    (none, Dr. GRPO)."""
    steps_per_generation: int = setting(1, least=1)
    """Optimizer steps per generated batch: the prompts x completions sampled once are cut into
    this many windows, the sampling log-probs kept (the clip matters only above 1)."""
    reward: str | None = setting(None, "str", metavar="MODULE:FUNCTION[,...]",
                                 default_text="the built-in tasks' exact match, partial match "
                                              "and format")  # fmt: skip
    """Reward functions, comma-separated: each f(prompts, completions, **columns) -> one float
    per completion (prompts and completions as text, without the end of text; the columns
    completion, each example's reference answer, and stopped, whether the completion ended
    with the end of text), imported from the working directory or the Python path (or
    path/to/file.py:function); their weighted sum is the reward. The run's config.yaml
    records a module of the working directory by its file's absolute path, found from
    anywhere."""
    reward_weights: str | None = setting(None, "str", metavar="W,...", default_text="1 each")
    """Weights of the --reward functions, one per function."""
    eval_prompts: int | None = setting(None, least=0, metavar="N",
                                       default_text="all for a run as long as the default, "
                                                    "else the run's share")  # fmt: skip
    """Held-out prompts each evaluation answers greedily (exact match; the built-in set holds
    500) and samples --num-generations completions from (at most 256). Not given: all of them
    for a run of the default run's 100 steps or more, a shorter run its share of them (at least
    1), so that a short run's evaluation is short; 0: the held-out loss only."""
