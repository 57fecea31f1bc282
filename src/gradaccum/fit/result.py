"""What `gradaccum fit` found: each size tried (`Candidate`), the choice with its k
(`FitResult`, the `--json` object), and `NothingFits` when not even one sequence does."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gradaccum.fit.memory import MemoryUse
from gradaccum.fit.target import BATCH_TOLERANCE, NOISE_FLOOR, Target
from gradaccum.utils.errors import BadInput


@dataclass
class Candidate:
    """One micro-batch size tried, with activation checkpointing off or on."""

    micro_batch: int
    """Sequences per micro-step on each rank."""
    checkpointing: bool
    """Activation checkpointing on."""
    fits: bool
    """Ran without running out of memory and within the budget, on every rank."""
    why: str = ""
    """Why it does not fit: 'out of memory' or 'over budget'; '' when it fits."""
    memory: MemoryUse | None = None
    """Measured memory; None after an out-of-memory error."""
    tokens_per_s: float | None = None
    """Training tokens per second on this rank (forward, backward, optimizer step) of the
    fastest timed step; None when not timed (the smaller sizes bisection tried)."""
    noise: float = NOISE_FLOOR
    """Relative spread of the timed steps, (median - fastest) / median, at least NOISE_FLOOR."""

    @property
    def peak_memory_bytes(self) -> int | None:
        return None if self.memory is None else self.memory.peak

    def to_dict(self) -> dict:
        return {**_measured(self), "fits": self.fits}


def _measured(x: Candidate | FitResult) -> dict:
    """The JSON fields a candidate and the chosen size share."""
    peak = x.peak_memory_bytes
    return {
        "micro_batch": x.micro_batch,
        "checkpointing": x.checkpointing,
        "tokens_per_s": x.tokens_per_s,
        "peak_memory_gb": None if peak is None else peak / 1e9,
    }


@dataclass
class FitResult:
    """The micro-batch chosen, the k that keeps the target, and every candidate tried."""

    micro_batch: int
    """Sequences per micro-step on each rank (the same on every rank)."""
    accum_steps: int
    """k = round(target / (micro_batch x seq_len x world)), at least 1."""
    checkpointing: bool
    """Train with activation checkpointing on."""
    tokens_per_s: float | None
    """Measured training tokens per second of the chosen candidate, on this rank."""
    memory: MemoryUse | None
    """Measured memory of the chosen candidate."""
    seq_len: int
    """Tokens per sequence."""
    world_size: int
    """Ranks."""
    target_tokens: int
    """Tokens per optimizer step asked for (all ranks together)."""
    budget_bytes: int | None
    """The memory bound of the search, when there was one."""
    candidates: list[Candidate] = field(default_factory=list)
    """Every size probed, in the order probed."""
    batch_tolerance: float = BATCH_TOLERANCE
    """How far from the target (a fraction) the global batch was allowed to land for speed."""
    lora: dict | None = None
    """With --lora-rank: what the probe's model trains (`models.lora.LoraInfo.to_dict`: rank,
    targets, trainable and total parameters); its base is frozen, so the gradients and the
    optimizer state measured are the adapters'."""
    base_quant: dict | None = None
    """With --base-bits: the quantised base probed (`QuantSpec.record`: bits, data type,
    compute dtype), the linear layers it stores in fewer bits (`layers`) and the bytes the
    probed model holds, constants and adapters included (`stored_bytes`)."""

    @property
    def target(self) -> Target:
        return Target(self.target_tokens, self.seq_len * self.world_size)

    @property
    def global_batch_tokens(self) -> int:
        """micro_batch x seq_len x k x world: the tokens per step the run really takes."""
        return self.micro_batch * self.seq_len * self.accum_steps * self.world_size

    @property
    def target_deviation(self) -> float:
        """(global - target) / target, a signed fraction."""
        return (self.global_batch_tokens - self.target_tokens) / self.target_tokens

    @property
    def peak_memory_bytes(self) -> int | None:
        return None if self.memory is None else self.memory.peak

    def to_dict(self) -> dict:
        """The `gradaccum fit --json` object."""
        return {
            **_measured(self),
            "accum_steps": self.accum_steps,
            "global_batch_tokens": self.global_batch_tokens,
            "target_deviation": self.target_deviation,
            "batch_tolerance": self.batch_tolerance,
            "memory": None if self.memory is None else asdict(self.memory),
            "lora": self.lora,
            "base_quant": self.base_quant,
            "candidates": [c.to_dict() for c in self.candidates],
        }


class NothingFits(BadInput):
    """Not even one sequence per micro-batch fits; `needs` is what micro-batch 1 measured
    (bytes), None when the device ran out of memory before it could be measured."""

    def __init__(self, flag: str, value, why: str, needs: int | None):
        super().__init__(flag, value, why)
        self.needs = needs
