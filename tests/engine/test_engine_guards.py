"""The engine in a hand-written loop is exact or refuses, never silently wrong (one process).

Each test checks against a big-batch reference computed without the engine (float64 autograd
on a copy of the model, tests/reference.py) or asserts that a misuse is refused with one line
and nothing stepped: stale gradients, parameters only the optimizer holds, windows that run
other than declared or are used after they closed, fp16 without token counts, and loss_fn
contract violations. The 2-rank cases are in tests/distributed/test_engine_guards_ranks.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from gradaccum import Accumulator, verify, windows
from tests.reference import (
    IGNORE,
    GradRecorder,
    big_batch,
    big_batch_grads,
    exact_fp64_sum,
    make_gpt,
    make_mlp,
    max_rel_error,
    ragged_batches,
    token_loss,
)

BF16_ROUNDING = 2.0**-8  # one rounding to bf16 (8 significant bits), relative


def probe(model, batch) -> None:
    """A backward outside any window: a sanity check, or an evaluation without no_grad."""
    loss_sum, n = token_loss(model, batch)
    (loss_sum / n).backward()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def unchanged(model, before: list[torch.Tensor]) -> bool:
    return same([p.detach() for p in model.parameters()], before)


# ---- 1. a .grad present when a window begins -------------------------------------------------


@pytest.mark.parametrize("setup", ["fp32", "bf16", "bf16_master_weights"])
def test_a_gradient_from_before_the_window_does_not_leak_into_it(setup):
    dtype = torch.float32 if setup == "fp32" else torch.bfloat16
    options = {"master_weights": True} if setup == "bf16_master_weights" else {}
    model = make_mlp(seed=2).to(dtype)
    clean = copy.deepcopy(model)
    data = ragged_batches("mlp", 8, seed=31, dtype=dtype)
    probe(model, data[0])  # a .grad already there when the Accumulator is built
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt, **options)
    acc.step(data[:4], token_loss)
    probe(model, data[6])  # between windows: lands in the fp32 buffers of bf16 parameters
    acc.step(data[4:], token_loss)
    clean_opt = GradRecorder(clean.parameters())
    clean_acc = Accumulator(clean, clean_opt, **options)
    for window in windows(data, 4):
        clean_acc.step(window, token_loss)
    # bit for bit what a model that never ran those backwards gets ...
    assert all(same(a, b) for a, b in zip(opt.seen, clean_opt.seen, strict=True))
    # ... which is each window's own gradient
    for seen, window in zip(opt.seen, (data[:4], data[4:]), strict=True):
        if dtype == torch.float32:
            assert max_rel_error(seen, big_batch_grads(model, window, dtype=torch.float64)) <= 1e-5
        else:  # bf16 micro-batch gradients summed in fp32, rounded to bf16 at most once
            assert max_rel_error(seen, exact_fp64_sum(model, window)) <= BF16_ROUNDING


# ---- 2. a parameter the optimizer holds and the model does not -------------------------------


def tempered_loss(temperature: torch.Tensor):
    """Token cross-entropy of logits / temperature: a learnable parameter used in loss_fn."""

    def loss_fn(model, batch):
        logits = model(batch["input_ids"])
        logits = logits if logits.dtype == torch.float64 else logits.float()
        labels = batch["labels"]
        loss = F.cross_entropy(
            (logits / temperature).reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return loss, (labels != IGNORE).sum()

    return loss_fn


def tempered_reference(model, temperature, window, max_grad_norm=None) -> list[torch.Tensor]:
    """Float64 big-batch gradient of the model's parameters and the temperature, clipped by
    hand to `max_grad_norm` (torch's rule: times min(1, max / (norm + 1e-6)))."""
    twin = copy.deepcopy(model).double()
    temp = temperature.detach().double().requires_grad_(True)
    loss_sum, n = tempered_loss(temp)(twin, big_batch(window))
    (loss_sum / n).backward()
    grads = [p.grad for p in twin.parameters()] + [temp.grad]
    if max_grad_norm is not None:
        norm = torch.cat([g.flatten() for g in grads]).norm().item()
        grads = [g * min(1.0, max_grad_norm / (norm + 1e-6)) for g in grads]
    return grads


@pytest.mark.parametrize("count_tokens", ["auto", None])
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_a_parameter_only_the_optimizer_holds_is_cleared_corrected_and_clipped(
    count_tokens, max_grad_norm
):
    model = make_gpt(seed=3)
    temperature = torch.nn.Parameter(torch.tensor(1.7))
    opt = GradRecorder([*model.parameters(), temperature])
    acc = Accumulator(model, opt, max_grad_norm=max_grad_norm, count_tokens=count_tokens)
    data = ragged_batches("gpt", 9, seed=41)
    loss_fn = tempered_loss(temperature)
    results = [acc.step(w, loss_fn) for w in windows(data, 3)]
    for seen, result, window in zip(opt.seen, results, windows(data, 3), strict=True):
        want = tempered_reference(model, temperature, window, max_grad_norm)
        assert max_rel_error(seen, want) <= 1e-5
        unclipped = tempered_reference(model, temperature, window)
        norm = torch.cat([g.flatten() for g in unclipped]).norm().item()
        assert result.grad_norm == pytest.approx(norm, rel=1e-5)
    assert temperature.grad is None  # cleared after the window, like the model's


def test_a_parameter_outside_the_model_steps_with_the_model():
    # SGD: the temperature moves by lr times its big-batch gradient, window after window
    model = make_gpt(seed=5)
    ref_model = copy.deepcopy(model)
    temperature = torch.nn.Parameter(torch.tensor(0.8))
    ref_temp = torch.nn.Parameter(torch.tensor(0.8))
    acc = Accumulator(model, torch.optim.SGD([*model.parameters(), temperature], lr=0.2))
    ref_opt = torch.optim.SGD([*ref_model.parameters(), ref_temp], lr=0.2)
    for window in windows(ragged_batches("gpt", 8, seed=43), 4):
        acc.step(window, tempered_loss(temperature))
        grads = tempered_reference(ref_model, ref_temp, window)
        for p, g in zip([*ref_model.parameters(), ref_temp], grads, strict=True):
            p.grad = g.to(p.dtype)
        ref_opt.step()
    assert max_rel_error([temperature.detach()], [ref_temp.detach()]) <= 1e-5
    assert max_rel_error(list(model.parameters()), list(ref_model.parameters())) <= 1e-5


# ---- 3. a hand-written window that runs other than it declared -------------------------------


def hand_window(acc, model, declared, batches, loss_fn=token_loss):
    w = acc.begin_window(declared)
    for batch in batches:
        with w.micro_step():
            w.backward(*loss_fn(model, batch))
    return w.finish()


def built(seed=7):
    model = make_gpt(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return model, opt, sched, Accumulator(model, opt, scheduler=sched)


def nothing_stepped(model, opt, sched, acc, before) -> bool:
    return (
        unchanged(model, before)
        and opt.state == {}
        and acc.steps == 0
        and sched.last_epoch == 0
        and all(p.grad is None for p in model.parameters())
    )


@pytest.mark.parametrize("declared, ran", [(3, 2), (2, 3), (4, 0)])
def test_a_window_that_runs_other_than_declared_is_refused(declared, ran):
    model, opt, sched, acc = built()
    before = [p.detach().clone() for p in model.parameters()]
    data = ragged_batches("gpt", 8, seed=47)
    calls = []

    def counting_loss(model, batch):
        calls.append(1)
        return token_loss(model, batch)

    word = "micro_step" if ran > declared else "finish"
    with pytest.raises(RuntimeError, match=rf"{word}\(\).*{declared}.*nothing stepped") as err:
        hand_window(acc, model, declared, data[:ran], counting_loss)
    assert "\n" not in str(err.value)
    assert len(calls) == min(ran, declared)  # the micro-step past the count ran no forward
    assert nothing_stepped(model, opt, sched, acc, before)
    # the Accumulator goes on: the next window is its own big batch, exactly
    recorder = GradRecorder(model.parameters())
    exact = Accumulator(model, recorder)
    hand_window(exact, model, 4, data[4:])
    assert max_rel_error(recorder.seen[0], big_batch_grads(model, data[4:], torch.float64)) <= 1e-5


def test_a_micro_step_without_a_backward_and_backward_outside_or_twice_are_refused():
    model, opt, sched, acc = built()
    before = [p.detach().clone() for p in model.parameters()]
    data = ragged_batches("gpt", 3, seed=53)
    w = acc.begin_window(data)
    for batch in data[:2]:
        with w.micro_step():
            w.backward(*token_loss(model, batch))
    with w.micro_step():
        pass  # this micro-batch never ran backward
    with pytest.raises(RuntimeError, match=r"finish\(\).*2 of .*backward.*nothing stepped"):
        w.finish()
    w = acc.begin_window(data)
    with pytest.raises(RuntimeError, match=r"backward.*outside.*micro_step"):
        w.backward(*token_loss(model, data[0]))
    with w.micro_step():
        w.backward(*token_loss(model, data[0]))
        with pytest.raises(RuntimeError, match=r"backward.*twice"):
            w.backward(*token_loss(model, data[0]))
    with pytest.raises(RuntimeError, match="raised"):
        with w.micro_step():
            raise RuntimeError("a micro-batch that raised")
    assert w.state == "abandoned"  # a micro-step that raised drops the window
    assert nothing_stepped(model, opt, sched, acc, before)


# ---- 4. a finished or abandoned window refuses further use -----------------------------------


def test_a_finished_window_refuses_to_step_again():
    model, opt, sched, acc = built()
    data = ragged_batches("gpt", 2, seed=59)
    w = acc.begin_window(data)
    for batch in data:
        with w.micro_step():
            w.backward(*token_loss(model, batch))
    first = w.finish()
    after = [p.detach().clone() for p in model.parameters()]
    for use in (w.finish, w.micro_step().__enter__, w.abandon):
        with pytest.raises(RuntimeError, match="already finished") as err:
            use()
        assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="already finished"):
        w.backward(*token_loss(model, data[0]))
    # one optimizer step and one scheduler step: lr 0.1 -> 0.05, not 0.025
    assert (first.step, acc.steps, sched.last_epoch) == (1, 1, 1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert unchanged(model, after)


def test_an_abandoned_window_refuses_use_and_an_open_one_blocks_the_next():
    model, opt, sched, acc = built()
    before = [p.detach().clone() for p in model.parameters()]
    data = ragged_batches("gpt", 4, seed=61)
    w = acc.begin_window(data[:2])
    with w.micro_step():
        w.backward(*token_loss(model, data[0]))
    with pytest.raises(RuntimeError, match=r"still open \(1 of 2 micro-steps"):
        acc.step(data[2:], token_loss)
    with pytest.raises(RuntimeError, match="still open"):
        acc.begin_window(data[2:])
    w.abandon()
    w.abandon()  # twice is harmless: it is dropped either way
    for use in (w.finish, w.micro_step().__enter__):
        with pytest.raises(RuntimeError, match="already abandoned"):
            use()
    assert nothing_stepped(model, opt, sched, acc, before)
    # acc.abandon_window() closes the open window too (the trainer's recovery seam)
    w = acc.begin_window(data[2:])
    acc.abandon_window()
    with pytest.raises(RuntimeError, match="already abandoned"):
        w.finish()
    assert acc.step(data[2:], token_loss).step == 1


# ---- 5. fp16 without token counts --------------------------------------------------------------


def sparse_first(seed: int, tokens_first: int, k: int = 4) -> list[dict]:
    """A window whose first micro-batch holds `tokens_first` valid tokens; the rest ragged."""
    window = ragged_batches("gpt", k, seed=seed)
    labels = torch.full_like(window[0]["labels"], IGNORE)
    labels.view(-1)[:tokens_first] = window[0]["input_ids"].view(-1)[:tokens_first]
    window[0] = {**window[0], "labels": labels}
    return window


@pytest.mark.slow  # 6 windows
@pytest.mark.parametrize("how", ["step", "begin_window(list)", "begin_window(length)"])
def test_fp16_without_counts_skips_no_window_when_the_first_micro_batch_is_nearly_empty(how):
    # The backward scale is the loss scale / an estimate of N, corrected at the window's end.
    # The estimate is the window's label elements when the batches are given (never below N),
    # else the first micro-batch's tokens times k, never below the previous window's rate; an
    # estimate of 0 (or 1 x k) made every backward overflow in fp16.
    model = make_gpt(seed=9)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt, precision="fp16", count_tokens=None)
    data = [sparse_first(67 + i, tokens_first=0 if i < 3 else 1) for i in range(6)]
    if how == "begin_window(length)":  # nothing to read a bound from: a first window to go by
        data[0] = ragged_batches("gpt", 4, seed=66)
    results = []
    for window in data:
        if how == "step":
            results.append(acc.step(window, token_loss))
        else:
            declared = window if how == "begin_window(list)" else len(window)
            results.append(hand_window(acc, model, declared, window))
    assert [r.skipped for r in results] == [False] * 6
    assert [r.loss_scale for r in results] == [2.0**16] * 6  # never backed off
    for seen, window in zip(opt.seen, data, strict=True):
        want = big_batch_grads(model, window, dtype=torch.float64)
        # fp16 keeps 11 significant bits (2**-11); the forward and backward round in fp16 a
        # few dozen times along each path, the late correction of N once in fp32
        assert max_rel_error(seen, want) <= 2.0**-7


# ---- 7. loss_fn contract violations ---------------------------------------------------------


def returning(kind: str):
    def loss_fn(model, batch):
        loss_sum, n = token_loss(model, batch)
        if kind == "float loss":
            return loss_sum.item(), n
        if kind == "bare float":
            return loss_sum.item()
        if kind == "3-tuple":
            return loss_sum, n, {"aux": 0.0}
        if kind == "per-row loss":
            logits = model(batch["input_ids"]).float()
            rows = F.cross_entropy(
                logits.transpose(1, 2), batch["labels"], ignore_index=IGNORE, reduction="none"
            ).sum(dim=1)
            return rows, n
        if kind == "per-row count":
            return loss_sum, (batch["labels"] != IGNORE).sum(dim=1)
        if kind == "no count":
            return loss_sum, None
        if kind == "no graph":
            return loss_sum.detach(), n
        raise AssertionError(kind)

    return loss_fn


@pytest.mark.parametrize(
    "kind, said",
    [
        ("float loss", r"loss_fn returned a float loss \(\d"),
        ("bare float", r"loss_fn returned a float \(\d.*\(loss_sum, num_tokens\)"),
        ("3-tuple", r"loss_fn returned a tuple of 3 values.*\(loss_sum, num_tokens\)"),
        ("per-row loss", r"loss_fn returned a loss of shape \(3,\)"),
        ("per-row count", r"loss_fn returned num_tokens of shape \(3,\)"),
        ("no count", r"loss_fn returned num_tokens None"),
        ("no graph", r"loss_fn returned a loss without a graph"),
    ],
)
def test_a_loss_fn_that_breaks_the_contract_is_named_in_one_line(kind, said):
    model, opt, sched, acc = built()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((TypeError, ValueError), match=said) as err:
        acc.step(ragged_batches("gpt", 3, seed=71), returning(kind))
    assert "\n" not in str(err.value)
    assert nothing_stepped(model, opt, sched, acc, before)


def test_a_wrong_count_for_tuple_batches_is_refused_like_for_dict_batches():
    model, opt, sched, acc = built()
    before = [p.detach().clone() for p in model.parameters()]
    data = [(b["input_ids"], b["labels"]) for b in ragged_batches("gpt", 3, seed=73)]

    def rows_as_count(model, batch):  # counts rows, not the tokens it sums over
        ids, labels = batch
        loss_sum, _ = token_loss(model, {"input_ids": ids, "labels": labels})
        return loss_sum, labels.shape[0]

    want = sum(int((labels != IGNORE).sum()) for _, labels in data)
    with pytest.raises(ValueError, match=rf"loss_fn reported 9 valid tokens.*{want}") as err:
        acc.step(data, rows_as_count)
    assert "\n" not in str(err.value)
    assert nothing_stepped(model, opt, sched, acc, before)

    def right_count(model, batch):
        ids, labels = batch
        return token_loss(model, {"input_ids": ids, "labels": labels})

    recorder = GradRecorder(model.parameters())
    Accumulator(model, recorder).step(data, right_count)
    dicts = [{"input_ids": ids, "labels": labels} for ids, labels in data]
    assert max_rel_error(recorder.seen[0], big_batch_grads(model, dicts, torch.float64)) <= 1e-5


def test_reduce_lr_on_plateau_is_fed_the_window_loss():
    model = make_gpt(seed=11)
    opt = GradRecorder(model.parameters())  # parameters stay: the loss repeats
    opt.param_groups[0]["lr"] = 0.4
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    acc = Accumulator(model, opt, scheduler=sched)
    window = ragged_batches("gpt", 3, seed=79)
    with torch.no_grad():
        loss_sum, n = token_loss(copy.deepcopy(model).double(), big_batch(window))
    results = [acc.step(window, token_loss) for _ in range(3)]
    assert sched.best == pytest.approx(loss_sum.item() / n.item(), rel=1e-6)
    # the same loss again is no improvement: patience 0 halves the lr after windows 2 and 3
    assert [r.lr for r in results] == pytest.approx([0.4, 0.4, 0.2])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_a_mean_instead_of_a_sum_is_what_verify_names():
    # Accumulator cannot tell a mean from a sum: verify compares the big batch with the
    # micro-batches and names loss_fn
    def mean_loss(model, batch):
        logits = model(batch["input_ids"]).float()
        labels = batch["labels"]
        loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE)
        return loss, (labels != IGNORE).sum()

    report = verify(
        make_gpt(seed=13), ragged_batches("gpt", 4, seed=83), mean_loss, wrong_ways=False
    )
    assert not report.passed
    (finding,) = [f for f in report.lint if f.severity == "error"]
    assert finding.module == "loss_fn"
    assert "averaged, not summed" in finding.problem and "loss_fn returned" in finding.problem


# ---- issue 38 item 4: an optimizer whose parameter groups have no lr --------------------------


class FixedStep(torch.optim.Optimizer):
    """Gradient descent with a step size of its own, not called lr (as optimizers that set
    their own step size have it): its parameter groups hold no "lr"."""

    def __init__(self, params, step_size: float):
        super().__init__(params, {"step_size": step_size})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["step_size"])


def test_an_optimizer_without_lr_steps_and_reports_no_lr():
    model = make_mlp()
    data = ragged_batches("mlp", 4, seed=3)
    start = [p.detach().clone() for p in model.parameters()]
    want = big_batch_grads(model, data)  # on a copy, float64: the window's gradient
    result = Accumulator(model, FixedStep(model.parameters(), 0.1)).step(data, token_loss)
    assert result.lr is None and not result.skipped and result.micro_steps == 4
    moved = [(s - p.detach()) / 0.1 for s, p in zip(start, model.parameters(), strict=True)]
    assert max_rel_error(moved, want) <= 1e-4  # one step of -0.1 x the big batch's gradient
