"""`gradaccum bench --task grpo`: ours and TRL's GRPOTrainer on the same model, prompts and
completions, for each loss type: the update's error against the exact big batch, then the
training part's completion tokens/s over rounds in alternating order; generation timed apart.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

from gradaccum.bench.grpo.config import GRPOBenchConfig
from gradaccum.bench.grpo.loops import CONTESTANTS
from gradaccum.bench.grpo.window import PROMPT_TOKENS, Window, exact_gradient, make_window
from gradaccum.bench.pretrain.data import no_dropout, snapshot, update_error
from gradaccum.bench.pretrain.measure import TIMING_LR, median, quiet, resolve_device
from gradaccum.models.hf_config import from_config, parameter_count
from gradaccum.models.optimizer import adamw
from gradaccum.parallel import devices
from gradaccum.utils.errors import BadInput, first_line


@dataclass
class LossRow:
    """One loss type's figures, per contestant name ("gradaccum", "trl")."""

    loss_type: str
    update_rel_err: dict[str, float] = field(default_factory=dict)
    """|update - exact big-batch gradient| / |gradient| after one SGD step at lr 1."""
    tokens_per_s: dict[str, list[float]] = field(default_factory=dict)
    """Completion tokens per second of forward, backward and step, one per round."""
    ratios: list[float] = field(default_factory=list)
    """Ours over TRL's tokens/s, one per round (the same round)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Why a contestant has no figures (a peer's failure, in one line)."""


def build(cfg: GRPOBenchConfig, device: torch.device):
    """The model both contestants start from: seeded, dropout off, on the device."""
    from gradaccum.bench.sft.data import VOCAB
    from gradaccum.bench.sft.measure import tiny_llama

    seq_len = PROMPT_TOKENS + cfg.max_completion_length
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.model_config is None:
            model = tiny_llama(seq_len)
        else:  # raises BadInput naming --model-config (vocabulary or positions too small)
            model, _ = from_config("--model-config", cfg.model_config, "", VOCAB, seq_len)
    return no_dropout(model).to(device)


def check_peers() -> None:
    """BadInput when TRL or datasets (its trainer's data) is not installed."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        raise BadInput(
            "--task", "grpo", "needs trl and datasets (pip install 'gradaccum[bench]')"
        ) from None


def contestant_step(name: str, model, optimizer, cfg, loss_type: str, workdir: str):
    make = next(m for n, m, _ in CONTESTANTS if n == name)
    with quiet():
        return make(model, optimizer, cfg, loss_type, workdir)


def update_check(name: str, model0, batches: list[dict], grad, cfg, loss_type, workdir) -> float:
    """One SGD step at lr 1 on a copy of model0: the update is the gradient it formed; its
    relative error against `grad`."""
    model = copy.deepcopy(model0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    step = contestant_step(name, model, optimizer, cfg, loss_type, workdir)
    before = snapshot(model)
    with quiet():
        step(batches)
    return update_error(before, snapshot(model), grad)


def timed(step, windows: list[list[dict]], device) -> float:
    """Seconds of every window but the first (the warm-up), one optimizer step each."""
    ticks = []
    with quiet():
        for batches in windows:
            step(batches)
            devices.synchronize(device)
            ticks.append(time.perf_counter())
    return ticks[-1] - ticks[0]


def run_grpo_bench(cfg: GRPOBenchConfig, progress=None) -> tuple[list[LossRow], dict]:
    """Both contestants for each loss type; rows in cfg.loss_types order and the config as
    the JSON reports it."""
    say = progress or (lambda line: None)
    check_peers()
    device = resolve_device(cfg.device)
    model0 = build(cfg, device)
    windows, generation = [], []
    for i in range(cfg.windows + 1):
        start = time.perf_counter()
        windows.append(make_window(model0, cfg, i))
        generation.append(time.perf_counter() - start)
    say(_plan_line(cfg, model0, windows, generation))
    batches = {
        name: [of(w, cfg.micro_batch, device) for w in windows] for name, _, of in CONTESTANTS
    }
    tokens = sum(w.tokens for w in windows[1:])
    workdir = tempfile.mkdtemp(prefix="gradaccum-bench-grpo-")
    rows = []
    try:
        for loss_type in cfg.loss_types:
            rows.append(_measure_loss(cfg, loss_type, model0, windows[0], batches, tokens, device,
                                      workdir, say))  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows, _config(cfg, model0, device, windows, generation)


def _measure_loss(cfg, loss_type, model0, window: Window, batches, tokens, device, workdir, say):
    row = LossRow(loss_type)
    start = time.perf_counter()
    grad = exact_gradient(model0, window, loss_type, cfg)
    say(f"{loss_type}: float64 big-batch gradient {time.perf_counter() - start:.1f} s")
    steps = {}
    for name, _, _ in CONTESTANTS:
        try:
            row.update_rel_err[name] = update_check(
                name, model0, batches[name][0], grad, cfg, loss_type, workdir
            )
            model = copy.deepcopy(model0)
            optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=TIMING_LR)
            steps[name] = contestant_step(name, model, optimizer, cfg, loss_type, workdir)
        except Exception as err:  # a peer's own error, in whatever type it raises
            if name == "gradaccum":
                raise
            row.skipped[name] = f"failed: {first_line(err)}"
            continue
        say(f"{loss_type}, {name}: update error {row.update_rel_err[name]:.1e}")
    for r in range(cfg.rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        rates = {}
        for name in order:
            rates[name] = tokens / timed(steps[name], batches[name], device)
            row.tokens_per_s.setdefault(name, []).append(rates[name])
        if len(rates) == 2:
            row.ratios.append(rates["gradaccum"] / rates["trl"])
        say(f"{loss_type}, round {r + 1}/{cfg.rounds}: " + ", ".join(
            f"{n} {rates[n]:,.0f} tokens/s" for n in order))  # fmt: skip
    return row


def _config(cfg: GRPOBenchConfig, model, device, windows: list[Window], generation) -> dict:
    import transformers
    import trl

    lengths = [n for w in windows for n in w.lengths]
    gen_tokens = sum(w.tokens for w in windows)
    return {
        "task": "grpo",
        "model": cfg.model_name,
        "parameters": parameter_count(model),
        "micro_batch": cfg.micro_batch,
        "accum_steps": cfg.accum_steps,
        "prompts_per_step": cfg.prompts_per_step,
        "num_generations": cfg.num_generations,
        "completions_per_step": cfg.completions_per_step,
        "prompt_tokens": PROMPT_TOKENS,
        "max_completion_length": cfg.max_completion_length,
        "temperature": cfg.temperature,
        "completion_lengths": {"min": min(lengths), "median": median(lengths), "max": max(lengths)},
        "rounds": cfg.rounds,
        "windows": cfg.windows,
        "generation_s_per_window": median(generation),
        "generation_tokens_per_s": gen_tokens / sum(generation),
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
    }


def _plan_line(cfg: GRPOBenchConfig, model, windows: list[Window], generation) -> str:
    lengths = [n for w in windows for n in w.lengths]
    return (
        f"bench --task grpo: {cfg.model_name} ({parameter_count(model):,} parameters); "
        f"{cfg.prompts_per_step} prompts x G {cfg.num_generations} = "
        f"{cfg.completions_per_step} completions per step (micro-batch {cfg.micro_batch} x k "
        f"{cfg.accum_steps}), {len(windows)} windows sampled in {sum(generation):.1f} s, "
        f"completions of {min(lengths)} to {max(lengths)} tokens; for each of "
        f"{', '.join(cfg.loss_types)}: the float64 big batch, one checked step each for "
        f"gradaccum and TRL, then {cfg.rounds} round(s) of {cfg.windows + 1} steps"
    )
