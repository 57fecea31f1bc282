"""Sampling the completions of RL fine-tuning: G completions per prompt from the policy itself.

`sample(model, prompts, G, max_new_tokens, temperature, eos_id, seed)` draws each token from
softmax(logits / temperature), the whole distribution (no top-k, no top-p, no repetition
penalty), which is what the loss's log-probs (`gradaccum.rl.completion_logprobs`, at the same
temperature) measure, so the sampling policy and the policy of the loss are the same one.

Two ways, one result shape:
- the built-in GPT (also with LoRA adapters injected, or inside a peft `PeftModel`): our own
  loop over `GPT.decode`, its key/value cache, one position per step. Tokens are drawn on the
  CPU with a `torch.Generator` seeded by `seed` (`torch.multinomial(probs.cpu(), generator=)`),
  so the draws do not depend on the device's RNG and the global RNG is untouched.
- a Hugging Face causal LM (or a peft model around one): its own `generate` (do_sample, the
  temperature, top_k 0, top_p 1, its cache), inside `torch.random.fork_rng` seeded with
  `torch.manual_seed(seed)`: the same seed gives the same completions on the same device, and
  the global RNG is as it was afterwards. `generate` merges the model's own generation_config
  (a saved model's repetition_penalty, top_k, no_repeat_ngram_size ...) into any settings it
  is given, which would sample from another distribution than the loss's; so for the call the
  model's generation_config is a fresh one holding only these settings, and is put back after.

The model runs in eval mode (no dropout: the policy's own distribution) under torch.no_grad,
and is put back in the mode it was in. A DDP or torch.compile wrapper is looked through.

Length: a prompt and its completion must fit the model's positions (the built-in GPT's
seq_len; a Hugging Face config's n_positions or max_position_embeddings), so a prompt gets at
most that many tokens less its own length, fewer than max_new_tokens when it is long.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from gradaccum.models.export import unwrap
from gradaccum.models.gpt import GPT

__all__ = ["BATCH_ROWS", "sample"]

BATCH_ROWS = 256
"""Most rows (completions) decoded together: whole groups of prompts of one length."""


def sample(
    model: nn.Module,
    prompts: list[list[int]],
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    seed: int,
) -> list[list[int]]:
    """`num_generations` completions of each prompt (token ids), len(prompts) x G lists, group
    by group (prompt i's completions at i*G .. i*G + G - 1). A completion holds the new tokens
    only: it ends with eos_id when EOS was sampled (the tokens after it are not kept), and
    holds at most max_new_tokens tokens, fewer when the prompt is long (see the module
    docstring). The same seed gives the same completions. ValueError for an empty prompt, or
    one that leaves no position for a completion."""
    if num_generations < 1 or max_new_tokens < 1 or not temperature > 0:
        raise ValueError(
            f"sample: num_generations {num_generations} and max_new_tokens {max_new_tokens} "
            f"must be >= 1, temperature {temperature} > 0"
        )
    model = unwrap(model)  # DDP and torch.compile wrappers looked through: no gradients here
    gpt = builtin_gpt(model)
    limit = _context_length(gpt if gpt is not None else model)
    budgets = [_budget(len(p), max_new_tokens, limit) for p in prompts]
    out: list[list[int]] = [[] for _ in range(len(prompts) * num_generations)]
    was_training = model.training
    model.eval()
    try:
        hf_seeded = contextlib.nullcontext() if gpt is not None else _hf_generation(model, seed)
        with torch.no_grad(), hf_seeded:
            generator = torch.Generator().manual_seed(seed)
            for group in _batches(prompts, num_generations):
                ids = [list(prompts[i]) for i in group for _ in range(num_generations)]
                budget = budgets[group[0]]
                if gpt is not None:
                    rows = _sample_gpt(gpt, ids, budget, temperature, eos_id, generator)
                else:
                    rows = _sample_hf(model, ids, budget, temperature, eos_id)
                for k, i in enumerate(group):
                    block = rows[k * num_generations : (k + 1) * num_generations]
                    out[i * num_generations : (i + 1) * num_generations] = block
    finally:
        model.train(was_training)
    return out


def builtin_gpt(model: nn.Module) -> GPT | None:
    """The built-in GPT `model` is, or holds inside a peft `PeftModel`; None for another model
    (a Hugging Face one). Injected LoRA adapters stay in place, so it computes what `model`
    does."""
    if isinstance(model, GPT):
        return model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else None
    return inner if isinstance(inner, GPT) else None


def _context_length(model: nn.Module) -> int | None:
    """Most positions the model reads, None when its config does not say."""
    if isinstance(model, GPT):
        return model.config.seq_len
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _budget(prompt_len: int, max_new_tokens: int, limit: int | None) -> int:
    """New tokens a prompt of prompt_len tokens may get."""
    if prompt_len == 0:
        raise ValueError("sample: every prompt needs at least one token")
    if limit is None:
        return max_new_tokens
    if prompt_len >= limit:
        raise ValueError(
            f"sample: a prompt of {prompt_len} tokens leaves no room for a completion in the "
            f"model's {limit} positions"
        )
    return min(max_new_tokens, limit - prompt_len)


def _batches(prompts: list[list[int]], num_generations: int) -> list[list[int]]:
    """Prompt indices decoded together: prompts of one length (no padding), at most
    BATCH_ROWS rows (at least one prompt) per batch, in order of first appearance."""
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    per_batch = max(1, BATCH_ROWS // num_generations)
    return [
        same[k : k + per_batch]
        for same in by_length.values()
        for k in range(0, len(same), per_batch)
    ]


def _draw(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> list[int]:
    """One token per row of logits (rows, V) from softmax(logits / temperature), in float64
    on the CPU with `generator`."""
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).view(-1).tolist()


def _sample_gpt(
    gpt: GPT,
    ids: list[list[int]],
    budget: int,
    temperature: float,
    eos_id: int,
    generator: torch.Generator,
) -> list[list[int]]:
    """Completions of rows `ids` (all of one length) by the built-in GPT with its KV cache."""
    device = gpt.wte.weight.device
    start = len(ids[0])
    logits, cache = gpt.decode(torch.tensor(ids, device=device), None, 0)
    rows: list[list[int]] = [[] for _ in ids]
    running = [True] * len(ids)
    for step in range(budget):
        tokens = _draw(logits[:, -1], temperature, generator)
        for r, token in enumerate(tokens):
            if running[r]:
                rows[r].append(token)
                running[r] = token != eos_id
        if not any(running) or step == budget - 1:
            break
        # Finished rows decode on (their tokens are dropped): the batch keeps its shape.
        new = torch.tensor(tokens, device=device).view(-1, 1)
        logits, cache = gpt.decode(new, cache, start + step)
    return rows


@contextlib.contextmanager
def _hf_generation(model: nn.Module, seed: int):
    """For a Hugging Face model's `generate`: the global RNG forked and seeded with `seed`,
    the model's generation_config a fresh one (see the module docstring), both put back
    after."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "generate") or not hasattr(base, "generation_config"):
        raise TypeError(
            f"sample: a {type(base).__name__} is neither the built-in GPT nor a Hugging Face "
            "causal LM (no generate)"
        )
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    if device.type == "cpu":
        devices = []
    elif device.index is not None:
        devices = [device.index]
    else:
        devices = [torch.get_device_module(device.type).current_device()]
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(seed)
            yield
    finally:
        base.generation_config = saved


def _sample_hf(
    model: nn.Module,
    ids: list[list[int]],
    budget: int,
    temperature: float,
    eos_id: int,
) -> list[list[int]]:
    """Completions of rows `ids` (all of one length) by the model's `generate`."""
    input_ids = torch.tensor(ids, device=next(model.parameters()).device)
    sequences = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=budget,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
    )
    rows = []
    for row in sequences[:, input_ids.shape[1] :].tolist():
        rows.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return rows
