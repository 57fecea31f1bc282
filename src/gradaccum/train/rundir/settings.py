"""What a run keeps in its folder and what it reports as it goes: settings components (no
torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting


@dataclass
class CheckpointSettings:
    """checkpoints and resume"""

    SECTION = "checkpointing"

    save_every: int = setting(100)
    """Save a checkpoint every N optimizer steps; 0: only at the end and on a stop."""
    keep_checkpoints: int = setting(2, least=1)
    """Checkpoints kept in --out, newest first; an older one is what a resume falls back to
    when the newest is damaged."""
    resume: bool = setting(False, "bool")
    """Continue the run in --out from its newest intact checkpoint, exactly."""
    allow_data_change: bool = setting(False, "bool")
    """On --resume, continue on other data than the run was trained on (refused otherwise)."""


@dataclass
class LoggingSettings:
    """evaluation, metrics and trackers"""

    eval_every: int | None = setting(None)
    """Held-out loss (with --task sft on the built-in set also exact match) every N optimizer
    steps; 0: only at the end."""
    noise_scale: bool = setting(False, "bool")
    """Estimate the gradient noise scale (the critical batch) from each window's micro-batch
    gradients as the run goes (needs k x world >= 2): metrics.jsonl, a plot panel, and the
    critical batch against the run's own at the end."""
    tensorboard: bool = setting(False, "bool")
    """Also write every metrics record as TensorBoard scalars under --out/tensorboard (pip
    install 'gradaccum[tensorboard]')."""


SETTINGS_FILE = "config.yaml"
"""The run's settings as chosen, by component, in --out: what `--config` takes back."""
LEGACY_SETTINGS_FILE = "train.toml"
"""Where runs of earlier versions kept their settings (flat TOML): still a run folder."""
