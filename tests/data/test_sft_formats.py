"""Every SFT source and format end to end: the labels are exactly the completion's (or the
assistant turns') tokens plus their end, computed here from the tokenizer independently."""

import json

import numpy as np
import pytest

from gradaccum.data.sft.load import load_sft, tokenize_rows
from gradaccum.data.sft.rows import read_rows, rows_from_dicts

PAIRS = [
    {"prompt": "reverse: abc\n", "completion": "cba"},
    {"prompt": "add: 12+30\n", "completion": "42"},
    {"prompt": "sort: the quick fox\n", "completion": "  cefhikoqtux"},
]


def runs(labels):
    """The maximal runs of target positions (labels != -100) as (start, end) pairs."""
    spans, start = [], None
    for t, label in enumerate(list(labels) + [-100]):
        if label != -100 and start is None:
            start = t
        elif label == -100 and start is not None:
            spans.append((start, t))
            start = None
    return spans


def test_prompt_completion_bytes(write_jsonl, byte_tok):
    data = load_sft(write_jsonl(PAIRS), byte_tok, seq_len=64)
    assert data.data_format == "prompt-completion" and len(data.examples) == 3
    for row, ex in zip(PAIRS, data.examples, strict=True):
        prompt, completion = list(row["prompt"].encode()), list(row["completion"].encode()) + [256]
        assert ex.input_ids.tolist() == prompt + completion
        assert ex.labels.tolist() == [-100] * len(prompt) + completion
        assert ex.num_targets == len(completion)


def test_prompt_completion_hf(write_jsonl, hf_tok, raw_hf_tok):
    data = load_sft(write_jsonl(PAIRS), hf_tok, seq_len=64)
    eos = raw_hf_tok.convert_tokens_to_ids("</s>")
    for row, ex in zip(PAIRS, data.examples, strict=True):
        prompt = raw_hf_tok(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = raw_hf_tok(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
        assert ex.input_ids.tolist() == prompt + completion
        assert ex.labels.tolist() == [-100] * len(prompt) + completion


def test_train_on_prompt_makes_every_token_but_the_first_a_target(write_jsonl, byte_tok):
    data = load_sft(write_jsonl(PAIRS), byte_tok, seq_len=64, train_on_prompt=True)
    for row, ex in zip(PAIRS, data.examples, strict=True):
        ids = list((row["prompt"] + row["completion"]).encode()) + [256]
        assert ex.labels.tolist() == [-100] + ids[1:]


def test_alpaca_prompts_with_and_without_input(write_jsonl, byte_tok):
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Say yo.", "output": "yo"},  # no input field at all
    ]
    with_input = (
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    )
    no_input = (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\n{}\n\n### Response:\n"
    )
    prompts = [with_input, no_input.format("Say hi."), no_input.format("Say yo.")]
    data = load_sft(write_jsonl(rows), byte_tok, seq_len=512)
    assert data.data_format == "alpaca"
    for row, prompt, ex in zip(rows, prompts, data.examples, strict=True):
        completion = list(row["output"].encode()) + [256]
        assert ex.input_ids.tolist() == list(prompt.encode()) + completion
        assert ex.labels.tolist() == [-100] * len(prompt.encode()) + completion


CONVERSATION = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "reverse abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "and sort dcba"},
    {"role": "assistant", "content": "abcd"},
]


def test_messages_hf_spans_decode_to_the_assistant_turns(write_jsonl, hf_tok, raw_hf_tok):
    data = load_sft(write_jsonl([{"messages": CONVERSATION}]), hf_tok, seq_len=128)
    ex = data.examples[0]
    assert data.data_format == "messages"
    assert raw_hf_tok.decode(ex.input_ids.tolist()) == (
        "<|system|>answer briefly<|end|><|user|>reverse abc<|end|><|assistant|>cba<|end|>"
        "<|user|>and sort dcba<|end|><|assistant|>abcd<|end|>"
    )
    spans = [raw_hf_tok.decode(ex.input_ids[s:e].tolist()) for s, e in runs(ex.labels)]
    assert spans == ["cba<|end|>", "abcd<|end|>"]
    assert (ex.labels[ex.labels != -100] == ex.input_ids[ex.labels != -100]).all()


def test_messages_bytes_spans_are_content_and_eos(write_jsonl, byte_tok):
    data = load_sft(write_jsonl([{"messages": CONVERSATION}]), byte_tok, seq_len=256)
    ex = data.examples[0]
    spans = [ex.input_ids[s:e].tolist() for s, e in runs(ex.labels)]
    assert spans == [list(b"cba") + [256], list(b"abcd") + [256]]


def test_conversational_prompt_completion_learns_the_completion_only(
    write_jsonl, hf_tok, raw_hf_tok
):
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    ex = load_sft(write_jsonl([row]), hf_tok, seq_len=128).examples[0]
    spans = [raw_hf_tok.decode(ex.input_ids[s:e].tolist()) for s, e in runs(ex.labels)]
    assert spans == ["abcd<|end|>"]  # the prompt's own assistant turn is context


@pytest.mark.parametrize("wrap", [None, "data", "train"])
def test_json_list_and_wrapped(tmp_path, byte_tok, wrap):
    path = tmp_path / "sft.json"
    path.write_text(json.dumps(PAIRS if wrap is None else {wrap: PAIRS}))
    data = load_sft(str(path), byte_tok, seq_len=64)
    expected = [list((r["prompt"] + r["completion"]).encode()) + [256] for r in PAIRS]
    assert [e.input_ids.tolist() for e in data.examples] == expected
    assert [e.index for e in data.examples] == [0, 1, 2]


def test_parquet(tmp_path, byte_tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "sft.parquet")
    pq.write_table(pa.Table.from_pylist(PAIRS), path)
    data = load_sft(path, byte_tok, seq_len=64)
    expected = [list((r["prompt"] + r["completion"]).encode()) + [256] for r in PAIRS]
    assert [e.input_ids.tolist() for e in data.examples] == expected


def test_parquet_messages(tmp_path, byte_tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "chat.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION}]), path)
    ex = load_sft(path, byte_tok, seq_len=256).examples[0]
    assert [ex.input_ids[s:e].tolist() for s, e in runs(ex.labels)][1] == list(b"abcd") + [256]


def test_hf_local_dataset_folder(tmp_path, byte_tok):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in PAIRS) + "\n")
    rows = read_rows(f"hf:{folder}:train")
    assert [r.fields for r in rows] == PAIRS
    assert rows[2].where == f"hf:{folder}:train row 2"


def test_forced_format_overrides_detection(byte_tok):
    rows = rows_from_dicts(
        [{"prompt": "p", "completion": "c", "instruction": "i", "output": "o"}], "mem"
    )
    auto = tokenize_rows(rows, byte_tok, seq_len=512, source="mem")
    forced = tokenize_rows(rows, byte_tok, seq_len=512, source="mem", data_format="alpaca")
    assert auto.data_format == "prompt-completion" and forced.data_format == "alpaca"
    assert auto.examples[0].input_ids.tolist() == list(b"pc") + [256]
    assert forced.examples[0].labels[-2:].tolist() == [ord("o"), 256]


def test_examples_store_compact_arrays(write_jsonl, byte_tok):
    ex = load_sft(write_jsonl(PAIRS), byte_tok, seq_len=64).examples[0]
    assert ex.input_ids.dtype == np.int32 and ex.labels.dtype == np.int32
