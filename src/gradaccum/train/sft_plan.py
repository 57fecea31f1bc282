"""The start-of-run plan of a `--task sft` run: what its steps hold, measured on its own windows.

A fine-tuning step is a window of whole examples, so its tokens, its padding and its k vary
from step to step; a table of --seq-len sequences would describe another run. `measure` cuts
the run's first SAMPLE windows exactly as the run will (the same data order, micro-batch,
--packing and ranks: one `SFTStream` per rank) and `SFTPlan` states, over them:
- examples per step (exact with --examples-per-step, else median and p10 / p90);
- counted tokens per step (the engine's N: completion tokens, or every token with
  --train-on-prompt), median, p10 / p90 and mean;
- positions computed per step over all ranks (padding included) and the padding fraction;
- k per rank (min, median, max): the micro-batches of the rank that holds the most;
- the run's steps, epochs, examples and counted tokens, walked over every window;
- the learning rate, and the memory of the largest micro-batch the packing can make
  (--micro-batch sequences of --seq-len, the plan's bound).
The run's metrics.jsonl records each step's `examples`, `counted_tokens` and `accum_steps`:
the same quantities, which the tests compare with this plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from gradaccum.data.sft.examples import Example
from gradaccum.plan.table import flops_text, memory_rows, render_rows
from gradaccum.train import sft
from gradaccum.train.config import TrainConfig
from gradaccum.train.settings import optimizer_defaults
from gradaccum.utils.sizes import fmt_count, fmt_int

SAMPLE = 64
"""Windows at the start of the run the plan cuts as the run will (at least the first 20
steps, whose figures a user compares first)."""


@dataclass
class Spread:
    """A quantity over the sampled windows: median, 10th and 90th percentiles, mean, extremes."""

    median: float
    p10: float
    p90: float
    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, values) -> Spread:
        v = np.asarray(values, dtype=np.float64)
        p10, median, p90 = np.percentile(v, [10, 50, 90])
        return cls(
            float(median), float(p10), float(p90), float(v.mean()), float(v.min()), float(v.max())
        )


@dataclass
class SFTPlan:
    """What a fine-tuning run does per step and in all (module docstring). Counts are over
    all ranks unless they say per rank."""

    world_size: int
    micro_batch: int
    """Examples per micro-batch (--packing none) or its share of the budget's positions."""
    micro_positions: int
    """Most positions one micro-batch holds on a rank (padding included)."""
    packing: str
    sampled: int
    """Windows the spreads are taken over (the run's first)."""
    examples: Spread
    counted_tokens: Spread
    positions: Spread
    """Positions computed per step over all ranks, padding included."""
    padding: float
    """Share of the sampled positions that are padding."""
    k: Spread
    """Micro-batches per step of the rank that holds the most (the run's k)."""
    steps: int
    epochs: float
    total_examples: int
    total_counted_tokens: int
    train_examples: int
    lr: float
    warmup_steps: int
    schedule: str

    def to_dict(self) -> dict:
        return asdict(self)


def _windows(config, examples: list[Example], micro: int, world: int, fill: bool, count: int):
    """The run's first `count` windows, each as its windows on every rank."""
    streams = [
        sft.SFTStream(config, examples, 0, micro, rank, world, fill) for rank in range(world)
    ]
    for _ in range(count):
        try:
            yield [next(s) for s in streams]
        except StopIteration:  # a run of --epochs shorter than the sample
            return


def _totals(config: TrainConfig, examples: list[Example], steps: int) -> tuple[int, int]:
    """(examples, counted tokens) of the run's `steps` windows, walked in its data order."""
    ahead = sft._ahead(config, examples, sft.stop_of(config, examples))
    counted = 0
    for _ in range(steps):
        try:
            indices = ahead.next_indices()
        except StopIteration:
            break
        counted += int(ahead.targets[indices].sum())
        ahead.position += len(indices)
    return ahead.position, counted


def measure(
    config: TrainConfig,
    examples: list[Example],
    micro_batch: int,
    world_size: int,
    steps: int,
    warmup_steps: int,
    fill_rows: bool = True,
) -> SFTPlan:
    """The plan of a run of `steps` optimizer steps over `examples` at `micro_batch`."""
    sizes, counted, positions, real, ks = [], [], [], [], []
    count = min(SAMPLE, steps)
    for ranks in _windows(config, examples, micro_batch, world_size, fill_rows, count):
        window = ranks[0]
        sizes.append(window.examples)
        counted.append(window.targets)
        positions.append(sum(w.padded_tokens for w in ranks if w.shares))
        real.append(window.tokens - window.examples)  # inputs: every token but the last
        ks.append(max(len(w.micro_batches) for w in ranks if w.shares))
    total_examples, total_counted = _totals(config, examples, steps)
    stream = sft.SFTStream(config, examples, 0, micro_batch, 0, world_size, fill_rows)
    packing = stream.packing
    return SFTPlan(
        world_size=world_size,
        micro_batch=micro_batch,
        micro_positions=packing.budget if packing is not None else micro_batch * config.seq_len,
        packing=stream.mode,
        sampled=len(sizes),
        examples=Spread.of(sizes),
        counted_tokens=Spread.of(counted),
        positions=Spread.of(positions),
        padding=1.0 - sum(real) / max(1, sum(positions)),
        k=Spread.of(ks),
        steps=steps,
        epochs=total_examples / len(examples),
        total_examples=total_examples,
        total_counted_tokens=total_counted,
        train_examples=len(examples),
        lr=config.lr,
        warmup_steps=warmup_steps,
        schedule=config.schedule,
    )


def _spread(s: Spread, digits: bool = False) -> str:
    f = (lambda x: f"{x:,.1f}") if digits else (lambda x: f"{x:,.0f}")
    return f"p10 {f(s.p10)}, p90 {f(s.p90)}, mean {f(s.mean)}"


def rows(plan: SFTPlan, config: TrainConfig, resolved_plan) -> list[tuple]:
    """(quantity, value, unit, how) for the SFT plan's table; `resolved_plan`: the run's
    `gradaccum.plan.Plan` (the model, and the memory at --micro-batch sequences of --seq-len)."""
    model = resolved_plan.model or "--params"
    model_row = ("model", fmt_count(resolved_plan.params), "parameters", model)
    what = "prompt and completion" if config.train_on_prompt else "completion"
    first = f"steps 1-{plan.sampled}" if plan.sampled > 1 else "step 1"
    if config.target_examples_per_step is not None:
        default = " (default)" if config.examples_defaulted else ""
        batch_how = f"--examples-per-step {config.target_examples_per_step}{default}"
        if plan.examples.min != plan.examples.max:  # the last window of --epochs
            batch_how += f"; the last {fmt_int(int(plan.examples.min))}"
    else:
        batch_how = (
            f"whole examples to --tokens-per-step {config.tokens_per_step:,}; median of "
            f"{first}, {_spread(plan.examples, True)}"
        )
    k = plan.k
    k_text = f"{k.min:.0f}" if k.min == k.max else f"{k.min:.0f}-{k.max:.0f}"
    if plan.packing == "none":
        micro_text, micro_unit = fmt_int(plan.micro_batch), "examples / rank, padded"
        k_how = f"ceil(examples per rank / {plan.micro_batch}), {first}; median {k.median:g}"
        micro_how = f"--micro-batch, to {fmt_int(plan.micro_positions)} positions at --seq-len"
    else:
        micro_text, micro_unit = fmt_int(plan.micro_positions), "positions / rank"
        k_how = f"from the micro-batch's positions, {first}; median {k.median:g}"
        source = (
            "--micro-batch-tokens"
            if config.micro_batch_tokens
            else (f"--micro-batch {plan.micro_batch} x --seq-len {config.seq_len}")
        )
        micro_how = source
    pretrained = config.init_from is not None and not sft.builtin_gpt(config)
    default = optimizer_defaults("sft", config.lora_rank is not None, pretrained)["lr"]
    which = "the pretrained-model default" if pretrained else "task default"
    lr_source = "--lr" if config.lr != default else f"--lr ({which})"
    out = [
        model_row,
        ("ranks", str(plan.world_size), "data-parallel ranks", ""),
        ("examples per step", f"{plan.examples.median:,.0f}", "examples / step", batch_how),
        (
            "counted tokens per step",
            f"{plan.counted_tokens.median:,.0f}",
            f"{what} tokens / step",
            f"median of {first}; {_spread(plan.counted_tokens)}",
        ),
        (
            "positions per step",
            f"{plan.positions.median:,.0f}",
            "positions / step, all ranks",
            f"median; {plan.padding:.1%} padding (--packing {plan.packing})",
        ),
        ("micro-batch", micro_text, micro_unit, micro_how),
        ("accumulation steps k", k_text, "micro-batches / rank / step", k_how),
        ("optimizer steps", fmt_int(plan.steps), "steps", ""),
        ("epochs", f"{plan.epochs:.3g}", f"passes over {plan.train_examples:,} examples", ""),
        ("examples", fmt_int(plan.total_examples), "examples", "in all"),
        ("counted tokens", fmt_count(plan.total_counted_tokens), f"{what} tokens", "in all"),
        (
            "learning rate",
            f"{plan.lr:.4g}",
            "peak",
            f"{lr_source}, {plan.schedule}, {plan.warmup_steps} warmup steps; no LR rule "
            "(one batch size)",
        ),
    ]
    flops = 6 * resolved_plan.params * plan.positions.median
    out.append(("FLOPs / step", flops_text(flops), "FLOP", "6 N x positions per step (median)"))
    memory = memory_rows(resolved_plan)
    largest = f"the largest micro-batch ({fmt_int(plan.micro_positions)} positions); "
    out += [(q, v, u, largest + how) if q == "memory: activations" else (q, v, u, how)
            for q, v, u, how in memory]  # fmt: skip
    return out


def render(table_rows: list[tuple]) -> str:
    """The SFT plan's table for people."""
    return render_rows("gradaccum plan: fine-tuning", table_rows, width=120)
