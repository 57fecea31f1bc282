"""One window of ragged SFT examples, cut into micro-batches three ways: the same gradient.

    python examples/packing.py

The engine divides the window's summed loss by the window's target count once, so the
update does not depend on how the examples are split, as long as each target is computed as
it would be alone. `gradaccum.data.sft.packing.micro_batches` cuts the window in each
`--packing` mode ("none", "window", "padding-free"); one optimizer step per mode on a copy of
the same model, each gradient compared with the examples run one by one by hand.
"""

import copy

import torch
import torch.nn.functional as F

from gradaccum import Accumulator
from gradaccum.data.sft.examples import make_example
from gradaccum.data.sft.packing import micro_batches
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss

torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, n_embd=32))

# 12 examples of 5 to 60 tokens: a prompt (label -100) then a completion (its targets)
g = torch.Generator().manual_seed(1)
examples = []
for i in range(12):
    length = int(torch.randint(5, 61, (1,), generator=g))
    prompt = int(torch.randint(1, length - 1, (1,), generator=g))
    ids = torch.randint(1, 256, (length,), generator=g).tolist()
    examples.append(make_example(ids, [-100] * prompt + ids[prompt:], index=i))
targets = sum(e.num_targets for e in examples)
print(f"{len(examples)} examples, {sum(e.length for e in examples)} tokens, {targets} targets")

# the reference, by hand: each example alone, the loss summed over the window / its targets
ref_model = copy.deepcopy(model)
for e in examples:
    ids, labels = torch.as_tensor(e.input_ids).long(), torch.as_tensor(e.labels).long()
    logits = ref_model(ids[None, :-1])[0]  # position t predicts token t + 1
    loss = F.cross_entropy(logits.float(), labels[1:], ignore_index=-100, reduction="sum")
    (loss / targets).backward()
reference = torch.cat([p.grad.flatten() for p in ref_model.parameters()])


def one_step(model, batches):
    """One optimizer step on a copy of `model`; its result and the gradient it stepped with."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = []  # the window's gradient, read just before the one optimizer step
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            torch.cat([p.grad.flatten() for p in model.parameters()])
        )
    )
    result = Accumulator(model, optimizer).step(batches, causal_lm_loss)
    return result, seen[0]


for mode in ("none", "window", "padding-free"):
    batches = micro_batches(
        examples,
        mode,
        micro_batch=4,
        micro_batch_tokens=128,
        row_tokens=64,
        pad_id=0,
        layout="shifted",
    )
    result, grad = one_step(model, batches)
    shapes = ", ".join("x".join(map(str, b["input_ids"].shape)) for b in batches)
    err = float((grad - reference).norm() / reference.norm())
    print(
        f"{mode}: {len(batches)} micro-batches ({shapes}), {result.tokens} targets, "
        f"loss {result.loss:.8f}, grad norm {result.grad_norm:.8f}, rel err vs by hand {err:.2e}"
    )
