"""Fixtures shared by the whole suite: Hugging Face folders made on the spot, never downloaded.

`hf_tokenizer_dir` is a folder holding a byte-level BPE tokenizer trained with the
`tokenizers` library on local text, with special tokens for chat roles and a chat template;
`make_hf_folder(arch, ...)` saves a tiny causal LM of that architecture from its config (random
weights, seeded) together with that tokenizer, as `save_pretrained` writes it. bitsandbytes'
4-bit layers take their AVX512-BF16 path in every test, whatever the CPU (tests/avx512bf16.py),
and a connection off this machine raises (tests/network.py).
"""

from __future__ import annotations

import os
import shutil

import pytest

from . import avx512bf16, network

avx512bf16.install()  # bitsandbytes' AVX512-BF16 path on every CPU (tests/avx512bf16.py)
network.refuse()  # no connection off this machine from the suite's process (tests/network.py)
# ... nor from a process it starts: Python runs tests/site/sitecustomize.py at its start.
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)

SPECIAL_TOKENS = [
    "<unk>",
    "<pad>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A chat template in the usual form: each turn wrapped in role markers, the assistant's
turn opened by `add_generation_prompt`. Rendering a conversation's prefix gives a prefix of
its rendering, as the templates of common chat models do."""

TOKENIZER_TEXT = [
    f"the quick brown fox jumps over the lazy dog {i}; reverse, sort, add and count {i * 7}"
    for i in range(300)
]
"""The local text the test tokenizer is trained on."""


def train_tokenizer(folder: str, vocab_size: int = 320, chat_template: str | None = CHAT_TEMPLATE):
    """Train a byte-level BPE tokenizer on TOKENIZER_TEXT and save it into `folder` as
    transformers does (tokenizer.json, tokenizer_config.json and the chat template). Every
    byte is in its alphabet, so any text encodes. Returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> str:
    """A folder with the test tokenizer and its chat template (shared: do not modify it)."""
    pytest.importorskip("transformers")
    folder = str(tmp_path_factory.mktemp("hf-tokenizer"))
    train_tokenizer(folder)
    return folder


def tiny_config(arch: str, vocab_size: int, seq_len: int = 64):
    """A transformers config of `arch` ("gpt2" or "llama") small enough for CPU tests."""
    from transformers import GPT2Config, LlamaConfig

    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=seq_len,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=2,
            eos_token_id=3,
        )
    if arch == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq_len,
            bos_token_id=2,
            eos_token_id=3,
            pad_token_id=1,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown test architecture {arch!r}")


@pytest.fixture
def make_hf_folder(hf_tokenizer_dir, tmp_path):
    """`make_hf_folder(arch, seed=0, dtype=None, max_shard_size=None, tokenizer=True)`: save a
    tiny causal LM of `arch` with the test tokenizer into a new folder and return its path.
    `max_shard_size` (e.g. "20KB") writes sharded safetensors with their index;
    `safe_serialization=False` writes a single pytorch_model.bin instead."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = []

    def make(
        arch: str,
        seed: int = 0,
        dtype=None,
        max_shard_size=None,
        tokenizer: bool = True,
        safe_serialization: bool = True,
    ) -> str:
        tok = AutoTokenizer.from_pretrained(hf_tokenizer_dir, local_files_only=True)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok)))
        if dtype is not None:
            model = model.to(dtype)
        folder = os.path.join(str(tmp_path), f"{arch}-{len(made)}")
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(folder, **kwargs)
        if not safe_serialization:  # the older format, written as torch.save writes it
            for name in os.listdir(folder):
                if name.startswith("model") and "safetensors" in name:
                    os.remove(os.path.join(folder, name))
            torch.save(model.state_dict(), os.path.join(folder, "pytorch_model.bin"))
        if tokenizer:
            for name in os.listdir(hf_tokenizer_dir):
                shutil.copy(os.path.join(hf_tokenizer_dir, name), folder)
        made.append(folder)
        return folder

    return make
