"""The run, its batch and its optimizer: settings components of `gradaccum train` (the batch
is `plan`'s, `verify`'s and `bench`'s too). No torch.

The defaults of the fields left None when not given are stated here once: None there means
"not given", which the other fields' rules need (--accum-steps with no --tokens-per-step sets
the batch; a resume keeps what was not given). The default run is sized so that `gradaccum
train` ends within 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.plan.batch_schedule import LR_RULES
from gradaccum.settings.field import setting
from gradaccum.train.schedule import SCHEDULES
from gradaccum.train.tasks.registry import BUILTIN, rules_of
from gradaccum.utils.choices import TASKS

DEFAULT_TOKENS_PER_STEP = 8192
"""Tokens per optimizer step when neither --tokens-per-step nor --accum-steps is given."""
DEFAULT_MAX_TOKENS = 1_572_864
"""Training tokens when neither --max-steps nor --max-tokens is given (192 steps of 8192)."""
DEFAULT_MAX_WARMUP_STEPS = 100
"""Without --warmup-steps: a tenth of the run, at most this many optimizer steps."""
DEFAULT_MIN_TOKENS_PER_STEP = 8192
"""--min-tokens-per-step of `--batch-schedule auto` when not given."""
DEFAULT_MAX_RATIO = 32
"""--max-tokens-per-step of `auto` when not given: this many times the minimum."""
DEFAULT_DOUBLE_EVERY = 50
"""--batch-double-every of `auto` when not given: optimizer steps between two growths."""
DEFAULT_EXAMPLES_PER_STEP = 32
"""--task sft: examples per optimizer step when neither --examples-per-step nor
--tokens-per-step is given."""

DEFAULT_SFT_EPOCHS = 3.0
"""--task sft on --data with no --epochs, --max-steps or --max-tokens: passes over the
training examples (TRL's num_train_epochs). The built-in set runs TASK_DEFAULTS' steps."""

TASK_DEFAULTS = {name: rules.defaults for name, (rules, _) in BUILTIN.items()}
"""`gradaccum train`'s defaults that depend on --task, for the fields left None when not
given. The SFT ones make the default `gradaccum train --task sft` (the built-in byte-level
tiny GPT on the built-in instruction set) learn the tasks in about 3 minutes on 2 CPU cores.
Their lr is for a model trained from scratch: a pretrained one takes PRETRAINED_LR."""

DEFAULT_WEIGHT_DECAY = 0.1
"""--weight-decay when not given, for a model trained from scratch (nanoGPT's, GPT-3's)."""
PRETRAINED_LR = {"full": 2e-5, "lora": 2e-4}
"""--lr when not given for a pretrained Hugging Face model (--init-from): TRL's for full
fine-tuning (SFTConfig's learning_rate) and with LoRA or QLoRA (its PEFT examples). The task
defaults (2e-3 and up) are for the tiny built-in GPT and would wreck a pretrained model."""
PRETRAINED_WEIGHT_DECAY = 0.0
"""--weight-decay when not given for a pretrained Hugging Face model: transformers'
TrainingArguments default (and so TRL's)."""


def optimizer_defaults(task: str, lora: bool, pretrained: bool) -> dict[str, float]:
    """--lr and --weight-decay when not given: for a pretrained Hugging Face model
    (`pretrained`, full or `lora` fine-tuning) or, otherwise, --task's (`TASK_DEFAULTS`)."""
    if pretrained:
        lr = PRETRAINED_LR["lora" if lora else "full"]
        return {"lr": lr, "weight_decay": PRETRAINED_WEIGHT_DECAY}
    return {"lr": rules_of(task).defaults["lr"], "weight_decay": DEFAULT_WEIGHT_DECAY}


@dataclass
class RunSettings:
    """run"""

    task: str = setting("pretrain", "str", metavar="{" + ",".join(TASKS) + "}|MODULE:CLASS")
    """pretrain: the next-token loss on every token of a stream of --seq-len chunks. sft:
    supervised fine-tuning on examples (prompt and completion, chat messages, Alpaca rows),
    the loss over the completion tokens only. grpo: RL fine-tuning on the examples' prompts,
    completions sampled and scored by --reward (docs/rl.md). MODULE:CLASS: a task of one's
    own (docs/tasks.md)."""
    max_steps: int | None = setting(None, least=1)
    """Optimizer steps to train for (or give --max-tokens)."""
    max_tokens: int | None = setting(None, least=1, default_text=f"{DEFAULT_MAX_TOKENS:,}")
    """Tokens to train on, e.g. 1.5M, rounded up to whole steps (or give --max-steps)."""
    epochs: float | None = setting(None, "float", above=True)
    """Passes over the training examples (SFT) or sequences (pretraining), each in a new
    order seeded by (--seed, epoch), e.g. 2 or 0.5. With --max-steps or --max-tokens too, the
    first reached ends the run; the plan says which. --task sft on --data with none of the
    three: 3 (the built-in set: 1,200 steps)."""
    seed: int = setting(0, most=2**63)
    """Seed of the model's initialisation, the built-in data and the data order."""
    out: str | None = setting(None, "path", metavar="DIR", default_text="runs/<date>-<time>")
    """Folder of the run's outputs."""
    json: bool = setting(False, "bool")
    """Print one JSON object on stdout (other text goes to stderr)."""


@dataclass
class BatchSettings:
    """batch"""

    tokens_per_step: int | None = setting(
        None, least=1, default_text=f"{DEFAULT_TOKENS_PER_STEP}, unless --accum-steps sets it"
    )
    """Tokens per optimizer step over all ranks, the recipe's batch: e.g. 262k, 4M. With
    --task sft, a budget of counted (target) tokens filled with whole examples."""
    examples_per_step: int | None = setting(None, least=1)
    """--task sft: examples per optimizer step over all ranks (per-device batch x
    accumulation x devices, as Hugging Face and TRL count it)."""
    seq_len: int = setting(128, least=1)
    """Tokens per sequence (the model reads seq_len, predicts seq_len)."""
    micro_batch: int | str | None = setting(None, "micro", least=1)
    """What one forward/backward holds on each rank: sequences of --seq-len. --task sft, by
    --packing: padding-free: rows of --seq-len positions, several examples a row (not one
    example, as TRL's per_device_train_batch_size); window: --micro-batch x --seq-len
    positions, as many examples as fit; none: examples, padded to their longest. --task grpo:
    completions. Or auto: the size that fits and trains fastest, measured (on CPU at most 2048
    tokens per micro-batch)."""
    accum_steps: int | None = setting(None, least=1, metavar="K",
                                      default_text="from --tokens-per-step")  # fmt: skip
    """Micro-batches per optimizer step, k."""
    micro_batch_tokens: int | None = setting(None, least=1,
                                             default_text="micro-batch x seq-len")  # fmt: skip
    """--task sft, --packing window or padding-free: positions per micro-batch and rank,
    padding included."""
    packing: str | None = setting(None, "str", metavar="MODE")
    """--task sft: how a window's examples become micro-batches: none (runs of --micro-batch
    padded to their longest), window (by --micro-batch-tokens, each padded to its longest) or
    padding-free (rows of --seq-len, attention within each example); the update is the same.
    train's default: padding-free, or window for a Hugging Face model without packed-position
    masks; bench takes a comma list of modes to run side by side."""
    batch_schedule: str | None = setting(None, "str", metavar="SCHEDULE")
    """Tokens per step by tokens seen instead of one --tokens-per-step: 0:32k,1B:256k,10B:4M
    (step-wise) or linear:0:32k,1B:4M (a ramp); k changes at window boundaries. auto
    (experimental, train) starts at --min-tokens-per-step and grows k toward the measured
    critical batch."""
    lr_rule: str | None = setting(None, "choice", choices=LR_RULES)
    """LR for a batch c times the base: none x 1, linear x c, sqrt x sqrt(c). train: with
    --batch-schedule, default none; plan: default sqrt for adamw, linear for sgd, none with
    --batch-schedule."""
    min_tokens_per_step: int | None = setting(None, least=1,
                                              default_text=f"{DEFAULT_MIN_TOKENS_PER_STEP}")  # fmt: skip
    """--batch-schedule auto: the tokens per step it starts at."""
    max_tokens_per_step: int | None = setting(
        None, least=1, default_text=f"{DEFAULT_MAX_RATIO} x the minimum"
    )
    """--batch-schedule auto: the largest tokens per step it grows to."""
    batch_double_every: int | None = setting(None, least=1,
                                             default_text=f"{DEFAULT_DOUBLE_EVERY}")  # fmt: skip
    """--batch-schedule auto: at most one doubling of k per this many optimizer steps."""


@dataclass
class OptimizerSettings:
    """optimizer and LR schedule (AdamW)"""

    lr: float | None = setting(None, "float", above=True)
    """Peak learning rate. Not given, for a Hugging Face model from --init-from: 2e-5, with
    --lora-rank 2e-4 (a pretrained model's, as TRL's; the task defaults are for training
    from scratch)."""
    warmup_steps: int | None = setting(None, default_text="a tenth of the run, at most 100")
    """Linear warmup, in optimizer steps."""
    schedule: str = setting("cosine", "choice", choices=SCHEDULES)
    """LR decay after warmup, counted in optimizer steps: cosine, linear or constant."""
    weight_decay: float | None = setting(None, "float",
                                         default_text=f"{DEFAULT_WEIGHT_DECAY}; 0.0 for a "
                                         "Hugging Face --init-from")  # fmt: skip
    """AdamW weight decay, on matrices and embeddings only (not on biases or norms)."""
    max_grad_norm: float = setting(1.0, "float")
    """Clip the window's gradient to this L2 norm; 0 turns clipping off."""
