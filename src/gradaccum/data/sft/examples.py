"""SFT rows tokenized into examples: the ids of the whole sequence and which of them are targets.

Labels convention (`Example`): `labels` has one entry per token of `input_ids`, *unshifted*:
labels[t] is input_ids[t] where token t is a target and -100 elsewhere. The first token is
never a target (nothing before it predicts it), so labels[0] is always -100. The two losses
read it through `sft_batches.collate`:
- layout "shifted" (gradaccum.models.loss.causal_lm_loss, which expects labels already
  shifted): input_ids[:-1] as inputs, labels[1:] as labels (the label at t is the token after
  input t);
- layout "unshifted" (gradaccum.hf.loss_fn and hf.count_tokens, which shift themselves, as
  Hugging Face models do): input_ids and labels as they are.
Both count the same targets: labels != -100, every one predicted by the token before it.

What is a target:
- a TextPair (prompt/completion strings, Alpaca): the prompt is `bos_ids + encode(prompt)`,
  the completion `encode(completion) + [eos_id]`, encoded separately (the prompt's tokens are
  those the model is given at generation, whatever the tokenizer would merge across the
  boundary); the completion and its EOS are the targets;
- a Chat: the conversation rendered by the chat template; the tokens of assistant turn i are
  those between the rendering of messages[:i] with the generation prompt and the rendering of
  messages[:i+1] (the content and the template's end of turn: EOS for the byte tokenizer's
  template; no EOS is inserted inside a conversation, where the template would never show one).
  This needs a template that renders a prefix of a conversation as a prefix of its rendering;
  one that does not is refused in one line naming the tokenizer;
- `train_on_prompt=True`: every token but the first.
Longer than `seq_len`: cut to the first seq_len tokens (the completion loses its end), or
dropped with `drop_long`; an example left without a target (a prompt of seq_len tokens or
more) is dropped either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradaccum.data.sft.rows import BadRow, Chat, TextPair
from gradaccum.data.tokenizers import TemplateRefused
from gradaccum.utils.errors import BadInput

__all__ = ["IGNORE_INDEX", "Example", "fit_to_length", "make_example", "tokenize_item"]

IGNORE_INDEX = -100
"""Label of a token that is not a target (PyTorch's cross_entropy default)."""


@dataclass(frozen=True, eq=False)
class Example:
    """One tokenized SFT example (see the module docstring for the labels convention)."""

    input_ids: np.ndarray
    """Every token of the example, int32, shape (length,)."""
    labels: np.ndarray
    """int32, shape (length,): the token where it is a target, IGNORE_INDEX elsewhere;
    unshifted, labels[0] is always IGNORE_INDEX."""
    index: int
    """The source row it came from (its position among the source's rows, from 0)."""
    num_targets: int
    """Target tokens (labels != IGNORE_INDEX): what the loss counts."""
    truncated: bool = False
    """Cut to seq_len: the end of its completion is missing."""

    @property
    def length(self) -> int:
        """Tokens in the example."""
        return len(self.input_ids)


def make_example(ids: list[int], labels: list[int], index: int, truncated: bool = False) -> Example:
    """An Example from equal-length id and label lists (labels[0] forced to IGNORE_INDEX)."""
    if len(ids) != len(labels):
        raise ValueError(f"{len(ids)} ids but {len(labels)} labels")
    label_arr = np.asarray(labels, dtype=np.int32)
    if len(label_arr):
        label_arr[0] = IGNORE_INDEX
    targets = int((label_arr != IGNORE_INDEX).sum())
    return Example(np.asarray(ids, dtype=np.int32), label_arr, index, targets, truncated)


def tokenize_item(item: TextPair | Chat, tokenizer, train_on_prompt: bool, where: str):
    """(ids, labels) of one parsed row, at full length. Raises BadRow (the template refuses
    the conversation) or BadInput (a template that is not prefix-preserving)."""
    if isinstance(item, TextPair):
        prompt = list(tokenizer.bos_ids) + tokenizer.encode(item.prompt)
        completion = tokenizer.encode(item.completion) + [tokenizer.eos_id]
        ids = prompt + completion
        labels = ids if train_on_prompt else [IGNORE_INDEX] * len(prompt) + completion
        return ids, list(labels)
    try:
        return _chat(item, tokenizer, train_on_prompt, where)
    except TemplateRefused as err:
        raise BadRow(f"field 'messages': the chat template refuses it ({err})") from None


def _chat(chat: Chat, tokenizer, train_on_prompt: bool, where: str):
    messages = list(chat.messages)
    ids = tokenizer.render_chat(messages, add_generation_prompt=False)
    if train_on_prompt:
        return ids, list(ids)
    labels = [IGNORE_INDEX] * len(ids)
    for i in range(chat.first_target, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(messages[: i + 1], add_generation_prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise BadInput(
                f"{tokenizer.origin}: the chat template does not render a conversation's "
                f"first turns as a prefix of the whole ({where}, turn {i}), so the assistant "
                "tokens cannot be told apart; use a prefix-preserving template or "
                "--train-on-prompt"
            )
        labels[len(before) : len(through)] = through[len(before) :]
    return ids, labels


def fit_to_length(ids: list[int], labels: list[int], seq_len: int, drop_long: bool):
    """(ids, labels, status) with at most seq_len tokens. status: "ok"; "truncated" (cut to
    the first seq_len tokens); "long" (longer and drop_long: dropped, ids None); "no_target"
    (nothing left to learn after the cut: dropped, ids None)."""
    if len(ids) <= seq_len:
        return ids, labels, "ok"
    if drop_long:
        return None, None, "long"
    ids, labels = ids[:seq_len], labels[:seq_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None, None, "no_target"
    return ids, labels, "truncated"
