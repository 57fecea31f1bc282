"""`gradaccum verify --world-size N --sync {window,micro,hsdp}`: the check under each sync policy
on 4 gloo ranks (hsdp as 2 replicas x 2 shards), its gradient within 1e-5 of the float64 big
batch, and the gradient bytes the engine counted per window equal to the planner's
(`plan.sync`), both derived here by hand from the model's parameter shapes; bad --sync and
--shards refused in one line; the command's flags reach the setups. One start of the ranks."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from gradaccum.cli import build_parser, main
from gradaccum.cli.verify import parse_sizes
from gradaccum.settings.command import namespace
from gradaccum.testing import EquivalenceSetup, check_equivalences
from gradaccum.verification.cases import build_case, world_setups
from gradaccum.verification.render import world_row
from gradaccum.verification.traffic import traffic_check
from tests.reference import make_gpt

pytestmark = pytest.mark.slow

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

WORLD, K = 4, 2
RUNS = {  # name: (wrapper, sync, shards)
    "ddp window": ("ddp", "window", None),
    "fsdp2 window": ("fsdp2", "window", None),
    "fsdp2 micro": ("fsdp2", "micro", None),
    "fsdp2 hsdp": ("fsdp2", "hsdp", 2),
}
UNITS = len(make_gpt().blocks) + 1  # FSDP2: one reduce-scatter per fully_shard unit per sync


@pytest.fixture(scope="module")
def reports() -> dict:
    setups = [
        EquivalenceSetup(WORLD, accum_steps=K, steps=2, wrapper=w, sync=s, shards=n)
        for w, s, n in RUNS.values()
    ]
    got = check_equivalences(make_gpt, setups, timeout_s=120.0)
    return dict(zip(RUNS, got, strict=True))


def _params(shards: int) -> int:
    """The gradient's elements with each parameter's first dimension padded to a multiple of
    `shards`, as FSDP2 lays out a reduce-scatter's input (make_gpt's vocabulary of 37 rows:
    40 over 4 shards, 38 over 2)."""
    return sum(-(-p.shape[0] // shards) * shards * p[0].numel() for p in make_gpt().parameters())


def _by_hand() -> dict:
    """Per window: (bytes in, of them across replicas, bytes sent per rank on a ring), fp32.
    A ring sends (n - 1)/n of a reduce-scatter's input and 2 (n - 1)/n of an all-reduce's; the
    planner's G = 4 P (plan.sync): window 2 (w-1)/w G under DDP, (w-1)/w G under FSDP2,
    micro k (w-1)/w G, hsdp k (s-1)/s G + 2 (r-1)/r G / s."""
    p1, p4, p2 = _params(1), _params(WORLD), _params(2)
    half, three_quarters = Fraction(1, 2), Fraction(3, 4)
    return {
        "ddp window": (4 * p1, 0, 2 * three_quarters * 4 * p1),
        "fsdp2 window": (4 * p4, 0, three_quarters * 4 * p4),
        "fsdp2 micro": (K * 4 * p4, 0, K * three_quarters * 4 * p4),
        "fsdp2 hsdp": (K * 4 * p2 + 4 * p2 // 2, 4 * p2 // 2, K * half * 4 * p2 + 4 * p2 // 2),
    }


@pytest.mark.parametrize("run", list(RUNS))
def test_each_policy_passes_against_the_float64_big_batch(reports, run):
    report = reports[run]
    assert report.passed, report.to_dict()
    assert report.grad_rel_error <= 1e-5 and report.loss_rel_error <= 1e-5
    assert report.steps == report.windows == 2 and report.reference == "float64"


@pytest.mark.parametrize("run", list(RUNS))
def test_counted_bytes_equal_the_planners(reports, run):
    assert _params(2) != _params(1) != _params(WORLD)  # the padding is counted, not zero
    t = reports[run].traffic
    bytes_in, across, sent = _by_hand()[run]
    assert t.micro_steps == [K, K]
    assert t.input_bytes == [bytes_in] * 2 and t.replica_bytes == [across] * 2
    assert sent.denominator == 1
    assert t.counted_wire_bytes == t.planned_wire_bytes == [int(sent)] * 2
    assert t.equal
    want_collectives = {"fsdp2 window": UNITS, "fsdp2 micro": K * UNITS}
    want_collectives["fsdp2 hsdp"] = K * UNITS + UNITS  # + one all-reduce per unit per window
    if run in want_collectives:
        assert t.collectives == [want_collectives[run]] * 2


def test_a_traffic_mismatch_fails_the_check(reports):
    report = reports["fsdp2 hsdp"]
    # the planner told of one parameter more than the ranks sent: bytes differ, the check fails
    shapes = [tuple(p.shape) for p in make_gpt().parameters()] + [(2,)]
    got = {
        "micro_steps": report.traffic.micro_steps,
        "collectives": report.grad_collectives,
        "bytes": report.grad_bytes,
        "replica_bytes": report.traffic.replica_bytes,
    }
    wrong = traffic_check(report.setup, shapes, got)
    assert not wrong.equal and wrong.counted_wire_bytes != wrong.planned_wire_bytes
    assert not replace(report, traffic=wrong).passed


def test_the_json_rows_carry_the_policy_and_its_traffic(reports):
    rows = {run: world_row(report) for run, report in reports.items()}
    assert [(r["sync"], r["mesh"]) for r in rows.values()] == [
        ("window", [4, 1]),
        ("window", [1, 4]),
        ("micro", [1, 4]),
        ("hsdp", [2, 2]),
    ]
    for run, row in rows.items():
        assert row["passed"] and row["traffic"]["equal"], run
        assert row["traffic"]["padded_params"] == _params(row["mesh"][1])


@pytest.mark.parametrize(
    "world, shards, mesh", [(4, None, (2, 2)), (6, None, (2, 3)), (8, 2, (4, 2))]
)
def test_the_command_runs_fsdp2_under_sync_and_ddp_once_per_window(world, shards, mesh):
    argv = ["verify", "--world-size", str(world), "--sync", "hsdp"]
    argv += [] if shards is None else ["--shards", str(shards)]
    args = namespace(build_parser().parse_args(argv))
    sizes = parse_sizes(args)
    ddp, fsdp2 = world_setups(build_case(args, sizes), sizes, None)
    assert (ddp.wrapper, ddp.sync, ddp.mesh_shape) == ("ddp", "window", (world, 1))
    assert (fsdp2.wrapper, fsdp2.sync, fsdp2.mesh_shape) == ("fsdp2", "hsdp", mesh)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "3", "--sync", "hsdp"], "--sync hsdp: --world-size 3 does not factor"),
        (["--world-size", "4", "--sync", "hsdp", "--shards", "4"], "--shards 4: --world-size 4"),
        (["--world-size", "6", "--sync", "hsdp", "--shards", "4"], "--shards 4: --world-size 6"),
        (["--world-size", "4", "--sync", "micro", "--shards", "2"], "--shards 2: needs --sync"),
        (["--sync", "micro"], "--sync micro: needs --world-size"),
        (["--world-size", "4", "--sync", "ring"], "--sync ring: choose one of"),
    ],
)
def test_bad_sync_input_is_one_line_and_exit_2(capsys, argv, message):
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert message in err
