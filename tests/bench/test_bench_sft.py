"""`gradaccum bench --task sft`: every contestant runs, its update error against a float64
reference computed here (each example's loss summed alone), the padding share each computes
against a hand count, the length distribution, bad flags. No timings are asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradaccum.bench.sft import data as sft_data
from gradaccum.bench.sft.config import SFTBenchConfig
from gradaccum.bench.sft.measure import build_hf, run_sft_bench
from gradaccum.bench.sft.report import render_table, to_json
from gradaccum.cli import bench as bench_cli
from gradaccum.cli.common import ArgumentParser
from gradaccum.settings.command import add_command
from gradaccum.utils.errors import BadInput

pytest.importorskip("transformers")

SMALL = {"micro_batch": 2, "accum_steps": 3, "seq_len": 96, "rounds": 1, "windows": 1}
PADDED_IN_ORDER = ("hand-loop", "trl", "trainer")
"""Contestants that pad runs of micro_batch examples in stream order."""


def cli(argv: list[str]) -> int:
    parser = ArgumentParser(prog="gradaccum")
    add_command(parser.add_subparsers(dest="command"), bench_cli.COMMAND)
    args = parser.parse_args(["bench", *argv])
    return args.run(args)


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory):
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=sft_data.VOCAB, n_positions=96
    ).save_pretrained(folder)  # ships with dropout 0.1: the bench must switch it off
    return str(folder / "config.json")


@pytest.fixture(scope="module")
def ran(gpt2_config):
    peers = tuple(p for p in ("trl", "trl-padding-free", "trainer") if _installed(p))
    cfg = SFTBenchConfig(model_config=gpt2_config, peers=peers, **SMALL)
    entries, config = run_sft_bench(cfg)
    return cfg, to_json(entries, config), entries, config


def _installed(peer: str) -> bool:
    import importlib.util

    return importlib.util.find_spec("trl" if peer.startswith("trl") else "accelerate") is not None


def first_window(cfg: SFTBenchConfig):
    n = cfg.windows + 1
    examples = sft_data.make_examples(
        max(4000, 2 * n * cfg.examples_per_step), cfg.seq_len, cfg.seed
    )
    return sft_data.make_windows(examples, n, cfg.examples_per_step, cfg.seed)[0]


def fp64_grads(model, window, runs=None):
    """float64 gradient of the window: each example run alone, its loss summed over its
    targets; divided by all the window's targets (exact), or with `runs` (lists of examples)
    each run's sum over its own targets, divided by k (mean / k)."""
    import copy

    return window_grads(copy.deepcopy(model).double(), window, runs)


def window_grads(ref, window, runs=None):
    """`fp64_grads` on `ref` itself (a float64 model), for the parameters that require grad."""
    params = [p for p in ref.parameters() if p.requires_grad]

    def alone(e):
        ids = torch.as_tensor(e.input_ids, dtype=torch.long)[None]
        labels = torch.as_tensor(e.labels[1:], dtype=torch.long)
        logits = ref(input_ids=ids).logits[0, :-1]
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")

    if runs is None:
        loss = sum(alone(e) for e in window) / sum(e.num_targets for e in window)
    else:
        loss = sum(sum(alone(e) for e in r) / sum(e.num_targets for e in r) for r in runs)
        loss = loss / len(runs)
    return torch.autograd.grad(loss, params)


def rel(a, b) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    return (num / sum(float(y.pow(2).sum()) for y in b)) ** 0.5


@pytest.mark.slow  # the bench with its peers
def test_every_contestant_runs_and_errors_are_what_they_must_be(ran):
    cfg, data, _, _ = ran
    by_name = {r["name"]: r for r in data["results"]}
    assert all(r["skipped"] is None for r in by_name.values()), by_name
    model = build_hf(cfg, torch.device("cpu"))
    window = first_window(cfg)
    exact = fp64_grads(model, window)
    runs = [window[i : i + cfg.micro_batch] for i in range(0, len(window), cfg.micro_batch)]
    mean_over_k = rel(fp64_grads(model, window, runs), exact)
    assert mean_over_k >= 1e-2  # ragged enough that mean / k is visibly off
    for name in ("gradaccum-none", "gradaccum-window", "gradaccum-padding-free"):
        assert by_name[name]["update_rel_err"] <= 1e-5, name
    for name in ("trl", "trl-padding-free", "trainer"):  # they divide by the window's count
        if name in by_name:
            assert by_name[name]["update_rel_err"] <= 1e-5, name
    assert by_name["hand-loop"]["update_rel_err"] == pytest.approx(mean_over_k, rel=1e-3)


@pytest.mark.slow  # the bench with its peers
def test_padding_shares_against_a_hand_count(ran):
    cfg, data, _, _ = ran
    by_name = {r["name"]: r for r in data["results"]}
    window = first_window(cfg)
    real = sum(e.length for e in window)
    runs = [window[i : i + cfg.micro_batch] for i in range(0, len(window), cfg.micro_batch)]
    in_order = 1 - real / sum(len(r) * max(e.length for e in r) for r in runs)
    by_len = sorted(window, key=lambda e: -e.length)
    sorted_runs = [by_len[i : i + cfg.micro_batch] for i in range(0, len(by_len), cfg.micro_batch)]
    longest_first = 1 - real / sum(len(r) * r[0].length for r in sorted_runs)
    assert in_order > longest_first > 0
    for name in PADDED_IN_ORDER:
        if name in by_name:
            assert by_name[name]["padding"] == pytest.approx(in_order, abs=1e-12), name
    assert by_name["gradaccum-none"]["padding"] == pytest.approx(longest_first, abs=1e-12)
    if "trl-padding-free" in by_name:
        assert by_name["trl-padding-free"]["padding"] == 0.0
    positions = bucketed_positions([e.length for e in window], cfg.seq_len)
    padding_free = by_name["gradaccum-padding-free"]["padding"]
    assert padding_free == pytest.approx(1 - real / positions, abs=1e-12)
    assert padding_free < longest_first


def bucketed_positions(lengths, seq_len: int) -> int:
    """Positions of bucketed padding-free rows, counted here: first-fit decreasing, a row as
    wide as the smallest of seq_len, seq_len / 2, / 4, / 8 (rounded up) that fits the example
    opening it, each computed at its full width (its opening example is wider than the next
    bucket down), however the rows are grouped into micro-batches."""
    buckets = sorted({-(-seq_len // 2**j) for j in range(4)})
    caps, room = [], []
    for n in sorted(lengths, reverse=True):
        fit = [r for r, left in enumerate(room) if n <= left]
        if fit:
            room[fit[0]] -= n
        else:
            caps.append(min(b for b in buckets if b >= n))
            room.append(caps[-1] - n)
    return sum(caps)


@pytest.mark.slow  # the bench with its peers
def test_json_and_table_state_the_lengths_and_every_figure(ran):
    cfg, data, entries, config = ran
    data = json.loads(json.dumps(data))
    assert set(data) == {"results", "config"}
    for r in data["results"]:
        assert r["tokens_per_s"] > 0 and r["spread"] >= 0
        assert r["peak_memory_gb"] is not None and r["peak_memory_gb"] > 0  # RSS on the CPU
    assert data["config"]["baseline"] == ("trl" if _installed("trl") else "hand-loop")
    assert next(r for r in data["results"] if r["name"] == data["config"]["baseline"])[
        "ratio"
    ] == pytest.approx(1.0)
    lengths = [e.length for e in sft_data.make_examples(4000, cfg.seq_len, cfg.seed)]
    v = np.sort(lengths)
    want = {q: int(v[int(np.ceil(p * len(v))) - 1]) for q, p in (("median", 0.5), ("p99", 0.99))}
    assert data["config"]["lengths"]["tokens"]["median"] == want["median"]
    assert data["config"]["lengths"]["tokens"]["p99"] == want["p99"]
    text = render_table(entries, config)
    assert f"tokens median {want['median']}" in text and "gradaccum --packing padding-free" in text


def test_the_instruction_set_has_a_long_tail():
    lengths = np.array([e.length for e in sft_data.make_examples(4000, 512, 0)])
    median = np.median(lengths)
    assert np.percentile(lengths, 99) >= 5 * median  # what makes padding cost
    assert lengths.max() >= 300
    targets = [e.num_targets for e in sft_data.make_examples(200, 512, 0)]
    assert min(targets) >= 1


@pytest.mark.slow  # a bench run per packing mode
def test_default_llama_runs_each_mode_exactly(capsys):
    argv = ["--task", "sft", "--json", "--peers", "none", "--seq-len", "64", "--micro-batch", "2"]
    assert cli(argv + ["--accum-steps", "2", "--rounds", "1", "--windows", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["model"] == "tiny Llama" and data["config"]["baseline"] == "hand-loop"
    names = [r["name"] for r in data["results"]]
    assert names == ["gradaccum-none", "gradaccum-window", "gradaccum-padding-free", "hand-loop"]
    for r in data["results"][:3]:
        assert r["update_rel_err"] <= 1e-5


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--task", "sft", "--packing", "rows"], "--packing"),
        (["--task", "sft", "--peers", "deepspeed"], "--peers"),
        (["--task", "sft", "--model", "tiny"], "--model"),
        (
            ["--task", "sft", "--seq-len", "128", "--micro-batch-tokens", "64"],
            "--micro-batch-tokens",
        ),
        (["--micro-batch-tokens", "512"], "--micro-batch-tokens"),
        (["--packing", "window"], "--packing"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(argv, flag):
    with pytest.raises(BadInput) as err:
        cli(argv)
    assert str(err.value).startswith(flag)
