"""`plan --sync`: each gradient-sync policy's bytes, memory and time against hand-derived
numbers, auto's choice, and the bad inputs (one line, exit 2)."""

import json

import pytest

from gradaccum.cli import main
from gradaccum.plan import PlanError, PlanInputs, make_plan, render_table
from gradaccum.plan.sync import PolicyCost, choose
from gradaccum.utils.sizes import parse_bandwidth

P7 = 6_738_415_616  # Llama 2 7B
G7 = 4 * P7  # its fp32 gradient, bytes


def small(**kw):
    """P = 1000 parameters, w = 4 ranks on 2 nodes of 2, k = 3; 1000 B/s within a node and
    100 B/s across nodes."""
    args = dict(params=1000, gpus=4, gpus_per_node=2, accum_steps=3, micro_batch=1)
    args.update(intra_node_bw=1000.0, inter_node_bw=100.0)
    return make_plan(PlanInputs(**{**args, **kw})).sync


def by_policy(sync) -> dict:
    return {c.policy: c for c in sync.policies}


def test_each_policy_by_hand():
    # G = 4 x 1000 = 4000 bytes of fp32 gradient; n = 2 per node, N = 2 nodes, w = 4.
    p = by_policy(small())
    # window, ZeRO-0: one all-reduce, hierarchical: 2 (n-1)/n G = 4000 within the node,
    # 2 (N-1)/N G/n = 2000 across; together 2 (w-1)/w G = 6000. Gradient held whole.
    assert (p["window"].intra_node_bytes, p["window"].inter_node_bytes) == (4000, 2000)
    assert p["window"].grad_memory_bytes == 4000
    assert p["window"].sync_time_s == pytest.approx(4000 / 1000 + 2000 / 100)
    # micro: 3 reduce-scatters over 4: 3 x (1/2 x 4000) within, 3 x (1/2 x 2000) across.
    assert (p["micro"].intra_node_bytes, p["micro"].inter_node_bytes) == (6000, 3000)
    assert p["micro"].intra_node_bytes + p["micro"].inter_node_bytes == 3 * 3 * 4000 // 4
    assert p["micro"].grad_memory_bytes == 1000
    assert p["micro"].sync_time_s == pytest.approx(6 + 30)
    # hsdp, 2 replicas x 2 shards: 3 reduce-scatters within the node, (s-1)/s G = 2000 each;
    # one all-reduce of the 2000-byte shard across the 2 replicas, 2 (r-1)/r x 2000 = 2000.
    assert (p["hsdp"].intra_node_bytes, p["hsdp"].inter_node_bytes) == (6000, 2000)
    assert p["hsdp"].grad_memory_bytes == 2000
    assert p["hsdp"].sync_time_s == pytest.approx(6 + 20)


def test_window_under_sharding_reduce_scatters_once():
    window = by_policy(small(zero=2))["window"]
    # (n-1)/n G = 2000 within the node, (N-1)/N G/n = 1000 across; the gradient stays whole.
    assert (window.intra_node_bytes, window.inter_node_bytes) == (2000, 1000)
    assert window.grad_memory_bytes == 4000 and window.zero == 2


def test_one_node_sends_nothing_across_and_has_no_hsdp():
    sync = small(gpus_per_node=4)
    assert [c.policy for c in sync.policies] == ["window", "micro"]
    assert all(c.inter_node_bytes == 0 for c in sync.policies)
    # all-reduce over 4 in one node: 2 x 3/4 x 4000; 3 reduce-scatters: 3 x 3/4 x 4000
    assert [c.intra_node_bytes for c in sync.policies] == [6000, 9000]


def test_gpus_per_node_default_is_the_largest_divisor_up_to_8():
    assert small(gpus=64, gpus_per_node=None).gpus_per_node == 8
    assert small(gpus=12, gpus_per_node=None).gpus_per_node == 6
    assert small(gpus=4, gpus_per_node=None).nodes == 1


def _seven_b(**kw):
    args = dict(
        model="llama2-7b", gpus=64, gpus_per_node=8, target_tokens=4_000_000, seq_len=4096,
        micro_batch=1, device_memory=80 * 10**9, sync="auto", flash_attention=True,
        checkpointing="full",
    )  # fmt: skip
    return make_plan(PlanInputs(**{**args, **kw}))


def test_auto_takes_hsdp_when_the_faster_window_does_not_fit():
    plan = _seven_b()
    p = by_policy(plan.sync)
    k = 15  # round(4M / (4096 x 64))
    assert plan.accum_steps == k
    # window at ZeRO-0 holds 2P bf16 weights + 4P fp32 buffer + 12P AdamW and master weights:
    # 18P = 121 GB before any activation, over 80 GB.
    assert p["window"].memory_total_gb > 18 * P7 / 1e9 > 80 and p["window"].fits is False
    # hsdp at ZeRO-2 over the node's 8: 2P + (4P + 12P) / 8 = 4P = 27 GB, plus activations.
    assert 4 * P7 / 1e9 < p["hsdp"].memory_total_gb < 80 and p["hsdp"].fits is True
    window = 2 * 7 / 8 * G7 / 300e9 + 2 * 7 / 8 * G7 / 8 / 50e9
    hsdp = k * 7 / 8 * G7 / 300e9 + 2 * 7 / 8 * G7 / 8 / 50e9
    micro = k * 7 / 8 * G7 / 300e9 + k * 7 / 8 * G7 / 8 / 50e9
    assert [c.sync_time_s for c in plan.sync.policies] == pytest.approx([window, micro, hsdp])
    assert plan.sync.policy == "hsdp" and "window" in plan.sync.why
    # the plan's memory rows are hsdp's
    assert plan.memory.total_gb == pytest.approx(p["hsdp"].memory_total_gb)
    assert plan.memory.accum_buffer_gb == pytest.approx(-(-G7 // 8) / 1e9)
    text = render_table(plan)
    assert "hsdp *" in text and "--sync auto chose hsdp" in text


def test_auto_takes_window_when_it_fits():
    plan = _seven_b(zero=3)  # FSDP2: the window's whole gradient fits beside sharded state
    assert plan.sync.policy == "window" and plan.sync.policies[0].fits


def test_auto_with_nothing_fitting_takes_the_least_memory():
    plan = _seven_b(flash_attention=None, checkpointing=None)  # 105 GB of activations
    assert all(c.fits is False for c in plan.sync.policies)
    assert plan.sync.policy == "micro" and "none fits" in plan.sync.why


def _cost(policy, time, gb, fits):
    return PolicyCost(policy, "", 2, 0, 0, 0, time, gb, fits)


def test_choose_fastest_that_fits():
    costs = [_cost("window", 1.0, 90, False), _cost("micro", 3.0, 10, True)]
    costs.append(_cost("hsdp", 2.0, 20, True))
    assert choose(costs, 80 * 10**9)[0] == "hsdp"
    costs[0].fits = True
    assert choose(costs, 80 * 10**9)[0] == "window"


def test_json_carries_the_policies(capsys):
    flags = "plan --params 1000 --gpus 4 --gpus-per-node 2 --accum-steps 3 --micro-batch 1"
    flags += " --intra-node-bw 1000B/s --inter-node-bw 800b/s --sync micro --json"
    assert main(flags.split()) == 0
    d = json.loads(capsys.readouterr().out)["sync"]
    assert d["policy"] == "micro" and d["inter_node_bw_gb_s"] == pytest.approx(100 / 1e9)
    micro = next(c for c in d["policies"] if c["policy"] == "micro")
    assert (micro["intra_node_bytes"], micro["inter_node_bytes"]) == (6000, 3000)
    assert micro["sync_time_s"] == pytest.approx(36.0)


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [("300GB/s", 300e9), ("400Gb/s", 50e9), ("25GiB/s", 25 * 2**30), ("50", 50e9), ("1TB", 1e12)],
)
def test_bandwidth_units(text, bytes_per_s):
    assert parse_bandwidth(text, "--inter-node-bw") == bytes_per_s


@pytest.mark.parametrize(
    "extra, words",
    [
        ("--gpus 12 --gpus-per-node 8", "--gpus-per-node 8: does not divide --gpus 12"),
        ("--gpus 8 --gpus-per-node 8 --sync hsdp", "--sync hsdp: needs 2 nodes or more"),
        ("--gpus 8 --sync hsdp", "--sync hsdp: needs 2 nodes or more"),
        ("--gpus 16 --sync micro --zero 1", "--sync micro: shards the gradient"),
        ("--sync micro", "--sync micro: needs --gpus 2 or more"),
        ("--gpus 16 --sync auto", "--sync auto: needs --device-memory"),
        ("--gpus 16 --sync bogus", "--sync bogus"),
        ("--gpus 16 --sync window --sync-every-micro-batch", "--sync-every-micro-batch"),
        ("--gpus 16 --inter-node-bw 5Q", "--inter-node-bw 5Q: unknown unit"),
        ("--gpus 16 --intra-node-bw 0", "--intra-node-bw 0: must be greater than zero"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, extra, words):
    base = ["plan", "--model", "llama2-7b", "--seq-len", "4096", "--micro-batch", "1"]
    assert main([*base, *extra.split()]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert words in captured.err


def test_bad_input_in_python_too():
    with pytest.raises(PlanError, match="does not divide"):
        PlanInputs(gpus=6, gpus_per_node=4)
