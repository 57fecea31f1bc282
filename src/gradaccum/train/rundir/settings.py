"""What a run keeps in its folder and what it reports as it goes: settings components (no
torch)."""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.settings.field import setting
from gradaccum.utils.errors import BadInput

RESUME_AUTO = "auto"
"""--resume's value that continues only when --out holds a checkpoint."""


def read_resume(value, flag: str) -> bool | str:
    """--resume: True alone (or true, a config file's boolean), False, or `auto`."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == RESUME_AUTO:
        return RESUME_AUTO
    if text in ("true", "false"):
        return text == "true"
    raise BadInput(flag, value, "give --resume alone (continue) or --resume auto")


@dataclass
class CheckpointSettings:
    """checkpoints and resume"""

    SECTION = "checkpointing"

    save_every: int = setting(100)
    """Save a checkpoint every N optimizer steps; 0: only at the end and on a stop."""
    keep_checkpoints: int = setting(2, least=1)
    """Checkpoints kept in --out, newest first; an older one is what a resume falls back to
    when the newest is damaged. --save-best's checkpoint is kept in addition, so the folder
    holds at most N + 1 (Transformers' save_total_limit counts the best among its N)."""
    resume: bool | str = setting(False, parse=read_resume, metavar="auto", bare=True)
    """Continue the run in --out from its newest intact checkpoint, exactly. --resume auto:
    continue when --out holds a checkpoint, start anew when it holds none; the default in a
    group torchrun restarted (TORCHELASTIC_RESTART_COUNT above 0, docs/distributed.md)."""
    allow_data_change: bool = setting(False, "bool")
    """On --resume, continue on other data than the run was trained on (refused otherwise)."""
    save_best: bool = setting(False, "bool")
    """Keep the checkpoint with the lowest eval loss beside the newest ones (saved at the
    evaluation that finds it, a save step or not) and export it as --out/best/ in the form of
    the final export; the summary names its step. Needs an eval set (not --eval-fraction 0);
    with --eval-every 0 only the end is evaluated, so the best is the final model. Not
    counted in --keep-checkpoints."""


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
"""What --report-to takes, as Transformers' `report_to` names them; `none` turns them off."""


def read_report_to(value, flag: str) -> str:
    """--report-to as a comma list of TRACKERS, each once, in the order given; or `none`. A
    config file may give a list."""
    if value is None:
        return "none"
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    names = list(dict.fromkeys(str(p).strip().lower() for p in parts if str(p).strip()))
    shown = value if isinstance(value, str) else ",".join(map(str, value))
    choices = f"a comma list of {', '.join(TRACKERS)}, or none"
    for name in names:
        if name not in (*TRACKERS, "none"):
            raise BadInput(flag, shown, f"unknown tracker {name!r}: {choices}")
    if names == ["none"]:
        return "none"
    if not names or "none" in names:
        raise BadInput(flag, shown, choices)
    return ",".join(names)


@dataclass
class LoggingSettings:
    """evaluation, metrics and trackers"""

    eval_every: int | None = setting(None)
    """Held-out loss (with --task sft on the built-in set also exact match) every N optimizer
    steps; 0: only at the end."""
    eval_data: str | None = setting(None, "path", default_text="a split of --data")
    """The examples (SFT) or tokens (pretraining) to evaluate on, in any form --data takes
    for the task, read and tokenized as --data is; the run then trains on all of --data.
    Pretraining evaluates on the file's first tokens, as on a split's."""
    eval_fraction: float | None = setting(
        None, "float", default_text="0.05, for SFT at most 500 examples"
    )
    """Share of --data held out for evaluation when no --eval-data is given (SFT: examples
    chosen by --seed, at least one; pretraining: the stream's tail, at least one sequence);
    0: no evaluation."""
    noise_scale: bool = setting(False, "bool")
    """Estimate the gradient noise scale (the critical batch) from each window's micro-batch
    gradients as the run goes (needs k x world >= 2): metrics.jsonl, a plot panel, and the
    critical batch against the run's own at the end."""
    tensorboard: bool = setting(False, "bool")
    """Also write every metrics record as TensorBoard scalars under --out/tensorboard (pip
    install 'gradaccum[tensorboard]'); the same as tensorboard in --report-to."""
    report_to: str = setting("none", parse=read_report_to, metavar="LIST")
    """Also send every metrics record, the settings and the plots to these trackers: a comma
    list of tensorboard, wandb, mlflow, trackio, or none (pip install 'gradaccum[trackers]').
    Offline, under --out, unless their own variables say otherwise (WANDB_MODE,
    MLFLOW_TRACKING_URI, TRACKIO_DIR: docs/pretraining.md#trackers)."""

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers this run reports to: --report-to's, with tensorboard for
        --tensorboard."""
        names = [] if self.report_to == "none" else self.report_to.split(",")
        if self.tensorboard and "tensorboard" not in names:
            names.insert(0, "tensorboard")
        return tuple(names)


SETTINGS_FILE = "config.yaml"
"""The run's settings as chosen, by component, in --out: what `--config` takes back."""
LEGACY_SETTINGS_FILE = "train.toml"
"""Where runs of earlier versions kept their settings (flat TOML): still a run folder."""
