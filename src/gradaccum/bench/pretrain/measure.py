"""Run the contestants side by side: each one's update against the exact big batch, then
tokens/s over several rounds in alternating order."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from gradaccum.bench.pretrain.config import BenchConfig
from gradaccum.bench.pretrain.data import (
    big_batch_gradient,
    make_windows,
    no_dropout,
    snapshot,
    to_device,
    update_error,
    valid_tokens,
)
from gradaccum.bench.pretrain.loops import CONTESTANTS, Contestant, Run, Setup
from gradaccum.models.build import build_model
from gradaccum.models.optimizer import adamw
from gradaccum.models.quantized import stored_bytes
from gradaccum.parallel import devices
from gradaccum.utils.errors import first_line
from gradaccum.utils.sizes import fmt_count, fmt_seconds

VOCAB = 256
"""Vocabulary of the built-in GPT here: the data are random ids, no tokenizer involved."""

TIMING_LR = 1e-4
"""AdamW's learning rate in the timing runs (it does not change the cost)."""


@dataclass
class Prepared:
    """A contestant's loop around its own copy of the model and its own optimizer."""

    run: Run
    optimizer: torch.optim.Optimizer
    model: torch.nn.Module
    steps: int = 0
    """Optimizer steps taken so far (counted by a hook on the optimizer)."""

    def resident_bytes(self) -> int:
        """Bytes of its model (every parameter and buffer, frozen ones too; a quantised
        weight at its stored size with its constants) and optimizer state (activations and
        gradients show in the peak during a run)."""
        total = stored_bytes(self.model)
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        return total


@dataclass
class Entry:
    """One contestant's figures; a skipped one has only its reason."""

    contestant: Contestant
    skipped: str | None = None
    update_rel_err: float | None = None
    tokens_per_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    padding: float | None = None
    """Fraction of the positions it computed that were padding (--task sft)."""
    prepared: Prepared | None = None
    """The contestant's loop, model copy and optimizer while it is being measured."""


def resolve_device(text: str) -> torch.device:
    """The device --device names, or BadInput when it is unknown or not on this machine
    (`devices.check_device`, the check every command shares)."""
    devices.check_device(text)
    return devices.resolve(text)


def build(cfg: BenchConfig, device: torch.device) -> tuple[torch.nn.Module, object]:
    """The model every contestant starts from, seeded, dropout off, on the device."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.model_config is not None:  # raises BadInput naming --model-config
            model, info = build_model(config_path=cfg.model_config, seq_len=cfg.seq_len)
        else:
            model, info = build_model(preset=cfg.model, vocab_size=VOCAB, seq_len=cfg.seq_len)
    return no_dropout(model).to(device), info


@contextlib.contextmanager
def quiet():
    """Peers print banners, tips, warnings and end-of-training dicts; none of it is ours."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")
    names += ("transformers", "accelerate", "trl", "datasets")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def resident_bytes() -> int | None:
    """The process's resident memory in bytes (Linux's /proc/self/statm; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class RSSPeak:
    """The process's resident memory sampled every `every` seconds on a thread while the
    block runs: `growth` is the peak above the resident memory at its start, in bytes (what
    the block added: activations, gradients, its loader; memory the allocator keeps from
    before is not counted twice). A sampled peak can miss a spike shorter than `every`."""

    def __init__(self, every: float = 0.002):
        self.every, self.growth = every, 0
        self._stop = threading.Event()

    def __enter__(self):
        start = resident_bytes()

        def sample():
            while start is not None and not self._stop.wait(self.every):
                self.growth = max(self.growth, (resident_bytes() or start) - start)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def timed_run(
    prepared: Prepared, windows, device: torch.device, rss: bool = False
) -> tuple[float, int | None]:
    """Seconds over all windows but the first (the warm-up), and peak memory in bytes: the
    device's own peak, or with `rss` where the device reports none (the CPU) the peak growth
    of the process's resident memory (`RSSPeak`); both plus the weights and optimizer state."""
    ticks: list[float] = []

    def tick():
        devices.synchronize(device)
        ticks.append(time.perf_counter())

    devices.reset_peak_memory(device)
    before = devices.peak_memory_bytes(device)  # right after a reset: what is allocated now
    start = prepared.steps
    sampler = RSSPeak() if rss and before is None else contextlib.nullcontext()
    with quiet(), sampler:
        prepared.run(windows, tick)
    taken = prepared.steps - start
    if taken != len(windows) or len(ticks) != len(windows):
        raise RuntimeError(f"took {taken} optimizer steps for {len(windows)} windows")
    peak = devices.peak_memory_bytes(device)
    own = None if peak is None or before is None else peak - before + prepared.resident_bytes()
    if isinstance(sampler, RSSPeak) and resident_bytes() is not None:
        own = sampler.growth + prepared.resident_bytes()
    return ticks[-1] - ticks[0], own


def prepare(contestant: Contestant, model0, setup: Setup, sgd: bool) -> tuple:
    """A copy of the initial model and a fresh optimizer (SGD at lr 1, or AdamW), handed to
    the contestant; returns the copy and the prepared loop."""
    model = copy.deepcopy(model0)
    params = [p for p in model.parameters() if p.requires_grad]
    if sgd:
        optimizer = torch.optim.SGD(params, lr=1.0)
    else:
        optimizer = adamw(params, lr=TIMING_LR)
    with quiet():
        run = contestant.make(model, optimizer, setup)
    prepared = Prepared(run, optimizer, model)

    def count(opt, args, kwargs):
        prepared.steps += 1

    optimizer.register_step_post_hook(count)
    return model, prepared


def measure_error(entry: Entry, model0, window, grad, setup: Setup) -> None:
    """One SGD step at lr 1 on one window: the update is the gradient the contestant formed."""
    model, prepared = prepare(entry.contestant, model0, setup, sgd=True)
    before = snapshot(model)
    timed_run(prepared, [window], setup.device)
    entry.update_rel_err = update_error(before, snapshot(model), grad)


def run_bench(cfg: BenchConfig, progress=None) -> tuple[list[Entry], dict]:
    """Every contestant on the same model, data and k; entries in table order and the
    config as the JSON reports it. `progress(line)` hears what the bench will do before the
    first step, how long one step took and what is left, and each contestant's figures as
    they come (a long sequence can take minutes a step on CPU)."""
    say = progress or (lambda line: None)
    device = resolve_device(cfg.device)
    model0, info = build(cfg, device)
    vocab = VOCAB if cfg.model_config is None else info.vocab_size
    chosen = [c for c in CONTESTANTS if c.name in ("gradaccum", "hand-loop") + tuple(cfg.peers)]
    entries = [Entry(c, skipped=c.missing()) for c in chosen]
    say(plan_line(cfg, info.params, device, entries))
    windows = make_windows(
        cfg.windows + 1, cfg.accum_steps, cfg.micro_batch, cfg.seq_len, vocab, cfg.seed
    )
    windows = to_device(windows, device)
    start = time.perf_counter()
    grad = big_batch_gradient(model0, windows[0])
    say(f"float64 big-batch gradient (the reference): {time.perf_counter() - start:.1f} s")
    workdir = tempfile.mkdtemp(prefix="gradaccum-bench-")
    try:
        setup = Setup(device, cfg.accum_steps, workdir, cfg.seed)
        for entry in entries:
            start = time.perf_counter()
            attempt(entry, lambda e=entry: measure_error(e, model0, windows[0], grad, setup))
            if entry.skipped is None:
                say(_checked_line(entry, time.perf_counter() - start, cfg, entries))
                attempt(entry, lambda e=entry: prepare_timing(e, model0, setup))
        run_rounds(entries, windows, cfg.rounds, device, say)
    finally:
        for entry in entries:
            entry.prepared = None
        shutil.rmtree(workdir, ignore_errors=True)
    config = {
        "model": cfg.model_name,
        "micro_batch": cfg.micro_batch,
        "accum_steps": cfg.accum_steps,
        "seq_len": cfg.seq_len,
        "rounds": cfg.rounds,
        "device": str(device),
        "torch": torch.__version__,
    }
    return entries, config


def plan_line(cfg: BenchConfig, params: int, device, entries: list[Entry]) -> str:
    """What the bench runs, in one line, before it runs any of it."""
    live = [e.contestant.name for e in entries if e.skipped is None]
    step = cfg.micro_batch * cfg.seq_len * cfg.accum_steps
    return (
        f"bench: {cfg.model_name} ({fmt_count(params)} parameters) on {device}, micro-batch "
        f"{cfg.micro_batch} x {cfg.seq_len:,} tokens x k {cfg.accum_steps} = {step:,} tokens "
        f"per optimizer step; {len(live)} contestants ({', '.join(live)}), each: 1 step checked "
        f"against the float64 big batch, then {cfg.rounds} round(s) of {cfg.windows + 1} steps;"
        " first the big batch's gradient"
    )


def _checked_line(entry: Entry, seconds: float, cfg: BenchConfig, entries: list[Entry]) -> str:
    """The update check's figure and, after the first one, the time the rest should take."""
    line = (
        f"update check, {entry.contestant.name}: error {entry.update_rel_err:.1e} ({seconds:.1f} s)"
    )
    if entry is not next(e for e in entries if e.skipped is None):
        return line
    live = sum(e.skipped is None for e in entries)
    steps = (live - 1) + live * cfg.rounds * (cfg.windows + 1)
    return line + (
        f"; at about that per step, the {steps} steps left take about "
        f"{fmt_seconds(steps * seconds)}"
    )


def prepare_timing(entry: Entry, model0, setup: Setup) -> None:
    _, entry.prepared = prepare(entry.contestant, model0, setup, sgd=False)


def attempt(entry: Entry, fn) -> None:
    """Run `fn`; a peer that fails is listed as skipped with its error, not a crash."""
    if entry.skipped is not None:
        return
    try:
        fn()
    except Exception as err:  # a peer's own error, in whatever type it raises
        if entry.contestant.name.startswith("gradaccum") or entry.contestant.name == "hand-loop":
            raise
        entry.skipped = f"failed: {first_line(err)}"
        entry.prepared = None


def run_rounds(
    entries: list[Entry],
    windows,
    rounds: int,
    device,
    say,
    tokens: int | None = None,
    baseline: str = "hand-loop",
    rss: bool = False,
) -> None:
    """`rounds` timing rounds, the order reversed every other round; each contestant's
    tokens/s (`tokens` counted over windows[1:], by default their valid labels) and its ratio
    to `baseline` in the same round."""
    tokens = valid_tokens(windows[1:]) if tokens is None else tokens
    for r in range(rounds):
        live = [e for e in entries if e.skipped is None]
        order = live if r % 2 == 0 else live[::-1]
        tps = {}
        for entry in order:
            start = time.perf_counter()
            attempt(entry, lambda e=entry, t=tps: _one_timing(e, windows, device, tokens, t, rss))
            name = entry.contestant.name
            if name in tps:
                say(
                    f"round {r + 1}/{rounds}, {name}: {tps[name]:,.0f} tokens/s "
                    f"({time.perf_counter() - start:.1f} s)"
                )
        base = tps.get(baseline)
        for entry in live:
            if entry.contestant.name in tps and base:
                entry.ratios.append(tps[entry.contestant.name] / base)


def _one_timing(entry: Entry, windows, device, tokens: int, tps: dict, rss: bool = False) -> None:
    seconds, peak = timed_run(entry.prepared, windows, device, rss)
    rate = tokens / seconds
    entry.tokens_per_s.append(rate)
    tps[entry.contestant.name] = rate
    if peak is not None:
        entry.peak_bytes = max(entry.peak_bytes or 0, peak)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
