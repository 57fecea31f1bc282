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
- a Chat: the conversation rendered by the chat template; the targets are the tokens of its
  assistant turns at index >= `first_target`: each turn's content and the template's end of
  turn (EOS for the byte tokenizer's template; no EOS is inserted inside a conversation, where
  the template would never show one). Assistant turn i is the text between the rendering of
  messages[:i] with the generation prompt and the rendering of messages[:i+1]; how its tokens
  are found depends on the tokenizer (`assistant_tokens_by`):
  - "offsets" (a fast tokenizer): the whole conversation's text is tokenized once with
    character offsets, and a token overlapping an assistant turn's characters is a target, so
    a generation prompt ending in a space that the tokenizer merges into the answer's first
    token ("assistant: " + "Paris" -> " Paris") still works: that token is a target;
  - "generation" (a fast tokenizer whose template has `{% generation %}` blocks): the tokens
    the template marks (transformers' assistant mask), those of turns before `first_target`
    left out;
  - "prefix" (the byte tokenizer, slow tokenizers: no offsets): the tokens between the two
    renderings, tokenized, which must be token prefixes of the whole.
  A template whose rendering of the first turns is not a prefix of the whole (text, or tokens
  for "prefix") is refused in one line naming the tokenizer;
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
    if train_on_prompt:
        ids = tokenizer.render_chat(messages, add_generation_prompt=False)
        return ids, list(ids)
    method = getattr(tokenizer, "assistant_tokens_by", "prefix")
    if method == "generation":
        return _chat_by_mask(chat, tokenizer, where)
    if method == "offsets":
        return _chat_by_offsets(chat, tokenizer, where)
    return _chat_by_prefix(chat, tokenizer, where)


def _learned_turns(chat: Chat) -> list[int]:
    """Indices of the assistant turns whose tokens are targets."""
    return [
        i
        for i in range(chat.first_target, len(chat.messages))
        if chat.messages[i]["role"] == "assistant"
    ]


def _chat_by_offsets(chat: Chat, tokenizer, where: str):
    """Targets: the tokens of the whole rendering that overlap an assistant turn's characters."""
    messages = list(chat.messages)
    text = tokenizer.render_chat_text(messages)
    spans = []
    for i in _learned_turns(chat):
        before = tokenizer.render_chat_text(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat_text(messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise _not_a_prefix(tokenizer, where, i, "text")
        spans.append((len(before), len(through)))
    ids, offsets = tokenizer.encode_with_offsets(text)
    labels = [t if _overlaps(o, spans) else IGNORE_INDEX for t, o in zip(ids, offsets, strict=True)]
    return ids, labels


def _chat_by_mask(chat: Chat, tokenizer, where: str):
    """Targets: the tokens the template's `{% generation %}` blocks mark, after the turns
    before `first_target` (the context of a conversational prompt/completion row)."""
    messages = list(chat.messages)
    ids, mask, offsets = tokenizer.render_chat_mask(messages)
    context = ""
    if chat.first_target > 0:
        context = tokenizer.render_chat_text(messages[: chat.first_target])
        if not tokenizer.render_chat_text(messages).startswith(context):
            raise _not_a_prefix(tokenizer, where, chat.first_target, "text")
    learned = [(len(context), float("inf"))]  # every character after the context
    labels = [
        t if m and _overlaps(o, learned) else IGNORE_INDEX
        for t, m, o in zip(ids, mask, offsets, strict=True)
    ]
    if all(label == IGNORE_INDEX for label in labels):
        raise BadInput(
            f"{tokenizer.origin}: the chat template's {{% generation %}} blocks mark none of "
            f"the assistant's tokens ({where}); mark each assistant turn's content with them "
            "or use --train-on-prompt"
        )
    return ids, labels


def _chat_by_prefix(chat: Chat, tokenizer, where: str):
    """Targets: the tokens between the tokenized rendering of the first turns with the
    generation prompt and that of the first turns through the assistant's."""
    messages = list(chat.messages)
    ids = tokenizer.render_chat(messages, add_generation_prompt=False)
    labels = [IGNORE_INDEX] * len(ids)
    for i in _learned_turns(chat):
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(messages[: i + 1], add_generation_prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise _not_a_prefix(tokenizer, where, i, "token")
        labels[len(before) : len(through)] = through[len(before) :]
    return ids, labels


def _overlaps(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether a token covering characters offset[0]:offset[1] overlaps a span [a, b) of
    `spans`. A token with no character of its own (p, p), a run of spaces whose offsets a
    ByteLevel post-processor trimmed, is counted as the character before p."""
    start, end = offset
    start = min(start, end - 1)
    return any(start < b and end > a for a, b in spans)


def _not_a_prefix(tokenizer, where: str, turn: int, kind: str) -> BadInput:
    """The one-line refusal of a template that renders a conversation's first turns as
    something other than a `kind` ("text" or "token") prefix of the whole."""
    return BadInput(
        f"{tokenizer.origin}: the chat template does not render a conversation's first turns "
        f"as a {kind} prefix of the whole ({where}, turn {turn}), so the assistant tokens "
        "cannot be told apart; use a prefix-preserving template or --train-on-prompt"
    )


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
