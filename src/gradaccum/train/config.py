"""What a `gradaccum train` run is asked to do: its settings components, assembled.

TrainConfig is the components `gradaccum train` takes (`COMPONENTS`: run, model, data, batch,
optimizer, precision, LoRA, MoE, device, checkpoints, logging), each owned by the package that
uses it and each field the one source of its flag (`gradaccum.settings`). Building a
TrainConfig reads and checks every value once (a string from the command line, a typed value
from a config file or Python), fills the per-task defaults (`TASK_DEFAULTS`) and checks the
rules that join fields of several components; it touches nothing else: no file system, no
clock, no device, no torch. What needs those (the default --out, the paths, the device, the
run folder's lock) is checked by the run's build step, before anything is written. A bad value
raises BadInput naming the flag and the value, which the command prints as one line with exit
code 2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from gradaccum.data.settings import DataSettings
from gradaccum.engine.settings import PrecisionSettings
from gradaccum.grpo.settings import RLSettings
from gradaccum.models.quantized_spec import check_base_flags
from gradaccum.models.settings import LoraSettings, ModelSettings
from gradaccum.moe.settings import MoESettings
from gradaccum.parallel.settings import ParallelSettings
from gradaccum.plan.batch_schedule import BatchSchedule, parse_batch_schedule
from gradaccum.settings.command import merge, section_name
from gradaccum.settings.field import flag_of, read_value
from gradaccum.train.rundir.settings import CheckpointSettings, LoggingSettings
from gradaccum.train.settings import (
    DEFAULT_DOUBLE_EVERY,
    DEFAULT_EXAMPLES_PER_STEP,
    DEFAULT_MAX_RATIO,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_WARMUP_STEPS,
    DEFAULT_MIN_TOKENS_PER_STEP,
    DEFAULT_SFT_EPOCHS,
    DEFAULT_TOKENS_PER_STEP,
    DEFAULT_WEIGHT_DECAY,
    BatchSettings,
    OptimizerSettings,
    RunSettings,
    optimizer_defaults,
)
from gradaccum.train.tasks import check_task, rules_of
from gradaccum.utils.choices import DEFAULT_MODEL, PACKINGS
from gradaccum.utils.errors import BadInput, flag_name

__all__ = [
    "COMPONENTS",
    "DEFAULT_TOKENS_PER_STEP",
    "EXCLUSIVE",
    "FLAGS",
    "TrainConfig",
    "merge_settings",
    "read_schedule",
]

COMPONENTS = (
    RunSettings,
    ModelSettings,
    DataSettings,
    BatchSettings,
    OptimizerSettings,
    PrecisionSettings,
    LoraSettings,
    RLSettings,
    MoESettings,
    ParallelSettings,
    CheckpointSettings,
    LoggingSettings,
)
"""`gradaccum train`'s settings, in the order --help and config.yaml show them."""

EXCLUSIVE = (
    ("max_steps", "max_tokens"),
    ("model", "model_config", "init_from"),
    ("examples_per_step", "tokens_per_step"),
    ("eval_data", "eval_fraction"),
)
"""Fields of which a run takes at most one: where settings are layered (a config file under
the command line, a checkpoint's settings under a resume's flags), the upper layer's choice
replaces the lower layer's whole group."""

AUTO = "auto"
"""--batch-schedule auto: k grown toward the measured critical batch."""


@dataclass
class TrainConfig(*reversed(COMPONENTS)):
    """Every setting of one `gradaccum train` run (the fields are the components')."""

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, read_value(f.name, flag_of(f), getattr(self, f.name), f.default))
        if self.packing is not None and self.packing not in PACKINGS:
            raise BadInput("--packing", self.packing, f"choose one of {', '.join(PACKINGS)}")
        check_task(self)
        given_length = self.max_tokens or self.run_epochs  # a length of its own: no step default
        later = {"max_steps"} if given_length else set()
        if self.init_from is not None:  # a pretrained model's or not: `with_model_defaults`
            later.add("lr")
        else:
            self.weight_decay = _default(self.weight_decay, DEFAULT_WEIGHT_DECAY)
        for name, value in rules_of(self.task).defaults.items():
            if getattr(self, name) is None and name not in later:
                setattr(self, name, value)
        self.lr_rule = self.lr_rule or "none"
        self._check_together()

    def with_model_defaults(self, pretrained: bool) -> TrainConfig:
        """The config with --lr and --weight-decay filled where not given, once --init-from's
        folder is known to hold a `pretrained` Hugging Face model or this project's checkpoint
        (`optimizer_defaults`): the build step reads the folder, this class reads no file."""
        defaults = optimizer_defaults(self.task, self.lora_rank is not None, pretrained)
        filled = {k: _default(getattr(self, k), v) for k, v in defaults.items()}
        return replace(self, **filled)

    @property
    def epochs_defaulted(self) -> bool:
        """--task sft on --data with no --epochs, --max-steps or --max-tokens: the run is
        DEFAULT_SFT_EPOCHS passes over the data (one's own data, counted as TRL counts it)."""
        given = (self.max_steps, self.max_tokens, self.epochs)
        counts = rules_of(self.task).counts_examples
        return counts and self.data is not None and all(x is None for x in given)

    @property
    def run_epochs(self) -> float | None:
        """The run's length in epochs: --epochs, or its default (`epochs_defaulted`)."""
        return DEFAULT_SFT_EPOCHS if self.epochs_defaulted else self.epochs

    def _check_lora(self) -> None:
        """The --lora-* flags and --base-bits need --lora-rank; --base-bits is 4 or 8,
        --base-quant is for 4."""
        check_base_flags(self.base_bits, self.base_quant, self.lora_rank)
        if self.lora_rank is None:
            for name in ("lora_alpha", "lora_dropout", "lora_targets", "merge_lora"):
                value = getattr(self, name)
                if value not in (None, False):
                    shown = None if value is True else value  # a switch has no value to show
                    shown = f"{shown:g}" if isinstance(shown, float) else shown
                    raise BadInput(flag_name(name), shown, "needs --lora-rank")

    def _check_together(self) -> None:
        if self.max_steps is not None and self.max_tokens is not None:
            raise BadInput(
                "--max-tokens",
                self.max_tokens,
                f"give either --max-steps ({self.max_steps}) or --max-tokens, not both",
            )
        if self.max_steps is not None and (self.warmup_steps or 0) > self.max_steps:
            raise BadInput(
                "--warmup-steps",
                self.warmup_steps,
                f"longer than the run (--max-steps {self.max_steps})",
            )
        self._check_batch_schedule()
        self._check_epochs()
        self._check_eval()
        self._check_lora()
        self._check_sync()
        given = [n for n in EXCLUSIVE[1] if getattr(self, n) is not None]
        if len(given) > 1:
            raise BadInput(
                flag_name(given[1]),
                getattr(self, given[1]),
                "give only one of --model, --model-config, --init-from "
                f"(also got {flag_name(given[0])})",
            )

    def _check_sync(self) -> None:
        """--sync: window, micro, hsdp or auto (chosen once the run is planned,
        `resolve.auto_sync`); micro and hsdp shard the model with FSDP2, which --task grpo
        (generation differs by rank), --base-bits (the quantised weights are not sharded) and
        --compile are not run with (auto then chooses window)."""
        if self.sync not in ("micro", "hsdp"):
            return
        for name, value, why in (
            ("task", self.task if rules_of(self.task).not_sharded else None,
             rules_of(self.task).not_sharded),
            ("base_bits", self.base_bits, "a base in 4 or 8 bits is not sharded; use --sync "
             "window"),
            ("compile", self.compile or None, "not with a model sharded by FSDP2; use --sync "
             "window to compile"),
        ):  # fmt: skip
            if value is not None:
                shown = None if value is True else value
                raise BadInput(flag_name(name), shown, f"with --sync {self.sync}: {why}")

    def _check_epochs(self) -> None:
        """--epochs: a length in passes over the data, with or without --max-steps or
        --max-tokens (the first reached ends the run); not with --batch-schedule, whose
        length is in tokens."""
        if self.epochs is not None and self.batch_schedule is not None:
            raise BadInput(
                "--epochs",
                f"{self.epochs:g}",
                "a --batch-schedule run's length is in tokens: give --max-tokens",
            )

    def _check_eval(self) -> None:
        """One eval set: --eval-data or --eval-fraction in [0, 1); --save-best needs one."""
        fraction = self.eval_fraction
        if fraction is not None and fraction >= 1:
            raise BadInput("--eval-fraction", f"{fraction:g}", "must be below 1")
        if fraction is not None and self.eval_data is not None:
            raise BadInput(
                "--eval-fraction",
                f"{fraction:g}",
                f"give either --eval-data ({self.eval_data}) or --eval-fraction, not both",
            )
        if self.save_best and fraction == 0:
            raise BadInput(
                "--save-best",
                None,
                "needs an eval set: --eval-fraction 0 holds none out; give a fraction above 0 "
                "or --eval-data",
            )

    def _check_batch_schedule(self) -> None:
        schedule = read_schedule(self.batch_schedule)  # BadInput if malformed
        for name in ("tokens_per_step", "accum_steps", "max_steps"):
            if schedule is not None and getattr(self, name) is not None:
                why = (
                    "a --batch-schedule run's length is in tokens: give --max-tokens"
                    if name == "max_steps"
                    else "the batch comes from --batch-schedule; give one or the other"
                )
                raise BadInput(flag_name(name), getattr(self, name), why)
        for name in ("min_tokens_per_step", "max_tokens_per_step", "batch_double_every"):
            if getattr(self, name) is not None and schedule != AUTO:
                raise BadInput(flag_name(name), getattr(self, name), "needs --batch-schedule auto")
        if self.lr_rule != "none" and schedule is None:
            raise BadInput("--lr-rule", self.lr_rule, "needs --batch-schedule")
        low, high = self.min_tokens_per_step, self.max_tokens_per_step
        if low is not None and high is not None and high < low:
            raise BadInput("--max-tokens-per-step", high, f"below --min-tokens-per-step {low}")
        if schedule == AUTO:
            self.batch_schedule, self.noise_scale = AUTO, True  # auto follows the noise scale

    @property
    def preset(self) -> str | None:
        """The preset to build: --model, or DEFAULT_MODEL when no other model source is
        given."""
        if self.model_config is None and self.init_from is None:
            return self.model or DEFAULT_MODEL
        return self.model

    @property
    def target_tokens_per_step(self) -> int | None:
        """Tokens per optimizer step of a run without --batch-schedule: --tokens-per-step,
        or DEFAULT_TOKENS_PER_STEP; None when --accum-steps alone sets the batch."""
        if self.tokens_per_step is None and self.accum_steps is None:
            return DEFAULT_TOKENS_PER_STEP
        return self.tokens_per_step

    @property
    def examples_defaulted(self) -> bool:
        """--task sft with neither --examples-per-step nor --tokens-per-step: a step is
        DEFAULT_EXAMPLES_PER_STEP examples (--examples-per-step is left None, so that a value
        the user gives, the default's included, is told from it)."""
        given = (self.examples_per_step, self.tokens_per_step)
        return rules_of(self.task).counts_examples and all(x is None for x in given)

    @property
    def target_examples_per_step(self) -> int | None:
        """--task sft: examples per optimizer step, --examples-per-step or its default
        (`examples_defaulted`); None when --tokens-per-step counts the step instead."""
        return DEFAULT_EXAMPLES_PER_STEP if self.examples_defaulted else self.examples_per_step

    @property
    def total_tokens(self) -> int | None:
        """Tokens the run trains on: --max-tokens, or DEFAULT_MAX_TOKENS; None when
        --max-steps or --epochs (without --max-tokens) sets the length instead."""
        if self.max_steps is not None or (self.run_epochs is not None and self.max_tokens is None):
            return None
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def warmup(self, run_length: int, step_size: int = 1) -> int:
        """Warmup in the units `run_length` counts (steps, or tokens with `step_size` tokens
        per first-phase step): --warmup-steps x step_size, or a tenth of the run, at most
        DEFAULT_MAX_WARMUP_STEPS steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps * step_size
        return min(DEFAULT_MAX_WARMUP_STEPS * step_size, run_length // 10)

    @property
    def auto_batch(self) -> tuple[int, int, int]:
        """`--batch-schedule auto`'s (tokens per step it starts at, tokens per step it grows
        to at most, optimizer steps between two growths), the defaults filled in."""
        low = self.min_tokens_per_step or DEFAULT_MIN_TOKENS_PER_STEP
        high = self.max_tokens_per_step or DEFAULT_MAX_RATIO * low
        return low, high, self.batch_double_every or DEFAULT_DOUBLE_EVERY

    def to_dict(self) -> dict:
        return asdict(self)

    def chosen(self) -> dict:
        """The settings as chosen (not derived), for config.yaml and `--config`: every field
        but the defaulted ones left None and those that only steer this one invocation."""
        skip = ("resume", "json", "allow_data_change", "out")
        return {k: v for k, v in asdict(self).items() if v is not None and k not in skip}

    def sections(self) -> dict[str, dict]:
        """`chosen` by component, as config.yaml holds it."""
        chosen = self.chosen()
        return {
            section_name(c): {n: chosen[n] for n in c.__annotations__ if n in chosen}
            for c in COMPONENTS
        }


FLAGS = {f.name: flag_of(f) for f in fields(TrainConfig)}
"""Field name -> its Flag, in the order of the fields."""


def _default(value, default):
    return default if value is None else value


def merge_settings(lower: dict, upper: dict) -> dict:
    """`upper` over `lower`, a field `upper` gives replacing its EXCLUSIVE group in `lower`."""
    return merge(lower, upper, EXCLUSIVE)


def read_schedule(text: str | None) -> BatchSchedule | str | None:
    """--batch-schedule as given: None, AUTO, or the parsed schedule (BadInput if malformed)."""
    if text is None:
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    return parse_batch_schedule(text)
