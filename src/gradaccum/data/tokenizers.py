"""The tokenizer interface the trainer tokenizes through, and its two implementations.

`Tokenizer` (a Protocol) is what SFT tokenization, batching and evaluation need:
- `encode(text) -> list[int]`: the text's ids, no special token added;
- `decode(ids) -> str`: the text of `ids`, special tokens (EOS, chat-role markers) left out;
- `eos_id`, `pad_id`, `vocab_size` (ids are in [0, vocab_size)), `bos_ids` (the ids the
  tokenizer puts before a text of its own accord, a Llama-style BOS; [] for none);
- `has_chat_template`, `render_chat(messages, add_generation_prompt=False) -> list[int]`: a
  conversation rendered by the chat template and tokenized;
- `assistant_tokens_by`: how the SFT examples find an assistant turn's tokens
  (gradaccum.data.sft.examples): "generation" (the template's `{% generation %}` blocks, read
  with `render_chat_mask`), "offsets" (character spans of the rendered text mapped to tokens
  with `render_chat_text` and `encode_with_offsets`, fast tokenizers) or "prefix" (token
  prefixes of `render_chat`);
- `origin`: "FLAG PATH" (or "built-in byte tokenizer"), the start of an error line about it.

`ByteTokenizer`: ids 0..255 are the UTF-8 bytes, 256 the end-of-document id, which is EOS and
also pads (padding is never a target, so what it holds does not matter). Vocabulary 257, the
same as the built-in corpus and GPT (`gradaccum.data.tokens.BYTE_VOCAB`). Its chat template
renders a conversation as bytes, each turn `<|ROLE|>` and a newline, then the content, then a
newline for a system, user or tool turn and EOS for an assistant turn; the generation prompt is
`<|assistant|>` and a newline. So an assistant turn's tokens are its content and EOS; they are
found by token prefixes ("prefix").

`HFTokenizer`: `transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)`
(the `hf` extra), with the folder's chat template if it has one. A conversation is rendered with
`apply_chat_template(..., tokenize=True, return_dict=True)` and its `input_ids` read: special
tokens written in the template text (role markers, a BOS) become their own ids, and no second
BOS is added (transformers tokenizes the rendered text with add_special_tokens=False).
A fast tokenizer (tokenizers' Rust backend) maps tokens to characters of the text, so its
assistant tokens are found by offsets, or by the template's assistant mask when the template
marks them with `{% generation %}`; a slow one has no offsets and keeps token prefixes.
"""

from __future__ import annotations

import os
import re
from typing import Protocol, runtime_checkable

from gradaccum.utils.errors import BadInput, first_line

__all__ = [
    "BYTE_EOS",
    "BYTE_VOCAB",
    "ByteTokenizer",
    "HFTokenizer",
    "TemplateRefused",
    "Tokenizer",
    "load_tokenizer",
    "require_chat_template",
]

BYTE_VOCAB = 257
"""Byte-level vocabulary: the 256 byte values and the end-of-document id (as
gradaccum.data.tokens.BYTE_VOCAB, so the built-in GPT and corpus stay compatible)."""
BYTE_EOS = 256
"""The byte tokenizer's end-of-document id: EOS after each completion, and padding."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
)
"""Files one of which a folder must hold to have a tokenizer (transformers would otherwise
build an empty one from the model's config alone)."""

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A `{% generation %}` tag: the template marks the tokens the assistant generates (the test
transformers runs before it computes an assistant mask)."""


class TemplateRefused(ValueError):
    """The chat template raised on a conversation (its own `raise_exception`, or a Jinja
    error): the row's fault as far as that template goes. str() is the template's reason."""


@runtime_checkable
class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    vocab_size: int
    bos_ids: list[int]
    has_chat_template: bool
    assistant_tokens_by: str
    origin: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = False
    ) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS (and padding) 256; a built-in chat template."""

    eos_id = BYTE_EOS
    pad_id = BYTE_EOS
    vocab_size = BYTE_VOCAB
    bos_ids: list[int] = []
    has_chat_template = True
    assistant_tokens_by = "prefix"
    origin = "built-in byte tokenizer"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        ids: list[int] = []
        for message in messages:
            ids += self.encode(f"<|{message['role']}|>\n{message['content']}")
            # An assistant turn ends with EOS, so generation stops where the turn ends.
            ids += [BYTE_EOS] if message["role"] == "assistant" else self.encode("\n")
        if add_generation_prompt:
            ids += self.encode("<|assistant|>\n")
        return ids


class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` interface. `origin` is "FLAG PATH"."""

    def __init__(self, tok, origin: str):
        self.tok = tok
        self.origin = origin
        if tok.eos_token_id is None:
            raise BadInput(f"{origin}: the tokenizer has no end-of-sequence token (eos_token)")
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tok)
        self.has_chat_template = bool(getattr(tok, "chat_template", None))
        self.bos_ids = _leading_special_ids(tok)
        self.assistant_tokens_by = _assistant_tokens_by(tok, self.has_chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        out = self._apply_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def render_chat_text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template renders it, before tokenizing."""
        return self._apply_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, offsets) of `text` tokenized as `render_chat` tokenizes a rendering (no special
        token added): token t covers characters offsets[t][0]:offsets[t][1] of `text`. Fast
        tokenizers only."""
        out = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(i) for i in out["input_ids"]], [tuple(o) for o in out["offset_mapping"]]

    def render_chat_mask(self, messages: list[dict]):
        """(ids, mask, offsets) of the rendered conversation: mask[t] is 1 where token t is in
        one of the template's `{% generation %}` blocks (transformers' assistant mask), and
        offsets as `encode_with_offsets`. Needs assistant_tokens_by == "generation"."""
        out = self._apply_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenizer_kwargs={"return_offsets_mapping": True},
        )
        ids = [int(i) for i in out["input_ids"]]
        mask = [int(m) for m in out["assistant_masks"]]
        return ids, mask, [tuple(o) for o in out["offset_mapping"]]

    def _apply_template(self, messages: list[dict], **kwargs):
        """tok.apply_chat_template(messages, **kwargs), its refusals as TemplateRefused."""
        if not self.has_chat_template:
            raise BadInput(f"{self.origin}: the tokenizer has no chat template")
        try:
            from jinja2 import TemplateError  # what transformers renders templates with
        except ImportError:
            raise BadInput(
                f"{self.origin}: rendering its chat template needs jinja2 "
                "(pip install 'gradaccum[hf]')"
            ) from None
        if not messages:  # transformers raises ValueError on an empty conversation
            raise TemplateRefused(
                "an assistant turn opening the conversation has no prompt to render"
            )
        try:
            return self.tok.apply_chat_template(messages, **kwargs)
        except TemplateError as err:  # a template's raise_exception(...), Jinja's own errors
            raise TemplateRefused(first_line(err)) from None


def _assistant_tokens_by(tok, has_chat_template: bool) -> str:
    """How the assistant tokens of transformers tokenizer `tok` are found: "generation",
    "offsets" or "prefix" (see the module docstring)."""
    if not getattr(tok, "is_fast", False):
        return "prefix"  # no offsets, and transformers' assistant mask needs them too
    template = tok.chat_template if has_chat_template else ""
    if isinstance(template, dict):  # named templates: apply_chat_template uses "default"
        template = template.get("default") or ""
    return "generation" if GENERATION_BLOCK.search(template) else "offsets"


def _leading_special_ids(tok) -> list[int]:
    """The special ids the tokenizer puts before a text by itself (a BOS): the ids of "a" with
    special tokens, up to where those without begin."""
    plain = list(tok("a", add_special_tokens=False)["input_ids"])
    full = list(tok("a", add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return [int(i) for i in full[:start]]
    return []


def load_tokenizer(path: str | None, flag: str = "--tokenizer"):
    """The byte tokenizer for None, else the Hugging Face tokenizer in folder `path`, read
    with local_files_only (never the network). `flag` names where the path came from
    (`--tokenizer` or `--init-from`) in error lines. Raises BadInput: no such folder, no
    tokenizer files in it, transformers missing (the `hf` extra), a tokenizer that will not
    load or has no EOS."""
    if path is None:
        return ByteTokenizer()
    origin = f"{flag} {path}"
    if not os.path.isdir(path):
        raise BadInput(f"{origin}: no such folder")
    names = os.listdir(path)
    if not any(name in TOKENIZER_FILES or name.endswith(".tiktoken") for name in names):
        raise BadInput(
            f"{origin}: no tokenizer in the folder (none of {', '.join(TOKENIZER_FILES[:3])}, ...)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise BadInput(
            f"{origin}: reading its tokenizer needs transformers (pip install 'gradaccum[hf]')"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ...
        raise BadInput(f"{origin}: cannot load its tokenizer ({first_line(err)})") from None
    if len(tok) == 0:
        raise BadInput(f"{origin}: the folder's tokenizer has an empty vocabulary")
    return HFTokenizer(tok, origin)


def require_chat_template(tokenizer) -> None:
    """BadInput naming the tokenizer's flag and path when it has no chat template (messages
    data needs one)."""
    if not tokenizer.has_chat_template:
        raise BadInput(
            f"{tokenizer.origin}: the tokenizer has no chat template, which messages data needs "
            "(add one to tokenizer_config.json or chat_template.jinja, or use prompt/completion "
            "rows)"
        )
