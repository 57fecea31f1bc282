"""The gradient noise scale, from the per-micro-batch gradients accumulation computes anyway.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"): below the critical
batch size a larger batch buys proportionally fewer steps, above it the extra compute is
mostly wasted. B_simple = tr(Sigma) / |G|^2 estimates it, where G is the true gradient and
Sigma the covariance of one token's gradient. A window of n micro-batches (over all ranks)
holds everything the estimate needs (docs/design.md, "Noise scale"):

- micro-batch i holds n_i valid tokens, N = sum n_i, and g_i is its own mean gradient;
- S_small = sum (n_i / N) |g_i|^2, S_big = |g|^2 with g the window's gradient;
- E[S_small] = |G|^2 + n tr(Sigma) / N and E[S_big] = |G|^2 + tr(Sigma) / N, so
  tr(Sigma) ~ N (S_small - S_big) / (n - 1) and |G|^2 ~ (n S_big - S_small) / (n - 1).

Each window's two estimates are noisy (|G|^2 can come out negative): they are averaged with
bias-corrected exponential moving averages, kept separately, and B_simple is their ratio.
Units: tokens (tr(Sigma) is per token); in sequences, divided by the window's mean valid
tokens per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch


@dataclass(frozen=True)
class NoiseEstimate:
    """The noise scale after a window. Gradients are per-token means, in fp32."""

    b_simple_tokens: float
    """Critical batch estimate in tokens: EMA(tr Sigma) / EMA(|G|^2); nan until |G|^2 > 0."""
    b_simple_sequences: float
    """The same in sequences (tokens / mean valid tokens per sequence); nan when unknown."""
    g2: float
    """Bias-corrected EMA of the unbiased |G|^2 estimate (squared gradient norm)."""
    trace_sigma: float
    """Bias-corrected EMA of the unbiased tr(Sigma) estimate (per-token gradient variance)."""
    ema_steps: int
    """Windows averaged so far (non-finite windows and windows of one micro-batch left out)."""


def window_estimates(
    s_small: float, s_big: float, tokens: float, micro_batches: int
) -> tuple[float, float]:
    """(|G|^2, tr Sigma) of one window: the unbiased estimators above. Needs n >= 2."""
    n = micro_batches
    if n < 2:
        raise ValueError(f"micro_batches {n}: the noise scale needs at least 2 per window")
    g2 = (n * s_big - s_small) / (n - 1)
    trace = tokens * (s_small - s_big) / (n - 1)
    return g2, trace


class NoiseScale:
    """Collects each micro-batch's squared gradient norm as backward produces it, and keeps
    the moving averages. The engine drives it (`Accumulator(noise_scale=True)`):

    - `watch(params)` once: a hook per parameter writes |grad| of the micro-batch in flight
      into that parameter's column of the micro-batch's row of one buffer;
    - `end_micro(factor, tokens)` after each backward: `factor` is what that backward's loss
      sum was multiplied by (1/N, the world factor and the loss scale), undone here;
    - `local_sums()` at the window's end: (sum_i |g_i|^2 n_i, micro-batches) on this rank,
      to be summed over ranks with the window's token count;
    - `update(summed, s_big, tokens, sequences)`: one window's estimate into the averages.
    Everything per micro-batch stays on the device: no host sync, nothing kept per
    micro-batch (memory does not grow with k).
    """

    def __init__(self, device: torch.device, decay: float = 0.99, rows: int = 16):
        """`rows`: micro-batches whose norms wait in the buffer before they are added to
        the sums (the buffer holds rows x parameters fp32 norms)."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"noise decay {decay}: must be in [0, 1)")
        if rows < 1:
            raise ValueError(f"noise rows {rows}: must be at least 1")
        self.decay = decay
        self.rows = rows
        self._device = device
        # Each small op after a backward costs as much as a parameter's norm, so a
        # micro-batch only fills a row (its norms from the hooks, its tokens here) and the
        # arithmetic runs once per `rows` micro-batches, or per window.
        self._norms = torch.zeros(self.rows, 0, dtype=torch.float32, device=device)
        self._slots: list[list[torch.Tensor]] = []  # [row][parameter]: 0-d views of _norms
        self._tokens = torch.zeros(self.rows, dtype=torch.float64, device=device)
        self._token_slots = self._tokens.unbind()
        self._row = 0  # the micro-batch in flight
        self._factor = 0.0  # the factor of the rows filled so far
        self._seen = False  # a hook wrote into the row in flight
        self._sums = torch.zeros(2, dtype=torch.float64, device=device)
        self._weighted, self._micro_batches = self._sums.unbind()  # views into _sums
        self._ema_g2 = 0.0
        self._ema_trace = 0.0
        self.ema_steps = 0
        self.last: NoiseEstimate | None = None

    def watch(self, params) -> list:
        """Register the per-parameter gradient hooks, once; returns their handles."""
        params = [p for p in params if p.requires_grad]
        self._norms = torch.zeros(self.rows, len(params), dtype=torch.float32, device=self._device)
        self._slots = [list(row.unbind()) for row in self._norms]
        return [p.register_hook(partial(self._on_grad, i)) for i, p in enumerate(params)]

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        if hasattr(grad, "to_local"):  # a DTensor gradient: this rank's shard
            grad = grad.to_local()
        if grad.requires_grad:  # only under create_graph; out= takes no graph
            grad = grad.detach()
        torch.linalg.vector_norm(grad, dtype=torch.float32, out=self._slots[self._row][index])
        self._seen = True

    def end_micro(self, factor: float, tokens) -> None:
        """Close one micro-batch: |g_i|^2 n_i = |factor * sum-gradient|^2 / (factor^2 n_i)."""
        row = self._row
        if not (factor and self._seen):
            self._norms[row].zero_()
        else:
            if row and factor != self._factor:  # rows of another factor: fold them first
                self._fold()
                self._norms[0].copy_(self._norms[row])
                self._norms[row].zero_()
            if isinstance(tokens, torch.Tensor):
                self._token_slots[self._row].copy_(tokens)
            else:
                self._token_slots[self._row].fill_(tokens)
            self._factor = factor
            self._row += 1
            if self._row == self.rows:
                self._fold()
        self._seen = False

    def _fold(self) -> None:
        """Add the filled rows to the sums and clear them; a micro-batch without tokens adds
        nothing and does not count."""
        filled = slice(0, self._row)
        n = self._tokens[filled]
        has_tokens = n > 0
        squared = torch.linalg.vector_norm(self._norms[filled], dim=1, dtype=torch.float64).square()
        own = torch.where(has_tokens, squared / n, 0.0).sum()  # where drops 0/0
        self._weighted.add_(own, alpha=1.0 / (self._factor * self._factor))
        self._micro_batches.add_(has_tokens.sum())
        self._norms[filled].zero_()
        self._tokens[filled].zero_()
        self._row = 0

    def local_sums(self) -> torch.Tensor:
        """This rank's (sum_i |g_i|^2 n_i, micro-batches with tokens), fp64; then cleared."""
        if self._row:
            self._fold()
        sums = self._sums.clone()
        self._sums.zero_()
        return sums

    def abandon(self) -> None:
        """Forget the window in progress (the engine abandoned it)."""
        self._norms.zero_()
        self._tokens.zero_()
        self._row = 0
        self._seen = False
        self._sums.zero_()

    def update(
        self, summed: tuple[float, float], s_big: float, tokens: float, sequences: float | None
    ) -> NoiseEstimate | None:
        """Fold one finite window in. `summed` is local_sums() summed over ranks, `s_big`
        the squared norm of the window's (unscaled, unclipped) gradient, `tokens` N."""
        weighted, micro_batches = summed
        n = int(round(micro_batches))
        if n >= 2 and tokens > 0 and all(map(math.isfinite, (weighted, s_big))):
            g2, trace = window_estimates(weighted / tokens, s_big, tokens, n)
            self._ema_g2 = self.decay * self._ema_g2 + (1 - self.decay) * g2
            self._ema_trace = self.decay * self._ema_trace + (1 - self.decay) * trace
            self.ema_steps += 1
            self.last = self._estimate(tokens / sequences if sequences else None)
        return self.last

    def _estimate(self, tokens_per_sequence: float | None) -> NoiseEstimate:
        correction = 1.0 - self.decay**self.ema_steps
        g2 = self._ema_g2 / correction
        trace = self._ema_trace / correction
        b_tokens = trace / g2 if g2 > 0 else math.nan
        b_seq = b_tokens / tokens_per_sequence if tokens_per_sequence else math.nan
        return NoiseEstimate(b_tokens, b_seq, g2, trace, self.ema_steps)

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "ema_g2": self._ema_g2,
            "ema_trace": self._ema_trace,
            "ema_steps": self.ema_steps,
            "last": None if self.last is None else self.last.__dict__.copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self._ema_g2 = float(state["ema_g2"])
        self._ema_trace = float(state["ema_trace"])
        self.ema_steps = int(state["ema_steps"])
        self.last = None if state["last"] is None else NoiseEstimate(**state["last"])
