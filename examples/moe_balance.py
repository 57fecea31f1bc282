"""A mixture of experts in a hand-written loop: the load-balancing loss over the whole window.

    python examples/moe_balance.py

The built-in GPT with 4 experts per block (top-2) trains three windows of 4 micro-batches.
`gradaccum.moe.Balance` in "global" mode counts the window's expert load f over every
micro-batch before the backward passes, so each step's gradient is the big batch's,
cross-entropy plus LBL = coef * E * mean over layers of sum_i f_i * P_i. The first window's
LBL is also computed here by hand from the router logits, for comparison.
"""

import torch

from gradaccum import Accumulator, moe, windows
from gradaccum.models.gpt import GPT, GPTConfig

torch.manual_seed(0)
config = GPTConfig(
    vocab_size=256,
    seq_len=32,
    n_layer=2,
    n_head=2,
    n_embd=32,
    n_expert=4,
    expert_top_k=2,
    router_aux_coef=0.1,
)
model = GPT(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
acc = Accumulator(model, optimizer, max_grad_norm=1.0)
balance = moe.Balance(model, "global")  # "micro" | "global" | "global-previous"


def loader(micro_batches=12, b=4, t=32):
    g = torch.Generator().manual_seed(1)
    for _ in range(micro_batches):
        ids = torch.randint(0, 256, (b, t + 1), generator=g)
        labels = ids[:, 1:].clone()
        lengths = torch.randint(4, t + 1, (b,), generator=g)
        labels[torch.arange(t)[None, :] >= lengths[:, None]] = -100
        yield {"input_ids": ids[:, :-1], "labels": labels}  # every input position is routed


def lbl_by_hand(model, micro_batches):
    """coef * E * mean over layers of sum_i f_i * P_i over every token of the window."""
    with torch.no_grad():
        outs = [model(b["input_ids"], output_router_logits=True) for b in micro_batches]
    per_layer = []
    for layer in range(config.n_layer):
        p = torch.cat([o.router_logits[layer] for o in outs]).float().softmax(-1)
        top = p.topk(config.expert_top_k, dim=-1).indices
        f = torch.zeros(config.n_expert).scatter_add_(0, top.flatten(), torch.ones(top.numel()))
        per_layer.append((f / len(p) * p.mean(0)).sum())
    return config.router_aux_coef * config.n_expert * float(torch.stack(per_layer).mean())


for micro_batches in windows(loader(), accum_steps=4):
    by_hand = lbl_by_hand(model, micro_batches)  # before the step: the weights it sees
    result, stats = balance.step(acc, micro_batches)
    print(
        f"step {result.step}: loss {result.loss:.4f}, aux {result.aux_loss:.8f}, "
        f"lbl {stats.lbl:.8f} (by hand {by_hand:.8f}), max load {stats.max_load:.3f} "
        f"over {stats.tokens} tokens"
    )
