"""The tokenizer interface the trainer tokenizes through, and its two implementations.

`Tokenizer` (a Protocol) is what SFT tokenization, batching and evaluation need:
- `encode(text) -> list[int]`: the text's ids, no special token added;
- `decode(ids) -> str`: the text of `ids`, special tokens (EOS, chat-role markers) left out;
- `eos_id`, `pad_id`, `vocab_size` (ids are in [0, vocab_size)), `bos_ids` (the ids the
  tokenizer puts before a text of its own accord, a Llama-style BOS; [] for none);
- `has_chat_template`, `render_chat(messages, add_generation_prompt=False) -> list[int]`: a
  conversation rendered by the chat template and tokenized;
- `origin`: "FLAG PATH" (or "built-in byte tokenizer"), the start of an error line about it.

`ByteTokenizer`: ids 0..255 are the UTF-8 bytes, 256 the end-of-document id, which is EOS and
also pads (padding is never a target, so what it holds does not matter). Vocabulary 257, the
same as the built-in corpus and GPT (`gradaccum.data.tokens.BYTE_VOCAB`). Its chat template
renders a conversation as bytes, each turn `<|ROLE|>` and a newline, then the content, then a
newline for a system, user or tool turn and EOS for an assistant turn; the generation prompt is
`<|assistant|>` and a newline. So an assistant turn's tokens are its content and EOS.

`HFTokenizer`: `transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)`
(the `hf` extra), with the folder's chat template if it has one. A conversation is rendered with
`apply_chat_template(..., tokenize=True, return_dict=True)` and its `input_ids` read: special
tokens written in the template text (role markers, a BOS) become their own ids, and no second
BOS is added (transformers tokenizes the rendered text with add_special_tokens=False).
"""

from __future__ import annotations

import os
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

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        if not self.has_chat_template:
            raise BadInput(f"{self.origin}: the tokenizer has no chat template")
        try:
            from jinja2 import TemplateError  # what transformers renders templates with
        except ImportError:
            raise BadInput(
                f"{self.origin}: rendering its chat template needs jinja2 "
                "(pip install 'gradaccum[hf]')"
            ) from None
        try:
            out = self.tok.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as err:  # a template's raise_exception(...), Jinja's own errors
            raise TemplateRefused(first_line(err)) from None
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]


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
