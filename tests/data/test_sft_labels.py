"""The labels convention against the two losses: the built-in loss (labels shifted by the
batch) and gradaccum.hf's (shifted by the loss) read the same targets as a per-example loss
computed here by hand, and the engine's window gradient does not depend on the micro-batch."""

import pytest
import torch
import torch.nn.functional as F

from gradaccum import Accumulator, hf
from gradaccum.data.sft.load import load_sft
from gradaccum.data.sft.windows import SFTBatches, collate
from gradaccum.engine.accumulator import count_labels
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss

ROWS = [
    {"prompt": "reverse: abc\n", "completion": "cba"},
    {"prompt": "add: 12+30\n", "completion": "42"},
    {"prompt": "sort: the quick brown fox\n", "completion": "  bcefhiknooqrtuwx"},
]
CHAT = [
    {"role": "user", "content": "reverse abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "count the o in fox"},
    {"role": "assistant", "content": "1"},
]


def reference(model, ids, positions):
    """Sum over target positions t of -log p(ids[t] | ids[:t]), one example at a time, with no
    padding anywhere; positions come from the test, not from the labels."""
    out = model(torch.tensor([ids]))
    logits = (out if isinstance(out, torch.Tensor) else out.logits)[0].double()
    logp = F.log_softmax(logits, dim=-1)
    return sum(-logp[t - 1, ids[t]] for t in positions), len(positions)


def pc_examples(write_jsonl, tok):
    return load_sft(write_jsonl(ROWS), tok, seq_len=64).examples


def pc_positions(raw, row, eos):
    prompt = raw(row["prompt"], add_special_tokens=False)["input_ids"]
    completion = raw(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
    return prompt + completion, list(range(len(prompt), len(prompt) + len(completion)))


@pytest.fixture
def hf_model(make_hf_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_hf_folder("gpt2"), local_files_only=True)
    return model.double().eval()


def test_both_layouts_give_the_per_example_loss(write_jsonl, hf_tok, raw_hf_tok, hf_model):
    examples = pc_examples(write_jsonl, hf_tok)
    eos = raw_hf_tok.convert_tokens_to_ids("</s>")
    want_loss, want_n = 0.0, 0
    for row in ROWS:
        ids, positions = pc_positions(raw_hf_tok, row, eos)
        loss, n = reference(hf_model, ids, positions)
        want_loss, want_n = want_loss + loss, want_n + n
    shifted = collate(examples, hf_tok.pad_id, "shifted")
    unshifted = collate(examples, hf_tok.pad_id, "unshifted")
    with torch.no_grad():
        # float64 logits stay float64 in both (gradaccum.models.loss); causal_lm_loss is held
        # to fp32 rounding, the precision the trainer runs it in
        for (loss, n), rel in (
            (causal_lm_loss(hf_model, shifted), 1e-6),
            (hf.loss_fn(hf_model, unshifted), 1e-10),
        ):
            assert int(n) == want_n
            assert float(loss) == pytest.approx(float(want_loss), rel=rel)
    # what the engine counts before the first backward, per layout
    assert int(count_labels()(shifted)) == want_n == int(hf.count_tokens(unshifted))
    assert int(count_labels()(unshifted)) == want_n  # labels[0] is never a target


def test_chat_layouts_give_the_per_example_loss(write_jsonl, hf_tok, raw_hf_tok, hf_model):
    ex = load_sft(write_jsonl([{"messages": CHAT}]), hf_tok, seq_len=128).examples[0]
    ids = raw_hf_tok.encode(
        "<|user|>reverse abc<|end|><|assistant|>cba<|end|><|user|>count the o in fox<|end|>"
        "<|assistant|>1<|end|>",
        add_special_tokens=False,
    )
    assert ex.input_ids.tolist() == ids
    marker, end = (raw_hf_tok.convert_tokens_to_ids(t) for t in ("<|assistant|>", "<|end|>"))
    positions = []  # from each <|assistant|> marker (excluded) to its <|end|> (included)
    for t, token in enumerate(ids):
        if token == marker:
            stop = ids.index(end, t)
            positions += list(range(t + 1, stop + 1))
    want = reference(hf_model, ids, positions)
    with torch.no_grad():
        for (loss, n), rel in (
            (causal_lm_loss(hf_model, collate([ex], hf_tok.pad_id, "shifted")), 1e-6),
            (hf.loss_fn(hf_model, collate([ex], hf_tok.pad_id, "unshifted")), 1e-10),
        ):
            assert (float(loss), int(n)) == (pytest.approx(float(want[0]), rel=rel), want[1])


def test_padding_is_masked_and_right_aligned(write_jsonl, byte_tok):
    examples = pc_examples(write_jsonl, byte_tok)
    for layout, cut in (("shifted", 1), ("unshifted", 0)):
        batch = collate(examples, byte_tok.pad_id, layout)
        width = max(e.length for e in examples) - cut
        assert batch["input_ids"].shape == (3, width) and batch["input_ids"].dtype == torch.int64
        for r, ex in enumerate(examples):
            n = ex.length - cut
            assert batch["attention_mask"][r].tolist() == [1] * n + [0] * (width - n)
            assert (batch["labels"][r, n:] == -100).all()
            assert (batch["input_ids"][r, n:] == byte_tok.pad_id).all()
            if layout == "shifted":  # the label at t is the token after input t
                assert batch["input_ids"][r, :n].tolist() == ex.input_ids[:-1].tolist()
                assert batch["labels"][r, :n].tolist() == ex.labels[1:].tolist()
    empty = collate(examples, byte_tok.pad_id, no_targets=True)
    assert (empty["labels"] == -100).all()


def window_gradient(model, examples, micro_batch):
    """The parameters' change under SGD(lr=1) after one engine step on one window."""
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = Accumulator(model, opt)
    batches = SFTBatches(
        examples, micro_batch=micro_batch, pad_id=256, examples_per_step=len(examples)
    )
    window = next(batches)
    acc.step(window.micro_batches, causal_lm_loss)
    acc.close()
    grads = [(s - p.detach()) for s, p in zip(start, model.parameters(), strict=True)]
    with torch.no_grad():
        for s, p in zip(start, model.parameters(), strict=True):
            p.copy_(s)
    return grads, window


def test_window_gradient_equals_the_big_batch_whatever_the_micro_batch(write_jsonl, byte_tok):
    rows = [
        {"prompt": "p" * (1 + 7 * i % 13), "completion": "abcdefghij"[: 1 + (5 * i) % 10]}
        for i in range(7)
    ]
    examples = load_sft(write_jsonl(rows), byte_tok, seq_len=64).examples
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, seq_len=32, n_layer=2, n_head=2, n_embd=16)).double()
    # reference: every example alone, summed over all targets, divided by their count
    total, n = 0.0, 0
    for row in rows:
        ids = list((row["prompt"] + row["completion"]).encode()) + [256]
        loss, k = reference(model, ids, list(range(len(row["prompt"]), len(ids))))
        total, n = total + loss, n + k
    model.zero_grad()
    (total / n).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for micro_batch in (1, 3, 7):
        grads, window = window_gradient(model, examples, micro_batch)
        assert window.targets == n
        # causal_lm_loss's cross-entropy is fp32: agreement to fp32 rounding of the largest
        for g, w in zip(grads, want, strict=True):
            assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
    # dividing each micro-batch's mean by k is the mistake the token count avoids
    model.zero_grad()
    for i in range(0, 7, 3):
        loss_sum, count = causal_lm_loss(model, collate(examples[i : i + 3], 256, "shifted"))
        (loss_sum / count / 3).backward()
    off = (
        sum(float((p.grad - w).norm() ** 2) for p, w in zip(model.parameters(), want, strict=True))
        ** 0.5
    )
    assert off > 1e-2 * sum(float(w.norm() ** 2) for w in want) ** 0.5
