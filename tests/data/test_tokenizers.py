"""The tokenizer interface: the byte tokenizer and its chat template, a Hugging Face folder's
tokenizer against transformers itself, and the one-line errors of a folder that cannot serve."""

import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum.data.tokenizers import BYTE_VOCAB, ByteTokenizer, Tokenizer, load_tokenizer
from gradaccum.utils.errors import BadInput


def test_byte_tokenizer_ids_are_utf8_bytes():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text) + [256]) == text  # EOS is left out of the text
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_ids) == (257, 256, 256, [])
    assert BYTE_VOCAB == 257
    assert isinstance(tok, Tokenizer)


def test_byte_chat_template_by_hand():
    tok = ByteTokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    expected = list(b"<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nyo") + [256]
    assert tok.render_chat(messages) == expected
    assert tok.render_chat(messages[:2], add_generation_prompt=True) == list(
        b"<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    )


message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.text(max_size=8),
    }
)


@settings(max_examples=60, deadline=None)
@given(st.lists(message, min_size=1, max_size=6))
def test_byte_chat_template_is_prefix_preserving(messages):
    tok = ByteTokenizer()
    full = tok.render_chat(messages)
    for i in range(len(messages)):
        head = tok.render_chat(
            messages[:i], add_generation_prompt=messages[i]["role"] == "assistant"
        )
        assert full[: len(head)] == head


def test_hf_tokenizer_matches_transformers(hf_tok, raw_hf_tok):
    text = "the quick brown fox 42"
    assert hf_tok.encode(text) == raw_hf_tok(text, add_special_tokens=False)["input_ids"]
    assert hf_tok.eos_id == raw_hf_tok.convert_tokens_to_ids("</s>")
    assert hf_tok.pad_id == raw_hf_tok.convert_tokens_to_ids("<pad>")
    assert hf_tok.vocab_size == len(raw_hf_tok)
    assert hf_tok.has_chat_template and hf_tok.bos_ids == []
    assert hf_tok.decode(hf_tok.encode(text)) == text
    assert isinstance(hf_tok, Tokenizer)


def test_hf_chat_rendering_turns_role_markers_into_their_ids(hf_tok, raw_hf_tok):
    messages = [{"role": "user", "content": "sort dcba"}, {"role": "assistant", "content": "abcd"}]
    ids = hf_tok.render_chat(messages)
    # The suite's template, written out by hand: every marker is one special token.
    assert raw_hf_tok.decode(ids) == "<|user|>sort dcba<|end|><|assistant|>abcd<|end|>"
    special = {
        raw_hf_tok.convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>", "<|end|>")
    }
    assert sum(i in special for i in ids) == 4
    prompt = hf_tok.render_chat(messages[:1], add_generation_prompt=True)
    assert raw_hf_tok.decode(prompt) == "<|user|>sort dcba<|end|><|assistant|>"


def test_hf_bos_of_a_tokenizer_that_adds_one(hf_tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import processors

    folder = tmp_path / "with-bos"
    folder.mkdir()
    for name in os.listdir(hf_tokenizer_dir):
        (folder / name).write_bytes(open(os.path.join(hf_tokenizer_dir, name), "rb").read())
    raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    raw.save(str(folder / "tokenizer.json"))
    tok = load_tokenizer(str(folder))
    assert tok.bos_ids == [bos]
    assert bos not in tok.encode("the fox")  # encode adds nothing


def test_no_path_is_the_byte_tokenizer():
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_missing_folder_is_one_line(tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(BadInput) as err:
        load_tokenizer(path, flag="--init-from")
    assert str(err.value) == f"--init-from {path}: no such folder"


def test_folder_without_a_tokenizer_is_one_line(make_hf_folder):
    folder = make_hf_folder("gpt2", tokenizer=False)
    with pytest.raises(BadInput) as err:
        load_tokenizer(folder, flag="--init-from")
    line = str(err.value)
    assert line.startswith(f"--init-from {folder}: no tokenizer in the folder")
    assert "\n" not in line


def test_missing_transformers_names_the_hf_extra(hf_tokenizer_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(BadInput) as err:
        load_tokenizer(hf_tokenizer_dir, flag="--tokenizer")
    line = str(err.value)
    assert line.startswith(f"--tokenizer {hf_tokenizer_dir}: ") and "gradaccum[hf]" in line
    assert "\n" not in line


def test_chat_template_without_jinja2_names_the_extra(hf_tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(BadInput) as err:
        hf_tok.render_chat([{"role": "user", "content": "hi"}])
    assert str(err.value).startswith(hf_tok.origin + ": rendering its chat template needs jinja2")
    assert "gradaccum[hf]" in str(err.value)
