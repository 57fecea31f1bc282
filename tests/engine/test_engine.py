"""The engine against big-batch references computed without it (tests/reference.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from gradaccum import Accumulator, windows
from gradaccum.engine.accumulator import backward_scale, count_labels
from gradaccum.testing import adamw_drift_bound, record_grads
from tests.reference import (
    IGNORE,
    GradRecorder,
    big_batch,
    big_batch_grads,
    make_gpt,
    make_mlp,
    max_rel_error,
    ragged_batches,
    token_loss,
)

MODELS = {"mlp": make_mlp, "gpt": make_gpt}


def accumulated_grads(model, micro_batches, **kwargs):
    opt = GradRecorder(model.parameters())
    result = Accumulator(model, opt, **kwargs).step(micro_batches, token_loss)
    return opt.seen[0], result


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_fp32_gradient_equals_big_batch(kind, k):
    model = MODELS[kind]()
    data = ragged_batches(kind, k, seed=k)
    want = big_batch_grads(model, data)
    got, result = accumulated_grads(model, data)
    assert max_rel_error(got, want) <= 1e-5
    assert result.tokens == sum(int((b["labels"] != IGNORE).sum()) for b in data)
    assert result.micro_steps == k
    # grad_norm is the norm of the big-batch gradient
    big_norm = torch.cat([g.flatten() for g in want]).norm().item()
    assert result.grad_norm == pytest.approx(big_norm, rel=1e-5)


@pytest.mark.parametrize("count_tokens", [None, count_labels(IGNORE)])
def test_late_rescale_and_explicit_counter_match_big_batch(count_tokens):
    model = make_gpt()
    data = ragged_batches("gpt", 8, seed=3)
    got, _ = accumulated_grads(model, data, count_tokens=count_tokens)
    assert max_rel_error(got, big_batch_grads(model, data)) <= 1e-5


def test_micro_batch_mean_differs_from_the_token_mean():
    # Dividing each micro-batch's mean loss by k weights a token in a short micro-batch more
    # than one in a long micro-batch: not the big-batch gradient when token counts differ.
    model = make_gpt()
    data = ragged_batches("gpt", 8, seed=5)
    counts = [int((b["labels"] != IGNORE).sum()) for b in data]
    assert len(set(counts)) > 1
    want = big_batch_grads(model, data)
    got, _ = accumulated_grads(model, data, normalize="micro_batch_mean")
    assert max_rel_error(got, want) > 1e-2
    # ... and it is exactly the mean of per-micro-batch mean gradients
    per_micro = [big_batch_grads(model, [b]) for b in data]
    mean_of_means = [sum(gs) / len(gs) for gs in zip(*per_micro, strict=True)]
    assert max_rel_error(got, mean_of_means) <= 1e-5


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum"])
def test_parameters_after_steps_match_big_batch_training(opt_name):
    def make_opt(params):
        if opt_name == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = make_gpt()
    ref = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    seen = record_grads(opt)
    acc = Accumulator(model, opt)
    ref_opt = make_opt(ref.parameters())
    data = ragged_batches("gpt", 12, seed=11)
    for window in windows(data, accum_steps=4):
        start = copy.deepcopy(model)
        acc.step(window, token_loss)
        # each window's gradient from the weights it started at: tight, whatever the steps
        assert max_rel_error(seen[-1], big_batch_grads(start, window)) <= 1e-5
        ref_opt.zero_grad()
        grads = big_batch_grads(ref, window)
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g
        ref_opt.step()
    if opt_name == "sgd_momentum":  # linear in the gradient: rounding stays rounding
        assert max_rel_error(_comparable(model), _comparable(ref)) <= 1e-5
        return
    # AdamW turns the rounding of a gradient that is zero up to rounding into a step of up
    # to lr either way: the trajectories agree only within adamw_drift_bound
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=2**-20, atol=adamw_drift_bound([1e-2] * 3))


def _comparable(model) -> list[torch.Tensor]:
    """Parameters, less the attention key bias: its true gradient is zero (softmax ignores a
    constant added to every key's score), so Adam turns the rounding noise of any two ways of
    summing into full-size steps of arbitrary sign."""
    out = []
    for name, p in model.named_parameters():
        if name.endswith("c_attn.bias"):
            q, _, v = p.detach().chunk(3)
            out += [q, v]
        else:
            out.append(p.detach())
    return out


def test_short_last_window_uses_its_own_token_count():
    model = make_mlp()
    data = ragged_batches("mlp", 10, seed=2)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt)
    results = [acc.step(w, token_loss) for w in windows(data, accum_steps=4)]
    assert [r.micro_steps for r in results] == [4, 4, 2]
    assert max_rel_error(opt.seen[2], big_batch_grads(model, data[8:])) <= 1e-5
    dropped = list(windows(data, accum_steps=4, drop_last=True))
    assert [len(w) for w in dropped] == [4, 4]


def test_scheduler_clip_and_zero_grad_once_per_window():
    model = make_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    acc = Accumulator(model, opt, scheduler=sched, max_grad_norm=0.05)
    data = ragged_batches("mlp", 12, seed=4)
    lrs = []
    for i, window in enumerate(windows(data, accum_steps=4)):
        result = acc.step(window, token_loss)
        lrs.append(result.lr)
        # reference: big-batch gradient, clipped by hand to norm 0.05, lr 0.5 / (1 + step)
        grads = big_batch_grads(ref, window)
        norm = torch.cat([g.flatten() for g in grads]).norm()
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-5)
        coef = min(1.0, 0.05 / (norm.item() + 1e-6))
        with torch.no_grad():
            for p, g in zip(ref.parameters(), grads, strict=True):
                p -= 0.5 / (1 + i) * coef * g
        assert all(p.grad is None for p in model.parameters())
    assert sched.last_epoch == 3  # three windows, three scheduler steps, not twelve
    assert lrs == pytest.approx([0.5, 0.25, 0.5 / 3])
    assert acc.steps == 3
    assert max_rel_error(list(model.parameters()), list(ref.parameters())) <= 1e-5


def test_low_level_window_equals_big_batch():
    model = make_gpt()
    data = ragged_batches("gpt", 4, seed=8)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt)
    window = acc.begin_window(data)
    for batch in data:
        with window.micro_step():
            loss_sum, n = token_loss(model, batch)
            window.backward(loss_sum, n)
    result = window.finish()
    assert max_rel_error(opt.seen[0], big_batch_grads(model, data)) <= 1e-5
    assert result.tokens == sum(int((b["labels"] != IGNORE).sum()) for b in data)


def test_a_loss_fn_that_counts_other_tokens_than_count_tokens_is_refused():
    # Labels that loss_fn shifts itself (Hugging Face style): the engine's count of valid
    # labels is not the count of tokens the loss sums over, and the gradient would be off.
    def shifting_loss(model, batch):
        logits = model(batch["input_ids"])[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return loss, (labels != IGNORE).sum()

    model = make_gpt()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="count_tokens"):
        acc.step(ragged_batches("gpt", 3, seed=1), shifting_loss)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    # counting the same shifted labels makes it exact again: the big-batch gradient of the
    # shifted loss over all micro-batches at once, divided by its own token count
    data = ragged_batches("gpt", 3, seed=1)
    opt = GradRecorder(model.parameters())
    counted = Accumulator(model, opt, count_tokens=lambda b: (b["labels"][:, 1:] != IGNORE).sum())
    result = counted.step(data, shifting_loss)
    twin = copy.deepcopy(model)
    loss_sum, n = shifting_loss(twin, big_batch(data))
    (loss_sum / n).backward()
    want = [p.grad for p in twin.parameters()]
    assert max_rel_error(opt.seen[0], want) <= 1e-5
    assert result.tokens == sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in data)


def test_micro_grad_hook_sees_each_micro_batch_gradient():
    model = make_mlp()
    data = ragged_batches("mlp", 3, seed=9)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = acc.add_micro_grad_hook(lambda name, g: seen.setdefault(name, []).append(g.clone()))
    acc.step(data, token_loss)
    for h in handles:
        h.remove()
    assert all(len(v) == 3 for v in seen.values())
    n_total = sum(int((b["labels"] != IGNORE).sum()) for b in data)
    # each hook call is micro-batch i's own gradient scaled by 1/N: they add up to the window's
    for i, batch in enumerate(data):
        want = big_batch_grads(model, [batch])
        n_i = int((batch["labels"] != IGNORE).sum())
        got = [seen[name][i] * n_total / n_i for name, _ in model.named_parameters()]
        assert max_rel_error(got, want) <= 1e-5


def test_bad_arguments_are_rejected():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="precision"):
        Accumulator(model, opt, precision="fp8")
    with pytest.raises(ValueError, match="normalize"):
        Accumulator(model, opt, normalize="sequences")
    with pytest.raises(ValueError, match="max_grad_norm"):
        Accumulator(model, opt, max_grad_norm=0)
    with pytest.raises(ValueError, match="accum_steps"):
        list(windows([1, 2], accum_steps=0))
    with pytest.raises(ValueError, match="accum_steps"):
        list(windows([1, 2], accum_steps=2.5))


# ---- the backward scale against the numerical rules (docs/design.md), derived by hand ----


@pytest.mark.parametrize(
    "args, want",
    [
        # one device: loss_sum / N
        (("tokens", 200, 4, 1, False, 1.0), 1 / 200),
        # DDP/FSDP2 average over 8 ranks: loss_sum * 8 / N undoes it
        (("tokens", 1000, 4, 8, True, 1.0), 8 / 1000),
        # the engine's own fp32 all-reduce sums: loss_sum / N
        (("tokens", 1000, 4, 8, False, 1.0), 1 / 1000),
        # fp16: times the loss scale
        (("tokens", 1000, 4, 8, True, 2.0**16), 8 * 2.0**16 / 1000),
        # no tokens at all: N taken as 1, never a division by zero
        (("tokens", 0, 4, 2, True, 1.0), 2.0),
        # mean of micro-batch means: 1 / (k * world), the averaging sync undone
        (("micro_batch_mean", 999, 4, 8, True, 1.0), 8 / 32),
        (("micro_batch_mean", 999, 4, 8, False, 1.0), 1 / 32),
    ],
)
def test_backward_scale_follows_the_numerical_rules(args, want):
    assert backward_scale(*args) == pytest.approx(want, rel=1e-12)


# ---- seams: k changing between windows, abandoning a window ------------------------------


def test_k_may_change_from_one_window_to_the_next():
    model = make_gpt()
    data = ragged_batches("gpt", 10, seed=13)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt)
    bounds = [(0, 2), (2, 7), (7, 10)]  # k = 2, then 5, then 3
    results = [acc.step(data[a:b], token_loss) for a, b in bounds]
    assert [r.micro_steps for r in results] == [2, 5, 3]
    for seen, (a, b) in zip(opt.seen, bounds, strict=True):
        assert max_rel_error(seen, big_batch_grads(model, data[a:b])) <= 1e-5


class FakeOutOfMemory(torch.OutOfMemoryError):
    """What a device raises when a micro-batch does not fit."""


def oom_at(index: int):
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        if calls["n"] == index + 1:
            raise FakeOutOfMemory("out of memory")
        return token_loss(model, batch)

    return loss_fn


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_a_window_abandoned_mid_way_leaves_no_trace(dtype, precision):
    # a window that fails at its third micro-batch, then a full window: the same parameters,
    # optimizer state and counters as a run that only ever saw the full window
    def build():
        model = make_mlp(seed=4).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, Accumulator(model, opt, precision=precision)

    model, opt, acc = build()
    ref_model, ref_opt, ref_acc = build()
    data = ragged_batches("mlp", 9, seed=17, dtype=dtype)
    failed, full = data[:5], data[5:]
    with pytest.raises(torch.OutOfMemoryError):
        acc.step(failed, oom_at(2))
    assert all(p.grad is None for p in model.parameters())
    assert (acc.steps, acc.skipped_total, opt.state) == (0, 0, {})
    result = acc.step(full, token_loss)
    ref_result = ref_acc.step(full, token_loss)
    assert (result.step, result.skipped_total, result.tokens) == (1, 0, ref_result.tokens)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True)
    )
    grads = big_batch_grads(make_mlp(seed=4), full, dtype=dtype)
    assert result.grad_norm == pytest.approx(
        torch.cat([g.double().flatten() for g in grads]).norm().item(),
        rel=1e-5 if dtype == torch.float32 else 2e-2,
    )


def test_abandon_by_hand_keeps_the_loss_scale_and_drops_partial_gradients():
    model = make_mlp(seed=6)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt, precision="fp16")
    scale = acc.scaler.scale
    data = ragged_batches("mlp", 6, seed=19)
    window = acc.begin_window(data[:4])
    for batch in data[:2]:
        with window.micro_step():
            window.backward(*token_loss(model, batch))
    window.abandon()
    assert all(p.grad is None for p in model.parameters())
    assert (acc.scaler.scale, acc.steps, acc.skipped_total, opt.seen) == (scale, 0, 0, [])
    result = acc.step(data[2:], token_loss)
    assert not result.skipped and result.step == 1
    assert max_rel_error(opt.seen[0], big_batch_grads(model, data[2:])) <= 5e-2


# ---- nothing per micro-batch outlives its micro-step (host memory flat in k) --------------


def test_no_per_micro_batch_tensor_lives_until_the_window_ends():
    import weakref

    model = make_mlp()
    data = ragged_batches("mlp", 6, seed=23)
    alive: list[weakref.ref] = []

    def loss_fn(model, batch):
        # everything the previous micro-batch returned is gone by now
        assert all(ref() is None for ref in alive)
        loss_sum, count = token_loss(model, batch)
        alive.extend([weakref.ref(loss_sum), weakref.ref(count)])
        return loss_sum, count

    for count_tokens in ("auto", None):
        alive.clear()
        acc = Accumulator(model, GradRecorder(model.parameters()), count_tokens=count_tokens)
        acc.step(data, loss_fn)


def test_close_frees_the_model_for_another_accumulator():
    # bf16 parameters: each Accumulator hooks every parameter to move its gradient into an
    # fp32 buffer. After close(), a second Accumulator on the same model gives exactly what
    # one on an untouched copy of the model gives.
    model = make_gpt().to(torch.bfloat16)
    untouched = copy.deepcopy(model)
    data = ragged_batches("gpt", 4, seed=11)
    first = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_scale=True)
    first.step(data, token_loss)
    first.close()
    opt, ref = GradRecorder(model.parameters()), GradRecorder(untouched.parameters())
    Accumulator(model, opt).step(data, token_loss)
    Accumulator(untouched, ref).step(data, token_loss)
    assert all(torch.equal(a, b) for a, b in zip(opt.seen[0], ref.seen[0], strict=True))
