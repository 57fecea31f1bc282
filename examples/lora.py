"""LoRA adapters on a frozen base, in a hand-written loop on gradaccum's engine.

    pip install -e '.[lora]'      # peft
    python examples/lora.py

The built-in GPT gets rank-4 adapters on every linear layer but the output head (peft, through
`gradaccum.models.lora`); everything else is frozen, so the optimizer, the engine's buffers
and the gradients hold the adapters only. Three windows of 4 micro-batches train them.
"""

import torch

from gradaccum import Accumulator, windows
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.lora import LoraSpec, apply_lora, trainable_parameters
from gradaccum.models.loss import causal_lm_loss

torch.manual_seed(0)
config = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=64)
model = GPT(config)
base = {name: p.detach().clone() for name, p in model.named_parameters()}

info = apply_lora(model, LoraSpec(rank=4))  # alpha 2 x rank; targets c_attn, c_proj, c_fc
print(f"lora: {info.describe()}")
print(f"trainable {info.trainable} of {info.total} parameters")

optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
acc = Accumulator(model, optimizer, max_grad_norm=1.0)


def loader(micro_batches=12, b=4, t=32):
    g = torch.Generator().manual_seed(1)
    for _ in range(micro_batches):
        ids = torch.randint(0, 256, (b, t + 1), generator=g)
        labels = ids[:, 1:].clone()
        lengths = torch.randint(4, t + 1, (b,), generator=g)
        labels[torch.arange(t)[None, :] >= lengths[:, None]] = -100
        yield {"input_ids": ids[:, :-1], "labels": labels}  # labels aligned with the logits


for micro_batches in windows(loader(), accum_steps=4):
    result = acc.step(micro_batches, causal_lm_loss)
    print(f"step {result.step}: loss {result.loss:.4f}, grad norm {result.grad_norm:.4f}")

# the base is untouched: peft keeps each adapted layer's weight as `base_layer`
now = {name.replace(".base_layer.", "."): p for name, p in model.named_parameters()}
base_change = max(float((now[name] - p).abs().max()) for name, p in base.items())
adapter_b = max(float(p.detach().abs().max()) for n, p in model.named_parameters() if "lora_B" in n)
print(f"base max change {base_change:.1e}, adapters' B max {adapter_b:.2e}")
