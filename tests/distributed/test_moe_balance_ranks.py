"""The MoE load-balancing loss on 2 gloo ranks under DDP and FSDP2: each rank holds part of the window's
micro-batches (3 and 2: the second repeats one with weight 0), and the gradient handed to the
optimizer equals one float64 big batch of the whole window computed without the engine or the
balance (`tests/models/moe_reference.py`), in each mode; the routed tokens and expert counts
travel in the window's own first all-gather. Under FSDP2 (every block and the root sharded)
the routing pass is the whole forward through the wrapper, and an expert that gets no token on
a rank still has its gradient reduce-scattered.

Every scenario runs in one pair of processes.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.moe.balance import Balance
from gradaccum.testing import GradRecorder, max_rel_error, run_ranks, wrap
from tests.models.moe_reference import MODELS, moe_batches, reference

from .ranks import TIMEOUT_S

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

NAMES = ("gpt", "mixtral")
SHARES = (slice(0, 3), slice(3, 5))  # rank 0 holds 3 micro-batches of the 5, rank 1 holds 2


def windows() -> list[list[dict]]:
    return [moe_batches(5, seed=61), moe_batches(5, seed=62)]


def _run(info, name: str, mode: str, wrapper: str = "ddp") -> dict:
    model = wrap(MODELS[name](), wrapper)  # FSDP2: each block, then the root
    recorder = GradRecorder(model.parameters())
    acc = Accumulator(model, recorder)
    balance = Balance(model, mode)
    out = {"aux": [], "lbl": [], "source": [], "agrees": []}
    for window in windows():
        result, stats = balance.step(acc, window[SHARES[info.rank]])
        assert result.micro_steps == 3
        out["aux"].append(result.aux_loss)
        out["lbl"].append(stats.lbl)
        out["source"].append(stats.f_source)
        out["agrees"].append(stats.routing_agrees)
    out["grads"] = recorder.seen
    return out


def _extra_sums(info) -> list:
    model = DistributedDataParallel(MODELS["gpt"]())
    acc = Accumulator(model, GradRecorder(model.parameters()))
    mine = torch.tensor([info.rank + 1, 10 * info.rank, 7], dtype=torch.int64)
    window = acc.begin_window(1 + info.rank, tokens=5, extra_sums=mine)
    out = [window.extra_sums.tolist(), window.micro_steps, window.tokens]
    window.abandon()
    return out


def scenarios(info) -> dict:
    out = {"extra": _extra_sums(info)}
    for name in NAMES:
        for mode in ("global", "micro", "global-previous"):
            out[f"{name}_{mode}"] = _run(info, name, mode)
        for mode in ("global", "global-previous"):
            out[f"fsdp2_{name}_{mode}"] = _run(info, name, mode, "fsdp2")
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(scenarios, 2, timeout_s=4 * TIMEOUT_S)


def test_extra_sums_are_summed_over_ranks_in_the_window_s_all_gather(ranks):
    assert [rank["extra"] for rank in ranks] == [[[3, 10, 14], 2, 10]] * 2


def both(ranks, key: str) -> dict:
    """Rank 0's results, after checking that rank 1 saw the same figures and gradients."""
    first, second = ranks[0][key], ranks[1][key]
    for a, b in zip(first["grads"], second["grads"], strict=True):
        assert max_rel_error(b, a) <= 1e-6  # replicas after DDP's all-reduce
    assert first["aux"] == pytest.approx(second["aux"], rel=1e-12)
    assert first["lbl"] == pytest.approx(second["lbl"], rel=1e-12)
    return first


@pytest.mark.parametrize("prefix", ["", "fsdp2_"])
@pytest.mark.parametrize("name", NAMES)
def test_global_on_two_ranks_is_the_big_batch(ranks, name, prefix):
    got = both(ranks, f"{prefix}{name}_global")
    model = MODELS[name]()
    for step, window in enumerate(windows()):
        want = reference(model, window, False)
        assert max_rel_error(got["grads"][step], want["grads"]) <= 1e-5
        assert got["aux"][step] == pytest.approx(want["lbl"], rel=1e-6)
        assert got["lbl"][step] == pytest.approx(want["lbl"], rel=1e-6)
    assert got["agrees"] == [True, True]


@pytest.mark.parametrize("name", NAMES)
def test_micro_on_two_ranks_is_the_token_weighted_micro_batch_losses(ranks, name):
    got = both(ranks, f"{name}_micro")
    model = MODELS[name]()
    window = windows()[0]
    own = reference(model, window, False, mode="micro")
    assert max_rel_error(got["grads"][0], own["grads"]) <= 1e-5
    assert max_rel_error(got["grads"][0], reference(model, window, False)["grads"]) > 1e-3
    assert got["aux"][0] == pytest.approx(own["aux"], rel=1e-6)


@pytest.mark.parametrize("prefix", ["", "fsdp2_"])
@pytest.mark.parametrize("name", NAMES)
def test_global_previous_on_two_ranks_takes_the_previous_window_s_f(ranks, name, prefix):
    got = both(ranks, f"{prefix}{name}_global-previous")
    model = MODELS[name]()
    first, second = windows()
    want_first = reference(model, first, False)
    want = reference(model, second, False, mode="given", f=want_first["f"])
    assert max_rel_error(got["grads"][0], want_first["grads"]) <= 1e-5
    assert max_rel_error(got["grads"][1], want["grads"]) <= 1e-5
    assert got["source"] == ["global", "previous"]
