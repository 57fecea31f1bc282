"""Every bad SFT input is one line naming the file, the line or row, and the field (or the
flag and path of the tokenizer); --skip-bad-rows skips and counts the bad rows instead."""

import json
import sys

import numpy as np
import pytest

from gradaccum.data.sft.load import load_sft, tokenize_rows
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.tokenizers import load_tokenizer
from gradaccum.utils.errors import BadInput

GOOD = {"prompt": "reverse: ab\n", "completion": "ba"}
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def one_line(call) -> str:
    with pytest.raises(BadInput) as err:
        call()
    line = str(err.value)
    assert "\n" not in line and line.startswith("--")
    return line


@pytest.mark.parametrize(
    "bad, why",
    [
        ('{"prompt": "x", "completion": ', "malformed JSON"),
        ("[1, 2]", "not a JSON object but a list"),
        ({"prompt": "x"}, "field 'completion': missing"),
        ({"prompt": "x", "completion": 5}, "field 'completion': expected a string, got an integer"),
        ({"prompt": "x", "completion": 0.5}, "field 'completion': expected a string, got a number"),
        ({"prompt": "x", "completion": None}, "field 'completion': null"),
        ({"prompt": ["x"], "completion": "y"}, "field 'prompt[0]': expected an object"),
        ({"prompt": 3, "completion": "y"}, "field 'prompt': expected a string, got an integer"),
        ({"prompt": "x", "completion": ""}, "field 'completion': empty"),
    ],
)
def test_bad_prompt_completion_row(write_jsonl, byte_tok, bad, why):
    path = write_jsonl([GOOD, GOOD, bad])
    line = one_line(lambda: load_sft(path, byte_tok, seq_len=64))
    assert line.startswith(f"--data {path} line 3: {why}")


@pytest.mark.parametrize(
    "messages, why",
    [
        ([{"role": "user", "content": "hi"}], "field 'messages': no assistant turn"),
        ([{"role": "bot", "content": "hi"}], "field 'messages[0].role': unknown role 'bot'"),
        ([{"role": "user"}, CHAT[1]], "field 'messages[0].content': missing"),
        ([{"content": "x"}, CHAT[1]], "field 'messages[0].role': missing"),
        ([CHAT[0], {"role": "assistant", "content": ""}], "field 'messages[1].content': empty"),
        (
            [CHAT[0], {"role": "assistant", "content": 7}],
            "field 'messages[1].content': expected a string",
        ),
        ([], "field 'messages': no messages"),
        ("hi", "field 'messages': expected a list of messages, got a string"),
    ],
)
def test_bad_messages_row(write_jsonl, byte_tok, messages, why):
    path = write_jsonl([{"messages": CHAT}, {"messages": messages}])
    line = one_line(lambda: load_sft(path, byte_tok, seq_len=64))
    assert line.startswith(f"--data {path} line 2: {why}")


def test_blank_lines_do_not_shift_line_numbers(write_jsonl, byte_tok):
    path = write_jsonl([GOOD, "", "   ", {"prompt": "x"}])
    assert one_line(lambda: load_sft(path, byte_tok, seq_len=64)).startswith(
        f"--data {path} line 4: field 'completion'"
    )


def test_alpaca_missing_output_and_non_string_input(write_jsonl, byte_tok):
    good = {"instruction": "i", "input": "", "output": "o"}
    path = write_jsonl([good, {"instruction": "i", "input": ["x"], "output": "o"}])
    assert one_line(lambda: load_sft(path, byte_tok, seq_len=512)).startswith(
        f"--data {path} line 2: field 'input': expected a string, got a list"
    )
    path = write_jsonl([good, {"instruction": "i"}], name="b.jsonl")
    assert one_line(lambda: load_sft(path, byte_tok, seq_len=512)).startswith(
        f"--data {path} line 2: field 'output': missing"
    )


def test_json_rows_are_named_by_index(tmp_path, byte_tok):
    path = tmp_path / "sft.json"
    path.write_text(json.dumps({"data": [GOOD, {"prompt": "x", "completion": ""}]}))
    assert one_line(lambda: load_sft(str(path), byte_tok, seq_len=64)) == (
        f"--data {path} row 1: field 'completion': empty"
    )


def test_forced_format_names_the_missing_field(write_jsonl, byte_tok):
    path = write_jsonl([GOOD])
    assert one_line(lambda: load_sft(path, byte_tok, seq_len=64, data_format="messages")) == (
        f"--data {path} line 1: field 'messages': missing"
    )


@pytest.mark.parametrize(
    "content, why",
    [
        ("", "no rows"),
        ('{"text": "hello"}\n', "cannot tell the format from the fields of"),
    ],
)
def test_whole_file_problems(tmp_path, byte_tok, content, why):
    path = tmp_path / "sft.jsonl"
    path.write_text(content)
    assert why in one_line(lambda: load_sft(str(path), byte_tok, seq_len=64))


def test_a_first_line_that_is_not_utf8_is_named_as_such(tmp_path, byte_tok):
    """Before: "no row is a JSON object, so its format cannot be told"."""
    path = tmp_path / "sft.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "completion": "x"}\n')
    assert one_line(lambda: load_sft(str(path), byte_tok, seq_len=64)).startswith(
        f"--data {path} line 1: not UTF-8 text"
    )


@pytest.mark.parametrize(
    "content, why",
    [
        ("[{]", "not valid JSON (Expecting property name"),
        ('{"rows": []}', 'under "data" or "train" (keys: rows)'),
        ('"text"', "must hold a list of rows, not a string"),
    ],
)
def test_bad_json_file(tmp_path, byte_tok, content, why):
    path = tmp_path / "sft.json"
    path.write_text(content)
    line = one_line(lambda: load_sft(str(path), byte_tok, seq_len=64))
    assert line.startswith(f"--data {path}: ") and why in line


@pytest.mark.parametrize("ext", [".bin", ".npy", ".txt"])
def test_pretraining_data_is_refused(tmp_path, byte_tok, ext):
    path = tmp_path / f"tokens{ext}"
    np.zeros(8, np.uint16).tofile(path)
    line = one_line(lambda: load_sft(str(path), byte_tok, seq_len=64))
    assert line.startswith(f"--data {path}: a {ext} file is text or tokens for pretraining")


def test_unknown_suffix_and_missing_file(tmp_path, byte_tok):
    assert "unknown format for --task sft" in one_line(
        lambda: load_sft(str(tmp_path / "x.csv"), byte_tok, seq_len=64)
    )
    missing = str(tmp_path / "x.jsonl")
    assert (
        one_line(lambda: load_sft(missing, byte_tok, seq_len=64))
        == f"--data {missing}: no such file"
    )


def test_bad_data_format_and_seq_len(write_jsonl, byte_tok):
    path = write_jsonl([GOOD])
    assert one_line(lambda: load_sft(path, byte_tok, seq_len=64, data_format="chatml")).startswith(
        "--data-format chatml: expected auto, prompt-completion, messages, alpaca"
    )
    assert one_line(lambda: load_sft(path, byte_tok, seq_len=1)).startswith("--seq-len 1: ")


def test_messages_need_a_chat_template(write_jsonl, tokenizer_copy):
    folder = tokenizer_copy(None)
    tok = load_tokenizer(folder, flag="--init-from")
    assert not tok.has_chat_template
    path = write_jsonl([{"messages": CHAT}])
    line = one_line(lambda: load_sft(path, tok, seq_len=64))
    assert line.startswith(f"--init-from {folder}: the tokenizer has no chat template")
    # prompt/completion strings need none
    assert len(load_sft(write_jsonl([GOOD], name="pc.jsonl"), tok, seq_len=64).examples) == 1


# A template that drops the content of earlier assistant turns (as reasoning models' templates
# drop their thinking): rendering the first turns is not a prefix of rendering the whole.
FORGETFUL = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_template_that_is_not_prefix_preserving(write_jsonl, tokenizer_copy):
    folder = tokenizer_copy(FORGETFUL)
    tok = load_tokenizer(folder, flag="--init-from")
    two_turns = CHAT + [
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "yo"},
    ]
    path = write_jsonl([{"messages": CHAT}, {"messages": two_turns}])
    line = one_line(lambda: load_sft(path, tok, seq_len=128))
    assert line.startswith(f"--init-from {folder}: the chat template does not render")
    assert f"{path} line 2, turn 1" in line
    # --train-on-prompt needs no assistant spans, so the same data loads
    assert len(load_sft(path, tok, seq_len=128, train_on_prompt=True).examples) == 2


def test_template_refusing_a_row_is_a_bad_row(write_jsonl, tokenizer_copy):
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system turns') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok = load_tokenizer(tokenizer_copy(strict), flag="--init-from")
    path = write_jsonl(
        [{"messages": CHAT}, {"messages": [{"role": "system", "content": "s"}] + CHAT}]
    )
    assert one_line(lambda: load_sft(path, tok, seq_len=64)) == (
        f"--data {path} line 2: field 'messages': the chat template refuses it (no system turns)"
    )
    data = load_sft(path, tok, seq_len=64, skip_bad_rows=True)
    assert (len(data.examples), data.bad_rows) == (1, 1)


def test_skip_bad_rows_counts_them(write_jsonl, byte_tok):
    rows = [GOOD, "{oops", {"prompt": "x"}, GOOD, {"prompt": "x", "completion": ""}, GOOD, "[]"]
    path = write_jsonl(rows)
    data = load_sft(path, byte_tok, seq_len=64, skip_bad_rows=True)
    assert (data.rows, len(data.examples), data.bad_rows) == (7, 3, 4)
    assert [e.index for e in data.examples] == [0, 3, 5]
    assert data.bad_reasons[0].startswith(f"--data {path} line 2: malformed JSON")
    assert len(data.bad_reasons) == 3  # the first few are kept for the print
    assert any("skipped 4 bad rows" in line for line in data.summary_lines())


def test_all_rows_bad_leaves_nothing(write_jsonl, byte_tok):
    path = write_jsonl([{"prompt": "x", "completion": ""}])
    assert "no example left to train on (1 bad rows skipped" in one_line(
        lambda: load_sft(path, byte_tok, seq_len=64, skip_bad_rows=True)
    )


def test_hf_dataset_not_in_the_cache(byte_tok):
    pytest.importorskip("datasets")
    line = one_line(lambda: load_sft("hf:no-such-owner/no-such-set-31337", byte_tok, seq_len=64))
    assert line.startswith("--data hf:no-such-owner/no-such-set-31337: cannot load from the local")


def test_hf_without_datasets_names_the_extra(byte_tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert "gradaccum[hf]" in one_line(lambda: load_sft("hf:foo/bar", byte_tok, seq_len=64))


def test_parquet_without_a_reader(tmp_path, byte_tok, monkeypatch):
    path = tmp_path / "sft.parquet"
    path.write_bytes(b"PAR1")
    for name in ("pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, name, None)
    assert one_line(lambda: load_sft(str(path), byte_tok, seq_len=64)) == (
        f"--data {path}: reading .parquet needs pyarrow (pip install pyarrow)"
    )


def test_rows_in_memory_are_named_by_source(byte_tok):
    rows = rows_from_dicts([GOOD, {"prompt": "x"}], "built-in")
    assert one_line(lambda: tokenize_rows(rows, byte_tok, seq_len=64, source="built-in")) == (
        "--data built-in row 1: field 'completion': missing"
    )
