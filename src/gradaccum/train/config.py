"""What a `gradaccum train` run is asked to do: one field per command-line flag.

Each field is the one source of its flag: how its value is read (`Flag.kind`), its help line
and metavar sit in the field's metadata, its meaning and units in the docstring under it. The
command line, the --config TOML keys and the checks all come from these fields. Building a
TrainConfig reads and checks every value once (a string from the command line, a typed value
from TOML or Python) and touches nothing else: no file system, no clock, no device, no torch.
What needs those (the default --out, the paths, the device, the run folder's lock) is checked
by the run's build step, before anything is written. A bad value raises BadInput naming the
flag and the value, which the command prints as one line with exit code 2.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from ..plan.batch_schedule import LR_RULES
from ..plan.memory import PRECISIONS
from ..plan.sizes import parse_count
from ..utils.errors import BadInput, flag_name
from .schedule import SCHEDULES

# The default run: sized so that `gradaccum train` ends within 3 minutes on 2 CPU cores.
DEFAULT_TOKENS_PER_STEP = 8192
"""Tokens per optimizer step when neither --tokens-per-step nor --accum-steps is given."""
DEFAULT_MAX_TOKENS = 1_572_864
"""Training tokens when neither --max-steps nor --max-tokens is given (192 steps of 8192)."""
DEFAULT_PRESET = "tiny"
"""Model when none of --model, --model-config, --init-from is given."""

EXCLUSIVE = (("max_steps", "max_tokens"), ("model", "model_config", "init_from"))
"""Fields of which a run takes at most one: where settings are layered (a TOML file under
the command line, a checkpoint's settings under a resume's flags), the upper layer's choice
replaces the lower layer's whole group."""


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line and read."""

    help: str
    """The --help line."""
    kind: str = "str"
    """count (4M, 262k, 1e6), micro (a count or auto), float, choice, path, str or bool."""
    metavar: str = "N"
    least: float = 0
    """Smallest allowed value of a count or a number (a float must exceed it if `above`)."""
    above: bool = False
    most: int | None = None
    """Largest allowed count (exclusive)."""
    choices: tuple = ()


def _flag(default, help: str, kind: str = "count", **kw):
    metavar = kw.pop("metavar", None) or {
        "float": "X",
        "micro": "N|auto",
        "choice": "NAME",
        "path": "PATH",
        "str": "TEXT",
    }.get(kind, "N")
    return field(default=default, metadata={"flag": Flag(help, kind, metavar, **kw)})


@dataclass
class TrainConfig:
    tokens_per_step: int | None = _flag(
        None,
        "tokens per optimizer step over all ranks, e.g. 8192, 262k, 4M (default 8192)",
        least=1,
    )
    """Target tokens per optimizer step over all ranks (the recipe's batch size). None:
    8192, unless --accum-steps fixes the batch as micro-batch x k x world size."""
    seq_len: int = _flag(128, "tokens per sequence (default 128)", least=1)
    """Tokens per training sequence (the model reads seq_len, predicts seq_len)."""
    micro_batch: int | str = _flag(
        "auto", "sequences per forward/backward per rank, or auto (default auto)", "micro", least=1
    )
    """Sequences per forward/backward on each rank, or "auto": measured (`gradaccum.fit`, a
    few seconds of probing; on CPU at most 2048 tokens per micro-batch), the size that fits and
    trains fastest with k from the tokens per step; with --accum-steps given, the largest
    power of two the memory estimate fits that gives the tokens per step."""
    accum_steps: int | None = _flag(
        None, "micro-batches per optimizer step (default: from --tokens-per-step)", least=1
    )
    """Micro-batches per optimizer step (k). None: chosen from --tokens-per-step."""
    max_steps: int | None = _flag(None, "optimizer steps to train", least=1)
    """Optimizer steps to train for (exclusive with --max-tokens)."""
    max_tokens: int | None = _flag(
        None, "tokens to train on, e.g. 1.5M (default 1,572,864)", least=1
    )
    """Tokens to train on, rounded up to whole steps. With neither: 1,572,864 tokens."""
    lr: float = _flag(3e-3, "peak learning rate (default 3e-3)", "float", above=True)
    """Peak learning rate of AdamW."""
    warmup_steps: int | None = _flag(
        None, "linear warmup, in optimizer steps (default a tenth of the run, <= 100)"
    )
    """Optimizer steps of linear warmup. None: a tenth of the run, at most 100."""
    schedule: str = _flag(
        "cosine",
        "cosine, linear or constant, in optimizer steps (default cosine)",
        "choice",
        choices=SCHEDULES,
    )
    """LR decay after warmup, counted in optimizer steps: cosine, linear or constant."""
    weight_decay: float = _flag(0.1, "AdamW weight decay (default 0.1)", "float")
    """AdamW weight decay, on matrices and embeddings only (not on biases or norms)."""
    max_grad_norm: float = _flag(
        1.0, "clip the step's gradient norm; 0: off (default 1.0)", "float"
    )
    """Clip the window's gradient to this L2 norm; 0 turns clipping off."""
    precision: str = _flag(
        "fp32", "fp32, bf16 or fp16 (default fp32)", "choice", choices=PRECISIONS
    )
    """fp32, bf16 (autocast) or fp16 (autocast and loss scaling)."""
    activation_checkpointing: bool = _flag(
        False, "recompute activations in backward to save memory", "bool"
    )
    """Recompute activations in backward: less memory, about a third more compute."""
    compile: bool = _flag(False, "torch.compile the model", "bool")
    """torch.compile the model (needs a working compiler toolchain)."""
    seed: int = _flag(0, "seed of init, built-in corpus and data order (default 0)", most=2**63)
    """Seed of the model's initialisation, the built-in corpus and the data order."""
    out: str | None = _flag(
        None, "output folder (default runs/<date>-<time>)", "path", metavar="DIR"
    )
    """Folder of the run's outputs. None: runs/<date>-<time> under the current folder,
    chosen when the run starts."""
    save_every: int = _flag(
        100, "checkpoint every N optimizer steps; 0: only at the end (default 100)"
    )
    """Save a checkpoint every this many optimizer steps; 0: only at the end and on a stop."""
    keep_checkpoints: int = _flag(2, "checkpoints kept in --out, newest first (default 2)", least=1)
    """Checkpoints kept under --out/checkpoints; an older one is what a resume falls back to
    when the newest is damaged."""
    resume: bool = _flag(
        False, "continue the run in --out from its newest intact checkpoint", "bool"
    )
    """Continue the run in --out from its newest intact checkpoint, exactly."""
    allow_data_change: bool = _flag(
        False, "on --resume, accept data other than the checkpoint was trained on", "bool"
    )
    """On --resume, continue on other data than the run was trained on (refused otherwise)."""
    json: bool = _flag(False, "print the final summary as JSON on stdout", "bool")
    """Print the final summary as one JSON object on stdout (other text goes to stderr)."""
    eval_every: int = _flag(
        50, "held-out loss every N optimizer steps; 0: only at the end (default 50)"
    )
    """Held-out loss every this many optimizer steps; 0: only at the end."""
    data: str | None = _flag(
        None, "PATH.txt, PATH.bin, PATH.npy or hf:NAME[:SPLIT] (default: built-in corpus)", "path"
    )
    """Training text or tokens: PATH.txt (bytes), PATH.bin or PATH.npy (token ids) or
    hf:NAME[:SPLIT]. None: the built-in Markov corpus, whose entropy is the loss floor."""
    model: str | None = _flag(
        None, "preset: tiny, small, gpt2-124m (default tiny)", "str", metavar="PRESET"
    )
    """Model preset: tiny, small or gpt2-124m. None: tiny, unless --model-config or
    --init-from is given."""
    model_config: str | None = _flag(
        None, "a Hugging Face config.json to build a causal LM from (random init)", "path"
    )
    """A Hugging Face config.json to build a causal LM from (random init, no download)."""
    init_from: str | None = _flag(
        None, "a checkpoint folder (config.json + model.pt) to start from", "path", metavar="DIR"
    )
    """A folder with config.json and model.pt (a checkpoint) to start from."""
    device: str = _flag(
        "auto", "cpu, cuda, cuda:1, npu, mps, xpu or auto (default auto)", "str", metavar="DEVICE"
    )
    """cpu, cuda, cuda:1, npu, xpu, mps, or auto (the best one present)."""
    noise_scale: bool = _flag(
        False, "estimate the gradient noise scale (the critical batch) as the run goes", "bool"
    )
    """Estimate the gradient noise scale from each window's micro-batch gradients (needs
    k x world >= 2): metrics.jsonl gets noise_scale_tokens and noise_scale_sequences, the plot
    a second panel, and the run ends with the critical batch against its own."""
    tensorboard: bool = _flag(
        False, "also write the metrics for TensorBoard under --out/tensorboard", "bool"
    )
    """Write every metrics record as TensorBoard scalars under <out>/tensorboard/ (the
    `tensorboard` extra)."""
    batch_schedule: str | None = _flag(
        None,
        "tokens per step by tokens seen: 0:32k,1B:256k,10B:4M; linear:0:32k,1B:4M ramps; "
        "auto (experimental) grows toward the measured critical batch",
        "str",
        metavar="SCHEDULE",
    )
    """A batch-size schedule instead of one --tokens-per-step (`gradaccum.train.batching`):
    points TOKENS_SEEN:TOKENS_PER_STEP, step-wise, or a linear ramp with `linear:`; k
    changes at window boundaries, the micro-batch stays. `auto` (experimental) starts at
    --min-tokens-per-step and grows k toward the noise scale's critical batch, up to
    --max-tokens-per-step, at most doubling once per --batch-double-every steps. The LR
    schedule then runs over tokens seen; the run's length is --max-tokens."""
    lr_rule: str = _flag(
        "none",
        "with --batch-schedule, scale the LR with the batch: none, linear or sqrt (default none)",
        "choice",
        choices=LR_RULES,
    )
    """With --batch-schedule: the LR times (batch / reference batch) for `linear`, its square
    root for `sqrt`; --lr belongs to the reference batch: the schedule's last one (as `plan`
    counts it), auto's --max-tokens-per-step."""
    min_tokens_per_step: int | None = _flag(
        None, "--batch-schedule auto: the batch it starts at (default 8192)", least=1
    )
    """`--batch-schedule auto`: tokens per step it starts at (default 8192)."""
    max_tokens_per_step: int | None = _flag(
        None,
        "--batch-schedule auto: the largest batch it grows to (default 32 x the minimum)",
        least=1,
    )
    """`--batch-schedule auto`: tokens per step it never grows past (default 32 x minimum)."""
    batch_double_every: int | None = _flag(
        None, "--batch-schedule auto: at most one doubling of k per N steps (default 50)", least=1
    )
    """`--batch-schedule auto`: optimizer steps between two growths of k (each at most x2).
    None: 50."""
    dist_timeout: float = _flag(
        300.0,
        "seconds a rank waits for the others before failing, under torchrun (default 300)",
        "float",
        metavar="SECONDS",
        above=True,
    )
    """Seconds a collective may wait for the other ranks: a rank that died or hangs is
    reported within this time, not after torch's 10-minute default."""

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, _read(f, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        if self.max_steps is not None and self.max_tokens is not None:
            raise BadInput(
                "--max-tokens",
                self.max_tokens,
                f"give either --max-steps ({self.max_steps}) or --max-tokens, not both",
            )
        if (
            self.warmup_steps is not None
            and self.max_steps is not None
            and self.warmup_steps > self.max_steps
        ):
            raise BadInput(
                "--warmup-steps",
                self.warmup_steps,
                f"longer than the run (--max-steps {self.max_steps})",
            )
        self._check_batch_schedule()
        given = [n for n in EXCLUSIVE[1] if getattr(self, n) is not None]
        if len(given) > 1:
            raise BadInput(
                flag_name(given[1]),
                getattr(self, given[1]),
                "give only one of --model, --model-config, --init-from "
                f"(also got {flag_name(given[0])})",
            )

    def _check_batch_schedule(self) -> None:
        from .batching import AUTO, read_schedule

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
        """The preset to build: --model, or tiny when no other model source is given."""
        if self.model_config is None and self.init_from is None:
            return self.model or DEFAULT_PRESET
        return self.model

    def to_dict(self) -> dict:
        return asdict(self)

    def chosen(self) -> dict:
        """The settings as chosen (not derived), for train.toml and `--config`: every field
        but the defaulted ones left None and those that only steer this one invocation."""
        skip = ("resume", "json", "allow_data_change", "out")
        return {k: v for k, v in asdict(self).items() if v is not None and k not in skip}


FLAGS = {f.name: f.metadata["flag"] for f in fields(TrainConfig)}
"""Field name -> its Flag, in the order of the fields."""


def _read(f, value):
    """The typed value of field `f` (see Flag.kind), or BadInput naming its flag."""
    spec, flag = f.metadata["flag"], flag_name(f.name)
    if value is None and f.default is None:
        return None
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise BadInput(flag, value, "must be true or false")
        return value
    if spec.kind in ("str", "path", "choice"):
        if not isinstance(value, str) or not value.strip():
            raise BadInput(
                flag,
                repr(value),
                "expected a path" if spec.kind == "path" else "expected a non-empty string",
            )
        if spec.choices and value not in spec.choices:
            raise BadInput(flag, value, f"choose one of {', '.join(spec.choices)}")
        return value
    if spec.kind == "float":
        return _number(flag, value, spec)
    if spec.kind == "micro" and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    count = _whole(flag, value)
    if count < spec.least:
        more = " or auto" if spec.kind == "micro" else ""
        raise BadInput(flag, count, f"must be a whole number >= {spec.least}{more}")
    if spec.most is not None and count >= spec.most:
        raise BadInput(
            flag,
            count,
            "must be below 2**63" if spec.most == 2**63 else f"must be below {spec.most}",
        )
    return count


def _whole(flag: str, value) -> int:
    if isinstance(value, bool) or value is None:
        raise BadInput(flag, value, "expected a whole number")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    return parse_count(str(value), flag, allow_zero=True)


def _number(flag: str, value, spec: Flag) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise BadInput(flag, value, "not a number") from None
    if not math.isfinite(number) or number < spec.least or (spec.above and number == spec.least):
        why = "must be a positive number" if spec.above else f"must be a number >= {spec.least:g}"
        raise BadInput(flag, f"{number:g}" if math.isfinite(number) else number, why)
    return number


def merge_settings(lower: dict, upper: dict) -> dict:
    """`upper` over `lower`, where a field `upper` gives also replaces the fields it excludes
    (EXCLUSIVE): `--max-tokens` on the command line overrides `max_steps` in a TOML file."""
    lower = dict(lower)
    for group in EXCLUSIVE:
        if any(upper.get(name) is not None for name in group):
            for name in group:
                lower.pop(name, None)
    return {**lower, **upper}


def to_toml(values: dict) -> str:
    """Flat key = value TOML of the given fields (None values are left out)."""
    lines = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
