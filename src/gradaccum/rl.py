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

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
"""The normalisations `loss_sum` and `window_count` implement (module docstring)."""


def check_loss_type(loss_type: str, max_completion_length: int | None = None) -> None:
    """ValueError for a loss type not in LOSS_TYPES, or dr_grpo without its constant."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    if loss_type == "dr_grpo" and not (max_completion_length and max_completion_length > 0):
        raise ValueError("loss_type 'dr_grpo' divides by max_completion_length: give it (> 0)")


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
    completion tokens (bnpo, dapo), or completions x max_completion_length (dr_grpo)."""
    check_loss_type(loss_type, max_completion_length)
    rows = int(mask.shape[0])
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
    out = model(input_ids, **kwargs)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    logits = logits[:, :-1].float() / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), 2, input_ids[:, 1:].unsqueeze(2)).squeeze(2)


class PolicyLoss:
    """`loss_fn(model, batch) -> (loss_sum, count)` for `Accumulator.step`, with
    `Accumulator(count_tokens=counter(loss_type, max_completion_length))`.

    batch: input_ids (B, T) prompt and completion, completion_mask (B, T-1) 1 where token t+1
    is a completion token, old_logprobs (B, T-1) the sampling policy's, advantages (B,), and
    with beta > 0 ref_logprobs (B, T-1); padding anywhere the mask is 0."""

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

    def __call__(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
        logprobs = completion_logprobs(model, batch["input_ids"], self.temperature)
        per_token = per_token_loss(
            logprobs,
            batch["old_logprobs"].to(logprobs.dtype),
            batch["advantages"],
            self.epsilon,
            self.epsilon_high,
            batch.get("ref_logprobs"),
            self.beta,
        )
        mask = batch["completion_mask"]
        count = window_count(mask, self.loss_type, self.max_completion_length)
        return loss_sum(per_token, mask, self.loss_type), count
