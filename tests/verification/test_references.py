"""What AdamW can do with gradients that agree only to rounding, as `gradaccum.testing` bounds
it, against torch's own AdamW run here: `adam_ratio_bound` (the most one step moves a weight,
in units of lr), `adamw_drift_bound` (two runs from the same weights) and `step_tolerance`
(one fp32 step against the same step in float64); and the one relative-error measure
(`gradaccum.verification.reference`) against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gradaccum.testing import adam_ratio_bound, adamw_drift_bound, step_tolerance
from gradaccum.verification.reference import max_rel_error, rel_errors, whole_rel_error

BETAS = [(0.9, 0.999), (0.9, 0.95), (0.5, 0.9)]


def _adam_steps(grads: list[torch.Tensor], lr: float, betas, weight_decay=0.0, dtype=torch.float64):
    """Weights after each AdamW step (eps 1e-8) from zeros, torch's implementation."""
    p = torch.zeros_like(grads[0], dtype=dtype, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=weight_decay)
    out = []
    for g in grads:
        p.grad = g.to(dtype)
        opt.step()
        out.append(p.detach().clone())
    return out


@pytest.mark.parametrize("betas", BETAS)
def test_the_ratio_bound_is_reached_and_never_exceeded(betas):
    b1, b2 = betas
    for t in (1, 2, 3, 10, 50):
        # equality in Cauchy-Schwarz: g_s proportional to (b1 / b2)^(t - s)
        worst = [torch.tensor([(b1 / b2) ** (t - s)]) for s in range(1, t + 1)]
        moved = _adam_steps(worst, 1.0, betas)
        step = float((moved[-1] - (moved[-2] if t > 1 else 0)).abs())
        assert step == pytest.approx(adam_ratio_bound(t, betas), rel=1e-6), t
        g = torch.Generator().manual_seed(t)
        noisy = [
            torch.randn(1000, generator=g) * 10 ** torch.randn(1, generator=g) for _ in range(t)
        ]
        moved = _adam_steps(noisy, 1.0, betas)
        last = moved[-1] - (moved[-2] if t > 1 else 0)
        assert float(last.abs().max()) <= adam_ratio_bound(t, betas) * (1 + 1e-9), t
    assert adam_ratio_bound(1, betas) == 1.0


def test_ratio_bound_by_hand():
    # betas (0.9, 0.999), step 2: 0.1 / 0.19 * sqrt(0.001999 / 0.001) * sqrt(1 + 0.81 / 0.999)
    by_hand = 0.1 / 0.19 * math.sqrt(0.001999 / 0.001) * math.sqrt(1 + 0.81 / 0.999)
    assert adam_ratio_bound(2) == pytest.approx(by_hand, rel=1e-12)
    limit = 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999))  # many steps: 7.27
    assert adam_ratio_bound(100_000) == pytest.approx(limit, rel=1e-9)
    with pytest.raises(ValueError, match="step 0"):
        adam_ratio_bound(0)


@pytest.mark.parametrize("betas", BETAS)
def test_two_runs_from_the_same_weights_drift_at_most_the_bound(betas):
    lrs = [1e-2] * 6
    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        # unrelated gradients, tiny ones among them (where Adam amplifies most)
        a = [torch.randn(500, generator=g) * 1e-9 ** (trial % 2) for _ in lrs]
        b = [torch.randn(500, generator=g) for _ in lrs]
        for wd in (0.0, 0.1):
            wa = _adam_steps(a, 1e-2, betas, wd)[-1]
            wb = _adam_steps(b, 1e-2, betas, wd)[-1]
            assert float((wa - wb).abs().max()) <= adamw_drift_bound(lrs, betas)
    # one step: opposite signs reach it exactly (2 lr)
    one = (
        _adam_steps([torch.ones(1)], 1e-2, betas)[0] - _adam_steps([-torch.ones(1)], 1e-2, betas)[0]
    )
    assert float(one.abs()) == pytest.approx(adamw_drift_bound([1e-2], betas), rel=1e-6)
    later = adamw_drift_bound([1e-2], betas, first_step=3)
    assert later == pytest.approx(2e-2 * adam_ratio_bound(3, betas))


def test_step_tolerance_by_hand():
    # (5 t + 8) R_t 2^-24, times 4, rounded up to 1, 2 or 5 times a power of ten
    r2 = 0.1 / 0.19 * math.sqrt(0.001999 / 0.001) * math.sqrt(1 + 0.81 / 0.999)
    assert 4 * 18 * r2 * 2.0**-24 == pytest.approx(4.30e-6, rel=1e-3)
    assert step_tolerance(2, 1e-2, (0.9, 0.999), torch.float32) == 5e-6
    assert step_tolerance(3, 1e-2, (0.9, 0.999), torch.float32) == 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_fp32_adamw_stays_within_the_step_tolerance_of_float64(seed):
    # the same steps, the same fp32 gradients (tiny and cancelling ones among them), from
    # the same weights: torch's AdamW in fp32 against itself in float64
    g = torch.Generator().manual_seed(seed)
    steps, lr = 3, 1e-2
    p0 = torch.randn(20_000, generator=g) * 0.05
    grads = [torch.randn(20_000, generator=g) * 10 ** (-8 * torch.rand(20_000, generator=g))]
    grads += [torch.randn(20_000, generator=g) * 1e-3 for _ in range(steps - 1)]
    worst = 0.0
    params = {
        dtype: p0.to(dtype).clone().requires_grad_() for dtype in (torch.float32, torch.float64)
    }
    opts = {d: torch.optim.AdamW([p], lr=lr, weight_decay=0.1) for d, p in params.items()}
    for grad in grads:
        start = params[torch.float32].detach().double()
        with torch.no_grad():  # both steps from the fp32 run's weights, as the check does
            params[torch.float64].copy_(start)
        for dtype, p in params.items():
            p.grad = grad.to(dtype)
            opts[dtype].step()
        diff = (params[torch.float32].detach().double() - params[torch.float64].detach()).abs()
        worst = max(worst, float((diff / (start.abs() + lr)).max()))
    assert worst <= step_tolerance(steps, lr, (0.9, 0.999), torch.float32)
    assert worst > 0  # fp32 did round


def test_the_relative_error_per_parameter_with_its_floor_by_hand():
    # parameter a: |(3, 4) - (3, 4.001)| = 1e-3 against |(3, 4.001)|; parameter b's reference
    # is zero, so its 1e-9 is measured against 1e-7 of the whole reference's norm; c has no
    # gradient on either side (0); d only in the reference (all of it is missing: 1)
    want_norm = math.sqrt(3**2 + 4.001**2)
    got = [torch.tensor([3.0, 4.0]), torch.tensor([1e-9]), None, None]
    want = [torch.tensor([3.0, 4.001]), torch.tensor([0.0]), None, torch.tensor([2.0])]
    whole = math.sqrt(3**2 + 4.001**2 + 2.0**2)
    errors = rel_errors(got, want)
    assert errors[0] == pytest.approx(1e-3 / want_norm, rel=1e-4)
    assert errors[1] == pytest.approx(1e-9 / (1e-7 * whole), rel=1e-4)
    assert errors[2:] == [0.0, pytest.approx(1.0)]
    assert max_rel_error(got, want) == max(errors)
    # the whole gradient as one vector: |(0, 1e-3, 1e-9, 2)| / |(3, 4.001, 0, 2)|
    assert whole_rel_error(got, want) == pytest.approx(math.sqrt(1e-6 + 1e-18 + 4) / whole)
    assert max_rel_error([], []) == 0.0 == whole_rel_error([None], [None])
