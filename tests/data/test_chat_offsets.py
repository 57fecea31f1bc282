"""Assistant tokens of chat templates whose generation prompt ends in a space ("<s>assistant: "),
which a byte-level BPE merges into the answer's first word (" fox" is one token): found by the
fast tokenizer's character offsets, or by the template's `{% generation %}` blocks. Every
expected target is computed here by string operations on the rows and the raw tokenizer."""

import json

import pytest

from gradaccum.cli import main
from gradaccum.data.sft.load import load_sft
from gradaccum.data.tokenizers import load_tokenizer
from gradaccum.utils.errors import BadInput
from tests.train.helpers import one_line_error, train_records

transformers = pytest.importorskip("transformers")

SPACED = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
"""ChatML-like, every turn `<s>ROLE: CONTENT</s>`; the generation prompt ends in a space."""
MARKED = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
"""SPACED with each assistant content (not its `</s>`) in a generation block."""
RENAMED = (
    "{% for m in messages %}<s>{{ 'bot' if m['role'] == 'assistant' else m['role'] }}: "
    "{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
"""Prompts the assistant as "assistant" but renders its turns as "bot": no prefix at all."""

CHATS = [
    [{"role": "user", "content": "sort the fox"}, {"role": "assistant", "content": "fox the"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse quick brown"},
        {"role": "assistant", "content": "brown quick"},
        {"role": "user", "content": "and the lazy dog"},
        {"role": "assistant", "content": "dog lazy the"},
    ],
]
PROMPT_COMPLETION = {  # the prompt's assistant turn is context, not a target
    "prompt": CHATS[1][:4],
    "completion": [{"role": "assistant", "content": "over jumps"}],
}


def rendered(messages, generation_prompt=False) -> str:
    """SPACED (and MARKED) written out by hand."""
    text = "".join(f"<s>{m['role']}: {m['content']}</s>" for m in messages)
    return text + ("<s>assistant: " if generation_prompt else "")


def target_runs(example) -> list[list[int]]:
    """The example's targets as runs of consecutive tokens."""
    runs, previous = [], None
    for t, label in enumerate(example.labels.tolist()):
        if label != -100:
            if previous != t - 1:
                runs.append([])
            runs[-1].append(label)
            previous = t
    return runs


def set_template(folder: str, template: str) -> str:
    """Replace the chat template saved in `folder` (a tokenizer or a whole model's folder)."""
    config_path = f"{folder}/tokenizer_config.json"
    with open(config_path) as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(config_path, "w") as f:
        json.dump(config, f)
    with open(f"{folder}/chat_template.jinja", "w") as f:
        f.write(template)
    return folder


def load(write_jsonl, folder, rows, **kw):
    tok = load_tokenizer(folder, flag="--init-from")
    return tok, load_sft(write_jsonl(rows, name=f"rows-{len(rows)}.jsonl"), tok, seq_len=128, **kw)


def ids_of(raw, text: str) -> list[int]:
    return raw(text, add_special_tokens=False)["input_ids"]


def test_prompt_is_not_a_token_prefix(tokenizer_copy):
    """What the offsets are for: the prompt's tokens end in "Ġ" alone, the answer's begin with
    "Ġfox", so the prompt's tokens are not a prefix of the conversation's."""
    raw = transformers.AutoTokenizer.from_pretrained(tokenizer_copy(SPACED), local_files_only=True)
    prompt, whole = ids_of(raw, rendered(CHATS[0][:1], True)), ids_of(raw, rendered(CHATS[0]))
    assert whole[: len(prompt)] != prompt
    assert raw.apply_chat_template(CHATS[0], tokenize=False) == rendered(CHATS[0])


def test_targets_are_each_assistant_turn(write_jsonl, tokenizer_copy):
    folder = tokenizer_copy(SPACED)
    raw = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok, data = load(write_jsonl, folder, [{"messages": chat} for chat in CHATS])
    assert tok.assistant_tokens_by == "offsets"
    for chat, example in zip(CHATS, data.examples, strict=True):
        assert example.input_ids.tolist() == ids_of(raw, rendered(chat))
        # each assistant content with the space before it (merged into its first word) and
        # the turn's end, `</s>`: what the template adds after the content, as for any template
        want = [" " + m["content"] + "</s>" for m in chat if m["role"] == "assistant"]
        runs = target_runs(example)
        assert [raw.decode(run) for run in runs] == want
        assert runs == [ids_of(raw, text) for text in want]
        assert example.num_targets == sum(len(ids_of(raw, text)) for text in want)
    _, data = load(write_jsonl, folder, [PROMPT_COMPLETION])
    (run,) = target_runs(data.examples[0])
    assert raw.decode(run) == " over jumps</s>"


def test_a_slow_tokenizer_keeps_token_prefixes(write_jsonl, tokenizer_copy):
    """Without offsets the same rows are refused, as a template that renders no token prefix."""
    tok = load_tokenizer(tokenizer_copy(SPACED), flag="--init-from")
    tok.assistant_tokens_by = "prefix"  # what a tokenizer without is_fast gets
    path = write_jsonl([{"messages": CHATS[0]}])
    with pytest.raises(BadInput, match="as a token prefix of the whole"):
        load_sft(path, tok, seq_len=128)


def test_generation_blocks_give_the_assistant_mask(write_jsonl, tokenizer_copy):
    folder = tokenizer_copy(MARKED)
    raw = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok, data = load(write_jsonl, folder, [{"messages": chat} for chat in CHATS])
    assert tok.assistant_tokens_by == "generation"
    for chat, example in zip(CHATS, data.examples, strict=True):
        assert example.input_ids.tolist() == ids_of(raw, rendered(chat))
        # the blocks hold the content alone: no `</s>`, unlike the offsets' convention
        want = [" " + m["content"] for m in chat if m["role"] == "assistant"]
        assert [raw.decode(run) for run in target_runs(example)] == want
    _, data = load(write_jsonl, folder, [PROMPT_COMPLETION])
    assert [raw.decode(run) for run in target_runs(data.examples[0])] == [" over jumps"]


def llama_folder(make_hf_folder, template: str) -> str:
    return set_template(make_hf_folder("llama"), template)


def sft_argv(folder, data, out, *more) -> list[str]:
    return [
        "train", "--task", "sft", "--init-from", folder, "--data", data, "--out", str(out),
        "--seq-len", "64", "--max-steps", "1", *more,
    ]  # fmt: skip


def test_a_template_without_a_text_prefix_is_refused(make_hf_folder, write_jsonl, capsys, tmp_path):
    folder = llama_folder(make_hf_folder, RENAMED)
    data = write_jsonl([{"messages": chat} for chat in CHATS])
    out = tmp_path / "run"
    capsys.readouterr()  # save_pretrained's progress bar
    line = one_line_error(capsys, sft_argv(folder, data, out))
    assert line.endswith(
        f"--init-from {folder}: the chat template does not render a conversation's first turns "
        f"as a text prefix of the whole ({data} line 1, turn 1), so the assistant tokens cannot "
        "be told apart; use a prefix-preserving template or --train-on-prompt"
    )
    assert not out.exists()


def test_first_step_does_not_depend_on_the_micro_batch(make_hf_folder, write_jsonl, tmp_path):
    folder = llama_folder(make_hf_folder, SPACED)
    raw = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    words = ["fox", "dog", "quick", "lazy", "brown", "over", "the", "jumps"]
    chats = [
        [
            {"role": "user", "content": f"sort {a} {b}"},
            {"role": "assistant", "content": " ".join(sorted([a, b]))},
        ]
        for a, b in zip(words, words[3:] + words[:3], strict=True)
    ] + CHATS
    data = write_jsonl([{"messages": chat} for chat in chats])
    held_out = write_jsonl([{"messages": CHATS[0]}], name="eval.jsonl")
    targets = sum(
        len(ids_of(raw, f" {m['content']}</s>")) for chat in chats for m in chat[1:]
        if m["role"] == "assistant"
    )  # fmt: skip
    lines = {}
    for micro in (1, 8):
        out = tmp_path / f"micro-{micro}"
        # --packing none: runs of --micro-batch examples, each alone at --micro-batch 1
        argv = sft_argv(folder, data, out, "--micro-batch", str(micro), "--examples-per-step",
                        str(len(chats)), "--packing", "none", "--eval-every", "0",
                        "--eval-data", held_out)  # fmt: skip
        assert main(argv) == 0
        (lines[micro],) = train_records(out)
    one, eight = lines[1], lines[8]
    assert (one["accum_steps"], eight["accum_steps"]) == (len(chats), 2)
    assert one["counted_tokens"] == eight["counted_tokens"] == targets
    assert eight["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert eight["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
