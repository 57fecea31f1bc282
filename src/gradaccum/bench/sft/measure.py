"""`gradaccum bench --task sft`: every contestant on the same Hugging Face model and the same
examples per step; its update against the exact big batch and the padding it computed, then
counted tokens/s over rounds in alternating order, and peak memory."""

from __future__ import annotations

import shutil
import tempfile
import time

import torch

from gradaccum.bench.pretrain.data import no_dropout, snapshot, update_error
from gradaccum.bench.pretrain.measure import (
    Entry,
    attempt,
    prepare,
    prepare_timing,
    resolve_device,
    run_rounds,
    timed_run,
)
from gradaccum.bench.sft import adapters
from gradaccum.bench.sft import data as sft_data
from gradaccum.bench.sft.config import SFTBenchConfig
from gradaccum.bench.sft.loops import SFT_CONTESTANTS, SFTSetup
from gradaccum.models.hf_config import from_config, parameter_count
from gradaccum.utils.errors import BadInput

BASELINE = "trl"
"""The contestant the ratios are taken against (the hand loop when TRL is not run)."""


def tiny_llama(seq_len: int):
    """A Llama from config: 4 layers of width 128 (MLP 512), 4 heads, the byte vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=sft_data.VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq_len,
        eos_token_id=sft_data.PAD_ID,
        pad_token_id=sft_data.PAD_ID,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def build_hf(cfg: SFTBenchConfig, device: torch.device):
    """The model every contestant starts from: seeded, dropout off, no KV cache (training:
    transformers builds the packed-sequence mask only without one), with --base-bits and
    --lora-rank its base quantised and its adapters on (`adapters.adapt`), on the device."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.model_config is None:
            model = tiny_llama(cfg.seq_len)
        else:  # raises BadInput naming --model-config (vocabulary or positions too small)
            model, _ = from_config(
                "--model-config", cfg.model_config, "", sft_data.VOCAB, cfg.seq_len
            )
        model.config.use_cache = False
        no_dropout(model)
        adapters.adapt(model, cfg, device)
    return model.to(device)


def count_positions(model: torch.nn.Module) -> tuple[list[int], object]:
    """A hook adding each forward's input positions (input_ids.numel()) to a list."""
    seen = [0]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_tensor(ids):
            seen[0] += ids.numel()

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def check_window(entry: Entry, model0, window, grad, setup: SFTSetup) -> None:
    """One SGD step at lr 1 on one window: the update error, and the fraction of the
    positions the contestant computed that were padding (the window's tokens are the real
    ones: every contestant feeds each example's tokens once)."""
    model, prepared = prepare(entry.contestant, model0, setup, sgd=True)
    before = snapshot(model)
    seen, handle = count_positions(model)
    try:
        timed_run(prepared, [window], setup.device)
    finally:
        handle.remove()
    entry.update_rel_err = update_error(before, snapshot(model), grad)
    real = sum(e.length for e in window)
    entry.padding = 1 - real / seen[0] if seen[0] else None


def run_sft_bench(cfg: SFTBenchConfig, progress=None) -> tuple[list[Entry], dict]:
    """Every contestant on the same model, examples and steps; entries in table order and the
    config (with the length distribution) as the JSON reports it."""
    say = progress or (lambda line: None)
    device = resolve_device(cfg.device)
    try:
        model0 = build_hf(cfg, device)
    except ImportError:
        raise BadInput(
            "--task", "sft", "needs transformers (pip install 'gradaccum[bench]')"
        ) from None
    names = tuple(f"gradaccum-{p}" for p in cfg.packings) + ("hand-loop",) + tuple(cfg.peers)
    entries = [Entry(c, skipped=c.missing()) for c in SFT_CONTESTANTS if c.name in names]
    n_windows = cfg.windows + 1
    examples = sft_data.make_examples(
        max(4000, 2 * n_windows * cfg.examples_per_step), cfg.seq_len, cfg.seed
    )
    stats = sft_data.length_stats(examples)
    windows = sft_data.make_windows(examples, n_windows, cfg.examples_per_step, cfg.seed)
    say(_plan_line(cfg, model0, stats, entries))
    start = time.perf_counter()
    grad = sft_data.big_batch_gradient(adapters.reference_base(model0), windows[0])
    say(f"float64 big-batch gradient (the reference): {time.perf_counter() - start:.1f} s")
    workdir = tempfile.mkdtemp(prefix="gradaccum-bench-sft-")
    try:
        setup = SFTSetup(
            device,
            cfg.micro_batch,
            cfg.accum_steps,
            cfg.micro_batch_tokens,
            cfg.seq_len,
            workdir,
            cfg.seed,
        )
        for entry in entries:
            start = time.perf_counter()
            attempt(entry, lambda e=entry: check_window(e, model0, windows[0], grad, setup))
            if entry.skipped is None:
                say(
                    f"update check, {entry.contestant.name}: error {entry.update_rel_err:.1e},"
                    f" padding {entry.padding:.1%} ({time.perf_counter() - start:.1f} s)"
                )
                attempt(entry, lambda e=entry: prepare_timing(e, model0, setup))
        live = {e.contestant.name for e in entries if e.skipped is None}
        baseline = BASELINE if BASELINE in live else "hand-loop"
        tokens = sft_data.targets_of(windows[1:])
        run_rounds(entries, windows, cfg.rounds, device, say, tokens, baseline, rss=True)
    finally:
        for entry in entries:
            entry.prepared = None
        shutil.rmtree(workdir, ignore_errors=True)
    return entries, _config(cfg, model0, device, stats, baseline)


def _config(cfg: SFTBenchConfig, model, device, stats: dict, baseline: str) -> dict:
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    return {
        "task": "sft",
        "model": cfg.model_name,
        "parameters": parameter_count(model),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora_rank": cfg.lora_rank,
        "base_quant": None if cfg.quant_spec is None else cfg.quant_spec.record(),
        "attention": getattr(model.config, "_attn_implementation", None),
        "micro_batch": cfg.micro_batch,
        "accum_steps": cfg.accum_steps,
        "examples_per_step": cfg.examples_per_step,
        "seq_len": cfg.seq_len,
        "micro_batch_tokens": cfg.micro_batch_tokens,
        "rounds": cfg.rounds,
        "windows": cfg.windows,
        "baseline": baseline,
        "lengths": stats,
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl_version,
        **adapters.versions(),
    }


def _plan_line(cfg: SFTBenchConfig, model, stats: dict, entries: list[Entry]) -> str:
    t = stats["tokens"]
    live = [e.contestant.name for e in entries if e.skipped is None]
    params = parameter_count(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    what = f"{params:,} parameters" + ("" if trained == params else f", {trained:,} train")
    return (
        f"bench --task sft: {cfg.model_name} ({what}); {stats['examples']:,} "
        f"examples of median {t['median']}, p90 {t['p90']}, p99 {t['p99']}, max {t['max']} "
        f"tokens; {cfg.examples_per_step} examples per step (micro-batch {cfg.micro_batch} x "
        f"k {cfg.accum_steps}; gradaccum window / padding-free: {cfg.micro_batch_tokens:,} "
        f"positions per micro-batch, rows of {cfg.seq_len}); {len(live)} contestants "
        f"({', '.join(live)}), each: 1 step against the float64 big batch, then "
        f"{cfg.rounds} round(s) of {cfg.windows + 1} steps; first the big batch's gradient"
    )
