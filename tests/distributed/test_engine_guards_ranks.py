"""The engine's guards on 2 gloo processes, under DDP and FSDP2: a hand-written window that runs
other than declared is refused on every rank with nothing stepped, and the next one is exact;
a parameter unused on one rank (an expert rank 0 never routes to) is exact; a gradient left
from before the window and a parameter only the optimizer holds are exact.

Every scenario runs in one pair of processes; each test checks one against a single process
taking both ranks' micro-batches as one float64 batch, computed here without the engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.parallel import collectives
from gradaccum.testing import run_ranks
from tests.reference import IGNORE, big_batch, big_batch_grads, make_gpt, max_rel_error, token_loss

from .ranks import TIMEOUT_S, full, rank_data, record_grads

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

WRAPPERS = ("ddp", "fsdp2")
VOCAB = 37
SPLIT = VOCAB // 2  # token ids below go to expert 0, the rest to expert 1; expert 2 gets none


class Experts(nn.Module):
    """Three experts routed by token id: rank 0's data holds only ids below SPLIT, so it never
    routes to expert 1 (its forward never runs there); no rank routes to expert 2."""

    def __init__(self, d: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        route = (ids >= SPLIT).long()
        out = h
        for e, expert in enumerate(self.experts):
            chosen = (route == e).unsqueeze(-1)
            if bool(chosen.any()):
                out = out + torch.where(chosen, torch.tanh(expert(h)), 0.0)
        return self.head(out)


def expert_data(rank: int, count: int) -> list[dict]:
    data = rank_data(rank, count, seed=300)
    if rank == 0:  # never an id at or above SPLIT: expert 1 is unused here
        data = [{**b, "input_ids": b["input_ids"] % SPLIT} for b in data]
    return data


def wrap(model: nn.Module, wrapper: str, **ddp_options) -> nn.Module:
    """DDP, or FSDP2 on each GPT block and the root. The experts stay in the root's unit: a
    unit whose forward runs on some ranks only would all-gather on those ranks only."""
    if wrapper == "ddp":
        return DistributedDataParallel(model, **ddp_options)
    for block in getattr(model, "blocks", []):
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    return model


def params_of(model) -> list[torch.Tensor]:
    return [full(p).detach().clone() for p in model.parameters()]


def hand_window(acc, model, declared: int, batches: list) -> None:
    w = acc.begin_window(declared)
    for batch in batches:
        with w.micro_step():
            w.backward(*token_loss(model, batch))
    w.finish()


# ---- 3. a window that runs other than declared --------------------------------------------------


def _miscounted(info, wrapper: str) -> dict:
    model = wrap(make_gpt(), wrapper)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = record_grads(opt)
    acc = Accumulator(model, opt)
    data = rank_data(info.rank, 7)
    before = params_of(model)
    out = {}
    for declared, ran in ((3, 2), (2, 3)):
        try:
            hand_window(acc, model, declared, data[:ran])
            out[(declared, ran)] = "no error"
        except RuntimeError as err:
            out[(declared, ran)] = str(err)
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(params_of(model), before, strict=True))
    out["state"] = (acc.steps, len(opt.state), len(grads))
    hand_window(acc, model, 2, data[5:7])  # then a window run as declared
    out["grads"] = grads
    return out


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_miscounted_window_is_refused_on_every_rank_and_the_next_is_exact(ranks, wrapper):
    for rank in ranks:
        got = rank[f"miscounted_{wrapper}"]
        assert "finish() after 2 of the 3 micro-steps" in got[(3, 2)]
        assert "micro_step() 3 of a window begun with 2" in got[(2, 3)]
        assert all(
            "nothing stepped" in got[key] and "\n" not in got[key] for key in ((3, 2), (2, 3))
        )
        assert got["untouched"] and got["state"] == (0, 0, 0)
        # nothing of the refused windows reached the next one (FSDP2 keeps unreduced
        # gradients of micro-steps run without sync: they are dropped too)
        window = rank_data(0, 7)[5:7] + rank_data(1, 7)[5:7]
        want = big_batch_grads(make_gpt(), window, dtype=torch.float64)
        assert max_rel_error(got["grads"][0], want) <= 1e-5


# ---- 6. a parameter unused on one rank ---------------------------------------------------------


def _unused(info, wrapper: str) -> dict:
    options = {"find_unused_parameters": True} if wrapper == "ddp" else {}
    model = wrap(Experts(), wrapper, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = record_grads_or_none(opt)
    acc = Accumulator(model, opt)
    data = expert_data(info.rank, 6)
    for window in (data[:3], data[3:]):
        acc.step(window, token_loss)
    return {"grads": grads}


def record_grads_or_none(optimizer) -> list[list[torch.Tensor | None]]:
    """The gradients handed to `optimizer` at each step (whole tensors; None where none)."""
    seen: list = []

    def hook(opt, args, kwargs):
        params = [p for g in opt.param_groups for p in g["params"]]
        seen.append([None if p.grad is None else full(p.grad).detach().clone() for p in params])

    optimizer.register_step_pre_hook(hook)
    return seen


def experts_reference(window: list[dict]) -> list[torch.Tensor | None]:
    """Float64 big-batch gradient of `Experts`; None for the expert no token routes to."""
    model = Experts().double()
    loss_sum, n = token_loss(model, big_batch(window))
    (loss_sum / n).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_parameter_unused_on_one_rank_is_exact(ranks, wrapper):
    data = [expert_data(r, 6) for r in range(2)]
    names = [name for name, _ in Experts().named_parameters()]
    for rank in ranks:
        got = rank[f"unused_{wrapper}"]["grads"]
        for step, window in enumerate((slice(0, 3), slice(3, 6))):
            want = experts_reference(data[0][window] + data[1][window])
            for name, g, w in zip(names, got[step], want, strict=True):
                if name.startswith("experts.2"):  # no rank routes to it: no gradient at all
                    assert w is None and (g is None or not g.any()), name
                    continue
                assert g is not None and max_rel_error([g], [w]) <= 1e-5, name


# ---- 1 and 2. a gradient from before the window; a parameter only the optimizer holds ----------


def tempered_loss(temperature):
    def loss_fn(model, batch):
        logits = model(batch["input_ids"])
        logits = logits if logits.dtype == torch.float64 else logits.float()
        labels = batch["labels"]
        loss = F.cross_entropy(
            (logits / temperature).reshape(-1, VOCAB),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return loss, (labels != IGNORE).sum()

    return loss_fn


def _stale_and_outside(info, wrapper: str, count_tokens) -> dict:
    model = wrap(make_gpt(), wrapper)
    # each rank starts its own value: the engine broadcasts rank 0's, as DDP does the model's
    temperature = nn.Parameter(torch.tensor(1.5 + info.rank))
    opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.0)
    grads = record_grads(opt)
    data = rank_data(info.rank, 6, seed=200)
    loss_fn = tempered_loss(temperature)
    loss_sum, n = loss_fn(model, data[0])
    (loss_sum / n).backward()  # a probe: .grad is there when the first window begins
    acc = Accumulator(model, opt, count_tokens=count_tokens, max_grad_norm=0.05)
    acc.step(data[:3], loss_fn)
    loss_sum, n = loss_fn(model, data[5])
    (loss_sum / n).backward()  # and another between windows
    acc.step(data[3:], loss_fn)
    return {"grads": grads, "temperature": temperature.item()}


def tempered_reference(window, max_grad_norm) -> list[torch.Tensor]:
    model = make_gpt().double()
    temp = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    loss_sum, n = tempered_loss(temp)(model, big_batch(window))
    (loss_sum / n).backward()
    grads = [p.grad for p in model.parameters()] + [temp.grad]
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    return [g * min(1.0, max_grad_norm / (norm + 1e-6)) for g in grads]


@pytest.mark.parametrize("count_tokens", ["auto", None])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_stale_gradients_and_a_parameter_outside_the_model_are_exact(ranks, wrapper, count_tokens):
    data = [rank_data(r, 6, seed=200) for r in range(2)]
    for rank in ranks:
        got = rank[f"stale_{wrapper}_{count_tokens}"]
        assert got["temperature"] == 1.5  # rank 0's value on every rank
        for step, window in enumerate((slice(0, 3), slice(3, 6))):
            want = tempered_reference(data[0][window] + data[1][window], 0.05)
            assert max_rel_error(got["grads"][step], want) <= 1e-5


def _dtensor_outside(info) -> str:
    model = wrap(make_gpt(), "fsdp2")
    mesh = init_device_mesh("cpu", (2,))
    bias = nn.Parameter(distribute_tensor(torch.zeros(VOCAB), mesh, [Replicate()]))
    try:
        Accumulator(model, torch.optim.SGD([*model.parameters(), bias], lr=0.1))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_sharded_parameter_outside_the_model_is_refused_naming_it(ranks):
    for rank in ranks:
        said = rank["dtensor_outside"]
        assert said.startswith("optimizer.param_groups[0][") and "DTensor outside the model" in said


# ---- the window's size: label capacity summed, or unknown when one rank cannot read it ----------


def _sizes(info) -> list:
    mine = 10 * (info.rank + 1)
    both = collectives.agree_on_window_size(3, 2 + info.rank, capacity=mine)
    one = collectives.agree_on_window_size(3, 2, capacity=mine if info.rank == 0 else None)
    return [both.tokens, both.micro_steps, both.capacity, one.capacity]


def test_ranks_agree_on_the_window_s_size_and_label_capacity(ranks):
    assert [rank["sizes"] for rank in ranks] == [[6, 3, 30, None]] * 2


# ---- one spawn for every scenario -----------------------------------------------------------------


def guard_scenarios(info) -> dict:
    out = {"sizes": _sizes(info), "dtensor_outside": _dtensor_outside(info)}
    for wrapper in WRAPPERS:
        out[f"miscounted_{wrapper}"] = _miscounted(info, wrapper)
        out[f"unused_{wrapper}"] = _unused(info, wrapper)
        for count_tokens in ("auto", None):
            out[f"stale_{wrapper}_{count_tokens}"] = _stale_and_outside(info, wrapper, count_tokens)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(guard_scenarios, 2, timeout_s=4 * TIMEOUT_S)
