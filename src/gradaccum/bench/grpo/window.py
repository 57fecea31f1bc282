"""The window of `gradaccum bench --task grpo`: P prompts x G sampled completions, their
rewards and advantages, laid out as each contestant takes them, and the exact update.

Prompts are the built-in instruction set's (`data.sft.builtin`) of exactly PROMPT_TOKENS byte
tokens: TRL left-pads prompts of different lengths, which moves every position of a row; one
length gives both contestants the same inputs, so the errors measure the normalisation alone.

Completions are sampled once (`grpo.sampling.sample`, the model's own `generate`), then each
is cut to a length drawn from the seed, log-uniform between max_completion_length / 8 and
max_completion_length, and ends in EOS there: a randomly initialised model almost never
samples EOS, so its completions would all be as long as allowed, while real ones vary by far
more than 4x (what makes a per-micro-batch normalisation differ from the window's).
Rewards are uniform on [0, 1) from the seed; advantages per group (`rl.group_advantages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradaccum import rl
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.data.tokenizers import BYTE_EOS, ByteTokenizer
from gradaccum.grpo.sampling import sample

PROMPT_TOKENS = 14
"""Byte tokens of every prompt (the built-in prompts of that length: reverse, sort, count and
add rows alike)."""

SHORTEST_SHARE = 8
"""The shortest drawn completion length is max_completion_length / SHORTEST_SHARE."""


@dataclass
class Window:
    """One optimizer step's completions, on the CPU."""

    prompts: list[list[int]]
    """P prompts of PROMPT_TOKENS byte tokens."""
    completions: list[list[int]]
    """P x G completions (ids, without the prompt), group by group, each ending in EOS."""
    advantages: torch.Tensor
    """(P x G,) float64, per group."""
    num_generations: int

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completions]

    @property
    def tokens(self) -> int:
        """Completion tokens (what every loss type sums over)."""
        return sum(self.lengths)


def builtin_prompts(count: int, seed: int) -> list[list[int]]:
    """`count` distinct built-in prompts of PROMPT_TOKENS byte tokens, drawn from `seed`."""
    tok = ByteTokenizer()
    found: list[list[int]] = []
    n = 64 * count
    while len(found) < count:
        rows = builtin_rows(seed, n)
        found = [
            ids for ids in (tok.encode(r["prompt"]) for r in rows) if len(ids) == PROMPT_TOKENS
        ]
        n *= 2
    return found[:count]


def cut_lengths(n: int, longest: int, seed: int) -> list[int]:
    """`n` lengths log-uniform on [longest / SHORTEST_SHARE, longest], rounded, >= 1."""
    rng = np.random.default_rng([seed, 0x6890])
    low = math.log(max(1.0, longest / SHORTEST_SHARE))
    return [max(1, round(math.exp(x))) for x in rng.uniform(low, math.log(longest), n)]


def make_window(model, cfg, index: int) -> Window:
    """Window `index` of the run: its prompts, G completions each sampled by `model` and cut
    (module docstring), rewards and advantages; the same for the same cfg.seed and index."""
    seed = cfg.seed * 1000 + index
    prompts = builtin_prompts(cfg.prompts_per_step * (index + 1), cfg.seed)[
        cfg.prompts_per_step * index :
    ]
    sampled = sample(
        model, prompts, cfg.num_generations, cfg.max_completion_length, cfg.temperature,
        BYTE_EOS, seed,
    )  # fmt: skip
    lengths = cut_lengths(len(sampled), cfg.max_completion_length, seed)
    completions = []
    for ids, n in zip(sampled, lengths, strict=True):
        ids = ids[: n - 1] if len(ids) >= n else ids[:-1]  # keep n - 1 tokens, then EOS
        completions.append(ids + [BYTE_EOS])
    rewards = torch.rand(len(completions), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)  # fmt: skip
    advantages = rl.group_advantages(rewards, cfg.num_generations)
    return Window(prompts, completions, advantages, cfg.num_generations)


def ours_micro_batches(window: Window, micro_batch: int, device) -> list[dict]:
    """The batches of `rl.PolicyLoss`: `micro_batch` consecutive completions each, prompt and
    completion right-padded to the micro-batch's longest, completion_mask (B, T-1) 1 where
    token t+1 is a completion token, advantages (B,) float32. On-policy: no old_logprobs."""
    out = []
    for start in range(0, len(window.completions), micro_batch):
        rows = range(start, min(start + micro_batch, len(window.completions)))
        out.append(_ours_batch(window, rows, device))
    return out


def _ours_batch(window: Window, rows, device) -> dict:
    pairs = [(window.prompts[i // window.num_generations], window.completions[i]) for i in rows]
    batch = rl.collate(pairs, window.advantages[list(rows)], BYTE_EOS)
    return {key: value.to(device) for key, value in batch.items()}


def trl_micro_batches(window: Window, micro_batch: int, device) -> list[dict]:
    """The inputs TRL's GRPOTrainer trains on: the dict `_generate_and_score_completions`
    returns for the window (prompt_ids / prompt_mask, completion_ids right-padded to the
    window's longest with completion_mask, advantages, num_items_in_batch the window's
    completion tokens), split into micro-batches with TRL's own `split_tensor_dict` as its
    `_prepare_inputs` does, without its shuffle (both contestants see the same micro-batches).
    On-policy with steps_per_generation = k and one iteration: TRL keeps no old log-probs."""
    from trl.trainer.utils import split_tensor_dict

    n = len(window.completions)
    width = max(window.lengths)
    completion_ids = torch.full((n, width), BYTE_EOS, dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.long)
    for i, ids in enumerate(window.completions):
        completion_ids[i, : len(ids)] = torch.tensor(ids)
        completion_mask[i, : len(ids)] = 1
    prompt_ids = torch.tensor(
        [window.prompts[i // window.num_generations] for i in range(n)], dtype=torch.long
    )
    whole = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": window.advantages.float(),
        "num_items_in_batch": completion_mask.sum(),
    }
    whole = {k: v.to(device) for k, v in whole.items()}
    return split_tensor_dict(whole, n // micro_batch)


def exact_gradient(model, window: Window, loss_type: str, cfg) -> list[torch.Tensor]:
    """The big batch's gradient, in float64 on a copy of `model`: one forward over all the
    window's completions, the loss of `rl`'s module docstring written out here (on-policy:
    ratio exp(logp - logp.detach()) = 1, clipped to [1 - 0.2, 1 + 0.2]), normalised over the
    whole window. Per trainable parameter, in `parameters()` order."""
    import copy

    ref = copy.deepcopy(model).double()
    ref.train()
    batch = _ours_batch(window, range(len(window.completions)), next(ref.parameters()).device)
    ids, mask = batch["input_ids"], batch["completion_mask"].double()
    logits = ref(ids).logits[:, :-1] / cfg.temperature
    logp = torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
    ratio = torch.exp(logp - logp.detach())
    adv = window.advantages.to(logp.device).unsqueeze(1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    summed = (per_token * mask).sum(dim=1)
    if loss_type == "grpo":
        loss = (summed / mask.sum(dim=1)).mean()
    elif loss_type == "dr_grpo":
        loss = summed.sum() / (len(window.completions) * cfg.max_completion_length)
    else:  # bnpo, dapo: token-level over the window
        loss = summed.sum() / mask.sum()
    loss.backward()
    return [p.grad for p in ref.parameters() if p.requires_grad]
