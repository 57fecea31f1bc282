"""`gradaccum verify --world-size N`: DDP and FSDP2 over N gloo processes on CPU against one
process taking the whole batch, window by window from the ranks' parameters, through
gradaccum.testing; for the built-in GPT at the command's own defaults (seeds 0 to 4, world
sizes 1 to 4, one start of the ranks per world size) and for a Hugging Face GPT-2 through
gradaccum.hf."""

from __future__ import annotations

import json

import pytest

from gradaccum.cli import build_parser, main
from gradaccum.cli.verify import parse_sizes
from gradaccum.settings.command import namespace
from gradaccum.testing import check_equivalences, rank_batches
from gradaccum.verification.cases import build_case, world_setups
from gradaccum.verification.check import TOLERANCES

pytestmark = pytest.mark.slow

SMALL = ["--micro-batch", "2", "--seq-len", "16", "--k", "2", "--world-size", "2", "--json"]
SEEDS = range(5)


def _world(capsys, *argv) -> dict:
    code = main(["verify", *argv])
    got = json.loads(capsys.readouterr().out)
    assert code == 0, got
    return got


def _check(got: dict, world: int = 2) -> None:
    assert got["passed"] is True
    assert [w["wrapper"] for w in got["world"]] == ["ddp", "fsdp2"]
    for w in got["world"]:
        assert w["passed"] and w["world_size"] == world
        assert w["grad_rel_err"] <= TOLERANCES["fp32"] and w["loss_rel_err"] <= TOLERANCES["fp32"]
        assert w["step_err"] <= w["step_tolerance"] == 5e-6  # 2 steps (tests/test_references)
        assert w["steps"] == w["windows"] == 2
        # tokens per window as the engine reported them, summed over the ranks, against the
        # single process's count of the same windows
        assert w["tokens"] == w["tokens_expected"] and min(w["tokens"]) > 0


def test_the_readme_command_passes(capsys):
    # `gradaccum verify --world-size 2` as the README gives it: the built-in GPT, seed 0
    _check(_world(capsys, "--world-size", "2", "--json"))


def test_world_size_2_passes_for_a_gpt2_config(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    config.save_pretrained(tmp_path)
    _check(_world(capsys, *SMALL, "--model-config", str(tmp_path / "config.json")))


def _cli_setups(world: int):
    """What `gradaccum verify --world-size WORLD --seed S` checks, for every seed in SEEDS."""
    setups, case = [], None
    for seed in SEEDS:
        # read as `verify_run.run` reads them: the defaults filled in
        args = namespace(
            build_parser().parse_args(["verify", "--world-size", str(world), "--seed", str(seed)])
        )
        sizes = parse_sizes(args)
        case = build_case(args, sizes)
        setups += world_setups(case, sizes)
    return case, setups


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_built_in_check_passes_for_seeds_0_to_4(world):
    case, setups = _cli_setups(world)
    assert {(s.seed, s.wrapper) for s in setups} == {
        (s, w) for s in SEEDS for w in ("ddp", "fsdp2")
    }
    reports = check_equivalences(
        case.factory,
        setups,
        timeout_s=900.0,
        loss_fn=case.loss_fn,
        count_tokens=case.count_tokens,
    )
    for report in reports:
        assert report.passed, report.to_dict()
        assert report.grad_rel_error <= TOLERANCES["fp32"]
        assert report.loss_rel_error <= TOLERANCES["fp32"]
        assert report.step_error <= report.step_tolerance == 5e-6
        assert report.reference == "float64"
        # tokens counted here from the data alone: window i holds every rank's
        # micro-batches k i .. k i + k - 1
        k, data = report.setup.accum_steps, [rank_batches(report.setup, r) for r in range(world)]
        want = [
            sum(int((b["labels"] != -100).sum()) for d in data for b in d[k * i : k * i + k])
            for i in range(report.windows)
        ]
        assert report.tokens == want and report.windows == 2


def _moe(capsys, mode: str, *argv) -> tuple[int, dict]:
    code = main(["verify", *SMALL, "--moe-balance", mode, *argv])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", ["global", "global-previous"])
def test_a_mixture_of_experts_passes_over_ranks_in_global_modes(capsys, mode):
    # each rank's windows through gradaccum.moe.Balance against the float64 big batch of
    # cross-entropy plus the LBL with the window's own f ("global-previous": the window
    # before's, at that window's parameters)
    code, got = _moe(capsys, mode, "--model", "tiny-moe")
    assert code == 0, got
    _check(got)
    assert got["moe"]["mode"] == mode and got["moe"]["passed"]


def test_a_mixture_of_experts_in_micro_mode_fails_over_ranks(capsys):
    code, got = _moe(capsys, "micro", "--model", "tiny-moe")
    assert code == 1 and got["passed"] is False
    assert [w["passed"] for w in got["world"]] == [False, False]
    assert all(
        w["grad_rel_err"] > 1e-4 and w["step_err"] <= w["step_tolerance"] for w in got["world"]
    )


def test_a_hugging_face_mixtral_config_passes_over_ranks(capsys, tmp_path):
    pytest.importorskip("transformers")
    from tests.models.moe_reference import moe_config

    moe_config("mixtral").save_pretrained(tmp_path)
    code, got = _moe(capsys, "global", "--model-config", str(tmp_path / "config.json"))
    assert code == 0, got
    _check(got)
