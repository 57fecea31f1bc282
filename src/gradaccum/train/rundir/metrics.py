"""What a run writes as it goes: metrics.jsonl (a line per window) and loss.png.

Each line is flushed as written, so `tail -f metrics.jsonl` follows a run and a killed run
keeps every line it finished. On resume the file is cut back to the lines the checkpoint had
seen, so it ends up equal to the uninterrupted run's file, timing fields aside.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import textwrap

from gradaccum.utils.atomic import append_whole, write_atomic, write_text_atomic, writing

TITLE_WIDTH = 80
"""Characters per line of loss.png's title (a longer one wraps, as the figure is 7 in wide)."""


def _clean(value):
    # JSON has no NaN or inf: a skipped window's grad_norm is written as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per line to `path`, each line written whole or not at all and
    visible at once (unbuffered).

    keep_lines: on resume, how many lines of an existing file to keep (the rest came after the
    checkpoint and will be written again); None starts a new file. No room on the disk raises
    DiskFull naming the file, which then ends with its last whole line.
    """

    def __init__(self, path: str, keep_lines: int | None = None):
        self.path = path
        self.lines = 0
        if keep_lines is None:
            with writing(path):
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
            return
        kept = read_metrics_text(path)[:keep_lines] if os.path.exists(path) else []
        if len(kept) < keep_lines:
            raise ValueError(
                f"{path} holds {len(kept)} lines but the checkpoint saw {keep_lines}; "
                "it was changed after the checkpoint"
            )
        write_text_atomic(path, "".join(line + "\n" for line in kept))
        self.lines = len(kept)
        with writing(path):
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def write(self, record: dict) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        append_whole(self._fd, line.encode("utf-8"), self.path)
        self.lines += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def window_record(result, seconds: float, batch, elapsed_s: float) -> dict:
    """A window's metrics.jsonl line: `result` (the engine's StepResult) of a window that
    took `seconds`, with the batch it trained at (a BatchState: k and micro-batch, tokens seen
    after it) and the run's `elapsed_s`."""
    return {
        "step": result.step,
        "loss": result.loss,
        "tokens": batch.tokens,
        "tokens_per_s": result.tokens / seconds,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "accum_steps": batch.k,
        "micro_batch": batch.micro_batch,
        "tokens_per_step": result.tokens,
        "skipped": result.skipped,
        "elapsed_s": elapsed_s,
        **noise_fields(result),
        **traffic_fields(result),
    }


def traffic_fields(result) -> dict:
    """The gradient collectives and bytes this rank launched in the window (`StepResult`),
    HSDP's part across replicas apart; none on one process."""
    fields = {"grad_collectives": result.grad_collectives, "grad_bytes": result.grad_bytes}
    if result.grad_replica_collectives:
        fields["grad_replica_collectives"] = result.grad_replica_collectives
        fields["grad_replica_bytes"] = result.grad_replica_bytes
    return fields if result.grad_collectives else {}


def noise_fields(result) -> dict:
    """noise_scale_tokens and noise_scale_sequences of a window (`result`, a StepResult),
    where they are finite."""
    noise = result.noise
    if noise is None:
        return {}
    fields = {
        "noise_scale_tokens": noise.b_simple_tokens,
        "noise_scale_sequences": noise.b_simple_sequences,
    }
    return {k: v for k, v in fields.items() if v is not None and math.isfinite(v)}


def read_metrics_text(path: str) -> list[str]:
    """The complete lines of a metrics file (a line cut short by a kill is dropped)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    return [line for line in lines[:-1] if line]  # the part after the last newline is partial


def read_metrics(path: str) -> list[dict]:
    """Every record of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in read_metrics_text(path)]


def plot_loss(
    records: list[dict], path: str, entropy_floor: float | None = None, title: str = ""
) -> bool:
    """Write loss.png (`loss_figure`) to `path`, atomically.

    Returns False, writing nothing, when matplotlib is not installed (an optional extra);
    raises DiskFull naming `path` when the disk has no room (the previous plot is kept).
    """
    plt = _pyplot()
    if plt is None:
        return False
    fig = loss_figure(records, entropy_floor, title)
    try:
        fig.tight_layout()
        write_atomic(path, lambda f: fig.savefig(f, format="png"))  # no room: DiskFull
    finally:
        plt.close(fig)
    return True


def _pyplot():
    """matplotlib.pyplot drawing off screen, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def loss_figure(records: list[dict], entropy_floor: float | None = None, title: str = ""):
    """loss.png's figure (matplotlib installed; the caller closes it): loss against tokens
    (and eval loss, and the floor); below it a panel for each of: the noise scale where the
    records carry noise_scale_tokens, the exact match where eval records carry it (--task sft
    on the built-in set), the load-balancing loss and the largest expert load where they carry
    moe_lbl (an MoE model), the rewards where they carry reward (--task grpo). A GRPO run's
    eval loss and the floor are in a panel of their own, under the policy loss."""
    plt = _pyplot()
    train = [r for r in records if r.get("loss") is not None and "eval_loss" not in r]
    evals = [r for r in records if r.get("eval_loss") is not None]
    # --task grpo: the train loss is the policy's (about 0), the eval loss the held-out
    # cross-entropy (about ln V); on one axis neither can be read
    policy = any(r.get("reward") is not None for r in train)
    panels = [(p, rs) for p, rs in _lower_panels(train, evals, entropy_floor, policy) if rs]
    if panels:
        fig, axes = plt.subplots(
            1 + len(panels),
            1,
            figsize=(7, 4.2 + 2.2 * len(panels)),
            dpi=120,
            sharex=True,
            height_ratios=(3,) + (2,) * len(panels),
        )
        ax = axes[0]
        for lower, (paint, rows) in zip(axes[1:], panels, strict=True):
            paint(lower, rows)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
        ax.set_xlabel("tokens")
    if policy:
        _plot_policy_loss(ax, train)
    else:
        _plot_losses(ax, train, evals, entropy_floor)
    ax.set_title("\n".join(textwrap.wrap(title, TITLE_WIDTH, break_on_hyphens=False)), fontsize=10)
    return fig


def _lower_panels(train: list[dict], evals: list[dict], entropy_floor, policy: bool) -> list:
    """The panels below the loss as (painter, its records), in order; one without records
    is left out."""
    held = [r for r in evals if r.get("eval_reward") is not None]
    reward = functools.partial(_plot_reward, held=held)
    panels = [
        (_plot_noise, [r for r in train if r.get("noise_scale_tokens") is not None]),
        (reward, [r for r in train if r.get("reward") is not None]),
        (_plot_exact_match, [r for r in evals if r.get("exact_match") is not None]),
        (_plot_moe, [r for r in train if r.get("moe_lbl") is not None]),
    ]
    if policy:  # the held-out cross-entropy on its own axis, right under the policy loss
        held_out = functools.partial(_plot_held_out, entropy_floor=entropy_floor)
        panels.insert(0, (held_out, evals))
    return panels


def _plot_losses(ax, train: list[dict], evals: list[dict], entropy_floor) -> None:
    """Train loss, eval loss and the entropy floor against tokens: one quantity, one axis."""
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], lw=1.2, color="tab:blue",
            label="train loss")  # fmt: skip
    _plot_eval_loss(ax, evals, entropy_floor)
    ax.set_ylabel("loss (nats per token)")


def _plot_policy_loss(ax, train: list[dict]) -> None:
    """--task grpo: the policy loss (the --loss-type objective, about 0) against tokens."""
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], lw=1.2, color="tab:blue",
            label="policy loss")  # fmt: skip
    ax.set_ylabel("policy loss (per token)")
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_held_out(ax, evals: list[dict], entropy_floor: float | None = None) -> None:
    """--task grpo: the held-out cross-entropy (and the floor) against tokens."""
    _plot_eval_loss(ax, evals, entropy_floor)
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats per token)")


def _plot_eval_loss(ax, evals: list[dict], entropy_floor: float | None) -> None:
    """The eval loss (held-out cross-entropy) and the entropy floor, where there are."""
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=4, lw=1,
                color="tab:orange", label="eval loss (held out)")  # fmt: skip
    if entropy_floor is not None:
        ax.axhline(entropy_floor, ls="--", color="k", lw=1,
                   label=f"entropy floor {entropy_floor:.3f} nats")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_noise(ax, records: list[dict]) -> None:
    """The gradient noise scale (critical batch, tokens) against tokens trained on."""
    ax.plot(
        [r["tokens"] for r in records],
        [r["noise_scale_tokens"] for r in records],
        lw=1.2,
        color="tab:green",
        label="noise scale (critical batch)",
    )
    ax.set_xlabel("tokens")
    ax.set_ylabel("tokens per step")
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_reward(ax, records: list[dict], held: list[dict] = ()) -> None:
    """--task grpo: each step's mean reward and each reward function's, against tokens; and
    the evaluations' reward of completions sampled from held-out prompts (`held`)."""
    tokens = [r["tokens"] for r in records]
    ax.plot(tokens, [r["reward"] for r in records], lw=1.2, color="tab:orange", label="reward")
    if held:
        ax.plot([r["tokens"] for r in held], [r["eval_reward"] for r in held], "o--", ms=4,
                color="tab:red", label="reward (held out, sampled)")  # fmt: skip
    names = sorted(k for k in records[0] if k.startswith("reward_") and k != "reward_std")
    for name, colour in zip(names, _unused_colours(ax), strict=False):
        values = [r.get(name) for r in records]
        ax.plot(tokens, values, lw=0.8, alpha=0.7, color=colour, label=name.removeprefix("reward_"))
    ax.set_xlabel("tokens (counted: the loss's count)")
    ax.set_ylabel("reward (step mean)")
    ax.grid(alpha=0.3)
    ax.legend()


def _unused_colours(ax):
    """Colours none of `ax`'s lines has (tab10's, then tab20's light shades), endlessly:
    matplotlib's cycle does not skip a colour a line was given, so a reward function would
    take the mean reward's orange."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    taken = {to_hex(line.get_color()) for line in ax.get_lines()}
    palette = colormaps["tab10"].colors + colormaps["tab20"].colors[1::2]
    return itertools.cycle([c for c in map(to_hex, palette) if c not in taken])


def _plot_exact_match(ax, records: list[dict]) -> None:
    """Held-out exact match (share of prompts answered exactly) against tokens trained on."""
    ax.plot(
        [r["tokens"] for r in records],
        [r["exact_match"] for r in records],
        "o-",
        ms=4,
        lw=1.2,
        color="tab:purple",
        label="exact match (held out, greedy)",
    )
    ax.set_xlabel("tokens (counted: the loss's targets)")
    ax.set_ylabel("exact match")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_moe(ax, records: list[dict]) -> None:
    """A mixture of experts' load-balancing loss (left axis) and its largest expert load,
    max over mean token fraction over the MoE layers (right axis, 1 when balanced)."""
    tokens = [r["tokens"] for r in records]
    ax.plot(tokens, [r["moe_lbl"] for r in records], lw=1.2, color="tab:red", label="LBL")
    ax.set_xlabel("tokens")
    ax.set_ylabel("load-balancing loss")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    loads = [r.get("moe_load_max") for r in records]
    right.plot(tokens, loads, lw=1, color="tab:blue", label="max expert load")
    right.set_ylabel("max expert load (x mean)")
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines])
