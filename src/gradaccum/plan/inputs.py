"""What the user asked of a plan, checked: one BadInput naming the flag and value if not.

Field names are the flag names (micro_batch is --micro-batch), so messages name the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradaccum.plan.batch_schedule import LR_RULES, BatchSchedule, parse_batch_schedule
from gradaccum.plan.memory import CHECKPOINTING, OPTIMIZERS
from gradaccum.plan.presets import BUILTIN_ONLY, preset
from gradaccum.plan.quantized import BASE_BITS
from gradaccum.plan.settings import (
    PlanLRSettings,
    PlanMemorySettings,
    PlanModelSettings,
    PlanTargetSettings,
    PlanTimeSettings,
)
from gradaccum.plan.sync import default_gpus_per_node
from gradaccum.utils.choices import PRECISIONS, SYNC_CHOICES
from gradaccum.utils.errors import BadInput, flag_name
from gradaccum.utils.sizes import fmt_count_exact

_COUNTS = (
    "target_tokens target_sequences accum_steps seq_len micro_batch micro_tokens gpus steps "
    "total_tokens params layers hidden heads vocab device_memory base_batch_tokens "
    "trainable_params lora_rank active_params gpus_per_node"
).split()


MAX_GPUS = 1_000_000
"""The most --gpus a plan takes: the largest training runs so far use about 100,000 devices;
a number far past that is a typo (a size suffix on the wrong flag), not a plan."""


def show_value(value) -> str:
    """A value as a message shows it: 4000000 -> '4M', 0.25 -> '0.25', 262144 -> '262144'."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        short = fmt_count_exact(value)
        return short if short[-1] in "kMBT" else str(value)
    return str(value)


@dataclass
class PlanInputs(
    PlanLRSettings, PlanMemorySettings, PlanModelSettings, PlanTimeSettings, PlanTargetSettings
):
    """What the user asked of a plan; None where a flag was not given. Counts are whole
    numbers. The plan's own settings are its components' (`gradaccum.plan.settings`); these
    are the batch, model, precision and LoRA rank every command takes
    (`gradaccum.train.settings.BatchSettings` and the others), None when not given."""

    accum_steps: int | None = None
    batch_schedule: BatchSchedule | None = None  # a string is parsed: `0:32k,1B:256k`
    sync: str | None = None  # window when not given (`ParallelSettings.sync`)
    seq_len: int | None = None
    micro_batch: int | None = None
    model: str | None = None  # a model shape by name (gradaccum.plan.presets.MODEL_SHAPES)
    precision: str | None = None  # bf16 (memory.DEFAULT_PRECISION) when not given
    lora_rank: int | None = None  # the adapters, counted from the model's shape, train
    base_bits: int | None = None  # the frozen base in 4, 8 or 16 bits (LoraSettings)
    lr_rule: str | None = None  # none with a batch schedule, else sqrt (adamw), linear (sgd)
    base_linear_weights: tuple[int, int] | None = None
    """(weights, output rows) of the linear layers a 4- or 8-bit base stores in fewer bits,
    counted on the model itself (`gradaccum train`: a gated MLP, grouped key/value heads,
    experts, which the shape from --layers ... does not describe); its base is wholly frozen,
    what trains comes on top. No flag: None counts them from the shape
    (`quantized.linear_weights`)."""

    def __post_init__(self):
        if isinstance(self.batch_schedule, str):
            self.batch_schedule = parse_batch_schedule(self.batch_schedule)
        for name in _COUNTS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BadInput(f"{flag_name(name)} {value}: must be a whole number, at least 1")
        if self.gpus is not None and self.gpus > MAX_GPUS:
            raise BadInput(
                f"--gpus {show_value(self.gpus)}: at most {MAX_GPUS:,} devices (the largest "
                "training runs so far use about 100,000)"
            )
        for name in ("micro_step_time", "peak_tflops", "mfu", "base_lr"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise BadInput(f"{flag_name(name)} {value}: must be greater than zero")
        if self.mfu is not None and self.mfu > 1:
            raise BadInput(f"--mfu {self.mfu}: must be a fraction in (0, 1], e.g. 0.4 or 40%")
        for name, choices in (
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("checkpointing", CHECKPOINTING),
            ("lr_rule", LR_RULES),
            ("zero", (0, 1, 2, 3)),
            ("sync", SYNC_CHOICES),
        ):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise BadInput(f"{flag_name(name)} {value}: expected one of {choices}")
        self._check_base_bits()
        self._check_conflicts()
        self._check_sync()
        if self.batch_schedule is not None:
            self._check_schedule()
        self._check_companions()

    def _check_base_bits(self) -> None:
        """--base-bits: one of BASE_BITS, for a frozen base only; 4 and 8 quantise the blocks'
        linear layers, which the model's shape gives (or the model, `base_linear_weights`)."""
        bits = self.base_bits
        counted = self.base_linear_weights
        if counted is not None and not (len(counted) == 2 and 1 <= counted[1] <= counted[0]):
            raise ValueError(f"base_linear_weights {counted}: expected 1 <= rows <= weights")
        if bits is None:
            return
        if isinstance(bits, bool) or bits not in BASE_BITS:
            shown = ", ".join(map(str, BASE_BITS))
            raise BadInput("--base-bits", show_value(bits), f"expected one of {shown}")
        if self.lora_rank is None and self.trainable_params is None:
            raise BadInput(
                "--base-bits",
                bits,
                "only a frozen base is stored in fewer bits; give --lora-rank or "
                "--trainable-params (the part that trains keeps --precision)",
            )
        if bits < 16 and self.model is None and self.layers is None and counted is None:
            raise BadInput(
                "--base-bits",
                bits,
                "needs the model's shape (--model, or --layers ...): only the blocks' linear "
                "layers are quantised",
            )

    def nodes_and_gpus_per_node(self) -> tuple[int, int]:
        """(nodes, devices per node): --gpus over --gpus-per-node, or its default."""
        world = self.gpus or 1
        per_node = self.gpus_per_node or default_gpus_per_node(world)
        return world // per_node, per_node

    def _check_sync(self) -> None:
        """--gpus-per-node divides --gpus; hsdp needs two nodes or more; micro and hsdp shard
        the gradient (not --zero 0 or 1); auto needs the memory it chooses by."""
        world, sync = self.gpus or 1, self.sync
        per_node = self.gpus_per_node
        if per_node is not None and world % per_node:
            raise BadInput("--gpus-per-node", per_node, f"does not divide --gpus {world}")
        if self.sync_every_micro_batch and sync in ("window", "auto"):
            raise BadInput(f"--sync-every-micro-batch conflicts with --sync {sync}: give one")
        if sync is None or sync == "window":
            return
        if world == 1:
            raise BadInput("--sync", sync, "needs --gpus 2 or more: one device syncs nothing")
        nodes, per_node = self.nodes_and_gpus_per_node()
        if sync == "hsdp" and nodes < 2:
            raise BadInput(
                "--sync",
                sync,
                f"needs 2 nodes or more (replicas x shards, a shard group per node): --gpus "
                f"{world} is {nodes} node of --gpus-per-node {per_node}; give --gpus "
                f"{2 * per_node} or more, or a smaller --gpus-per-node",
            )
        if sync in ("micro", "hsdp") and self.zero is not None and self.zero < 2:
            raise BadInput(
                "--sync",
                sync,
                f"shards the gradient (FSDP2, --zero 2 or 3); conflicts with --zero {self.zero}",
            )
        if sync == "auto":
            needs = {
                "device_memory": "--device-memory",
                "micro_batch": "--micro-batch",
                "seq_len": "--seq-len",
            }
            missing = [flag for name, flag in needs.items() if getattr(self, name) is None]
            batch = ("target_tokens", "target_sequences", "accum_steps", "batch_schedule")
            if not self._given(*batch):
                missing.append("a global batch (--target-tokens or --accum-steps)")
            if self.model is None and self.layers is None:
                missing.append("a model shape (--model, or --layers ...)")
            if missing:
                raise BadInput(
                    "--sync",
                    sync,
                    f"needs {', '.join(missing)}: it picks the fastest policy whose memory fits",
                )

    @property
    def _builtin_model(self) -> bool:
        """--model names a preset of the built-in GPT (not a published model's shape)."""
        return self.model is not None and self.model.strip().lower() in BUILTIN_ONLY

    def _given(self, *names: str) -> list[str]:
        return [n for n in names if getattr(self, n) is not None]

    def _check_conflicts(self) -> None:
        shape = ("layers", "hidden", "heads", "vocab")
        pairs = [
            ("target_tokens", "target_sequences"),
            ("micro_batch", "micro_tokens"),
            ("accum_steps", "target_tokens"),
            ("accum_steps", "target_sequences"),
            ("steps", "total_tokens"),
            ("params", "model"),
            ("trainable_params", "lora_rank"),
        ]
        # --params with a shape is allowed: the shape sizes activations, --params counts
        # what the shape formula leaves out (biases, learned positions, untied heads).
        # The built-in GPT takes its vocabulary from the data: --vocab may give it.
        pairs += [("model", b) for b in shape if not (self._builtin_model and b == "vocab")]
        for a, b in pairs:
            if getattr(self, a) is not None and getattr(self, b) is not None:
                raise BadInput(
                    f"{flag_name(a)} {show_value(getattr(self, a))} conflicts with "
                    f"{flag_name(b)} {show_value(getattr(self, b))}: give one of them"
                )

    def _check_schedule(self) -> None:
        """A schedule sets the batch (no target or k beside it), its LR belongs to its last
        batch (no --base-batch-tokens), and its phases are counted in tokens seen."""
        why = {
            "target_tokens": "the schedule sets the batch; give one of them",
            "target_sequences": "the schedule sets the batch; give one of them",
            "accum_steps": "the schedule sets k phase by phase; give one of them",
            "steps": "a scheduled run's length is --total-tokens",
            "base_batch_tokens": "--base-lr belongs to the schedule's last batch",
        }
        given = self._given(*why)
        if given:
            name = given[0]
            raise BadInput(
                f"{flag_name(name)} {show_value(getattr(self, name))} conflicts with "
                f"--batch-schedule {self.batch_schedule}: {why[name]}"
            )
        if self.total_tokens is None:
            raise BadInput(
                "--batch-schedule", self.batch_schedule, "needs --total-tokens (the run's length)"
            )

    def _check_companions(self) -> None:
        shape = ("layers", "hidden", "heads", "vocab")
        given = self._given(*shape)
        if self._builtin_model and given == ["vocab"]:  # the data's vocabulary, not a shape
            given = []
        if given and len(given) < len(shape):
            missing = ", ".join(flag_name(n) for n in shape if n not in given)
            first = given[0]
            raise BadInput(
                f"{flag_name(first)} {getattr(self, first)}: a model shape also needs {missing}"
            )
        if given and self.hidden % self.heads:
            raise BadInput(f"--hidden {self.hidden}: not divisible by --heads {self.heads}")
        if self.lora_rank is not None and self.model is None and not given:
            raise BadInput(
                "--lora-rank", self.lora_rank, "needs the model's shape (--model, or --layers ...)"
            )
        needs = [("mfu", "peak_tflops"), ("base_batch_tokens", "base_lr")]
        if self.batch_schedule is None:  # with one, the LR factor is shown without an LR
            needs += [("base_lr", "base_batch_tokens"), ("lr_rule", "base_lr")]
        if self.peak_tflops is not None and self.mfu is None and self.micro_step_time is None:
            raise BadInput(
                f"--peak-tflops {self.peak_tflops:g}: needs --mfu (or --micro-step-time, "
                "to measure the MFU)"
            )
        for name, other in needs:
            if getattr(self, name) is not None and getattr(self, other) is None:
                raise BadInput(
                    f"{flag_name(name)} {show_value(getattr(self, name))}: needs {flag_name(other)}"
                )
        if self.model is not None:
            try:
                preset(self.model)
            except KeyError as err:
                raise BadInput(f"--model {self.model}: {err.args[0]}") from None
