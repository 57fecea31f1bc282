"""The window `gradaccum verify --task grpo` checks, and the check.

The window: the first P prompts of the built-in instruction set drawn from the seed
(`gradaccum.data.sft.builtin.builtin_rows`), tokenized as `verify --task sft` tokenizes them (the
byte tokenizer for the built-in GPT, the --init-from folder's own otherwise) up to the first
completion token; G completions each, sampled by `gradaccum.grpo.sampling.sample` at the
temperature, at most max_completion_length tokens. When the sampled lengths are not at least
LENGTH_SPREAD x apart (an untrained model rarely samples its EOS), each completion is cut to a
length drawn from the seed, and the output says so: a spread of lengths is what makes a
per-micro-batch normalisation wrong. Rewards are drawn from the seed (uniform in [0, 1)): the
check is of the gradient's arithmetic, not of the reward. Advantages per group
(`rl.group_advantages`). On-policy: no sampling log-probs kept, so the ratio is 1 (the clip
bites only when a generation batch is reused). With beta > 0 the reference log-probs are those
of a copy of the model whose every floating weight moved by seeded normal noise of REF_NOISE x
its tensor's mean absolute value: the starting model itself would make the KL term zero.

The check, per loss type: the window's C completions, cut into k consecutive micro-batches,
through `Accumulator` (`rl.counter`, `rl.PolicyLoss`) in the model's precision, against one big
batch of all C completions in float64 whose loss is written out here from the formulas of
`gradaccum.rl`'s docstring (not through its code). Then the mistakes, on the same completions
through the same engine, each with its error against the same big batch:
- per_micro_batch_over_k: each micro-batch normalised by its own count, the sum over k (TRL's
  grpo, bnpo and dr_grpo path); right only when every micro-batch holds as many of what the
  loss type counts;
- window_over_k_again: the window's normalisation divided by k once more (ms-swift 10117): the
  gradient k times too small, an error of 1 - 1/k;
- group_split: every micro-batch boundary moved by G/2 completions (the window rotated) so
  that groups are cut in two, each micro-batch's advantages taken within its part of each
  group, normalised per micro-batch and over k.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from gradaccum import rl
from gradaccum.data.sft.examples import IGNORE_INDEX
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.utils.errors import BadInput
from gradaccum.verification.budget import MAX_SEQ_LEN, check_fits
from gradaccum.verification.cases import Case, build_case
from gradaccum.verification.sft import Reading, read_examples

__all__ = ["GRPOWindow", "grpo_case", "logprobs", "micro_batch_sizes"]

LENGTH_SPREAD = 4
"""How many times longer the longest completion must be than the shortest."""
REF_NOISE = 0.05
"""With beta > 0: the reference model's weights are the model's plus normal noise of this
times each tensor's mean absolute value."""


# ---- the window -------------------------------------------------------------------------


def micro_batch_sizes(completions: int, k: int | None, micro_batch: int | None,
                      default_k: int) -> list[int]:  # fmt: skip
    """Completions per micro-batch, consecutive: --micro-batch each (the last holding what is
    left), or --k micro-batches as equal as they can be (the first ones one longer), or
    `default_k` of them. BadInput for a k above the completions or a --k and --micro-batch
    that disagree."""
    window = f"the window's {completions} completions (--prompts-per-step x --num-generations)"
    if micro_batch is not None:
        sizes = [micro_batch] * (completions // micro_batch)
        sizes += [completions % micro_batch] if completions % micro_batch else []
        if sizes == [] or (k is not None and k != len(sizes)):
            raise BadInput("--k", k, f"--micro-batch {micro_batch} cuts {window} into "
                           f"{len(sizes)} micro-batches; give one of the two")  # fmt: skip
        return sizes
    k = default_k if k is None else k
    if k > completions:
        raise BadInput("--k", k, f"more micro-batches than {window}")
    return [completions // k + (i < completions % k) for i in range(k)]


def builtin_prompts(tokenizer, seed: int, count: int) -> list[list[int]]:
    """The first `count` built-in rows drawn from `seed`, tokenized as `verify --task sft`
    reads them, each cut before its first target token: the prompt the model completes."""
    data = read_examples(None, Reading(seq_len=MAX_SEQ_LEN, tokenizer=tokenizer), seed, count)
    prompts = []
    for example in data.examples:
        targets = (example.labels != IGNORE_INDEX).nonzero()[0]
        prompts.append(example.input_ids[: int(targets[0])].tolist())
    return prompts


def spread_lengths(sampled: list[int], seed: int) -> list[int]:
    """The completions' lengths as checked: as sampled when the longest is LENGTH_SPREAD x the
    shortest or more; otherwise each cut to a length drawn from `seed` (uniform in 1 .. its
    own), and the shortest then cut to a LENGTH_SPREAD-th of the longest if still needed."""
    if max(sampled) >= LENGTH_SPREAD * min(sampled):
        return list(sampled)
    g = torch.Generator().manual_seed(seed)
    cut = [int(torch.randint(1, n + 1, (1,), generator=g)) for n in sampled]
    if max(cut) < LENGTH_SPREAD * min(cut):
        cut[cut.index(min(cut))] = max(1, max(cut) // LENGTH_SPREAD)
    return cut


@dataclass
class GRPOWindow:
    """One window of P prompts x G completions, in one padded batch, and what it holds."""

    batch: dict
    """Every completion in one batch, right-padded: input_ids (C, T), completion_mask (C, T-1),
    advantages (C,), and ref_logprobs (C, T-1) with beta > 0 (`rl.PolicyLoss`'s keys)."""
    rewards: torch.Tensor
    """(C,) rewards, group by group: drawn from the seed."""
    num_generations: int
    """G: completions per prompt, consecutive."""
    sizes: list[int]
    """Completions in each of the k micro-batches, in order."""
    prompt_lengths: list[int]
    """Tokens of each prompt."""
    sampled_lengths: list[int]
    """Tokens of each completion as sampled (an EOS included)."""
    lengths: list[int]
    """Tokens of each completion as checked (`spread_lengths`)."""
    scale_rewards: bool
    """Advantages over the group's std (--scale-rewards group)."""
    tokenizer: str
    """The tokenizer, in words."""
    ref_noise: float | None = None
    """With beta > 0: REF_NOISE, how the reference model was made; None without."""

    @property
    def cut(self) -> bool:
        """Whether the completions were cut to drawn lengths."""
        return self.lengths != self.sampled_lengths

    @property
    def spread(self) -> float:
        """The longest completion's tokens over the shortest's."""
        return max(self.lengths) / min(self.lengths)

    def micro_batches(self, order: list[int] | None = None, advantages=None) -> list[dict]:
        """The k micro-batches of `sizes` completions, taken in `order` (default as sampled),
        each cut to its own longest row; `advantages` (C,) in place of the window's."""
        order = list(range(len(self.lengths))) if order is None else order
        out, start = [], 0
        for size in self.sizes:
            rows = torch.tensor(order[start : start + size])
            start += size
            mask = self.batch["completion_mask"][rows]
            width = int(mask.sum(0).nonzero().max()) + 2  # the last completion token + 1
            batch = {key: value[rows, : width - 1] for key, value in self.batch.items()
                     if value.dim() == 2}  # fmt: skip
            batch["input_ids"] = self.batch["input_ids"][rows, :width]
            adv = self.batch["advantages"] if advantages is None else advantages
            batch["advantages"] = adv[rows]
            out.append(batch)
        return out


OBJECTIVE = ("epsilon", "epsilon_high", "beta", "max_completion_length", "temperature")
"""The settings of the loss (`rl.PolicyLoss`) besides its loss type."""


def grpo_case(args, sizes: dict) -> tuple[Case, GRPOWindow]:
    """The model of verify's flags, built as for --task sft (`cases.build_case`: byte tokens,
    or the --init-from folder's tokenizer), and the window sampled from it. Sets
    sizes["seq_len"] to the longest prompt + max_completion_length where --seq-len is not
    given; BadInput where it is given and shorter, or the window does not fit in memory."""
    from gradaccum.train.sft import tokenizer_for  # the trainer's rule, as cases.py uses it

    tokenizer = tokenizer_for(args)[0] if args.init_from is not None else ByteTokenizer()
    prompts = builtin_prompts(tokenizer, sizes["seed"], args.prompts_per_step)
    width = max(map(len, prompts)) + args.max_completion_length
    if sizes["seq_len"] is None:
        sizes["seq_len"] = width
    elif sizes["seq_len"] < width:
        raise BadInput("--seq-len", sizes["seq_len"], f"below the longest prompt "
                       f"({width - args.max_completion_length} tokens) + "
                       f"--max-completion-length {args.max_completion_length} = {width}")  # fmt: skip
    case = build_case(args, sizes)  # the byte vocabulary with its EOS, or the folder's tokenizer
    completions = sum(sizes["cut"])
    check_fits(case.info, {**sizes, "k": 1, "micro_batch": completions, "seq_len": width})
    window = sample_window(case.model, case.tokenizer, prompts, args, sizes["cut"], sizes["seed"])
    return case, window


def sample_window(model, tokenizer, prompts: list[list[int]], rl_args, sizes: list[int],
                  seed: int) -> GRPOWindow:  # fmt: skip
    """The window (module docstring) of `prompts` (`builtin_prompts`). rl_args: verify's RL
    settings (num_generations, max_completion_length, temperature, beta, scale_rewards)."""
    from gradaccum.grpo.sampling import sample

    G, most = rl_args.num_generations, rl_args.max_completion_length
    completions = sample(model, prompts, G, most, rl_args.temperature, tokenizer.eos_id, seed)
    sampled = [len(c) for c in completions]
    lengths = spread_lengths(sampled, seed)
    rows = [
        (prompts[i // G], c[:n]) for i, (c, n) in enumerate(zip(completions, lengths, strict=True))
    ]
    rewards = torch.rand(len(rows), generator=torch.Generator().manual_seed(seed))
    scale = rl_args.scale_rewards == "group"
    batch = rl.collate(rows, rl.group_advantages(rewards, G, scale), tokenizer.pad_id)
    ids = batch["input_ids"]
    if rl_args.beta:
        batch["ref_logprobs"] = _reference_logprobs(model, ids, rl_args.temperature, seed)
    return GRPOWindow(
        batch, rewards, G, sizes, [len(p) for p in prompts], sampled, lengths, scale,
        tokenizer.origin, REF_NOISE if rl_args.beta else None,
    )  # fmt: skip


@torch.no_grad()
def _reference_logprobs(model, ids: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
    """Log-probs (C, T-1) of a frozen reference: the model with its floating weights moved by
    seeded noise (REF_NOISE x each tensor's mean |w|), in float32 as a trainer keeps them."""
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed + 1)
    for p in ref.parameters():
        if p.is_floating_point() and p.numel():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.add_(noise * REF_NOISE * p.abs().mean())
    return logprobs(ref, ids, temperature).float()


def logprobs(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token t+1 | tokens up to t), (C, T-1), in the model's dtype or float32."""
    out = model(ids)
    logits = (out if isinstance(out, torch.Tensor) else out.logits)[:, :-1]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32))
                             / temperature, dim=-1)  # fmt: skip
    return logp.gather(2, ids[:, 1:, None]).squeeze(2)
