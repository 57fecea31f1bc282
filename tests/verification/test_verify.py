"""`verify` and `gradaccum verify`: the check, the usual mistakes, the lint and the precision
study, each against numbers computed here without the engine (plain autograd in float64)."""

from __future__ import annotations

import copy
import json
import struct
import time

import pytest
import torch
import torch.nn as nn

from gradaccum import verify
from gradaccum.cli import main
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.testing import big_batch_grads, max_rel_error, token_loss
from gradaccum.utils.errors import BadInput
from gradaccum.verification.check import TOLERANCES, WRONG_WAYS, concat_batches, sample_batches
from gradaccum.verification.precision_study import (
    PRECISION_MODES,
    derive_tolerances,
    nice_ceil,
    precision_study,
    write_plot,
)
from gradaccum.verification.ranks import RANK_BASE_BYTES, RANKS_PER_CORE, rank_capacity
from tests.reference import make_gpt

K = 4


def gpt_data(k: int = K, rows: int = 3, seed: int = 1) -> list[dict]:
    """Micro-batches of ragged rows (2..16 tokens), each as wide as its longest row."""
    return sample_batches(k, rows, 16, 37, seed=seed)


@pytest.fixture(scope="module")
def gpt_report():
    return verify(make_gpt(), gpt_data(), token_loss)


def _fp64_grads(model, micro_batches, weight) -> list[torch.Tensor]:
    """Gradient of sum_i weight(i, loss_sum_i, n_i) by plain autograd on a float64 copy."""
    model = copy.deepcopy(model).double()
    total = 0
    for i, batch in enumerate(micro_batches):
        loss_sum, n = token_loss(model, batch)
        total = total + weight(i, loss_sum, n)
    total.backward()
    return [p.grad for p in model.parameters()]


def test_the_built_in_gpt_passes_in_fp32(gpt_report):
    report = gpt_report
    assert report.passed
    assert report.max_rel_err <= 1e-5
    assert report.tolerance == TOLERANCES["fp32"] == 1e-5
    assert report.cosine_min > 1 - 1e-9
    assert report.reference == "float64"
    data = gpt_data()
    assert report.tokens == sum(int((b["labels"] != -100).sum()) for b in data)
    assert [p.name for p in report.params] == [n for n, _ in make_gpt().named_parameters()]
    assert report.lint == []
    assert json.loads(report.to_json())["max_rel_err"] == report.max_rel_err


def test_wrong_ways_cost_what_plain_autograd_says(gpt_report):
    model, data = make_gpt(), gpt_data()
    want = big_batch_grads(model, data, dtype=torch.float64)
    mean_over_k = _fp64_grads(model, data, lambda i, s, n: s / n / K)
    no_division = _fp64_grads(model, data, lambda i, s, n: s / n)
    ways = gpt_report.wrong_ways
    assert ways["mean_over_k"] == pytest.approx(max_rel_error(mean_over_k, want), rel=1e-3)
    assert ways["no_division"] == pytest.approx(max_rel_error(no_division, want), rel=1e-3)
    # the short window: the first k/2 micro-batches, each mean still divided by k
    short = data[: K // 2]
    short_want = big_batch_grads(model, short, dtype=torch.float64)
    short_got = _fp64_grads(model, short, lambda i, s, n: s / n / K)
    assert ways["short_window_over_k"] == pytest.approx(
        max_rel_error(short_got, short_want), rel=1e-3
    )


def test_every_wrong_way_is_far_from_the_big_batch_on_ragged_data(gpt_report):
    assert set(gpt_report.wrong_ways) == set(WRONG_WAYS)
    for name, err in gpt_report.wrong_ways.items():
        assert err is not None and err > 1e-3, name
    # k AdamW steps instead of one move the parameters about k times as far
    assert gpt_report.wrong_ways["step_every_micro_batch"] > 1.0


class BatchNormTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(37, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 37)

    def forward(self, ids):
        x = self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(x)


def test_batchnorm_fails_and_the_lint_names_it():
    torch.manual_seed(0)
    report = verify(BatchNormTagger(), gpt_data(), token_loss)
    assert not report.passed
    assert report.max_rel_err > 1e-3
    errors = [f for f in report.lint if f.severity == "error"]
    assert [f.module for f in errors] == ["norm"]
    assert "BatchNorm1d" in errors[0].problem and "LayerNorm" in errors[0].fix


def test_dropout_passes_with_the_note_that_rng_was_fixed():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, seq_len=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = verify(model, gpt_data(), token_loss)
    assert report.passed and report.max_rel_err <= 1e-5
    assert any("RNG fixed" in n and "blocks.0.attn" in n for n in report.notes)
    assert [f.severity for f in report.lint] == ["note"]
    # the model handed in is untouched: weights, and dropout still on
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(m.training for m in model.modules())


def test_a_loss_averaged_inside_is_named():
    def mean_loss(model, batch):
        loss_sum, n = token_loss(model, batch)
        return loss_sum / n, n

    report = verify(make_gpt(), gpt_data(), mean_loss, wrong_ways=False)
    assert not report.passed
    (finding,) = [f for f in report.lint if f.severity == "error"]
    assert finding.module == "loss_fn" and "averaged" in finding.problem
    assert "reduction='sum'" in finding.fix


class Router(nn.Module):
    """Leaves a load-balancing term of its batch in `self.aux`."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x):
        probs = self.proj(x).softmax(-1)
        self.aux = 100 * 4 * (probs.mean(dim=(0, 1)) ** 2).sum()
        return x


class RoutedTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(37, 16)
        self.router = Router()
        self.head = nn.Linear(16, 37)
        self.unused = nn.Linear(2, 2)

    def forward(self, ids):
        return self.head(self.router(self.embed(ids)))


def test_a_per_batch_auxiliary_loss_and_unused_parameters_are_named():
    def with_aux(model, batch):
        loss_sum, n = token_loss(model, batch)
        return loss_sum + model.router.aux, n

    torch.manual_seed(0)
    report = verify(RoutedTagger(), gpt_data(), with_aux, wrong_ways=False)
    by_module = {f.module: f for f in report.lint}
    assert "does not add up" in by_module["router"].problem
    assert "num_tokens" in by_module["router"].fix
    assert by_module["unused.weight"].severity == "warning"
    assert by_module["unused.bias"].problem == "receives no gradient from this loss"


def test_concatenation_pads_and_the_error_says_what_to_pass():
    a = {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([[2, 3]])}
    b = {"input_ids": torch.tensor([[4, 5, 6]]), "labels": torch.tensor([[5, 6, 7]])}
    whole = concat_batches([a, b])
    assert whole["input_ids"].tolist() == [[1, 2, 0], [4, 5, 6]]
    assert whole["labels"].tolist() == [[2, 3, -100], [5, 6, 7]]
    tagged = [{**m, "source": "doc"} for m in gpt_data()]
    with pytest.raises(BadInput, match="pass big_batch= .* or concat="):
        verify(make_gpt(), tagged, token_loss)
    report = verify(
        make_gpt(), tagged, token_loss, big_batch=concat_batches(gpt_data()), wrong_ways=False
    )
    assert report.passed


def test_bad_arguments_name_the_value():
    with pytest.raises(BadInput, match="precision 'fp8'"):
        verify(make_gpt(), gpt_data(), token_loss, precision="fp8")
    with pytest.raises(BadInput, match="needs at least one micro-batch"):
        verify(make_gpt(), [], token_loss)


@pytest.mark.parametrize("x, want", [(0.0123, 0.02), (2e-6, 2e-6), (4.1e-6, 5e-6), (6e-3, 1e-2)])
def test_nice_ceil(x, want):
    assert nice_ceil(x) == pytest.approx(want)


@pytest.mark.slow
def test_precision_study_fp32_buffer_beats_bf16_accumulation(tmp_path):
    data = sample_batches(64, 1, 16, 37, seed=2)
    points = precision_study(make_gpt(), data, token_loss)
    err = {(p.k, p.mode): p.rel_err for p in points}
    assert sorted({p.k for p in points}) == [1, 2, 4, 8, 16, 32, 64]
    for k in (16, 32, 64):
        assert err[k, "bf16_fp32_buffer"] < err[k, "bf16_accumulation"], k
    # one gradient: nothing is summed, both bf16 ways hand over the same numbers
    assert err[1, "bf16_fp32_buffer"] == pytest.approx(err[1, "bf16_accumulation"], rel=1e-9)
    assert max(p.max_param_rel_err for p in points if p.mode == "fp32") <= 1e-5
    # verify's tolerances pass this model's windows in every precision, at every k
    for precision, mode in PRECISION_MODES.items():
        worst = max(p.max_param_rel_err for p in points if p.mode == mode)
        assert worst <= TOLERANCES[precision], precision
    # and derive_tolerances follows its rule: largest x 4, rounded up, fp32 at least 1e-5
    derived = derive_tolerances(points)
    assert derived["fp32"] == 1e-5
    worst16 = max(p.max_param_rel_err for p in points if p.mode == "fp16_loss_scaler")
    assert worst16 * 4 <= derived["fp16"] <= worst16 * 4 * 2.5
    path = tmp_path / "study.png"
    assert write_plot(points, str(path))
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (840, 540)  # 7 x 4.5 inches at 120 dpi


# ---- the command line --------------------------------------------------------------------------

SMALL = ["--micro-batch", "2", "--seq-len", "16", "--k", "4"]


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_built_in_model_passes_as_json(capsys):
    code, out, _ = _run(capsys, *SMALL, "--json")
    got = json.loads(out)
    assert code == 0 and got["passed"] is True
    assert got["max_rel_err"] <= 1e-5 and got["tolerance"] == 1e-5
    for key in ("max_abs_err", "cosine_min", "param_max_abs_err"):
        assert isinstance(got[key], float)
    assert set(got["wrong_ways"]) == set(WRONG_WAYS)
    assert all(v > 1e-3 for v in got["wrong_ways"].values())
    assert got["lint"] == []


def test_cli_table_and_failure_exit_code(capsys, monkeypatch):
    code, out, _ = _run(capsys, *SMALL)
    assert code == 0
    assert "PASS" in out and "divided by k" in out and "tolerance 1e-05" in out
    # a tolerance below fp32 rounding: the check fails, a finding and not an error
    monkeypatch.setitem(TOLERANCES, "fp32", 1e-12)
    code, out, _ = _run(capsys, *SMALL)
    assert code == 1 and "FAIL" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--k", "0"], "--k 0"),
        (["--model", "huge"], "--model huge: unknown preset"),
        (["--k-max", "1000"], "--k-max 1000: must be a power of two"),
        (["--model-config", "/nonexistent/config.json"], "no such file"),
        (["--seq-len", "1"], "--seq-len 1: must be at least 2"),
        (["--model", "tiny", "--model-config", "c.json"], "--model tiny: give --model or"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_hf_config_and_precision_study(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    config.save_pretrained(tmp_path)
    plot = tmp_path / "study.png"
    argv = [*SMALL, "--model-config", str(tmp_path / "config.json"), "--json"]
    code, out, _ = _run(capsys, *argv, "--precision-study", "--k-max", "16", "--plot", str(plot))
    got = json.loads(out)
    assert code == 0 and got["passed"] and got["max_rel_err"] <= 1e-5
    assert any(f["severity"] == "note" for f in got["lint"])  # GPT-2's dropout, turned off
    study = got["precision_study"]
    assert {(p["k"], p["mode"]) for p in study} == {
        (k, m)
        for k in (1, 2, 4, 8, 16)
        for m in ("fp32", "bf16_fp32_buffer", "bf16_accumulation", "fp16_loss_scaler")
    }
    assert got["plot"] == str(plot) and plot.read_bytes()[:4] == b"\x89PNG"


# ---- sizes and paths refused before any work, in one line ------------------------------------


def test_cli_world_size_the_machine_cannot_hold_is_refused_before_starting(capsys):
    started = time.monotonic()
    code, out, err = _run(capsys, "--world-size", "100000")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--world-size 100000: more ranks than this machine holds" in err
    # the rule: at most 4 ranks per usable core, and the memory of 0.3 GB + 48 bytes per
    # parameter each (the tiny preset here)
    limit, rule = rank_capacity(48 * 834_304)
    assert f"at most {limit}: {rule}" in err and "per CPU core" in err
    assert time.monotonic() - started < 30  # nothing was started
    words = _help(capsys)  # the same rule in --help
    assert f"at most {RANKS_PER_CORE} per CPU core" in words
    assert f"{RANK_BASE_BYTES / 1e9:.1f} GB plus 48 bytes per model parameter" in words


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_cli_plot_without_the_study_is_refused(capsys, tmp_path):
    code, out, err = _run(capsys, *SMALL, "--plot", str(tmp_path / "p.png"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"--plot {tmp_path / 'p.png'}: needs --precision-study" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing_folder", "a_folder"])
def test_cli_plot_path_is_checked_before_the_study(capsys, tmp_path, where):
    plot = tmp_path / "nowhere" / "study.png" if where == "missing_folder" else tmp_path
    started = time.monotonic()
    code, out, err = _run(
        capsys, *SMALL, "--precision-study", "--k-max", "1024", "--plot", str(plot)
    )
    # one line, before the study (which prints its progress on stderr and takes minutes)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"--plot {plot}: " in err and "precision study" not in err
    assert ("no folder" in err) if where == "missing_folder" else ("is a folder" in err)
    assert time.monotonic() - started < 30
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_cli_sizes_beyond_what_the_reference_can_take_are_refused(capsys):
    started = time.monotonic()
    code, out, err = _run(capsys, "--seq-len", "100000")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--seq-len 100000: at most 4096" in err
    assert "at most 4096" in _help(capsys)
    # 100000 x 64 x 64 tokens, about 80 kB each in float64 on the tiny preset: far past any
    # machine's memory; the line names the three flags and what it would need
    code, out, err = _run(capsys, "--k", "100000", "--micro-batch", "64")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--k 100000 x --micro-batch 64 x --seq-len 64: verify's float64 big batch" in err
    need_gb = 100_000 * 64 * 64 * 8 * (18 * 4 * 128 + 3 * 256) / 1e9
    assert f"needs about {need_gb:,.0f} GB" in err
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_cli_a_long_window_says_what_it_does(capsys):
    # 65 x 4 x 64 = 16,640 positions: above the 16,384 that run in seconds
    code, out, err = _run(capsys, "--k", "65", "--seq-len", "64", "--json")
    assert code == 0 and json.loads(out)["passed"]
    lines = err.strip().splitlines()
    assert lines[0].startswith("verify: a window of 65 x 4 sequences of up to 64 tokens")
    assert [line.strip() for line in lines[1:]] == [
        "verify: the big batch in float64",
        "verify: the window through the engine, 65 micro-batches",
        f"verify: the usual mistakes ({len(WRONG_WAYS)}), same data, same engine",
        "verify: the lint",
    ]
