"""A mixture of experts' load-balancing loss under accumulation (docs/design.md, "Mixture of
experts").

Per MoE layer l with E experts and top-k routing, over a set S of routed tokens (the tokens
that are real input: `models.router.routed_mask`), with p[l,t,:] = softmax(router logits) in
fp32, counts[l,i] = tokens of S whose top-k contains expert i (no gradient),
f[l,i] = counts[l,i] / |S| (summing to k) and P[l,i] = sum over S of p[l,t,i] / |S|:

    LBL(S) = coef * E * mean over l of sum over i of f[l,i] * P[l,i]

Hugging Face's f/P convention (top-k counts, the factor E, the model's coefficient), per
layer and averaged over layers; a Hugging Face model's own loss pools every layer's tokens
into one f and one P instead, which differs unless the layers route alike.

The window W is every micro-batch on every rank, T = |S_W| over ranks. Micro-batch m (tokens
S_m, T_m of them) adds to its backward a term already normalized for the window (the engine
scales it as the loss but without dividing by N: `Window.backward(..., aux=)`); summed over the
window's micro-batches and ranks it is the window's term:

- "global": aux_m = coef * E * mean_l sum_i f_W[l,i] * (sum over S_m of p[l,t,i]) / T, f_W
  from the whole window over ranks, counted by a no-grad routing pass before the window's
  backward passes (a forward per micro-batch without the output head where the model allows,
  and no activations kept). Summed over m: LBL(W) exactly, its value and its gradient.
- "micro": aux_m = (T_m / T) * LBL(S_m), each micro-batch's own loss as a model computes it,
  weighted by its share of the routed tokens. It differs from "global" only in f.
- "global-previous": "global" with the f of the previous window (over ranks): no routing
  pass, exact in P, one window stale in f. The first window (no previous f) is "global".

The routed token count T and, for "global", the counts travel to every rank in the window's
own first collective (`begin_window(extra_sums=)`); after the window one all-reduce of the
counts and probability sums (2 L E numbers) gives the exact LBL(W) in every mode and the f
that "global-previous" uses next. Exact when the forward is deterministic (no dropout before
a router, no router jitter): `BalanceStats.routing_agrees` says whether the training forwards
routed as the routing pass did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from gradaccum.engine.window import repeated_batch
from gradaccum.models.loss import count_targets, token_sum_loss
from gradaccum.moe import router
from gradaccum.moe.router import MoESpec
from gradaccum.parallel import collectives
from gradaccum.parallel.devices import autocast
from gradaccum.utils.choices import MOE_BALANCES

__all__ = ["Balance", "BalanceStats"]


@dataclass
class BalanceStats:
    """One window's load balance, over all micro-batches and ranks."""

    lbl: float
    """The window's LBL(W) (module docstring), from its counts and probability sums over
    ranks, whatever the mode; 0 with no routed token."""
    load: list[float] = field(default_factory=list)
    """Per MoE layer, max_i f[l,i] / mean_i f[l,i]: 1 when balanced, E / k when all tokens go
    to the same k experts; 0 with no routed token."""
    max_load: float = 0.0
    """The largest of `load`."""
    tokens: int = 0
    """Routed tokens in the window over ranks (T)."""
    aux_loss: float | None = None
    """The term the window trained with (`StepResult.aux_loss`): LBL(W) in "global", the
    token-weighted micro-batch losses in "micro"; None when no result was given."""
    f_source: str = "global"
    """Whose f the window used: "global" (its own, by a routing pass), "micro" or
    "previous"."""
    routing_agrees: bool | None = None
    """With a routing pass: whether the training forwards' top-k counts over the window
    equal the routing pass's (False: a forward that is not deterministic); else None."""


class Balance:
    """The load-balancing loss of a mixture of experts for one window at a time.

    spec: the model's `MoESpec`, or the model itself (`models.router.moe_spec`). mode: one of
    `MOE_BALANCES`. shift: labels unshifted, as `gradaccum.hf` takes them (position t predicts
    label t + 1, every batch key but labels goes to the model); False: labels aligned with the
    logits, as the trainer's batches (`models.loss.causal_lm_loss`).
    Per window, in this order: `prepare` (before `begin_window`), `begin` (the window),
    `loss` per micro-batch (its three values to `window.backward`; `backward` does both),
    `end` after `finish`; or `abandon` for a window dropped. `step` does all of it for one
    window.
    """

    def __init__(self, spec: MoESpec | torch.nn.Module, mode: str, shift: bool = False):
        if mode not in MOE_BALANCES:
            raise ValueError(f"moe balance {mode!r}: expected one of {', '.join(MOE_BALANCES)}")
        if isinstance(spec, torch.nn.Module):
            spec = _spec_of(spec)
        self.spec, self.mode, self.shift = spec, mode, shift
        self._previous_f: torch.Tensor | None = None  # (L, E) float64, over ranks
        self._last_batch = None  # repeated with weight 0 by `step` on a rank with fewer
        self._clear()

    def _clear(self) -> None:
        self._source: str | None = None  # the f of the window prepared: global/micro/previous
        self._window_counts: torch.Tensor | None = None  # over ranks, from extra_sums
        self._f: torch.Tensor | None = None
        self._tokens = 0
        self._begun = False
        self._reduce, self._group = False, None  # whether end() sums over ranks, and where
        # this rank's, from the training forwards, on the device they come from
        self._counts: torch.Tensor | int = 0
        self._prob_sums: torch.Tensor | float = 0.0

    # ---- one window ----------------------------------------------------------------------

    def prepare(
        self, model: torch.nn.Module, micro_batches: Sequence[Mapping], acc=None
    ) -> torch.Tensor:
        """This rank's counts for `begin_window(extra_sums=)`: int64 [T_local] and, when the
        window takes its own f ("global", and "global-previous" without a previous f), its
        counts from a no-grad routing pass over this rank's micro-batches, [T_local,
        counts (L * E)]. acc: the Accumulator the window runs on; the routing pass then runs
        under its autocast (bf16, fp16), as the micro-steps do, so that it routes alike."""
        spec = self.spec
        tokens = int(sum(router.routed_mask(b).sum() for b in micro_batches))  # one sync
        source = {"global": "global", "micro": "micro"}.get(self.mode, "previous")
        if source == "previous" and self._previous_f is None:
            source = "global"
        self._clear()
        self._source = source
        if source != "global":
            return torch.tensor([tokens], dtype=torch.int64)
        joining = self._joining_passes(model, micro_batches, acc)  # before any pass
        counts = torch.zeros(spec.layers, spec.n_expert, dtype=torch.int64)
        for batch in micro_batches:
            logits = self._routing_pass(model, batch, acc)
            mask = router.routed_mask(batch)
            counts = router.layer_figures(logits, mask, spec.top_k)[0] + counts.to(mask.device)
        for batch in joining:
            self._routing_pass(model, batch, acc)  # joins the other ranks' all-gathers only
        local = torch.cat([torch.tensor([tokens]), counts.cpu().flatten()])  # one copy to host
        return local.to(torch.int64)

    def _routing_pass(self, model, batch: Mapping, acc) -> list[torch.Tensor]:
        with nullcontext() if acc is None else autocast(acc.device, acc.autocast_dtype):
            logits = router.routing_pass(model, batch, self.shift)
        self._check_layers(logits)
        return logits

    def _joining_passes(self, model, micro_batches: Sequence[Mapping], acc) -> list[Mapping]:
        """Under FSDP2 every routing forward all-gathers the parameters, so a rank with fewer
        micro-batches than another in the window runs as many passes: its last batch again,
        uncounted (one 8-byte all-reduce agrees on the number). None otherwise."""
        if not router.is_sharded(model):
            return []
        group = None if acc is None else acc.dp.group
        most = collectives.max_over_ranks(len(micro_batches), group)
        if most == len(micro_batches):
            return []
        last = repeated_batch(micro_batches, self._last_batch)
        if last is None:
            raise ValueError(
                "this rank has no micro-batch in its first window, another has "
                f"{most}: under FSDP2 its routing pass needs a batch to join their all-gathers"
            )
        return [last] * (most - len(micro_batches))

    def begin(self, window) -> None:
        """Read the window's routed tokens T (and, with a routing pass, its counts) from
        `window.extra_sums`, summed over ranks; fixes the f its micro-batches use."""
        if self._source is None:
            raise RuntimeError("Balance.begin without Balance.prepare for this window")
        extra = window.extra_sums
        width = 1 + (self.spec.layers * self.spec.n_expert if self._source == "global" else 0)
        if extra is None or extra.numel() != width:
            got = "none" if extra is None else f"{extra.numel()} numbers"
            raise ValueError(
                f"the window's extra_sums hold {got}, not the {width} of Balance.prepare: pass "
                "its result to begin_window(extra_sums=...)"
            )
        self._tokens = int(extra[0])
        dp = window.acc.dp
        self._reduce, self._group = dp.averages_over_ranks, dp.group
        if self._source == "global":
            self._window_counts = extra[1:].view(self.spec.layers, self.spec.n_expert)
            self._f = self._window_counts.double() / max(self._tokens, 1)
        elif self._source == "previous":
            self._f = self._previous_f
        self._begun = True

    def loss(self, model: torch.nn.Module, batch: Mapping, weight: float = 1.0):
        """(cross-entropy summed over the batch's targets, their count, aux): one forward with
        router logits, the first two as `models.loss.token_sum_loss`, aux the micro-batch's
        term of the window's loss (module docstring), a 0-d tensor with its graph. Pass
        weight=0 for a batch repeated only to join the collectives: its routing is then not
        counted (pass the same weight to `window.backward`)."""
        if not self._begun:
            raise RuntimeError("Balance.loss outside a window begun with Balance.begin")
        logits, router_logits = router.forward(model, batch, self.shift)
        self._check_layers(router_logits)
        loss_sum, num_tokens = token_sum_loss(logits, batch["labels"], shift=self.shift)
        mask = router.routed_mask(batch)
        counts, prob_sums = router.layer_figures(router_logits, mask, self.spec.top_k)
        aux = self._aux(counts, prob_sums, mask.sum())
        if weight:  # on the device: no host sync per micro-batch
            self._counts = counts + self._counts
            self._prob_sums = prob_sums.detach().double() + self._prob_sums
        return loss_sum, num_tokens, aux

    def backward(self, window, model: torch.nn.Module, batch: Mapping, weight: float = 1.0):
        """One micro-batch inside `window.micro_step()`: `loss`, then `window.backward` of its
        three values with the same weight (0 for a batch repeated only to join the
        collectives)."""
        loss_sum, num_tokens, aux = self.loss(model, batch, weight)
        window.backward(loss_sum, num_tokens, weight, aux=aux)

    def _aux(self, counts, prob_sums, micro_tokens) -> torch.Tensor:
        spec = self.spec
        scale = spec.coef * spec.n_expert / spec.layers / max(self._tokens, 1)
        if self._f is None:  # "micro": this micro-batch's own f, weighted by T_m / T
            own_f = counts.to(prob_sums) / micro_tokens.to(prob_sums.device).clamp(min=1)
            return scale * (own_f * prob_sums).sum()
        return scale * (self._f.to(prob_sums) * prob_sums).sum()

    def end(self, result=None) -> BalanceStats:
        """The window's figures after `window.finish()` (one all-reduce of the counts and
        probability sums over ranks; none alone). "global-previous" keeps this window's f for
        the next, unless the window was skipped (then the previous f stays)."""
        if not self._begun:
            raise RuntimeError("Balance.end outside a window begun with Balance.begin")
        spec, tokens = self.spec, self._tokens
        shape = (spec.layers, spec.n_expert)
        counts = torch.zeros(shape, dtype=torch.float64) + torch.as_tensor(self._counts).cpu()
        prob_sums = torch.zeros(shape, dtype=torch.float64) + torch.as_tensor(self._prob_sums).cpu()
        sums = torch.cat([counts.flatten(), prob_sums.flatten()])
        if self._reduce:
            sums = collectives.all_reduce_sum(sums, self._group)
        counts, prob_sums = sums.view(2, *shape)
        f = counts / max(tokens, 1)
        lbl = spec.coef * spec.n_expert * float((f * prob_sums / max(tokens, 1)).sum(1).mean())
        mean_f = f.mean(dim=1)
        load = torch.where(mean_f > 0, f.max(dim=1).values / mean_f.clamp(min=1e-300), 0.0)
        agrees = None
        if self._window_counts is not None:
            agrees = bool(torch.equal(counts.round().long(), self._window_counts))
        stats = BalanceStats(
            lbl=lbl,
            load=load.tolist(),
            max_load=float(load.max()),
            tokens=tokens,
            aux_loss=None if result is None else result.aux_loss,
            f_source=self._source,
            routing_agrees=agrees,
        )
        if self.mode == "global-previous" and not getattr(result, "skipped", False):
            self._previous_f = f if tokens else self._previous_f
        self._clear()
        return stats

    def abandon(self) -> None:
        """Forget the window in progress (abandoned, e.g. out of memory): its counts are
        dropped and the previous f, if any, is kept."""
        self._clear()

    def _check_layers(self, router_logits) -> None:
        if len(router_logits) != self.spec.layers:
            raise ValueError(
                f"{self.spec.model_class} returned router logits of {len(router_logits)} "
                f"layers, its MoESpec counts {self.spec.layers}"
            )

    # ---- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The previous window's f (what "global-previous" needs to resume exactly)."""
        f = None if self._previous_f is None else self._previous_f.clone()
        return {"mode": self.mode, "previous_f": f}

    def load_state_dict(self, state: Mapping) -> None:
        f = state.get("previous_f")
        shape = (self.spec.layers, self.spec.n_expert)
        if f is not None and tuple(f.shape) != shape:
            raise ValueError(f"previous_f of shape {tuple(f.shape)}: this model's is {shape}")
        self._previous_f = None if f is None else f.to(torch.float64).cpu().clone()

    # ---- a whole window, for hand-written loops -------------------------------------------

    def step(self, acc, micro_batches: Sequence[Mapping]):
        """One window of `micro_batches` on `acc` (an Accumulator of the model) with the
        balance: prepare, `begin_window` with this rank's target count and the extra sums,
        then `Window.run` with `backward` per micro-step (under torchrun a rank with fewer
        repeats its last batch with weight 0, so every rank needs a batch in its first
        window) and its finish. Returns (StepResult, BalanceStats). A window that raises is
        abandoned, by the Accumulator and here."""
        micro_batches = list(micro_batches)
        model = acc.model
        extra = self.prepare(model, micro_batches, acc)
        tokens = int(sum(count_targets(b["labels"], self.shift) for b in micro_batches))
        window = acc.begin_window(micro_batches, tokens=tokens, extra_sums=extra)

        def forward_backward(batch: Mapping, weight: float) -> None:
            self.backward(window, model, batch, weight)

        try:
            self.begin(window)
            result = window.run(micro_batches, forward_backward, stand_in=self._last_batch)
        except BaseException:
            window.abandon()  # harmless when run() already dropped it
            self.abandon()
            raise
        self._last_batch = repeated_batch(micro_batches, self._last_batch)
        return result, self.end(result)


def _spec_of(model: torch.nn.Module) -> MoESpec:
    spec = router.moe_spec(model)
    if spec is None:
        name = type(router.core_model(model)).__name__
        raise ValueError(
            f"{name} has no mixture-of-experts layers whose router logits gradaccum reads: "
            "a load-balancing mode needs an MoE model (the built-in GPT with n_expert > 0, "
            "or a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE)"
        )
    return spec
