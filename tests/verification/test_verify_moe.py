"""`verify` and `gradaccum verify` on a mixture of experts: the load-balancing loss in each
`--moe-balance` mode against the float64 big batch of `tests/models/moe_reference.py`, computed
there without the engine, the balance or verify's own reference."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from gradaccum import verify
from gradaccum.cli import main
from gradaccum.testing import max_rel_error, token_loss
from tests.models.moe_reference import (
    COEF,
    EXPERTS,
    moe_batches,
    moe_config,
    moe_gpt,
    reference,
)

SMALL = ["--micro-batch", "2", "--seq-len", "16", "--k", "4"]


def _verify(mode, window, **kw):
    return verify(moe_gpt(), window, token_loss, moe_balance=mode, wrong_ways=False, **kw)


def test_global_passes_and_the_per_micro_batch_loss_is_a_note():
    window = moe_batches(4, seed=5)
    report = _verify("global", window)
    big = reference(moe_gpt(), window, shift=False)
    micro = reference(moe_gpt(), window, shift=False, mode="micro")
    moe = report.moe
    assert report.passed and moe.passed and moe.mode == "global"
    assert moe.grad_rel_err <= 1e-5 and moe.tolerance == 1e-5
    assert moe.lbl == pytest.approx(big["lbl"], rel=1e-9)
    assert moe.aux_loss == pytest.approx(big["lbl"], rel=1e-6)
    assert moe.micro_lbl == pytest.approx(micro["aux"], rel=1e-6)
    # the per-micro-batch loss's error, as the independent reference gives it
    want = max_rel_error(micro["grads"], big["grads"])
    assert want > 1e-3 and moe.micro_rel_err == pytest.approx(want, rel=1e-2)
    (note,) = [f for f in report.lint if "per micro-batch" in f.problem]
    assert note.severity == "note" and note.module == "blocks.0.mlp.router"
    assert moe.tokens == sum(int(b["attention_mask"].sum()) for b in window)


def test_micro_fails_with_the_finding_and_its_error():
    window = moe_batches(4, seed=5)
    report = _verify("micro", window)
    big = reference(moe_gpt(), window, shift=False)
    micro = reference(moe_gpt(), window, shift=False, mode="micro")
    want = max_rel_error(micro["grads"], big["grads"])
    assert report.max_rel_err <= 1e-5  # the cross-entropy alone adds up
    assert not report.passed and not report.moe.passed
    assert report.moe.grad_rel_err > 1e-3
    assert report.moe.grad_rel_err == pytest.approx(want, rel=1e-2)
    # --json's top level carries the worst check, the balance's, beside passed false
    out = json.loads(report.to_json())
    assert out["max_rel_err"] == pytest.approx(want, rel=1e-2) and out["passed"] is False
    assert out["max_rel_err_check"] == "moe" and out["max_rel_err"] > out["tolerance"]
    finding = report.lint[0]
    assert finding.severity == "error"
    said = re.search(
        r"computed per micro-batch is off by (\S+) from the global batch's", finding.problem
    )
    assert float(said.group(1)) == pytest.approx(want, rel=0.06)  # printed to 2 digits
    assert "--moe-balance global makes it exact" in finding.fix


def test_global_previous_matches_the_exact_gradient_with_the_first_window_s_f():
    first, second = moe_batches(3, seed=11), moe_batches(4, seed=12)
    report = _verify("global-previous", second, previous_window=first)
    f_first = reference(moe_gpt(), first, shift=False)["f"]
    given = reference(moe_gpt(), second, shift=False, mode="given", f=f_first)
    own = reference(moe_gpt(), second, shift=False)
    moe = report.moe
    assert report.passed and moe.passed and moe.grad_rel_err <= 1e-5
    assert moe.aux_loss == pytest.approx(given["aux"], rel=1e-6)
    stale = max_rel_error(given["grads"], own["grads"])
    assert stale > 1e-3 and moe.stale_rel_err == pytest.approx(stale, rel=1e-2)
    assert any("one window stale in f" in note for note in report.notes)


def test_a_loss_fn_that_adds_the_model_s_own_per_forward_balance_is_named():
    def with_own_balance(model, batch):  # the LBL of each forward, as a model computes it
        out = model(batch["input_ids"], output_router_logits=True)
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )
        real = batch["attention_mask"].reshape(-1) == 1
        lbl = 0.0
        for logits in out.router_logits:
            probs = logits[real].float().softmax(-1)
            f = F.one_hot(probs.topk(2).indices, EXPERTS).sum((0, 1)) / real.sum()
            lbl = lbl + COEF * EXPERTS * (f * probs.mean(0)).sum() / len(out.router_logits)
        return loss_sum + lbl, (labels != -100).sum()

    torch.manual_seed(0)
    report = verify(moe_gpt(), moe_batches(4, seed=5), with_own_balance, wrong_ways=False)
    (finding,) = [f for f in report.lint if "once per forward" in f.problem]
    assert "does not add up over micro-batches" in finding.problem
    assert "--moe-balance global" in finding.fix and finding.severity == "error"


# ---- the command line --------------------------------------------------------------------------


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_moe_defaults_to_global_and_micro_fails_as_json(capsys):
    code, out, _ = _run(capsys, "--model", "tiny-moe", *SMALL, "--json")
    got = json.loads(out)
    assert code == 0 and got["passed"] is True
    assert got["moe"]["mode"] == "global" and got["moe"]["passed"] is True
    assert got["moe"]["grad_rel_err"] <= 1e-5
    code, out, _ = _run(capsys, "--model", "tiny-moe", "--moe-balance", "micro", *SMALL, "--json")
    got = json.loads(out)
    assert code == 1 and got["passed"] is False
    moe = got["moe"]
    assert moe["mode"] == "micro" and moe["passed"] is False and moe["grad_rel_err"] > 1e-3
    # the top level carries the worst of the checks deciding passed, and names it: the
    # balance's error, not the cross-entropy's alone, which passes on its own
    assert got["max_rel_err"] >= moe["grad_rel_err"] and got["max_rel_err_check"] == "moe"
    assert got["max_rel_err"] > got["tolerance"] == moe["tolerance"]  # as passed false says
    gradient, balance = got["checks"]
    assert gradient["check"] == "gradient" and gradient["passed"] is True
    assert gradient["max_rel_err"] <= 1e-5 < balance["max_rel_err"] == moe["grad_rel_err"]
    assert moe["grad_rel_err"] == moe["micro_rel_err"]
    assert {"lbl", "micro_lbl", "aux_loss", "tokens", "tolerance"} <= set(moe)
    assert got["lint"][0]["severity"] == "error" and "per micro-batch" in got["lint"][0]["problem"]


def test_cli_global_previous_table(capsys):
    code, out, _ = _run(capsys, "--model", "tiny-moe", "--moe-balance", "global-previous", *SMALL)
    assert code == 0
    (row,) = [line for line in out.splitlines() if "--moe-balance global-previous" in line]
    assert row.endswith("PASS") and float(row.split()[-2]) <= 1e-5
    assert "one window stale in f" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--moe-balance", "global"],
            "--moe-balance global: GPT is not a mixture of experts whose router logits",
        ),
        (
            ["--model", "tiny-moe", "--task", "sft", "--packing", "window"],
            "--packing window: a mixture of experts (--moe-balance global) is checked on padded",
        ),
        (["--model", "tiny-moe", "--moe-balance", "pooled"], "--moe-balance"),
    ],
)
def test_bad_moe_input_one_line_exit_2(capsys, argv, words):
    code, out, err = _run(capsys, *SMALL, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err


def test_cli_a_hugging_face_moe_config_global_passes_and_micro_fails(capsys, tmp_path):
    pytest.importorskip("transformers")
    moe_config("mixtral", vocab_size=300, coef=0.02).save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    code, out, _ = _run(capsys, "--model-config", config, *SMALL, "--json")
    moe = json.loads(out)["moe"]
    assert code == 0 and moe["mode"] == "global" and moe["grad_rel_err"] <= 1e-5
    assert (moe["n_expert"], moe["top_k"], moe["layers"], moe["coef"]) == (EXPERTS, 2, 2, 0.02)
    code, out, _ = _run(
        capsys, "--model-config", config, "--moe-balance", "micro", *SMALL, "--json"
    )
    moe = json.loads(out)["moe"]
    assert code == 1 and moe["passed"] is False and moe["grad_rel_err"] > 1e-3
