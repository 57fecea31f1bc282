"""The built-in corpus's exact entropy rate, the file loaders, the split and the batches."""

import math
import sys

import numpy as np
import pytest
import torch

from gradaccum.data.batches import Batches, eval_batches
from gradaccum.data.corpus import markov_entropy_rate, stationary_distribution
from gradaccum.data.tokens import MarkovCorpus, TokenDataset, load_tokens
from gradaccum.utils.errors import BadInput


def h(p):
    """Binary entropy in nats."""
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


# ---- the entropy rate ------------------------------------------------------------------------


def test_two_state_chain_by_hand():
    # P = [[0.9, 0.1], [0.3, 0.7]]: pi = (0.3, 0.1) / 0.4 = (0.75, 0.25),
    # H = 0.75 h(0.1) + 0.25 h(0.3) = 0.75 * 0.325083 + 0.25 * 0.610864 = 0.396528 nats.
    P = np.array([[0.9, 0.1], [0.3, 0.7]])
    np.testing.assert_allclose(stationary_distribution(P), [0.75, 0.25], rtol=1e-12)
    assert markov_entropy_rate(P) == pytest.approx(0.396528, abs=1e-6)


def test_deterministic_cycle_has_zero_entropy_and_uniform_pi():
    P = np.roll(np.eye(5), 1, axis=1)
    np.testing.assert_allclose(stationary_distribution(P), np.full(5, 0.2), rtol=1e-12)
    assert markov_entropy_rate(P) == 0.0


@pytest.mark.parametrize("vocab_size,mean_doc_len", [(3, 4.0), (40, 10.0)])
def test_single_successor_corpus_by_hand(vocab_size, mean_doc_len):
    # With one successor each, a content token moves on w.p. 1-q or ends the document w.p. q:
    # h(q) nats. After EOD the start distribution s costs H(s). One EOD per 1/q content
    # tokens, so pi(EOD) = q / (1 + q) and H = (h(q) + q H(s)) / (1 + q).
    corpus = MarkovCorpus(vocab_size=vocab_size, branching=1, mean_doc_len=mean_doc_len, seed=3)
    q = 1 / mean_doc_len
    s = corpus.transitions[-1, :-1]
    H_start = -(s * np.log(s)).sum()
    assert corpus.entropy_rate == pytest.approx((h(q) + q * H_start) / (1 + q), rel=1e-10)
    assert corpus.stationary[-1] == pytest.approx(q / (1 + q), rel=1e-10)


@pytest.fixture(scope="module")
def sample():
    corpus = MarkovCorpus(vocab_size=256, branching=4, mean_doc_len=64, seed=1)
    return corpus, corpus.generate(3_000_000, seed=7)


def test_entropy_rate_matches_monte_carlo(sample):
    corpus, x = sample
    logp = np.log(corpus.transitions[x[:-1].astype(np.int64), x[1:].astype(np.int64)])
    assert np.isfinite(logp).all()  # no transition outside the chain's support
    # Standard error from 200 batch means (the terms are correlated along the chain).
    means = -logp[: len(logp) // 200 * 200].reshape(200, -1).mean(axis=1)
    se = means.std(ddof=1) / math.sqrt(len(means))
    assert abs(-logp.mean() - corpus.entropy_rate) < 4 * se
    assert se < 0.01  # the check above is tight, not vacuous


def test_transition_frequencies_and_token_shares_match(sample):
    corpus, x = sample
    V = corpus.vocab_size
    counts = np.bincount(x[:-1].astype(np.int64) * V + x[1:], minlength=V * V).reshape(V, V)
    visits = counts.sum(axis=1)
    P = corpus.transitions
    freq = counts / visits[:, None]
    sigma = np.sqrt(P * (1 - P) / visits[:, None])
    assert (np.abs(freq - P) <= 5 * sigma + 1e-12).all()
    share, pi, n = visits / visits.sum(), corpus.stationary, visits.sum()
    assert (np.abs(share - pi) <= 6 * np.sqrt(pi / n)).all()  # Poisson-sized error per token


def test_documents_have_the_requested_mean_length(sample):
    corpus, x = sample
    ends = np.flatnonzero(x == corpus.eod_token)
    lengths = np.diff(ends) - 1  # content tokens between two EODs
    se = lengths.std() / math.sqrt(len(lengths))
    assert abs(lengths.mean() - corpus.mean_doc_len) < 4 * se
    assert x[0] != corpus.eod_token  # the stream starts with a document


def test_generate_is_seeded_and_exact_length():
    corpus = MarkovCorpus(vocab_size=64, branching=3, mean_doc_len=20)
    a, b = corpus.generate(10_001, seed=1), corpus.generate(10_001, seed=1)
    assert a.dtype == np.uint16 and len(a) == 10_001 and np.array_equal(a, b)
    assert not np.array_equal(a, corpus.generate(10_001, seed=2))
    assert a.max() < 64
    assert len(corpus.generate(0)) == 0


def test_default_corpus_sits_between_floor_and_ln_v():
    corpus = MarkovCorpus()
    assert corpus.vocab_size == 512 and corpus.eod_token == 511
    assert 1.0 < corpus.entropy_rate < 0.5 * math.log(512)


def test_corpus_validation():
    with pytest.raises(ValueError, match="branching"):
        MarkovCorpus(vocab_size=10, branching=10)
    with pytest.raises(ValueError, match="vocab_size"):
        MarkovCorpus(vocab_size=2)


# ---- loaders and split ------------------------------------------------------------------------


def test_builtin_corpus_split(tmp_path):
    corpus = MarkovCorpus(vocab_size=100, branching=4, mean_doc_len=30)
    train, val, info = load_tokens(
        None, 32, seed=5, val_fraction=0.1, corpus=corpus, corpus_tokens=20_000
    )
    assert info.vocab_size == 100 and info.eod_token == 99
    assert info.entropy_floor == corpus.entropy_rate
    assert (info.num_tokens, info.train_tokens, info.val_tokens) == (20_000, 18_000, 2_000)
    stream = corpus.generate(20_000, seed=5)
    assert np.array_equal(np.asarray(train.tokens), stream[:18_000])
    assert np.array_equal(np.asarray(val.tokens), stream[18_000:])


def test_txt_is_bytes_with_a_held_out_tail(tmp_path):
    text = ("the quick brown fox jumps over the lazy dog. " * 40).encode()
    path = tmp_path / "a.txt"
    path.write_bytes(text)
    train, val, info = load_tokens(str(path), seq_len=16, val_fraction=0.25)
    assert info.vocab_size == 257 and info.entropy_floor is None
    n_val = round(0.25 * len(text))
    assert bytes(np.asarray(train.tokens).tolist()) == text[: len(text) - n_val]
    assert bytes(np.asarray(val.tokens).tolist()) == text[len(text) - n_val :]
    assert len(train) == (len(text) - n_val - 1) // 16
    assert train[2].tolist() == list(text[32:49])
    assert isinstance(train.tokens, np.memmap)


def test_bin_and_npy_are_memory_mapped(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) * 7
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.uint32) + 70_000)
    train, val, info = load_tokens(str(tmp_path / "t.bin"), 10, val_fraction=0.1)
    assert isinstance(train.tokens, np.memmap) and info.vocab_size == 999 * 7 + 1
    assert np.array_equal(np.concatenate([train.tokens, val.tokens]), ids)
    train, _, info = load_tokens(str(tmp_path / "t.npy"), 10, val_fraction=0.0)
    assert isinstance(train.tokens, np.memmap) and info.vocab_size == 70_000 + 999 * 7 + 1
    assert train[0].tolist() == (ids[:11].astype(np.int64) + 70_000).tolist()


@pytest.mark.parametrize(
    "name,make,match",
    [
        ("missing.bin", None, "no such file"),
        ("t.csv", lambda p: p.write_text("1,2"), "unknown format"),
        ("t.npy", lambda p: np.save(p, np.arange(500, dtype=np.int64)), "dtype int64"),
        ("t.npy", lambda p: np.save(p, np.zeros((40, 40), np.uint16)), "1-D"),
        ("t.bin", lambda p: p.write_bytes(b"\0" * 301), "301 bytes"),
        ("t.txt", lambda p: p.write_bytes(b"x" * 20), "20 tokens, too few"),
        ("t.txt", lambda p: p.write_bytes(b""), "0 tokens, too few"),
    ],
)
def test_bad_files_name_the_flag(tmp_path, name, make, match):
    path = tmp_path / name
    if make:
        make(path)
    with pytest.raises(BadInput, match=rf"^--data {path}: .*{match}"):
        load_tokens(str(path), seq_len=16)


def _cut_npy(path):
    np.save(path, np.arange(1000, dtype=np.uint16))
    path.write_bytes(path.read_bytes()[:500])  # the header whole, the ids cut off


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p.write_text("hello world\n" * 20), "not a NumPy array file; expected a 1-D"),
        (lambda p: p.write_bytes(bytes(range(256)) * 4), "not a NumPy array file; expected"),
        (lambda p: np.save(p, np.array([{"a": 1}], dtype=object)), "holds Python objects"),
        (_cut_npy, "a damaged or cut-off NumPy array file"),
    ],
    ids=["text", "bytes", "objects", "cut"],
)
def test_a_npy_that_is_not_token_ids_says_what_it_is(tmp_path, make, match):
    path = tmp_path / "t.npy"
    make(path)
    with pytest.raises(BadInput, match=rf"^--data {path}: {match}") as err:
        load_tokens(str(path), seq_len=16)
    assert "pickle" not in str(err.value) and "\n" not in str(err.value)
    assert "uint16 or uint32 token ids" in str(err.value)


def test_ids_outside_the_model_vocabulary_are_refused(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, 3, 500] * 50, np.uint16).tofile(path)
    with pytest.raises(BadInput, match=rf"^--data {path}: token id 500 .* vocabulary of 400"):
        load_tokens(str(path), seq_len=8, vocab_size=400)
    load_tokens(str(path), seq_len=8, vocab_size=501)


def test_hf_without_datasets_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(BadInput, match=r"^--data hf:foo/bar:train: needs the datasets package"):
        load_tokens("hf:foo/bar:train", seq_len=8)


def test_hf_local_text_dataset(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.txt").write_text("hello\nworld, again\n" * 5)
    train, val, info = load_tokens(f"hf:{folder}", seq_len=8, val_fraction=0.0)
    doc = list(b"hello") + [256] + list(b"world, again") + [256]
    assert np.asarray(train.tokens).tolist() == doc * 5
    assert info.vocab_size == 257 and info.eod_token == 256


# ---- batches ------------------------------------------------------------------------------------


def toy_dataset(num_sequences=23, seq_len=4):
    return TokenDataset(np.arange(num_sequences * seq_len + 1, dtype=np.uint32), seq_len)


def seq_ids(batch, seq_len=4):
    # In toy_dataset sequence i starts with token i * seq_len.
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["labels"][:, -1], batch["input_ids"][:, -1] + 1)
    return (batch["input_ids"][:, 0] // seq_len).tolist()


def stream(ds, micro_batch, world_size, sequences, seed=0):
    """The first `sequences` sequence ids read by all ranks together, in global order."""
    ranks = [
        Batches(ds, micro_batch, seed=seed, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    out = []
    while len(out) < sequences:
        for it in ranks:
            out += seq_ids(next(it))
    return out[:sequences]


def test_each_epoch_visits_every_sequence_once():
    ds = toy_dataset()  # 23 sequences; micro-batches of 3 do not divide an epoch
    seen = stream(ds, micro_batch=3, world_size=1, sequences=3 * 23)
    epochs = [seen[e * 23 : (e + 1) * 23] for e in range(3)]
    assert all(sorted(e) == list(range(23)) for e in epochs)  # nothing skipped, nothing twice
    assert epochs[0] != epochs[1] != epochs[2]  # a fresh order per epoch
    it = Batches(ds, micro_batch=3, seed=0)
    for _ in range(8):  # 24 sequences read: the next one is in epoch 1
        next(it)
    assert it.epoch == 1


def test_the_order_does_not_depend_on_micro_batch_or_world_size():
    # b x k on one process and b x k / W on W ranks must read the same windows, also across
    # epoch boundaries, or the runs stop matching after the first epoch.
    ds = toy_dataset(num_sequences=23)
    want = stream(ds, micro_batch=1, world_size=1, sequences=120)
    for micro_batch, world_size in ((4, 1), (2, 2), (5, 2), (3, 3)):
        assert stream(ds, micro_batch, world_size, sequences=120) == want


def test_two_ranks_split_the_one_rank_global_batch():
    ds = toy_dataset(num_sequences=31)
    single = Batches(ds, micro_batch=4, seed=9)  # one rank, global micro-batch 2 x 2
    ranks = [Batches(ds, micro_batch=2, seed=9, rank=r, world_size=2) for r in (0, 1)]
    for step in range(3 * 31 // 4 + 1):  # three epochs and a bit
        a, b = seq_ids(next(ranks[0])), seq_ids(next(ranks[1]))
        if step < 31 // 4:  # inside the first epoch the ranks never share a sequence
            assert not set(a) & set(b)
        assert a + b == seq_ids(next(single))


@pytest.mark.parametrize("p", [0, 5, 13])
def test_resume_at_a_position_yields_the_same_batches(p):
    ds = toy_dataset()
    straight = Batches(ds, micro_batch=3, seed=4, rank=1, world_size=2)
    for _ in range(p):
        next(straight)
    state = straight.state_dict()
    expected = [next(straight) for _ in range(8)]  # crosses epoch boundaries (23 sequences)
    for resumed in (
        Batches(ds, 3, seed=4, rank=1, world_size=2, start=p),
        Batches(ds, 3, seed=4, rank=1, world_size=2),
    ):
        if resumed.position == 0:
            resumed.load_state_dict(state)
        assert resumed.position == p
        for want in expected:
            got = next(resumed)
            assert torch.equal(got["input_ids"], want["input_ids"])
            assert torch.equal(got["labels"], want["labels"])


def test_resume_on_another_layout_continues_the_stream_or_names_the_numbers():
    ds = toy_dataset()
    two_ranks = [Batches(ds, 3, seed=4, rank=r, world_size=2) for r in range(2)]
    for b in two_ranks:
        next(b), next(b)  # 2 micro-steps x 3 sequences x 2 ranks = 12 sequences read
    one = Batches(ds, 2, seed=4)
    one.load_state_dict(two_ranks[0].state_dict())
    reference = Batches(ds, 12, seed=4)  # the stream, 12 sequences at a time
    next(reference)
    want = next(reference)["input_ids"]  # sequences 12..23 of the stream
    got = torch.cat([next(one)["input_ids"] for _ in range(6)])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="12 sequences read .* micro-steps of 5 sequences x 1"):
        Batches(ds, 5, seed=4).load_state_dict(two_ranks[0].state_dict())
    with pytest.raises(ValueError, match="seed was 4, now 5"):
        Batches(ds, 3, seed=5).load_state_dict(two_ranks[0].state_dict())


def test_fewer_sequences_than_one_micro_batch_still_read_whole_epochs():
    ds = toy_dataset(5)
    seen = stream(ds, micro_batch=4, world_size=2, sequences=20)
    assert all(sorted(seen[e * 5 : (e + 1) * 5]) == list(range(5)) for e in range(4))


def test_eval_batches_cover_the_prefix_once_across_ranks():
    ds = toy_dataset(10)
    per_rank = [
        [i for b in eval_batches(ds, 3, max_sequences=8, rank=r, world_size=2) for i in seq_ids(b)]
        for r in (0, 1)
    ]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(8))
    assert per_rank[0] == [0, 1, 2, 6, 7]
