"""Evaluation of an SFT model on held-out examples: exact match by greedy generation, and the
loss over completion tokens.

`exact_match` gives the model each example's prompt (its tokens up to its last target span)
and generates greedily, as many tokens as the reference (that span: the completion and its
EOS, or the template's end of turn); it matches when they are the same tokens, or, with
`check` (e.g. sft_tasks.check), when check(prompt text, generated text up to EOS) holds.
Examples cut to seq_len are left out (their reference lost its end). Any causal LM works whose
forward takes (b, T) input ids and returns logits (b, T, V), or an output with `.logits` (a
Hugging Face model): prompts of a batch are padded on the right, and with causal attention the
padding after a row's last token never changes that row's logits, so no attention mask is
needed and the built-in GPT, which takes none, generates exactly as one prompt at a time.

`heldout_loss` sums the cross-entropy over the examples' target tokens and divides by their
count (nats per target token), in micro-batches of the given layout (sft_batches.collate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gradaccum.data.sft.examples import IGNORE_INDEX, Example
from gradaccum.data.sft.windows import collate

__all__ = ["ExactMatch", "HeldoutLoss", "Sample", "exact_match", "greedy_generate", "heldout_loss"]


@dataclass(frozen=True)
class Sample:
    """One evaluated prompt, for printing."""

    prompt: str
    expected: str
    generated: str
    correct: bool


@dataclass
class ExactMatch:
    correct: int
    """Examples answered exactly."""
    total: int
    """Examples evaluated."""
    samples: list[Sample] = field(default_factory=list)
    """The first few evaluated examples."""

    @property
    def rate(self) -> float:
        """Share answered exactly, in [0, 1] (0 for none evaluated)."""
        return self.correct / self.total if self.total else 0.0


@dataclass
class HeldoutLoss:
    loss_sum: float
    """Cross-entropy summed over the target tokens, nats."""
    tokens: int
    """Target tokens."""

    @property
    def loss(self) -> float:
        """Nats per target token (nan for none)."""
        return self.loss_sum / self.tokens if self.tokens else float("nan")


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new: Sequence[int],
    eos_id: int,
    pad_id: int,
    batch_size: int = 32,
) -> list[list[int]]:
    """Greedy continuations of `prompts` (token ids): prompt i gets at most max_new[i] new
    tokens, stopping after EOS. Each step runs the whole batch without a cache (a few short
    answers: simple beats fast). Returns the new tokens of each prompt, EOS included.
    Every prompt must hold at least one token."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate: every prompt needs at least one token")
    device = _model_device(model)
    out: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        seqs = [list(prompts[i]) for i in rows]
        active = [max_new[i] > 0 for i in rows]
        while any(active):
            width = max(len(s) for s, a in zip(seqs, active, strict=True) if a)
            ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : min(len(s), width)] = torch.tensor(s[:width])
            logits = _logits(model, ids.to(device))
            for r, i in enumerate(rows):
                if not active[r]:
                    continue
                token = int(logits[r, len(seqs[r]) - 1].argmax())
                seqs[r].append(token)
                out[i].append(token)
                active[r] = token != eos_id and len(out[i]) < max_new[i]
    return out


def _last_span(example: Example) -> tuple[int, int]:
    """(start, end) of the example's last run of target tokens."""
    labels = example.labels
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start, end


def exact_match(
    model: torch.nn.Module,
    examples: Sequence[Example],
    tokenizer,
    check: Callable[[str, str], bool] | None = None,
    max_examples: int | None = None,
    samples: int = 3,
    batch_size: int = 32,
) -> ExactMatch:
    """Exact match of greedy generation on `examples` (not those truncated), the first
    `max_examples` of them; `samples` of them kept for printing. The model is put in eval
    mode for the generation and back in the mode it was in."""
    chosen = [e for e in examples if not e.truncated][:max_examples]
    spans = [_last_span(e) for e in chosen]
    prompts = [e.input_ids[:s].tolist() for e, (s, _) in zip(chosen, spans, strict=True)]
    refs = [e.input_ids[s:t].tolist() for e, (s, t) in zip(chosen, spans, strict=True)]
    was_training = model.training
    model.eval()
    try:
        generated = greedy_generate(
            model, prompts, [len(r) for r in refs], tokenizer.eos_id, tokenizer.pad_id, batch_size
        )
    finally:
        model.train(was_training)
    result = ExactMatch(0, len(chosen))
    for prompt, ref, gen in zip(prompts, refs, generated, strict=True):
        prompt_text, gen_text = (
            tokenizer.decode(prompt),
            tokenizer.decode(_until_eos(gen, tokenizer.eos_id)),
        )
        ok = check(prompt_text, gen_text) if check is not None else gen == ref
        result.correct += ok
        if len(result.samples) < samples:
            result.samples.append(Sample(prompt_text, tokenizer.decode(ref), gen_text, bool(ok)))
    return result


def _until_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    examples: Sequence[Example],
    pad_id: int,
    layout: str = "shifted",
    micro_batch: int = 16,
    rank: int = 0,
    world_size: int = 1,
) -> HeldoutLoss:
    """Cross-entropy over the target tokens of `examples` (fp32), this rank's share: rank r
    takes every world_size-th micro-batch, so the caller sums loss_sum and tokens over ranks.
    layout "shifted" calls model(input_ids) (any causal LM, the built-in GPT included);
    "unshifted" calls model(input_ids=..., attention_mask=...) (a Hugging Face model). Eval
    mode during, the model's own mode after."""
    device = _model_device(model)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for k, first in enumerate(range(0, len(examples), micro_batch)):
            if k % world_size != rank:
                continue
            batch = collate(examples[first : first + micro_batch], pad_id, layout)
            total_k, tokens_k = _loss_sum(model, batch, layout, device)
            total, tokens = total + total_k, tokens + tokens_k
    finally:
        model.train(was_training)
    return HeldoutLoss(total, tokens)


def _loss_sum(model, batch: dict, layout: str, device) -> tuple[float, int]:
    ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    if layout == "shifted":
        logits = _logits(model, ids)
    else:  # the labels are those of input positions: position t predicts label t + 1
        out = model(input_ids=ids, attention_mask=batch["attention_mask"].to(device))
        logits = (out if isinstance(out, torch.Tensor) else out.logits)[:, :-1]
        labels = labels[:, 1:]
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return float(loss), int((labels != IGNORE_INDEX).sum())
