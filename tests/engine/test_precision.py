"""bf16/fp16: fp32 accumulation buffers, the loss scaler, and windows skipped without damage."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gradaccum import Accumulator
from gradaccum.engine.precision import LossScaler
from gradaccum.testing import adamw_drift_bound, record_grads
from tests.reference import (
    GradRecorder,
    big_batch_grads,
    exact_fp64_sum,
    make_gpt,
    make_mlp,
    max_rel_error,
    ragged_batches,
    token_loss,
)


def test_bf16_parameters_accumulate_in_fp32_buffers():
    k = 64
    model = make_mlp(seed=1).to(torch.bfloat16)
    data = ragged_batches("mlp", k, seed=101, dtype=torch.bfloat16)
    want = exact_fp64_sum(model, data)

    def grads_seen(**kwargs):
        twin = copy.deepcopy(model)
        opt = GradRecorder(twin.parameters())
        Accumulator(twin, opt, **kwargs).step(data, token_loss)
        return opt.seen[0]

    fp32_sum = grads_seen(master_weights=True)  # the fp32 sum handed to fp32 master weights
    rounded_once = grads_seen()  # the fp32 sum rounded once to bf16
    bf16_sum = grads_seen(accum_dtype=torch.bfloat16)  # plain bf16 accumulation
    assert all(g.dtype == torch.float32 for g in fp32_sum)
    assert all(g.dtype == torch.bfloat16 for g in rounded_once + bf16_sum)
    err_fp32, err_once, err_bf16 = (
        max_rel_error(g, want) for g in (fp32_sum, rounded_once, bf16_sum)
    )
    assert err_fp32 * 10 <= err_bf16
    # rounding once to bf16 costs at most one bf16 rounding (relative 2**-8), bf16 adds k of them
    assert err_once <= 2.0**-8 < err_bf16


class MixedMLP(torch.nn.Module):
    """An fp32 first layer (as norms and embeddings often stay) and a bf16 second layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 5).to(torch.bfloat16)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)).to(torch.bfloat16))


def test_mixed_fp32_and_bf16_parameters_buffer_the_bf16_ones():
    model = MixedMLP()
    data = ragged_batches("mlp", 64, seed=31)
    want = exact_fp64_sum(model, data)
    first = copy.deepcopy(model)
    opt = GradRecorder(first.parameters())
    Accumulator(first, opt, master_weights=True).step(data, token_loss)
    fp32_path = opt.seen[0]
    twin = copy.deepcopy(model)
    opt_bf16 = GradRecorder(twin.parameters())
    Accumulator(twin, opt_bf16, accum_dtype=torch.bfloat16).step(data, token_loss)
    # the bf16 layer's gradient is summed in fp32 (error at fp32 rounding), not in bf16
    err_fp32 = max_rel_error(fp32_path[2:], want[2:])
    err_bf16 = max_rel_error(opt_bf16.seen[0][2:], want[2:])
    assert err_fp32 <= 1e-6 and err_fp32 * 10 <= err_bf16
    assert max_rel_error(fp32_path[:2], want[:2]) <= 1e-6  # the fp32 layer as before


def test_bf16_buffer_frees_each_low_precision_grad():
    model = make_mlp().to(torch.bfloat16)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    window = acc.begin_window(ragged_batches("mlp", 2, seed=3, dtype=torch.bfloat16))
    for batch in ragged_batches("mlp", 2, seed=3, dtype=torch.bfloat16):
        with window.micro_step():
            loss_sum, n = token_loss(model, batch)
            window.backward(loss_sum, n)
        # between micro-batches only the fp32 buffer holds the running sum
        assert all(p.grad is None for p in model.parameters())
    window.finish()


def test_master_weights_step_in_fp32_and_round_once():
    model = make_mlp(seed=2).to(torch.bfloat16)
    ref = make_mlp(seed=2).to(torch.bfloat16).float()  # fp32 copy of the same bf16 values
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = Accumulator(model, opt, master_weights=True)
    data = ragged_batches("mlp", 4, seed=7, dtype=torch.bfloat16)
    acc.step(data, token_loss)
    grads = exact_fp64_sum(make_mlp(seed=2).to(torch.bfloat16), data)
    with torch.no_grad():
        masters = [
            ref_p - 0.5 * g.float() for ref_p, g in zip(ref.parameters(), grads, strict=True)
        ]
    state = acc.state_dict()
    assert max_rel_error(state["masters"], masters) <= 1e-5
    for p, m in zip(model.parameters(), state["masters"], strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_bf16_and_fp16_autocast_track_fp32():
    data = ragged_batches("gpt", 4, seed=12)
    want = big_batch_grads(make_gpt(), data)
    for precision in ("bf16", "fp16"):
        model = make_gpt()
        opt = GradRecorder(model.parameters())
        result = Accumulator(model, opt, precision=precision).step(data, token_loss)
        assert not result.skipped
        assert max_rel_error(opt.seen[0], want) <= 5e-2, precision
        assert (result.loss_scale is not None) == (precision == "fp16")


def snapshot(model, opt, sched):
    return (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(sched.state_dict()),
    )


def assert_same(a, b):
    params_a, opt_a, sched_a = a
    params_b, opt_b, sched_b = b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
    assert sched_a == sched_b
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for key, st in opt_a["state"].items():
        for name, value in st.items():
            assert torch.equal(value, opt_b["state"][key][name])


def poisoned(batch, how: str, dtype):
    x = batch["input_ids"].clone()
    if how == "nan":
        x[0, 0, 0] = math.nan
    else:  # a value whose activations overflow fp16's 65504
        x[0, 0, :] = 1e6
    return {**batch, "input_ids": x.to(dtype)}


@pytest.mark.parametrize(
    "precision,param_dtype,how",
    [
        ("fp32", torch.float32, "nan"),
        ("bf16", torch.bfloat16, "nan"),
        ("fp16", torch.float32, "inf"),
    ],
)
def test_non_finite_window_is_skipped_without_damage(precision, param_dtype, how):
    def build():
        model = make_mlp(seed=5).to(param_dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return model, opt, sched, Accumulator(model, opt, scheduler=sched, precision=precision)

    model, opt, sched, acc = build()
    ref_model, ref_opt, ref_sched, ref_acc = build()
    seen, ref_seen = record_grads(opt), record_grads(ref_opt)
    data = ragged_batches("mlp", 12, seed=21, dtype=param_dtype)
    first, bad, after = data[:4], data[4:8], data[8:]
    bad = [bad[0], poisoned(bad[1], how, param_dtype), *bad[2:]]

    assert not acc.step(first, token_loss).skipped
    ref_acc.step(first, token_loss)
    before = snapshot(model, opt, sched)
    result = acc.step(bad, token_loss)
    assert result.skipped and math.isnan(result.grad_norm)
    assert result.step == 1 and result.skipped_total == 1
    assert_same(snapshot(model, opt, sched), before)
    assert all(p.grad is None for p in model.parameters())

    # the next window trains as if the bad one never happened
    assert not acc.step(after, token_loss).skipped
    ref_acc.step(after, token_loss)
    if precision == "fp16":  # the scale was halved: same gradient up to fp16 rounding
        assert acc.scaler.scale == ref_acc.scaler.scale / 2
        assert max_rel_error(seen[-1], ref_seen[-1]) <= 1e-3
        # one AdamW step (lr at most 1e-2) from the same weights: where a gradient is zero up
        # to rounding, its step goes up to lr either way (adamw_drift_bound)
        bound = adamw_drift_bound([1e-2], first_step=2)
        for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=2**-20, atol=bound)
    else:
        assert_same(snapshot(model, opt, sched), snapshot(ref_model, ref_opt, ref_sched))


def test_fp16_scaler_backs_off_until_gradients_fit():
    model = make_mlp(seed=6)
    init = [p.detach().clone() for p in model.parameters()]
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt, precision="fp16", loss_scaler=LossScaler(scale=2.0**30))
    data = ragged_batches("mlp", 4, seed=8)
    results = []
    for _ in range(30):
        results.append(acc.step(data, token_loss))
        if results[-1].skipped:  # an overflowing window leaves the parameters alone
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), init, strict=True))
    skipped = [r.skipped for r in results]
    first_ok = skipped.index(False)
    assert first_ok > 0 and not any(skipped[first_ok:])
    assert results[first_ok].loss_scale == 2.0 ** (30 - first_ok)
    # once the scale fits, the unscaled gradient is the fp32 big-batch gradient (fp16 rounding)
    assert len(opt.seen) == 30 - first_ok
    assert max_rel_error(opt.seen[0], big_batch_grads(make_mlp(seed=6), data)) <= 5e-2


def test_loss_scaler_grows_after_interval():
    scaler = LossScaler(scale=8.0, growth_interval=3)
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 16.0
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0
    state = scaler.state_dict()
    other = LossScaler()
    other.load_state_dict(state)
    assert other.scale == 8.0
