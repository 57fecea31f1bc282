"""A Hugging Face causal LM in a hand-written loop on gradaccum's engine.

    python examples/hf_own_loop.py

A tiny Llama built from its config (nothing downloaded) trains on random token rows of ragged
lengths. Batches hold input_ids, labels (unshifted, -100 on padding) and attention_mask, as
a Hugging Face model takes them; `gradaccum.hf` sums the loss over the targets after the
shift and counts the same targets, so every window of 4 micro-batches is one exact step.
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from gradaccum import Accumulator, hf, verify, windows

config = LlamaConfig(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
acc = Accumulator(model, optimizer, max_grad_norm=1.0, count_tokens=hf.count_tokens)


def loader(micro_batches=12, b=4, t=32):
    g = torch.Generator().manual_seed(1)
    for _ in range(micro_batches):
        ids = torch.randint(0, 256, (b, t), generator=g)
        lengths = torch.randint(4, t + 1, (b,), generator=g)
        real = torch.arange(t)[None, :] < lengths[:, None]
        labels = ids.masked_fill(~real, -100)  # unshifted: the model's own convention
        yield {"input_ids": ids, "labels": labels, "attention_mask": real.long()}


for micro_batches in windows(loader(), accum_steps=4):
    # the window's targets by hand: labels after the shift that are not padding
    targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
    result = acc.step(micro_batches, hf.loss_fn)
    print(
        f"step {result.step}: loss {result.loss:.4f} over {result.tokens} targets "
        f"(counted by hand: {targets}), {result.micro_steps} micro-steps"
    )

# the same window as one big batch in float64, on a copy of the model
report = verify(model, micro_batches, hf.loss_fn, count_tokens=hf.count_tokens)
print(f"verify: passed {report.passed}, max rel err {report.max_rel_err:.2e}")
