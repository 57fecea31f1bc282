"""What `gradaccum bench` times: settings component and its per-task defaults (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting

BENCH_DEFAULTS = {
    "pretrain": {"micro_batch": 4, "accum_steps": 8, "seq_len": 128, "rounds": 5, "windows": 3},
    "sft": {"micro_batch": 8, "accum_steps": 8, "seq_len": 512, "rounds": 5, "windows": 3},
    "grpo": {"micro_batch": 4, "accum_steps": 8, "rounds": 5, "windows": 3},
}
"""`gradaccum bench`'s sizes by --task, the defaults of BenchConfig, SFTBenchConfig and
GRPOBenchConfig. SFT's --seq-len is the longest example and the padding-free row; GRPO's
micro-batch counts completions (4 x k 8 = 32: 4 prompts x G 8) and it has no --seq-len (the
prompts and --max-completion-length set the rows)."""


@dataclass
class BenchSettings:
    """the measurement"""

    SECTION = "bench"

    rounds: int | None = setting(None, least=1)
    """Timing rounds, the contestants' order alternating from one round to the next."""
    windows: int | None = setting(None, least=1)
    """Optimizer steps timed per contestant and round, after one untimed."""
    peers: str | None = setting(None, "str", metavar="NAMES", default_text="all")
    """Comma list of accelerate, trainer, lightning (--task sft: trl, trl-padding-free,
    trainer), or none."""
