"""`gradaccum bench`: each contestant's update error against a big batch computed here, the
JSON fields, skipped peers. No timings are asserted: they belong to the benchmark run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from gradaccum.bench import BenchConfig, render_table, run_bench, to_json
from gradaccum.bench.pretrain.data import make_windows
from gradaccum.cli import bench as bench_cli
from gradaccum.cli.common import ArgumentParser
from gradaccum.models.build import build_model
from gradaccum.settings.command import add_command
from gradaccum.utils.errors import BadInput

SMALL = {"micro_batch": 2, "accum_steps": 4, "seq_len": 16, "rounds": 1, "windows": 1}
RESULT_FIELDS = {
    "name",
    "tokens_per_s",
    "ratio",
    "spread",
    "peak_memory_gb",
    "update_rel_err",
    "skipped",
}


def cli(argv: list[str]) -> int:
    """`gradaccum bench ARGV` through the subcommand's own parser."""
    parser = ArgumentParser(prog="gradaccum")
    add_command(parser.add_subparsers(dest="command"), bench_cli.COMMAND)
    args = parser.parse_args(["bench", *argv])
    return args.run(args)


def fp64_grads(model, window, per_micro_batch_mean: bool) -> list[torch.Tensor]:
    """float64 gradient of the window: the token mean over the whole window (one forward over
    all rows), or the sum over micro-batches of each one's token mean / k."""
    ref = copy.deepcopy(model).double()
    params = list(ref.parameters())

    def loss_sum(batch):
        logits = ref(batch["input_ids"])
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        labels = batch["labels"]
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )
        return total, (labels != -100).sum()

    if per_micro_batch_mean:
        loss = sum(s / n for s, n in map(loss_sum, window)) / len(window)
    else:
        rows = {k: torch.cat([b[k] for b in window]) for k in ("input_ids", "labels")}
        s, n = loss_sum(rows)
        loss = s / n
    return torch.autograd.grad(loss, params)


def rel(a, b) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.pow(2).sum()) for y in b)
    return (num / den) ** 0.5


def first_window_and_model(cfg: BenchConfig, vocab: int = 256):
    torch.manual_seed(cfg.seed)
    model, _ = build_model(preset=cfg.model, vocab_size=vocab, seq_len=cfg.seq_len)
    window = make_windows(1, cfg.accum_steps, cfg.micro_batch, cfg.seq_len, vocab, cfg.seed)[0]
    return model, window


@pytest.fixture(scope="module")
def no_peers():
    cfg = BenchConfig(peers=(), **SMALL)
    entries, config = run_bench(cfg)
    return cfg, entries, config


def test_errors_against_a_big_batch_computed_here(no_peers):
    cfg, entries, config = no_peers
    model, window = first_window_and_model(cfg)
    exact = fp64_grads(model, window, per_micro_batch_mean=False)
    mean_over_k = fp64_grads(model, window, per_micro_batch_mean=True)
    hand_expected = rel(mean_over_k, exact)
    assert hand_expected > 1e-3  # the data are ragged enough to tell the two apart
    by_name = {r["name"]: r for r in to_json(entries, config)["results"]}
    assert by_name["gradaccum"]["update_rel_err"] <= 1e-5
    assert by_name["hand-loop"]["update_rel_err"] == pytest.approx(hand_expected, rel=1e-3)


def test_json_has_exactly_the_fields(no_peers):
    cfg, entries, config = no_peers
    data = json.loads(json.dumps(to_json(entries, config)))
    assert set(data) == {"results", "overhead_ratio", "config"}
    assert [r["name"] for r in data["results"]] == ["gradaccum", "hand-loop"]
    for r in data["results"]:
        assert set(r) == RESULT_FIELDS
        assert r["skipped"] is None
        assert r["tokens_per_s"] > 0 and r["spread"] >= 0
    assert data["results"][1]["ratio"] == 1.0  # the hand loop over itself
    assert data["overhead_ratio"] == data["results"][0]["ratio"]
    assert data["config"] == {
        "model": "tiny",
        "micro_batch": 2,
        "accum_steps": 4,
        "seq_len": 16,
        "rounds": 1,
        "device": "cpu",
        "torch": torch.__version__,
    }


def test_table_names_who_divides_by_k(no_peers):
    cfg, entries, config = no_peers
    text = render_table(entries, config)
    assert "gradaccum Accumulator" in text and "hand loop" in text
    assert "divide each micro-batch's mean loss by k" in text
    assert "overhead ratio" in text


@pytest.mark.slow  # two rounds of both contestants
def test_it_says_what_it_will_run_before_the_first_step_then_each_figure(monkeypatch):
    from gradaccum.bench.pretrain import measure

    heard = []
    real = measure.big_batch_gradient

    def reference(*args):  # the first computation on the data: the plan must come before it
        heard.append("<reference computed>")
        return real(*args)

    monkeypatch.setattr(measure, "big_batch_gradient", reference)
    run_bench(BenchConfig(peers=(), **{**SMALL, "rounds": 2}), progress=heard.append)
    assert heard[1] == "<reference computed>"
    # 2 x 16 tokens x k 4 = 128 tokens per step; 2 contestants, 1 check step and 2 x (1 + 1)
    assert heard[0].startswith("bench: tiny (") and "on cpu" in heard[0]
    assert "micro-batch 2 x 16 tokens x k 4 = 128 tokens per optimizer step" in heard[0]
    assert "2 contestants (gradaccum, hand-loop)" in heard[0]
    assert "then 2 round(s) of 2 steps; first the big batch's gradient" in heard[0]
    assert heard[2].startswith("float64 big-batch gradient (the reference): ")
    # after the first step: the steps left, 1 check and 2 contestants x 2 rounds x 2 steps
    assert heard[3].startswith("update check, gradaccum: error ")
    assert "the 9 steps left take about" in heard[3]
    assert heard[4].startswith("update check, hand-loop: error ")
    rounds = [line.split(":")[0] for line in heard[5:]]
    assert rounds == [
        "round 1/2, gradaccum",
        "round 1/2, hand-loop",
        "round 2/2, hand-loop",  # the order alternates
        "round 2/2, gradaccum",
    ]
    assert all(line.endswith(" s)") and "tokens/s" in line for line in heard[5:])


def test_a_missing_peer_is_skipped_with_its_reason(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def fake(name, *args):
        if name == "lightning":
            raise ImportError("No module named 'lightning'")
        return real(name, *args)

    monkeypatch.setattr("gradaccum.bench.pretrain.loops.importlib.import_module", fake)
    assert (
        cli(
            [
                "--json",
                "--peers",
                "lightning",
                "--seq-len",
                "8",
                "--rounds",
                "1",
                "--windows",
                "1",
                "--micro-batch",
                "1",
                "--accum-steps",
                "2",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    skipped = data["results"][-1]
    assert skipped["name"] == "lightning"
    assert "not installed" in skipped["skipped"]
    assert all(skipped[f] is None for f in RESULT_FIELDS - {"name", "skipped"})


@pytest.mark.slow  # trains with each peer
def test_peers_against_the_big_batch():
    """Accelerate and Lightning divide by k (the hand loop's error); the Trainer passes the
    window's token count to the model (exact)."""
    for package in ("accelerate", "transformers", "lightning"):
        pytest.importorskip(package)
    cfg = BenchConfig(**SMALL)
    entries, config = run_bench(cfg)
    by_name = {r["name"]: r for r in to_json(entries, config)["results"]}
    assert all(r["skipped"] is None for r in by_name.values()), by_name
    model, window = first_window_and_model(cfg)
    exact = fp64_grads(model, window, per_micro_batch_mean=False)
    divided = rel(fp64_grads(model, window, per_micro_batch_mean=True), exact)
    assert by_name["trainer"]["update_rel_err"] <= 1e-5
    for name in ("accelerate", "lightning"):
        assert by_name[name]["update_rel_err"] == pytest.approx(divided, rel=1e-3)


def test_hugging_face_model_from_its_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16
    )  # ships with dropout 0.1: the bench must switch it off to compare updates
    config.save_pretrained(tmp_path)
    argv = ["--json", "--model-config", str(tmp_path / "config.json"), "--peers", "none"]
    argv += ["--seq-len", "16", "--micro-batch", "2", "--accum-steps", "3", "--rounds", "1"]
    assert cli(argv + ["--windows", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    ours, hand = data["results"]
    assert ours["update_rel_err"] <= 1e-5
    assert hand["update_rel_err"] > 1e-3
    assert data["config"]["model"].startswith("hf:")


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"micro_batch": 0}, "--micro-batch"),
        ({"accum_steps": -1}, "--accum-steps"),
        ({"seq_len": 1}, "--seq-len"),
        ({"rounds": 0}, "--rounds"),
        ({"model": "huge"}, "--model"),
        ({"model": "tiny", "model_config": "x.json"}, "--model"),
        ({"model_config": "/no/such/config.json"}, "--model-config"),
        ({"peers": ("deepspeed",)}, "--peers"),
    ],
)
def test_bad_config_names_the_flag(kwargs, flag):
    with pytest.raises(BadInput) as err:
        BenchConfig(**kwargs)
    assert str(err.value).startswith(flag)
