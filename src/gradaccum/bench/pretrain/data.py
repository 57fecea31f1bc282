"""The bench's data and its yardstick: ragged windows and the exact big-batch gradient
(`gradaccum.verification.reference`, the one reference and relative error verify uses)."""

from __future__ import annotations

import torch

from gradaccum.models.loss import IGNORE_INDEX, causal_lm_loss
from gradaccum.verification.reference import big_batch_reference, concat_batches, whole_rel_error


def make_windows(
    n_windows: int, accum_steps: int, micro_batch: int, seq_len: int, vocab: int, seed: int
) -> list[list[dict]]:
    """`n_windows` windows of `accum_steps` micro-batches of `micro_batch` rows, on the CPU.

    Rows are random token ids; row i holds a valid length drawn from 1..seq_len and its labels
    past that length are IGNORE_INDEX, so micro-batches hold different valid-token counts (what
    makes "mean loss / k" differ from the token mean). Labels are already shifted: the label
    at position t is the token after input t.
    """
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_len)[None, :]
    out = []
    for _ in range(n_windows):
        window = []
        for _ in range(accum_steps):
            ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
            lengths = torch.randint(1, seq_len + 1, (micro_batch, 1), generator=g)
            labels = ids[:, 1:].clone()
            labels[positions >= lengths] = IGNORE_INDEX
            window.append({"input_ids": ids[:, :-1].contiguous(), "labels": labels})
        out.append(window)
    return out


def to_device(windows: list[list[dict]], device: torch.device) -> list[list[dict]]:
    return [[{k: v.to(device) for k, v in b.items()} for b in w] for w in windows]


def valid_tokens(windows: list[list[dict]]) -> int:
    """Labels that are not IGNORE_INDEX, over all the windows' rows."""
    return sum(int((b["labels"] != IGNORE_INDEX).sum()) for w in windows for b in w)


def reference_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device computes in it (all but mps)."""
    return torch.float32 if device.type == "mps" else torch.float64


def big_batch_gradient(model: torch.nn.Module, window: list[dict]) -> list[torch.Tensor]:
    """The exact gradient of the window: one forward over all its rows in float64
    (`reference_dtype`), the loss summed over every valid token (`causal_lm_loss`) and divided
    by N, the valid tokens of the whole window; no engine, no accumulation. Per trainable
    parameter, in `parameters()` order (None where one gets no gradient)."""
    dtype = reference_dtype(next(model.parameters()).device)
    whole = concat_batches(window)
    return big_batch_reference(model, whole, causal_lm_loss, seed=None, dtypes=(dtype,)).grads


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters that train, copied (in the order `parameters()` gives them)."""
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def update_error(before: list[torch.Tensor], after: list[torch.Tensor], grad) -> float:
    """|update - g| / |g| over all parameters at once (`whole_rel_error`), where the update is
    before - after: with one SGD step at lr 1 it is the gradient the optimizer was handed."""
    update = [b.double() - a.double() for b, a in zip(before, after, strict=True)]
    return whole_rel_error(update, grad)


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Switch every dropout off (Hugging Face configs ship with 0.1): with random masks no
    two runs, and no run and the big batch, compute the same gradient."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
    for name in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "dropout"):
        config = getattr(model, "config", None)
        if config is not None and isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    return model
