"""`gradaccum verify --task sft --init-from FOLDER`: the user's own fine-tuning setup (a Hugging
Face folder's model with its weights, its tokenizer and ChatML template, messages rows read as
the trainer reads them), checked in each --packing mode against the float64 big batch; the
targets counted here with transformers' tokenizer alone."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from gradaccum.cli import build_parser, main
from gradaccum.cli.verify import parse_sizes
from gradaccum.settings.command import namespace
from gradaccum.verification.cases import build_case

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>'"
    " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
"""ChatML, as Qwen's and many other chat models' templates write it."""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the quick brown fox jumps over the lazy dog and counts to nine".split()
K, MICRO = 4, 2  # the window: 8 examples, every row of the file


def _tokenizer(folder: str):
    """A byte-level BPE tokenizer trained here on WORDS, ChatML's tokens special, saved as
    transformers saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return fast


def _rows() -> list[dict]:
    """Messages rows whose answers run from 1 to 17 words: ragged target counts, examples
    of 24 to 47 tokens, within verify's default --seq-len of 64 (none cut) and short enough
    for some to share a padding-free row."""
    rows = []
    for i in range(K * MICRO):
        answer = " ".join(WORDS[j % len(WORDS)] for j in range(1 + (i * 5) % 19))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"count {i}"},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(folder, rows.jsonl, the folder's tokenizer from transformers, the rows): a tiny Llama
    saved with save_pretrained beside its tokenizer."""
    folder = str(tmp_path_factory.mktemp("llama-chatml"))
    tok = _tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    rows = _rows()
    data = tmp_path_factory.mktemp("data") / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, str(data), tok, rows


def _verify(*argv) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["verify", "--task", "sft", *argv, "--json"])
    return code, json.loads(out.getvalue())


def _rendered(tok, messages) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def _targets(tok, rows) -> int:
    """Each answer's tokens and ChatML's end of turn (<|im_end|> and the newline after it),
    by the tokenizer alone: what the loss counts."""
    return sum(
        len(tok(r["messages"][-1]["content"] + "<|im_end|>\n", add_special_tokens=False).input_ids)
        for r in rows
    )


@pytest.mark.parametrize("mode", ["none", "window", "padding-free"])
def test_the_folder_s_setup_passes_and_mean_over_k_is_off(setup, mode):
    folder, data, tok, rows = setup
    argv = ["--init-from", folder, "--data", data, "--k", str(K), "--micro-batch", str(MICRO)]
    code, got = _verify(*argv, "--packing", mode)
    assert code == 0 and got["passed"] is True, got["checks"]
    assert got["precision"] == "fp32" and got["reference"] == "float64"
    assert got["max_rel_err"] <= 1e-5 and got["max_rel_err_check"] == "gradient"
    # the folder's tokenizer and template made the targets: the answers' tokens, counted here
    assert got["tokens"] == _targets(tok, rows)
    window = got["sft_window"]
    assert window["data_format"] == "messages" and window["examples"] == K * MICRO
    assert window["tokenizer"] == f"--init-from {folder}"
    assert sum(window["targets"]) == got["tokens"] and len(set(window["targets"])) > 1
    every = sum(len(_rendered(tok, r["messages"])) for r in rows)
    assert window["tokens"] == every
    if mode == "padding-free":  # rows of 64 positions, some holding two examples
        assert set(window["widths"]) <= {8, 16, 32, 64} and sum(window["rows"]) < K * MICRO
    # the mistake's size on this data: the micro-batches hold different target counts
    assert got["wrong_ways"]["mean_over_k"] > 1e-3
    names = {p["name"] for p in got["params"]}
    assert "model.layers.0.self_attn.q_proj.weight" in names  # the folder's Llama


def test_train_on_prompt_counts_every_token_but_each_example_s_first(setup):
    folder, data, tok, rows = setup
    argv = ["--init-from", folder, "--data", data, "--k", str(K), "--micro-batch", str(MICRO)]
    code, got = _verify(*argv, "--train-on-prompt")
    assert code == 0 and got["passed"] is True and got["max_rel_err"] <= 1e-5
    # nothing before an example's first token predicts it
    assert got["tokens"] == sum(len(_rendered(tok, r["messages"])) - 1 for r in rows)


def _case(*argv):
    """The case `verify --task sft ARGV` checks, read as `verify_run.run` reads its flags."""
    args = namespace(build_parser().parse_args(["verify", "--task", "sft", *argv]))
    return build_case(args, parse_sizes(args))


def test_the_folder_s_weights_in_their_own_dtype_unless_precision_says(setup, tmp_path):
    folder, _, _, _ = setup
    case = _case("--init-from", folder)
    want = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    got = case.model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)  # not a seeded init
    assert case.precision == "fp32" and case.tokenizer.origin == f"--init-from {folder}"
    # bf16 weights: checked in bf16 unless --precision fp32 asks for them in fp32
    half = transformers.AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16)
    half.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{folder}/{name}", tmp_path)
    case = _case("--init-from", str(tmp_path))
    assert case.precision == "bf16"
    assert {p.dtype for p in case.model.parameters()} == {torch.bfloat16}
    case = _case("--init-from", str(tmp_path), "--precision", "fp32")
    assert case.precision == "fp32"
    assert {p.dtype for p in case.model.parameters()} == {torch.float32}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "tiny"], "give only one of --model, --model-config, --init-from"),
        (["--data-format", "alpaca"], "--data-format alpaca: needs --task sft"),
        (["--train-on-prompt"], "--train-on-prompt: needs --task sft"),
    ],
)
def test_bad_input_one_line_exit_2(setup, capsys, argv, words):
    folder = setup[0]
    task = [] if argv[0] == "--model" else ["--task", "pretrain"]
    code = main(["verify", *task, "--init-from", folder, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err and "Traceback" not in err
