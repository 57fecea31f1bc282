"""The named choices every part offers, defined once (no torch: the planner reads them too)."""

from __future__ import annotations

PRECISIONS = ("fp32", "bf16", "fp16")
"""Training precisions: fp32; bf16 or fp16 autocast (or 16-bit parameters with fp32
accumulation); fp16 adds the loss scaler."""

BUILTIN_MODELS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "small": {"n_layer": 6, "n_head": 4, "n_embd": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768},
}
"""The built-in GPT's presets (`--model NAME`): layers, heads and width; its vocabulary and
sequence length come from the data."""

DEFAULT_MODEL = "tiny"
"""The built-in GPT preset used when no model is named."""
