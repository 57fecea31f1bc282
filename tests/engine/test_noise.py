"""The gradient noise scale against truths computed without the engine: a closed form on
linear regression, and a brute-force estimate from per-sequence gradients on a GPT."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gradaccum import Accumulator
from gradaccum.engine.noise import NoiseScale, window_estimates
from tests.reference import IGNORE, make_gpt, token_loss

# ---- linear regression: tr(Sigma) and |G|^2 in closed form --------------------------------
#
# y = x . w* + eps, x ~ N(0, I_d), eps ~ N(0, s^2), loss per example (x . w - y)^2. With
# delta = w - w*: the per-example gradient is 2 x (x . delta - eps), so G = 2 delta and
# Sigma = 4 ((|delta|^2 + s^2) I + delta delta^T) (Isserlis: E[x x^T (x.delta)^2] =
# |delta|^2 I + 2 delta delta^T). B_simple = tr Sigma / |G|^2 = (d (|delta|^2 + s^2) +
# |delta|^2) / |delta|^2 examples.

D, NOISE = 8, 0.5


def regression_truth(delta: torch.Tensor) -> float:
    d2 = float(delta.pow(2).sum())
    return (D * (d2 + NOISE**2) + d2) / d2


def regression_batches(delta_model, generator, rows_per_micro: list[int]):
    out = []
    for rows in rows_per_micro:
        x = torch.randn(rows, D, generator=generator)
        y = x @ delta_model + NOISE * torch.randn(rows, generator=generator)
        out.append({"x": x, "y": y})
    return out


def squared_loss(model, batch):
    pred = model(batch["x"]).squeeze(-1)
    return (pred - batch["y"]).pow(2).sum(), batch["y"].shape[0]


@pytest.mark.slow  # 400 windows
@pytest.mark.parametrize("ragged", [False, True])
def test_linear_regression_b_simple_within_10_percent_of_the_closed_form(ragged):
    torch.manual_seed(0)
    model = torch.nn.Linear(D, 1, bias=False)
    w_star = torch.randn(D)
    delta = model.weight.detach()[0] - w_star
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # parameters fixed: one truth
    acc = Accumulator(model, opt, count_tokens=lambda b: b["y"].shape[0], noise_scale=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        rows = torch.randint(1, 9, (8,), generator=g).tolist() if ragged else [4] * 8
        result = acc.step(regression_batches(w_star, g, rows), squared_loss)
    truth = regression_truth(delta)
    assert result.noise.ema_steps == 400
    assert result.noise.b_simple_tokens == pytest.approx(truth, rel=0.10)
    # the two parts as well: |G|^2 = 4 |delta|^2 and tr Sigma = 4 (d(|delta|^2+s^2)+|delta|^2)
    d2 = float(delta.pow(2).sum())
    assert result.noise.g2 == pytest.approx(4 * d2, rel=0.10)
    assert result.noise.trace_sigma == pytest.approx(4 * (D * (d2 + NOISE**2) + d2), rel=0.10)


# ---- GPT: against per-sequence gradients on the same parameters ----------------------------


def sequences(count: int, seq_len: int, vocab: int, ragged: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    # A skewed unigram distribution: a gradient signal that random weights are far from.
    probs = torch.softmax(torch.randn(vocab, generator=g) * 2, 0)
    ids = torch.multinomial(probs, count * (seq_len + 1), replacement=True, generator=g)
    ids = ids.view(count, seq_len + 1)
    labels = ids[:, 1:].clone()
    if ragged:
        lengths = torch.randint(seq_len // 4, seq_len + 1, (count,), generator=g)
        labels[torch.arange(seq_len)[None, :] >= lengths[:, None]] = IGNORE
    return ids[:, :-1], labels


def brute_force_b_simple(model, ids, labels) -> float:
    """tr Sigma per token and |G|^2 from every sequence's own summed gradient S_j (T_j
    tokens): g = sum S_j / sum T_j, tr Sigma = E|S_j - T_j g|^2 / E[T_j] (the variance of a
    ratio estimate over n tokens is that / n), |G|^2 = |g|^2 - tr Sigma / sum T_j."""
    sums, counts = [], []
    for j in range(ids.shape[0]):
        model.zero_grad()
        logits = model(ids[j : j + 1])
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[j], ignore_index=IGNORE, reduction="sum"
        )
        loss.backward()
        sums.append(torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]))
        counts.append(float((labels[j] != IGNORE).sum()))
    model.zero_grad()
    s = torch.stack(sums)
    t = torch.tensor(counts, dtype=torch.float64)
    g = s.sum(0) / t.sum()
    trace = (s - t[:, None] * g).pow(2).sum(1).mean() / t.mean()
    g2 = g.pow(2).sum() - trace / t.sum()
    return float(trace / g2)


@pytest.mark.slow  # 150 windows
@pytest.mark.parametrize("ragged", [False, True])
def test_gpt_b_simple_within_25_percent_of_per_sequence_gradients(ragged):
    seq_len, vocab = 16, 37
    model = make_gpt(seed=3, vocab=vocab, seq_len=seq_len)
    ids, labels = sequences(512, seq_len, vocab, ragged, seed=4)
    truth = brute_force_b_simple(model, ids, labels)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = Accumulator(model, opt, noise_scale=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(150):  # windows of 8 micro-batches of 2 sequences drawn from the 512
        pick = torch.randint(0, 512, (8, 2), generator=g)
        window = [{"input_ids": ids[p], "labels": labels[p]} for p in pick]
        result = acc.step(window, token_loss)
    est = result.noise
    assert est.b_simple_tokens == pytest.approx(truth, rel=0.25)
    tokens_per_sequence = float((labels != IGNORE).sum()) / labels.shape[0]
    assert est.b_simple_sequences == pytest.approx(
        est.b_simple_tokens / tokens_per_sequence, rel=0.25
    )


# ---- the estimators and the averages by hand -------------------------------------------------


def test_window_estimates_match_the_formulas_by_hand():
    # n = 4 micro-batches, S_small = 3, S_big = 1.5, N = 100:
    # |G|^2 = (4 * 1.5 - 3) / 3 = 1, tr Sigma = 100 * (3 - 1.5) / 3 = 50
    g2, trace = window_estimates(3.0, 1.5, 100.0, 4)
    assert g2 == pytest.approx(1.0)
    assert trace == pytest.approx(50.0)
    with pytest.raises(ValueError, match="at least 2"):
        window_estimates(1.0, 1.0, 10.0, 1)


def test_bias_corrected_moving_averages_by_hand():
    noise = NoiseScale(torch.device("cpu"), decay=0.5)
    # window 1: |G|^2 = (2*2 - 3)/1 = 1, tr = 10*(3-2)/1 = 10 (S_small = 30/10 = 3)
    first = noise.update((30.0, 2.0), 2.0, 10.0, 5.0)
    assert (first.g2, first.trace_sigma, first.b_simple_tokens) == pytest.approx((1, 10, 10))
    assert first.b_simple_sequences == pytest.approx(10 / 2)  # 2 tokens per sequence
    # window 2: |G|^2 = (2*4 - 5)/1 = 3, tr = 10*(5-4) = 10; EMAs 0.5*0.5*1+0.5*3 = 1.75
    # and 0.5*0.5*10+0.5*10 = 7.5, corrected by 1 - 0.25: 7/3 and 10
    second = noise.update((50.0, 2.0), 4.0, 10.0, None)
    assert second.g2 == pytest.approx(1.75 / 0.75)
    assert second.trace_sigma == pytest.approx(10.0)
    assert second.b_simple_tokens == pytest.approx(10.0 / (1.75 / 0.75))
    assert math.isnan(second.b_simple_sequences)
    # a non-finite or single-micro-batch window changes nothing
    assert noise.update((math.inf, 2.0), 1.0, 10.0, None) is second
    assert noise.update((5.0, 1.0), 1.0, 10.0, None).ema_steps == 2


def test_resumed_averages_continue_bit_for_bit():
    a = NoiseScale(torch.device("cpu"))
    for i in range(5):
        a.update((30.0 + i, 3.0), 2.0, 10.0, 5.0)
    b = NoiseScale(torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    assert a.update((40.0, 3.0), 2.5, 10.0, 5.0) == b.update((40.0, 3.0), 2.5, 10.0, 5.0)


def test_noise_scale_needs_the_token_mean():
    model = make_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="noise_scale"):
        Accumulator(model, opt, noise_scale=True, normalize="micro_batch_mean")


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_micro_batch_sums_match_each_micro_batch_gradient_by_autograd(rows):
    """sum_i |g_i|^2 n_i against each micro-batch's own gradient from torch.autograd.grad:
    a parameter left out of a micro-batch adds nothing to it (not the last one's norm), a
    micro-batch without tokens or with factor 0 adds nothing and is not counted, and the
    factor may change between micro-batches (however many wait in the buffer)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    params = [*a.parameters(), *b.parameters()]
    x = torch.randn(5, 3, 4)
    masks = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0], [1, 1, 1], [1, 1, 0]]).float()
    uses_b = [True, False, True, False, True]
    factors = [1 / 64, 1 / 32, 1 / 32, 0.0, 1 / 16]  # what the engine's backward multiplies by

    def loss_sum(i):
        out = a(x[i]) + b(x[i]) if uses_b[i] else a(x[i])
        return (out.squeeze(-1).pow(2) * masks[i]).sum(), masks[i].sum().long()

    expected, counted = 0.0, 0
    for i in range(5):  # before the hooks exist: the truth, in fp64
        loss, n = loss_sum(i)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        squared = sum(float(g.double().pow(2).sum()) for g in grads if g is not None)
        if n > 0 and factors[i]:
            expected += squared / int(n)
            counted += 1

    noise = NoiseScale(torch.device("cpu"), rows=rows)
    noise.watch(params)
    for i in range(5):
        loss, n = loss_sum(i)
        (loss * factors[i]).backward()
        noise.end_micro(factors[i], n)
    weighted, micro_batches = noise.local_sums().tolist()
    assert counted == 3 and micro_batches == 3
    assert weighted == pytest.approx(expected, rel=1e-6)
