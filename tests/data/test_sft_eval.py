"""Evaluation: greedy generation in padded batches equals one prompt at a time, exact match
counts what an oracle model gets right, and the held-out loss equals a per-example sum."""

import pytest
import torch
import torch.nn.functional as F

import gradaccum.data.sft.builtin as tasks
from gradaccum.data.sft.evaluation import exact_match, greedy_generate, heldout_loss
from gradaccum.data.sft.examples import make_example
from gradaccum.data.sft.load import tokenize_rows
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.gpt import GPT, GPTConfig


class Oracle(torch.nn.Module):
    """A causal LM that knows the next token of some prefixes: logits (b, T, V) one-hot on
    table[prefix through t], on token 0 for a prefix it does not know."""

    def __init__(self, table: dict, vocab: int = 257):
        super().__init__()
        self.table, self.vocab = table, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        b, t = input_ids.shape
        logits = torch.zeros(b, t, self.vocab)
        for r in range(b):
            row = input_ids[r].tolist()
            for j in range(t):
                logits[r, j, self.table.get(tuple(row[: j + 1]), 0)] = 1.0
        return logits


def byte_examples(rows):
    return tokenize_rows(
        rows_from_dicts(rows, "mem"), ByteTokenizer(), seq_len=128, source="mem"
    ).examples


def teach(table, prompt: str, answer: str):
    ids = list(prompt.encode()) + list(answer.encode()) + [256]
    start = len(prompt.encode())
    for t in range(start, len(ids)):
        table[tuple(ids[:t])] = ids[t]


def test_exact_match_counts_what_the_oracle_knows():
    rows = tasks.builtin_rows(seed=4, n=40)
    table = {}
    for i, row in enumerate(rows):
        # rows 0, 3, 6, ... answered right; the others answered with one wrong last letter
        answer = row["completion"] if i % 3 == 0 else row["completion"][:-1] + "#"
        teach(table, row["prompt"], answer)
    model = Oracle(table)
    model.train()
    tok = ByteTokenizer()
    examples = byte_examples(rows)
    by_tokens = exact_match(model, examples, tok, batch_size=7)
    by_check = exact_match(model, examples, tok, check=tasks.check, samples=5, batch_size=40)
    right = len(range(0, 40, 3))
    assert (by_tokens.correct, by_tokens.total) == (right, 40) == (by_check.correct, by_check.total)
    assert by_tokens.rate == pytest.approx(right / 40)
    assert model.training  # put back in the mode it was in
    first = by_check.samples[0]
    assert (first.prompt, first.expected, first.generated, first.correct) == (
        rows[0]["prompt"],
        rows[0]["completion"],
        rows[0]["completion"],
        True,
    )
    second = by_check.samples[1]
    assert second.generated == rows[1]["completion"][:-1] + "#" and not second.correct
    assert len(by_check.samples) == 5


def test_truncated_examples_are_left_out():
    whole = make_example([1, 2, 3, 256], [-100, -100, 3, 256], 0)
    cut = make_example([1, 2, 3], [-100, -100, 3], 1, truncated=True)
    table = {(1, 2): 3, (1, 2, 3): 256}
    assert exact_match(Oracle(table), [whole, cut], ByteTokenizer()).total == 1


def test_batched_generation_equals_one_prompt_at_a_time():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, seq_len=48, n_layer=2, n_head=2, n_embd=32)).eval()
    prompts = [
        list(b"sort: cab\n"),
        list(b"add: 1+2\n"),
        list(b"x"),
        list(b"reverse: abcdefabcdef\n"),
    ]
    max_new = [5, 9, 3, 12]
    want = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_new, strict=True):
            ids, new = list(prompt), []
            while len(new) < n:
                token = int(model(torch.tensor([ids]))[0, -1].argmax())
                ids.append(token)
                new.append(token)
                if token == 256:
                    break
            want.append(new)
    for batch_size in (1, 2, 4):
        assert (
            greedy_generate(model, prompts, max_new, eos_id=256, pad_id=256, batch_size=batch_size)
            == want
        )


def test_hf_model_generation_matches_transformers(make_hf_folder, hf_tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        make_hf_folder("gpt2"), local_files_only=True
    ).eval()
    prompts = [hf_tok.encode("the quick brown"), hf_tok.encode("reverse, sort and count 7")]
    got = greedy_generate(model, prompts, [6, 6], eos_id=hf_tok.eos_id, pad_id=hf_tok.pad_id)
    for prompt, ours in zip(prompts, got, strict=True):
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=hf_tok.eos_id,
            pad_token_id=hf_tok.pad_id,
        )
        assert ours == out[0, len(prompt) :].tolist()[: len(ours)]


def per_example_loss(model, examples):
    """Sum over each example's targets of -log p(token | tokens before), alone, no padding."""
    total, n = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor(ex.input_ids.tolist())
            out = model(ids[None])
            logp = F.log_softmax(
                (out if isinstance(out, torch.Tensor) else out.logits)[0].double(), -1
            )
            for t, label in enumerate(ex.labels.tolist()):
                if label != -100:
                    total -= float(logp[t - 1, label])
                    n += 1
    return total, n


def test_heldout_loss_equals_the_per_example_sum():
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=257, seq_len=128, n_layer=2, n_head=2, n_embd=32))
    examples = byte_examples(tasks.builtin_rows(seed=2, n=23))
    want, n = per_example_loss(model, examples)
    got = heldout_loss(model, examples, pad_id=256, micro_batch=5)
    assert got.tokens == n and got.loss_sum == pytest.approx(want, rel=1e-6)
    assert got.loss == pytest.approx(want / n, rel=1e-6)
    assert model.training
    parts = [
        heldout_loss(model, examples, pad_id=256, micro_batch=5, rank=r, world_size=2)
        for r in range(2)
    ]
    assert sum(p.tokens for p in parts) == n
    assert sum(p.loss_sum for p in parts) == pytest.approx(want, rel=1e-6)


def test_heldout_loss_of_an_hf_model_unshifted(make_hf_folder, hf_tok, write_jsonl):
    from transformers import AutoModelForCausalLM

    from gradaccum.data.sft.load import load_sft

    model = AutoModelForCausalLM.from_pretrained(make_hf_folder("llama"), local_files_only=True)
    rows = [
        {"prompt": "the quick", "completion": " brown fox"},
        {"prompt": "add 7", "completion": " and count 14"},
    ]
    examples = load_sft(write_jsonl(rows), hf_tok, seq_len=64).examples
    want, n = per_example_loss(model, examples)
    for layout in ("shifted", "unshifted"):
        got = heldout_loss(model, examples, pad_id=hf_tok.pad_id, layout=layout, micro_batch=2)
        assert got.tokens == n and got.loss_sum == pytest.approx(want, rel=1e-5)
