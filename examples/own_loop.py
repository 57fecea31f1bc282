"""A hand-written training loop on gradaccum's engine, alone or under torchrun.

    python examples/own_loop.py
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py

Each rank trains on its own random token sequences with ragged lengths (padding labels are
-100); every window of 8 micro-batches is one optimizer step over the tokens of all ranks.
"""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.parallel.process_group import aligned_windows, init_distributed, teardown


def loss_fn(model, batch):
    """Cross-entropy summed (not averaged) over valid tokens, and their count."""
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss_sum, (labels != -100).sum()


def my_rank_loader(rank: int, device, micro_batches: int = 32, b: int = 4, t: int = 64):
    g = torch.Generator().manual_seed(rank)
    for _ in range(micro_batches):
        ids = torch.randint(0, 256, (b, t + 1), generator=g)
        labels = ids[:, 1:].clone()
        lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
        labels[torch.arange(t)[None, :] >= lengths[:, None]] = -100
        yield {"input_ids": ids[:, :-1].to(device), "labels": labels.to(device)}


def main():
    rank = init_distributed()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, n_embd=64))
    model = model.to(rank.device)
    if rank.world_size > 1:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    acc = Accumulator(model, optimizer, max_grad_norm=1.0)
    for micro_batches in aligned_windows(my_rank_loader(rank.rank, rank.device), accum_steps=8):
        result = acc.step(micro_batches, loss_fn)
        if rank.rank == 0:
            print(
                f"step {result.step}: loss {result.loss:.4f} over {result.tokens} tokens, "
                f"{result.micro_steps} micro-steps, {result.grad_collectives} gradient "
                "collective(s)"
            )
    teardown(rank)


if __name__ == "__main__":
    main()
