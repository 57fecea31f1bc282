"""What one `gradaccum bench --task grpo` run measures, checked before anything is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gradaccum.bench.pretrain.config import check_int
from gradaccum.bench.settings import BENCH_DEFAULTS
from gradaccum.grpo.settings import RLSettings
from gradaccum.utils.choices import LOSS_TYPES
from gradaccum.utils.errors import BadInput

_RL = RLSettings()
"""RL fine-tuning's own defaults (G, completion length, temperature), the bench's too."""


@dataclass
class GRPOBenchConfig:
    """One Hugging Face causal LM, P prompts x G completions per optimizer step, cut into
    k micro-batches of `micro_batch` completions (TRL's per_device_train_batch_size and
    gradient_accumulation_steps): P x G = micro_batch x k."""

    model_config: str | None = None
    """A Hugging Face causal-LM config.json (or its folder), random init; None: the tiny
    Llama of `bench --task sft`."""
    micro_batch: int = BENCH_DEFAULTS["grpo"]["micro_batch"]
    """Completions per micro-batch."""
    accum_steps: int = BENCH_DEFAULTS["grpo"]["accum_steps"]
    """Micro-batches per optimizer step (k)."""
    num_generations: int = _RL.num_generations
    """Completions sampled per prompt (G, the group of the advantages)."""
    prompts_per_step: int | None = None
    """Prompts per optimizer step (P); None: micro_batch x k / G."""
    max_completion_length: int = _RL.max_completion_length
    """Most tokens per completion; dr_grpo divides by it."""
    temperature: float = _RL.temperature
    """Sampling temperature, and the one the loss's log-probs are taken at."""
    loss_types: tuple[str, ...] = field(default=LOSS_TYPES)
    rounds: int = BENCH_DEFAULTS["grpo"]["rounds"]
    """Timing rounds; ours and TRL's order alternates from one round to the next."""
    windows: int = BENCH_DEFAULTS["grpo"]["windows"]
    """Optimizer steps timed per contestant, loss type and round (after one untimed)."""
    device: str = "auto"
    seed: int = 0
    """Seed of the initial weights, the prompts, the sampling, the lengths and the rewards."""

    def __post_init__(self):
        for name, least in (("micro_batch", 1), ("accum_steps", 1), ("num_generations", 2),
                            ("max_completion_length", 4), ("rounds", 1), ("windows", 1),
                            ("seed", 0)):  # fmt: skip
            check_int(name, getattr(self, name), least)
        completions = self.micro_batch * self.accum_steps
        if self.prompts_per_step is None:
            if completions % self.num_generations:
                raise BadInput(
                    "--num-generations",
                    self.num_generations,
                    f"does not divide micro-batch x k = {self.micro_batch} x "
                    f"{self.accum_steps} = {completions} completions per step",
                )
            self.prompts_per_step = completions // self.num_generations
        check_int("prompts_per_step", self.prompts_per_step, 1)
        if self.prompts_per_step * self.num_generations != completions:
            raise BadInput(
                "--prompts-per-step",
                self.prompts_per_step,
                f"x G {self.num_generations} is not micro-batch x k = {completions} completions",
            )
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise BadInput("--temperature", self.temperature, "must be above 0")
        unknown = [t for t in self.loss_types if t not in LOSS_TYPES]
        if unknown or not self.loss_types:
            raise BadInput("--loss-type", ",".join(self.loss_types),
                           f"choose from {', '.join(LOSS_TYPES)}")  # fmt: skip
        if self.model_config is not None:
            path = self.model_config
            target = os.path.join(path, "config.json") if os.path.isdir(path) else path
            if not os.path.isfile(target):
                raise BadInput("--model-config", path, "no such file")
        if not isinstance(self.device, str) or not self.device.strip():
            raise BadInput("--device", repr(self.device), "expected a device name")

    @property
    def completions_per_step(self) -> int:
        return self.micro_batch * self.accum_steps

    @property
    def model_name(self) -> str:
        return "tiny Llama" if self.model_config is None else f"hf:{self.model_config}"
