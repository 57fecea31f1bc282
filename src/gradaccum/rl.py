"""Policy-gradient losses for RL fine-tuning (the GRPO family), exact under accumulation.

A window holds P prompts x G sampled completions, cut into micro-batches like any examples.
Each loss below is a sum over the window's completion tokens divided by ONE count over the
whole window (every micro-batch, every rank); the engine does that division
(`Accumulator(count_tokens=rl.counter(loss_type, ...))` and `rl.PolicyLoss` as `loss_fn`), so
the window's gradient is the one of the big batch, whatever the micro-batch, k or ranks.

Per completion token t of completion i (its mask m_it, 1 on completion tokens):
  ratio r_it = exp(logp_it - logp_old_it)  (the sampling policy's log-probs; on-policy r = 1)
  l_it = -min(r_it A_i, clip(r_it, 1 - epsilon, 1 + epsilon_high) A_i) + beta kl_it
  kl_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1  (k3 estimator, to a frozen reference)
The normalisations (`LOSS_TYPES`), each over the WINDOW's completions C and tokens:
  grpo:    sum_i [ sum_t m_it l_it / sum_t m_it ] / C            (divides by completions)
  bnpo:    sum_it m_it l_it / sum_it m_it                        (divides by completion tokens)
  dapo:    as bnpo (token-level over the window)
  dr_grpo: sum_it m_it l_it / (C x max_completion_length)        (divides by a constant per row)
`loss_sum` gives a micro-batch's numerator and `window_count` its part of the denominator.

Advantages per group (`group_advantages`): each completion's reward minus its group's mean,
divided by the group's std (population, + 1e-4) unless scale=False (Dr. GRPO's "none").

The mistakes users meet (`verify`'s and the tests' contrasts): a micro-batch normalised on its
own and then divided by k (right only when every micro-batch holds as many of the counted
things), and the window's normalisation divided by k once more (the update k times too small).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gradaccum.utils.choices import LOSS_TYPES

__all__ = [
    "LOSS_TYPES",
    "PolicyLoss",
    "collate",
    "counter",
    "group_advantages",
    "loss_sum",
    "window_count",
]


def check_loss_type(loss_type: str, max_completion_length: int | None = None) -> None:
    """ValueError for a loss type not in LOSS_TYPES, or dr_grpo without its constant."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    if loss_type == "dr_grpo" and not (max_completion_length and max_completion_length > 0):
        raise ValueError("loss_type 'dr_grpo' divides by max_completion_length: give it (> 0)")


def collate(rows: list[tuple[list[int], list[int]]], advantages, pad_id: int) -> dict:
    """A batch of (prompt tokens, completion tokens) rows, right-padded with `pad_id` to the
    longest: input_ids (B, T), completion_mask (B, T-1) 1 where token t+1 is a completion
    token, advantages (B,) float32 (a list or a tensor, one per row): `PolicyLoss`'s keys."""
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1, dtype=torch.long)
    for r, (prompt, completion) in enumerate(rows):
        input_ids[r, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        mask[r, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = 1
    return {"input_ids": input_ids, "completion_mask": mask,
            "advantages": torch.as_tensor(advantages, dtype=torch.float32)}  # fmt: skip


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Advantages of P x G rewards laid out group by group (each prompt's G completions
    consecutive): reward minus the group mean, over the group's std (population) + eps when
    `scale`. A group whose rewards are all equal gets 0 for each."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64 if rewards.dtype == torch.float64
                              else torch.float32)  # fmt: skip
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards: {tuple(rewards.shape)} is not P x G with G = {num_generations}, "
            "one reward per completion, each prompt's completions consecutive"
        )
    groups = rewards.view(-1, num_generations)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1)


def per_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """l_it (module docstring) of (B, T) log-probs and (B,) advantages: the clipped
    surrogate, plus beta x the k3 KL to the reference when beta > 0."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv)
    if beta:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs, the reference model's log-probs")
        diff = ref_logprobs - logprobs
        loss = loss + beta * (torch.exp(diff) - diff - 1)
    return loss


def loss_sum(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """A micro-batch's numerator of the window's loss (module docstring): for grpo the sum
    of its completions' token means, for the others the sum over its completion tokens."""
    check_loss_type(loss_type, 1)
    mask = mask.to(per_token.dtype)
    summed = (per_token * mask).sum(dim=1)
    if loss_type == "grpo":
        return (summed / mask.sum(dim=1).clamp(min=1)).sum()
    return summed.sum()


def window_count(
    mask: torch.Tensor, loss_type: str, max_completion_length: int | None = None
) -> int:
    """A micro-batch's part of the window's denominator: its completions (grpo), its
    completion tokens (bnpo, dapo), or completions x max_completion_length (dr_grpo). A row
    with no completion token (a rank's stand-in) counts for nothing."""
    check_loss_type(loss_type, max_completion_length)
    rows = int((mask.sum(dim=1) > 0).sum().item())  # a stand-in row of no completion: none
    if loss_type == "grpo":
        return rows
    if loss_type == "dr_grpo":
        return rows * int(max_completion_length)
    return int(mask.sum().item())


def counter(loss_type: str, max_completion_length: int | None = None) -> Callable[[dict], int]:
    """`Accumulator(count_tokens=...)` for a loss type: a batch's `window_count`, from its
    `completion_mask`, counted before the window's first backward."""
    check_loss_type(loss_type, max_completion_length)
    return lambda batch: window_count(batch["completion_mask"], loss_type, max_completion_length)


def completion_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, temperature: float = 1.0, **kwargs
) -> torch.Tensor:
    """log p(token t | tokens before it) for t = 1 .. T-1 of (B, T) ids: (B, T-1), the logits
    divided by the sampling temperature (as the samples were drawn)."""
    return _log_probs(model, input_ids, temperature, **kwargs)[0]


def _log_probs(model, input_ids, temperature, entropy=False, **kwargs):
    """(completion_logprobs, the entropy of each position's distribution (B, T-1) or None)."""
    out = model(input_ids, **kwargs)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    taken = torch.gather(logp, 2, input_ids[:, 1:].unsqueeze(2)).squeeze(2)
    if not entropy:
        return taken, None
    with torch.no_grad():
        return taken, -(logp.exp() * logp).sum(dim=-1)


TOTALS = ("tokens", "entropy", "clipped", "kl")
"""What `PolicyLoss.totals` sums over completion tokens (`PolicyLoss.start_tracking`)."""


class PolicyLoss:
    """`loss_fn(model, batch) -> (loss_sum, count)` for `Accumulator.step`, with
    `Accumulator(count_tokens=counter(loss_type, max_completion_length))`.

    batch: input_ids (B, T) prompt and completion, completion_mask (B, T-1) 1 where token t+1
    is a completion token, old_logprobs (B, T-1) the sampling policy's, advantages (B,), and
    with beta > 0 ref_logprobs (B, T-1); padding anywhere the mask is 0. Without
    old_logprobs the batch is on-policy: the sampling log-probs are this forward's own,
    detached, so the ratio is exactly 1 and its gradient the policy gradient."""

    def __init__(
        self,
        loss_type: str = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        max_completion_length: int | None = None,
        temperature: float = 1.0,
    ):
        check_loss_type(loss_type, max_completion_length)
        self.loss_type, self.epsilon, self.epsilon_high = loss_type, epsilon, epsilon_high
        self.beta, self.max_completion_length = beta, max_completion_length
        self.temperature = temperature
        self.totals: dict[str, float] | None = None
        """Sums over the completion tokens seen since `start_tracking`; None: not kept."""

    def __call__(
        self, model: torch.nn.Module, batch: dict, track: bool = True
    ) -> tuple[torch.Tensor, int]:
        """(the batch's loss sum, its count); its figures added to `totals` when kept and
        `track` (False: a stand-in batch of weight 0)."""
        track = track and self.totals is not None
        logprobs, entropy = _log_probs(model, batch["input_ids"], self.temperature, track)
        old = batch.get("old_logprobs")
        old = logprobs.detach() if old is None else old.to(logprobs.dtype)
        ref = batch.get("ref_logprobs")
        per_token = per_token_loss(
            logprobs, old, batch["advantages"], self.epsilon, self.epsilon_high, ref, self.beta
        )
        mask = batch["completion_mask"]
        if track:
            self._track(logprobs.detach(), old, batch["advantages"], ref, entropy, mask)
        count = window_count(mask, self.loss_type, self.max_completion_length)
        return loss_sum(per_token, mask, self.loss_type), count

    def start_tracking(self) -> None:
        """From now on, add each call's sums over completion tokens to `totals` (`TOTALS`):
        tokens, entropy (nats), tokens whose ratio the clip holds, and the k3 KL to the
        reference (with ref_logprobs). Reset by calling it again."""
        self.totals = dict.fromkeys(TOTALS, 0.0)

    def _track(self, logprobs, old, advantages, ref, entropy, mask) -> None:
        mask = mask.to(logprobs.dtype)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        ratio, adv = torch.exp(logprobs - old), advantages.to(logprobs.dtype).unsqueeze(1)
        clipped = ((ratio < 1 - self.epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        sums = {"tokens": mask, "entropy": entropy, "clipped": clipped.to(mask.dtype)}
        if ref is not None:
            diff = ref.to(logprobs.dtype) - logprobs
            sums["kl"] = torch.exp(diff) - diff - 1
        for name, value in sums.items():
            self.totals[name] += float((value * mask).sum())
