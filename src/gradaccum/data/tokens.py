"""Tokens to train on, split and batched: the built-in corpus or the user's own data.

`load_tokens(spec, seq_len, ...)` reads
- None: the built-in Markov corpus (gradaccum.data.corpus), generated from the seed;
- "PATH.txt": the file's bytes as tokens 0..255, vocabulary 257 (256 is the end-of-document id,
  which a single text file does not use);
- "PATH.bin": raw uint16 token ids (nanoGPT's format); "PATH.npy": a 1-D uint16 or uint32 array;
  both memory-mapped, never read whole;
- "hf:NAME[:SPLIT]": a `datasets` dataset (optional extra) from the local cache, or a folder
  written by save_to_disk (`gradaccum.data.hf_datasets`), its "text" column as UTF-8 bytes
  with the end-of-document id 256 after each row, held in memory.

Split: the last `val_fraction` of the token stream (at least one sequence) is held out for
evaluation, the rest is for training; no token of the held-out tail is ever trained on.
Sequences: sequence i of a split is tokens [i*T, i*T + T] (T + 1 tokens, T = seq_len), so
neighbours share one token and every token but the first is a label exactly once. Batching
them for training and evaluation is `gradaccum.data.batches`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.data.hf_datasets import folder_problem, load_hf_dataset
from gradaccum.data.settings import SOURCES
from gradaccum.utils.errors import BadInput

__all__ = ["DataInfo", "MarkovCorpus", "TokenDataset", "load_tokens"]

BYTE_VOCAB = 257
"""Byte-level vocabulary: the 256 byte values and an end-of-document id (256)."""

DEFAULT_CORPUS_TOKENS = 8_000_000
"""Tokens generated for the built-in corpus (about 16 MB, about half a second)."""


class TokenDataset:
    """Training sequences of `seq_len + 1` tokens over a 1-D token array (memory-mapped or not).

    len(ds) is the number of sequences; ds[i] is a LongTensor of seq_len + 1 tokens
    (inputs x[:-1], labels x[1:]).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        start = i * self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], np.int64))

    def batch(self, indices) -> torch.Tensor:
        """Sequences `indices` stacked: a (len(indices), seq_len + 1) LongTensor."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        rows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        return torch.from_numpy(rows.astype(np.int64))


@dataclass
class DataInfo:
    source: str
    """Where the tokens came from, in words."""
    vocab_size: int
    """Token ids are in [0, vocab_size): the model's vocabulary must be at least this."""
    entropy_floor: float | None
    """Nats per token no model can beat in expectation (built-in corpus only, else None)."""
    num_tokens: int
    """Tokens in the whole stream, both splits."""
    train_tokens: int
    """Tokens in the training split."""
    val_tokens: int
    """Tokens in the held-out split."""
    eod_token: int | None
    """The end-of-document id, where the source has one."""
    fingerprint: str = ""
    """A hash of every token of the stream (both splits): equal for the same tokens, however
    they are stored or named."""

    def to_dict(self) -> dict:
        return asdict(self)


def load_tokens(
    spec: str | None,
    seq_len: int,
    seed: int = 0,
    val_fraction: float = 0.05,
    vocab_size: int | None = None,
    corpus: MarkovCorpus | None = None,
    corpus_tokens: int = DEFAULT_CORPUS_TOKENS,
):
    """(train, val, info) for `--data spec`; see the module docstring for the formats.

    seq_len: tokens per training sequence. seed: samples the built-in corpus.
    val_fraction: share of tokens held out (0 for none; else at least one sequence).
    vocab_size: the model's vocabulary when it is fixed (an HF config, a checkpoint): ids at or
        above it are refused; None takes the data's own.
    corpus, corpus_tokens: the built-in chain and how many tokens to draw from it.
    Raises BadInput naming `--data` on bad input.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise BadInput(f"--val-fraction {val_fraction}: must be in [0, 1)")
    eod, floor, top = None, None, None
    if spec is None:
        corpus = corpus or MarkovCorpus()
        tokens = corpus.generate(corpus_tokens, seed)
        data_vocab, eod, floor = corpus.vocab_size, corpus.eod_token, corpus.entropy_rate
        source = (
            f"built-in Markov corpus (vocab {corpus.vocab_size}, branching "
            f"{corpus.branching}, mean document {corpus.mean_doc_len:g} tokens, seed {seed})"
        )
    elif spec.startswith("hf:"):
        tokens = _load_hf(spec)
        data_vocab, eod, source = BYTE_VOCAB, BYTE_VOCAB - 1, f"Hugging Face dataset {spec[3:]}"
    else:
        tokens, data_vocab = _load_file(spec)
        source = spec
        if not spec.lower().endswith(".txt"):
            top = data_vocab - 1  # already the largest id in the file
    flag = "--data " + (spec if spec is not None else "(built-in)")
    if vocab_size is not None and len(tokens):
        top = int(tokens.max()) if top is None else top
        if top >= vocab_size:
            raise BadInput(
                f"{flag}: token id {top} is outside the model's vocabulary of {vocab_size}"
            )
    n, need = len(tokens), seq_len + 1
    n_val = 0 if val_fraction == 0 else max(need, int(round(val_fraction * n)))
    if n - n_val < need:
        held = f" plus {n_val} held out" if n_val else ""
        raise BadInput(f"{flag}: {n} tokens, too few for one sequence of {need} tokens{held}")
    train, val = (
        TokenDataset(tokens[: n - n_val], seq_len),
        TokenDataset(tokens[n - n_val :], seq_len),
    )
    info = DataInfo(source, int(data_vocab), floor, n, n - n_val, n_val, eod, fingerprint(tokens))
    return train, val, info


def fingerprint(tokens: np.ndarray) -> str:
    """blake2b of the token ids as little-endian int64s, read in blocks (a memory-mapped
    file is streamed, never held whole): the same ids give the same hash in any dtype."""
    digest = hashlib.blake2b(digest_size=16)
    block = 1 << 22
    for start in range(0, len(tokens), block):
        digest.update(np.asarray(tokens[start : start + block], dtype="<i8").tobytes())
    return digest.hexdigest()


MAX_VOCAB = 2**21
"""Largest vocabulary a token file may imply (the largest in use are about 256k)."""


def _load_file(path: str) -> tuple[np.ndarray, int]:
    """Memory-mapped tokens of a .txt/.bin/.npy file and its vocabulary size."""
    flag = f"--data {path}"
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        raise BadInput(folder_problem(path, "pretrain", reads_rows=False))
    if ext not in (".txt", ".bin", ".npy"):
        raise BadInput(f"{flag}: unknown format; expected {SOURCES['pretrain']}")
    if not os.path.isfile(path):
        raise BadInput(f"{flag}: no such file")
    size = os.path.getsize(path)
    if ext == ".txt":
        return _memmap(path, np.uint8, size), BYTE_VOCAB
    if ext == ".bin":
        if size % 2:
            raise BadInput(f"{flag}: {size} bytes is not a whole number of uint16 token ids")
        tokens = _memmap(path, np.uint16, size)
    else:
        tokens = _load_npy(path, flag)
        if tokens.dtype not in (np.uint16, np.uint32):
            raise BadInput(f"{flag}: dtype {tokens.dtype}; token ids must be uint16 or uint32")
        if tokens.ndim != 1:
            raise BadInput(f"{flag}: shape {tokens.shape}; token ids must be a 1-D array")
    # The vocabulary is what the ids use: one pass over the file.
    top = int(tokens.max()) if len(tokens) else 0
    if top >= MAX_VOCAB:  # a sentinel such as 2**32 - 1 would ask for a 4e9-row embedding
        raise BadInput(
            f"{flag}: token id {top} implies a vocabulary over {MAX_VOCAB:,}; "
            "is a padding or sentinel id in the file?"
        )
    return tokens, top + 1


NPY_EXPECTED = "expected a 1-D array of uint16 or uint32 token ids saved with numpy.save"


def _load_npy(path: str, flag: str) -> np.ndarray:
    """The array of a .npy file, memory-mapped; BadInput saying what the file is instead
    (text or other bytes, Python objects, a cut-off array) in words, not numpy's advice on
    unpickling."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        try:
            version = fmt.read_magic(f)
        except ValueError:  # text, or any other bytes
            raise BadInput(f"{flag}: not a NumPy array file; {NPY_EXPECTED}") from None
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        try:
            dtype = read(f)[2]
        except ValueError:
            why = "a damaged NumPy array file (its header cannot be read)"
            raise BadInput(f"{flag}: {why}; {NPY_EXPECTED}") from None
    if dtype.hasobject:
        raise BadInput(f"{flag}: holds Python objects, not integer token ids; {NPY_EXPECTED}")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError):
        raise BadInput(f"{flag}: a damaged or cut-off NumPy array file; {NPY_EXPECTED}") from None


def _memmap(path: str, dtype, size: int) -> np.ndarray:
    # np.memmap refuses an empty file; an empty array fails the length check like any short one.
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def _load_hf(spec: str) -> np.ndarray:
    """Byte tokens of a `datasets` dataset's text column, EOD (256) after each row."""
    ds = load_hf_dataset(spec)
    if "text" not in ds.column_names:
        raise BadInput(f"--data {spec}: no 'text' column (columns: {', '.join(ds.column_names)})")
    eod = np.array([BYTE_VOCAB - 1], np.uint16)
    parts = []
    for text in ds["text"]:
        if text is None:
            continue
        parts.append(np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16))
        parts.append(eod)
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)
