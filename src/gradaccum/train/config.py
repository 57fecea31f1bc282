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

from dataclasses import asdict, dataclass, fields

from ..plan.batch_schedule import LR_RULES, BatchSchedule, parse_batch_schedule
from ..utils.choices import BUILTIN_MODELS, DEFAULT_MODEL, MOE_BALANCES, PACKINGS, PRECISIONS, TASKS
from ..utils.errors import BadInput, flag_name
from .flag_values import EXCLUSIVE, Flag, merge_settings, read_value, to_toml
from .flag_values import flag_field as _flag
from .schedule import SCHEDULES
from .tasks import DATA_FORMATS, DEFAULT_EXAMPLES_PER_STEP, TASK_DEFAULTS, check_task

__all__ = [
    "EXCLUSIVE",
    "FLAGS",
    "Flag",
    "TrainConfig",
    "merge_settings",
    "read_schedule",
    "to_toml",
]

# The defaults of the fields left None when not given (None there means "not given", which
# the other fields' rules need: --accum-steps with no --tokens-per-step sets the batch, a
# resume keeps what was not given). Each is stated here once; the properties and methods of
# TrainConfig below turn a None into it.
# The default run: sized so that `gradaccum train` ends within 3 minutes on 2 CPU cores.
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
DEFAULT_PRESET = DEFAULT_MODEL
"""Model when none of --model, --model-config, --init-from is given (`utils.choices`)."""

AUTO = "auto"
"""--batch-schedule auto: k grown toward the measured critical batch."""


@dataclass
class TrainConfig:
    task: str = _flag(
        "pretrain",
        "pretrain (a token stream) or sft (prompt/completion examples) (default pretrain)",
        "choice",
        choices=TASKS,
    )
    """pretrain: next-token loss on every token of a stream of --seq-len chunks. sft:
    supervised fine-tuning on examples (prompt and completion, chat messages, Alpaca rows),
    the loss over the completion tokens only (`gradaccum.train.sft`)."""
    tokens_per_step: int | None = _flag(
        None,
        "tokens per optimizer step over all ranks, e.g. 8192, 262k, 4M "
        f"(default {DEFAULT_TOKENS_PER_STEP}); --task sft: counted target tokens, the step "
        "filled with whole examples up to it",
        least=1,
    )
    """Target tokens per optimizer step over all ranks (the recipe's batch size). None (not
    given): DEFAULT_TOKENS_PER_STEP, unless --accum-steps fixes the batch as micro-batch x k
    x world size (`target_tokens_per_step`); on --resume, the checkpoint's. With --task sft:
    a budget of counted (target) tokens, the window taking whole examples in data order while
    their targets stay within it (exclusive with --examples-per-step)."""
    examples_per_step: int | None = _flag(
        None,
        "--task sft: examples per optimizer step over all ranks "
        f"(default {DEFAULT_EXAMPLES_PER_STEP})",
        least=1,
    )
    """--task sft: the global batch in examples (per-device batch x accumulation x devices,
    as HF/TRL count it). None (not given): DEFAULT_EXAMPLES_PER_STEP, unless
    --tokens-per-step sets the step in counted tokens."""
    seq_len: int = _flag(128, "tokens per sequence (default 128)", least=1)
    """Tokens per training sequence (the model reads seq_len, predicts seq_len)."""
    micro_batch: int | str | None = _flag(
        None,
        "sequences per forward/backward per rank, or auto (default auto; --task sft 16)",
        "micro",
        least=1,
    )
    """Sequences (SFT: examples) per forward/backward on each rank, or "auto". None (not
    given): the task's default (TASK_DEFAULTS). "auto": measured (`gradaccum.fit`, a
    few seconds of probing; on CPU at most 2048 tokens per micro-batch), the size that fits and
    trains fastest with k from the tokens per step; with --accum-steps given, the largest
    power of two the memory estimate fits that gives the tokens per step."""
    accum_steps: int | None = _flag(
        None, "micro-batches per optimizer step (default: from --tokens-per-step)", least=1
    )
    """Micro-batches per optimizer step (k). None (not given): chosen from
    --tokens-per-step."""
    max_steps: int | None = _flag(None, "optimizer steps to train", least=1)
    """Optimizer steps to train for (exclusive with --max-tokens). None (not given): the
    run's length is in tokens (`total_tokens`)."""
    max_tokens: int | None = _flag(
        None, f"tokens to train on, e.g. 1.5M (default {DEFAULT_MAX_TOKENS:,})", least=1
    )
    """Tokens to train on, rounded up to whole steps. None (not given): DEFAULT_MAX_TOKENS,
    unless --max-steps is given (`total_tokens`)."""
    lr: float | None = _flag(
        None, "peak learning rate (default 3e-3; --task sft 2e-3)", "float", above=True
    )
    """Peak learning rate of AdamW. None (not given): the task's default (TASK_DEFAULTS)."""
    warmup_steps: int | None = _flag(
        None,
        "linear warmup, in optimizer steps "
        f"(default a tenth of the run, <= {DEFAULT_MAX_WARMUP_STEPS})",
    )
    """Optimizer steps of linear warmup. None (not given): a tenth of the run, at most
    DEFAULT_MAX_WARMUP_STEPS (`warmup`)."""
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
    """Folder of the run's outputs. None (not given): runs/<date>-<time> under the current
    folder, chosen when the run starts (`checks.default_out`: it reads the clock)."""
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
    eval_every: int | None = _flag(
        None,
        "held-out loss every N optimizer steps; 0: only at the end (default 50; --task sft 300)",
    )
    """Held-out loss (with --task sft on the built-in set also exact match) every this many
    optimizer steps; 0: only at the end. None (not given): the task's default
    (TASK_DEFAULTS)."""
    data: str | None = _flag(
        None, "PATH.txt, PATH.bin, PATH.npy or hf:NAME[:SPLIT] (default: built-in corpus)", "path"
    )
    """Training text or tokens: PATH.txt (bytes), PATH.bin or PATH.npy (token ids) or
    hf:NAME[:SPLIT]. None: the built-in Markov corpus, whose entropy is the loss floor.
    With --task sft: PATH.jsonl, PATH.json, PATH.parquet or hf:NAME[:SPLIT] rows; None: the
    built-in instruction set (`gradaccum.data.sft_tasks`)."""
    document_mask: bool = _flag(False, "pretrain: attention within each document", "bool")
    """Each --eod-id input opens a document (position 0); attention stays within documents."""
    eod_id: int | None = _flag(
        None, "--document-mask: the end-of-document id, e.g. 50256 for GPT-2 (default the data's)"
    )
    """None: the data's end-of-document id; .bin/.npy/.txt have none (`parts.document_eod`)."""
    data_format: str = _flag(
        "auto",
        "--task sft: auto, prompt-completion, messages or alpaca (default auto: from the fields)",
        "choice",
        choices=DATA_FORMATS,
    )
    """--task sft: the rows' format (`gradaccum.data.sft_rows`); auto detects it from the
    first row's fields."""
    skip_bad_rows: bool = _flag(
        False, "--task sft: skip and count bad rows instead of stopping at the first", "bool"
    )
    """--task sft: a bad row (malformed line, missing field, empty completion) is skipped and
    counted, not a one-line error."""
    drop_long: bool = _flag(
        False, "--task sft: drop examples longer than --seq-len (default: cut them)", "bool"
    )
    """--task sft: drop examples longer than --seq-len tokens instead of cutting the end of
    their completion."""
    train_on_prompt: bool = _flag(
        False, "--task sft: the loss over the prompt tokens too, not only the completion", "bool"
    )
    """--task sft: every token a target (the prompt too), not only the completion's."""
    packing: str | None = _flag(
        None,
        "--task sft: a window's examples as micro-batches: none (runs of --micro-batch), "
        "window (by --micro-batch-tokens, each padded to its longest) or padding-free (rows "
        "of --seq-len, attention within each example); the update is the same (default "
        "padding-free; window for a Hugging Face model without packed-position masks)",
        "choice",
        choices=PACKINGS,
    )
    """--task sft: how each rank's share of a window becomes micro-batches
    (`gradaccum.data.sft_packed`); the step's update does not change, only its cost. None
    (not given): padding-free where the model keeps packed examples apart (the built-in
    GPT, Hugging Face models whose attention honours packed position ids), else window
    (`sft.packing_of`)."""
    micro_batch_tokens: int | None = _flag(
        None,
        "--task sft, --packing window or padding-free: positions per micro-batch, padding "
        "included (default micro-batch x seq-len)",
        least=1,
    )
    """Tokens (positions, padding included) per micro-batch and rank of --packing window or
    padding-free (which takes rows of --seq-len: at least one row). None (not given):
    --micro-batch x --seq-len, the memory of --packing none's widest micro-batch."""
    model: str | None = _flag(
        None,
        f"preset: {', '.join(BUILTIN_MODELS)} (default {DEFAULT_MODEL})",
        "str",
        metavar="PRESET",
    )
    """A built-in model preset (`utils.choices.BUILTIN_MODELS`). None (not given):
    DEFAULT_MODEL, unless --model-config or --init-from is given (`preset`)."""
    model_config: str | None = _flag(
        None, "a Hugging Face config.json to build a causal LM from (random init)", "path"
    )
    """A Hugging Face config.json to build a causal LM from (random init, no download).
    None: not given."""
    init_from: str | None = _flag(
        None, "a checkpoint folder (config.json + model.pt) to start from", "path", metavar="DIR"
    )
    """A folder with config.json and model.pt (a checkpoint) to start from. None: not
    given."""
    moe_balance: str | None = _flag(
        None, "micro, global, global-previous (MoE; default global)", "choice", choices=MOE_BALANCES
    )
    """A mixture of experts' load-balancing loss per window (`utils.choices.MOE_BALANCES`,
    `train.moe`). None (not given): "global" for an MoE model, none for a dense one."""
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
    schedule then runs over tokens seen; the run's length is --max-tokens. None (not
    given): one batch throughout."""
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
        None,
        f"--batch-schedule auto: the batch it starts at (default {DEFAULT_MIN_TOKENS_PER_STEP})",
        least=1,
    )
    """`--batch-schedule auto`: tokens per step it starts at. None (not given, which only
    `auto` allows): DEFAULT_MIN_TOKENS_PER_STEP (`auto_batch`)."""
    max_tokens_per_step: int | None = _flag(
        None,
        "--batch-schedule auto: the largest batch it grows to "
        f"(default {DEFAULT_MAX_RATIO} x the minimum)",
        least=1,
    )
    """`--batch-schedule auto`: tokens per step it never grows past. None (not given):
    DEFAULT_MAX_RATIO x the minimum (`auto_batch`)."""
    batch_double_every: int | None = _flag(
        None,
        f"--batch-schedule auto: at most one doubling of k per N steps "
        f"(default {DEFAULT_DOUBLE_EVERY})",
        least=1,
    )
    """`--batch-schedule auto`: optimizer steps between two growths of k (each at most x2).
    None (not given): DEFAULT_DOUBLE_EVERY (`auto_batch`)."""
    dist_timeout: float = _flag(
        300.0,
        "seconds a rank waits for the others before failing, under torchrun (default 300)",
        "float",
        metavar="SECONDS",
        above=True,
    )
    """Seconds a collective may wait for the other ranks: a rank that died or hangs is
    reported within this time, not after torch's 10-minute default."""
    # LoRA (the `lora` extra, on peft): adapters on a frozen base, `gradaccum.train.adapters`.
    lora_rank: int | None = _flag(
        None,
        "train LoRA adapters of rank R on the frozen model (pip install 'gradaccum[lora]')",
        least=1,
        metavar="R",
    )
    """LoRA rank r: each adapted linear layer (out x in) gains r x (in + out) parameters, the
    only ones that train. None (not given): every parameter trains."""
    lora_alpha: float | None = _flag(
        None,
        "LoRA scale: the update is alpha / rank x B A (default 2 x rank)",
        "float",
        above=True,
        metavar="A",
    )
    """The adapters' update is scaled by alpha / rank. None (not given): 2 x rank, a scale of
    2 (`models.lora.LoraSpec`)."""
    lora_dropout: float | None = _flag(
        None, "dropout on the LoRA adapters' input, in [0, 1) (default 0)", "float", metavar="P"
    )
    """Dropout probability on the adapters' input. None (not given): 0, which keeps a run
    exact and bit-for-bit reproducible."""
    lora_targets: str | None = _flag(
        None,
        "modules to adapt, e.g. q_proj,v_proj (default: the attention and MLP projections)",
        "str",
        metavar="A,B",
    )
    """Comma-separated module names to adapt (a module matches when its name is the target
    or ends in "." + target). None (not given): every linear layer but the output head
    (`models.lora.default_targets`), printed at the start."""
    merge_lora: bool = _flag(
        False, "with --lora-rank: also write the merged model to --out/merged", "bool"
    )
    """With --lora-rank: besides the adapter folder, write the model with the adapters
    folded into its weights (--out/merged)."""

    def _check_lora(self) -> None:
        """The --lora-* flags need --lora-rank; --lora-dropout is a probability below 1."""
        if self.lora_rank is None:
            for name in ("lora_alpha", "lora_dropout", "lora_targets", "merge_lora"):
                value = getattr(self, name)
                if value not in (None, False):
                    shown = None if value is True else value  # a switch has no value to show
                    shown = f"{shown:g}" if isinstance(shown, float) else shown
                    raise BadInput(flag_name(name), shown, "needs --lora-rank")
        if self.lora_dropout is not None and not self.lora_dropout < 1:
            raise BadInput("--lora-dropout", f"{self.lora_dropout:g}", "must be in [0, 1)")

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, read_value(f, getattr(self, f.name)))
        check_task(self)
        for name, value in TASK_DEFAULTS[self.task].items():
            if getattr(self, name) is None and not (name == "max_steps" and self.max_tokens):
                setattr(self, name, value)
        if self.task == "sft" and self.examples_per_step is None and self.tokens_per_step is None:
            self.examples_per_step = DEFAULT_EXAMPLES_PER_STEP
        self._check_together()

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
        self._check_lora()
        given = [n for n in EXCLUSIVE[1] if getattr(self, n) is not None]
        if len(given) > 1:
            raise BadInput(
                flag_name(given[1]),
                getattr(self, given[1]),
                "give only one of --model, --model-config, --init-from "
                f"(also got {flag_name(given[0])})",
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
    def total_tokens(self) -> int | None:
        """Tokens the run trains on: --max-tokens, or DEFAULT_MAX_TOKENS; None when
        --max-steps sets the length instead."""
        if self.max_steps is not None:
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
        """The settings as chosen (not derived), for train.toml and `--config`: every field
        but the defaulted ones left None and those that only steer this one invocation."""
        skip = ("resume", "json", "allow_data_change", "out")
        return {k: v for k, v in asdict(self).items() if v is not None and k not in skip}


FLAGS = {f.name: f.metadata["flag"] for f in fields(TrainConfig)}
"""Field name -> its Flag, in the order of the fields."""


def read_schedule(text: str | None) -> BatchSchedule | str | None:
    """--batch-schedule as given: None, AUTO, or the parsed schedule (BadInput if malformed)."""
    if text is None:
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    return parse_batch_schedule(text)
