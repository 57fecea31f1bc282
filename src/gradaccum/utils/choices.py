"""The named choices every part offers, defined once (no torch: the planner reads them too)."""

from __future__ import annotations

from gradaccum.utils.errors import BadInput

PRECISIONS = ("fp32", "bf16", "fp16")
"""Training precisions: fp32; bf16 or fp16 autocast (or 16-bit parameters with fp32
accumulation); fp16 adds the loss scaler."""

BUILTIN_MODELS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "small": {"n_layer": 6, "n_head": 4, "n_embd": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768},
    "tiny-moe": {"n_layer": 4, "n_head": 4, "n_embd": 128, "n_expert": 4, "expert_top_k": 2},
}
"""The built-in GPT's presets (`--model NAME`): layers, heads and width, and for a mixture of
experts the experts per block and the experts each token is routed to (`GPTConfig`); its
vocabulary and sequence length come from the data."""

MOE_BALANCES = ("micro", "global", "global-previous")
"""How a mixture of experts' load-balancing loss is balanced under accumulation
(`gradaccum.moe.balance`): "micro", each micro-batch's own loss weighted by its share of
the window's routed tokens (what a model computes per forward); "global", the token fractions
f of the whole window over all ranks from a routing pass before its backward passes (the big
batch's loss and gradient, exactly); "global-previous", the previous window's f (no extra
pass; exact in the probabilities, one window stale in f; the first window falls back to
"global")."""

SYNC_POLICIES = ("window", "micro", "hsdp")
"""How data-parallel ranks sync the window's gradient (`Accumulator(sync=...)`): "window",
once after the window's last micro-batch; "micro", a reduce-scatter after every micro-batch
(FSDP2); "hsdp", a reduce-scatter within the shard group after every micro-batch and an
all-reduce across replicas once per window (FSDP2 over a 2-D mesh)."""
SYNC_CHOICES = (*SYNC_POLICIES, "auto")
"""--sync: a policy, or "auto", the planner's choice."""

TASKS = ("pretrain", "sft", "grpo")
"""--task of train, verify and bench: pretraining on a token stream, supervised fine-tuning on
examples, or RL fine-tuning (GRPO family) on prompts with sampled completions."""

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
"""--loss-type: the normalisations of the GRPO family's loss (`gradaccum.rl`), each over the
whole window: grpo, each completion's token mean averaged over the completions; bnpo and dapo,
the sum over completion tokens over their count; dr_grpo, the sum over completions x
--max-completion-length."""

SCALE_REWARDS = ("group", "none")
"""--scale-rewards: advantages over the group's std (group), or only centred (none, Dr. GRPO)."""

PACKINGS = ("none", "window", "padding-free")
"""--packing: how a window's examples become micro-batches (`gradaccum.data.sft.packing`): runs of
--micro-batch examples padded to their longest; micro-batches by a token budget
(--micro-batch-tokens), each padded to its own longest; or rows of concatenated examples with
attention kept within each example (document masking). All three give the same gradient."""

DEFAULT_MODEL = "tiny"
"""The built-in GPT preset used when no model is named."""

DEVICES = "cpu, cuda, cuda:1, npu, npu:1, xpu, mps or auto"
"""What --device takes, in the words every command's help and message use (the check itself,
`gradaccum.parallel.devices.check_device`, needs torch)."""


def check_builtin_model(name, flag: str) -> str:
    """`name` when it is a preset of BUILTIN_MODELS; BadInput naming `flag` otherwise."""
    if name not in BUILTIN_MODELS:
        raise BadInput(flag, name, f"unknown preset; choose one of {', '.join(BUILTIN_MODELS)}")
    return name
