"""--epochs: a run's length in passes over its training data, and the plan line that states it.

An epoch is one pass over the training examples (SFT) or sequences (pretraining) in the order
seeded by (--seed, epoch); the epochs follow each other in one stream (`SFTBatches`,
`Batches`), which a resume continues from the place its checkpoint saved. How a run of E
epochs ends:
- SFT: after the first round(E x examples) examples of the stream. The window that reaches
  that place is cut short there (the engine divides it by its own N), so E whole epochs train
  every example exactly E times, whatever the micro-batch, packing or number of ranks; the
  steps are the windows it takes (ceil(E x examples / examples per step) at
  --examples-per-step).
- pretraining: E x sequences x --seq-len tokens, rounded up to whole steps as --max-tokens is:
  ceil(E x sequences / sequences per step) steps; every step holds the same number of
  sequences, so the last step may read past the E epochs, and the plan line says by how many
  sequences.
With --max-steps or --max-tokens too, the run ends at the first reached; with none of them,
at the task's default length (`TASK_DEFAULTS`, `DEFAULT_MAX_TOKENS`). No torch.
"""

from __future__ import annotations


def epoch_stop(epochs: float, items: int) -> int:
    """Examples (or sequences) of the stream that `epochs` passes over `items` cover:
    round(epochs x items), at least 1."""
    return max(1, round(epochs * items))


def pretrain_epoch_tokens(epochs: float | None, sequences: int, seq_len: int) -> int | None:
    """Tokens of --epochs passes over `sequences` training sequences of `seq_len` tokens;
    None without --epochs."""
    if epochs is None:
        return None
    return epoch_stop(epochs, sequences) * seq_len


def length_line(
    lengths: dict[str, int], given: dict[str, str], items: int, unit: str, trained: int
) -> str:
    """The plan's line on the run's length. lengths: optimizer steps each given (or
    defaulted) length takes, by flag; given: the flag's value as typed, or the default's
    words; items: training examples (or sequences) in an epoch; trained: examples (or
    sequences) the run reads in all."""
    total = min(lengths.values())
    first = min(lengths, key=lambda flag: lengths[flag])
    others = [f"{flag} {given[flag]} at step {steps}" for flag, steps in lengths.items()
              if flag != first]  # fmt: skip
    reason = f"{first} {given[first]}" + (f", before {', '.join(others)}" if others else "")
    line = (
        f"length {total} step(s): {trained / items:.4g} epoch(s) of {items:,} {unit} "
        f"({trained:,} {unit} read); ends at {reason}"
    )
    if "--epochs" in lengths and first == "--epochs":
        epochs = given["--epochs"].split(" ", 1)[0]  # the number, without a default's words
        past = trained - epoch_stop(float(epochs), items)
        if past > 0:
            line += f"; the last step reads {past:,} {unit} past {epochs} epoch(s)"
    return line


def pretrain_length_line(config, sequences: int, steps: int, tokens_per_step: int) -> str:
    """`length_line` of a pretraining run of `steps` steps at `tokens_per_step` (one batch
    throughout) over `sequences` training sequences of --seq-len tokens."""
    per_step = tokens_per_step // config.seq_len
    found, given = {}, {}
    if config.max_steps is not None:
        found["--max-steps"], given["--max-steps"] = config.max_steps, str(config.max_steps)
    if config.epochs is not None:
        stop = epoch_stop(config.epochs, sequences)
        found["--epochs"], given["--epochs"] = _ceil_div(stop, per_step), f"{config.epochs:g}"
    if config.total_tokens is not None:
        found["--max-tokens"] = _ceil_div(config.total_tokens, tokens_per_step)
        given["--max-tokens"] = f"{config.total_tokens:,}"
        if config.max_tokens is None:
            given["--max-tokens"] += " (the default when no --epochs, --max-steps or --max-tokens)"
    if min(found.values()) != steps:  # a resume's length as planned from its checkpoint
        found = {"the plan": steps}
        given = {"the plan": f"({steps} steps)"}
    return length_line(found, given, sequences, "sequences", steps * per_step)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
