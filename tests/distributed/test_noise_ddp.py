"""The noise scale on 2 gloo ranks under DDP equals one process taking the same global
windows: each micro-batch's squared norm travels in the window's token all-reduce."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from gradaccum.testing import run_ranks
from tests.reference import make_gpt, token_loss

from .ranks import TIMEOUT_S, K, global_windows, rank_data

pytestmark = pytest.mark.slow  # one spawn of 2 processes for the module

WINDOWS = 4


def _noise_on_rank(info) -> list[dict]:
    model = DistributedDataParallel(make_gpt())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.05), noise_scale=True)
    data = rank_data(info.rank, WINDOWS * K, seed=500)
    out = []
    for i in range(WINDOWS):
        result = acc.step(data[i * K : (i + 1) * K], token_loss)
        out.append(result.noise.__dict__.copy())
    return out


def test_two_ranks_give_the_one_process_estimate():
    per_rank = run_ranks(_noise_on_rank, 2, timeout_s=TIMEOUT_S)
    model = make_gpt()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.05), noise_scale=True)
    want = [acc.step(w, token_loss).noise for w in global_windows((WINDOWS * K,) * 2, K, 500)]
    for got in per_rank:
        assert len(got) == WINDOWS
        for g, w in zip(got, want, strict=True):
            assert g["ema_steps"] == w.ema_steps
            assert w.trace_sigma > 0  # a real figure, not an empty one
            for key in ("g2", "trace_sigma"):
                assert g[key] == pytest.approx(getattr(w, key), rel=1e-4), key
            for key in ("b_simple_tokens", "b_simple_sequences"):  # nan while |G|^2 <= 0
                assert g[key] == pytest.approx(getattr(w, key), rel=1e-4, nan_ok=True), key
