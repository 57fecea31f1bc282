"""loss.png's figure (`gradaccum.train.rundir.metrics.loss_figure`), read from its axes and
lines rather than its pixels: a GRPO run's policy loss (about 0) and held-out cross-entropy
(about ln V) on axes of their own, and every line of a panel in a colour of its own."""

import matplotlib.pyplot as plt
from matplotlib.colors import to_hex

from gradaccum.train.rundir.metrics import loss_figure

FUNCTIONS = ("exact", "partial", "format")
"""The built-in rewards' names: three functions beside the step mean in one panel."""


def grpo_records(steps: int = 4) -> list[dict]:
    """metrics.jsonl of a GRPO run: its windows (a policy loss about 0, the reward and each
    function's) and an evaluation every other step (the held-out cross-entropy, the sampled
    reward)."""
    records = []
    for s in range(1, steps + 1):
        fields = {f"reward_{name}": 0.1 * s * i for i, name in enumerate(FUNCTIONS)}
        records.append({"step": s, "tokens": 50 * s, "loss": 1e-3 * (-1) ** s, "reward": 0.3 * s,
                        "reward_std": 0.2, **fields})  # fmt: skip
        if s % 2 == 0:
            records.append({"step": s, "tokens": 50 * s, "eval_loss": 6.3 - 0.01 * s,
                            "eval_reward": 0.25 * s})  # fmt: skip
    return records


def lines_by_label(fig) -> dict:
    return {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}


def test_grpo_held_out_cross_entropy_has_an_axis_of_its_own():
    fig = loss_figure(grpo_records(), title="grpo")
    try:
        lines = lines_by_label(fig)
        (policy,) = [
            line for label, line in lines.items() if "loss" in label and "eval" not in label
        ]
        (held_out,) = [line for label, line in lines.items() if label.startswith("eval loss")]
        assert policy.axes is not held_out.axes  # a panel or a second y axis of its own
    finally:
        plt.close(fig)


def test_every_line_of_a_panel_has_a_colour_of_its_own():
    fig = loss_figure(grpo_records(), entropy_floor=2.0, title="grpo")
    try:
        for ax in fig.axes:
            colours = [to_hex(line.get_color()) for line in ax.get_lines()]
            assert len(set(colours)) == len(colours), [line.get_label() for line in ax.get_lines()]
        labels = lines_by_label(fig)
        assert {"reward", "reward (held out, sampled)", *FUNCTIONS} <= set(labels)
    finally:
        plt.close(fig)
