"""The built-in corpus: documents from a sparse random Markov chain, with an exact loss floor.

Tokens 0 .. V-2 are content, token V-1 ends a document (EOD). From a content token the next
token is EOD with probability q = 1 / mean_doc_len, else one of `branching` successors drawn
once per corpus, with Dirichlet weights. After EOD a new document starts from any content
token, with Dirichlet weights over all of them. Document lengths are therefore geometric
(mean 1/q content tokens), and the stream, EOD included, is itself a first-order Markov chain
over V states with transition matrix P. Every content token reaches EOD and EOD reaches every
content token, so P is irreducible; its entropy rate

    H = -sum_i pi_i sum_j P_ij ln P_ij        (pi: the stationary distribution, pi P = pi)

is the lowest loss any model can reach in expectation, in nats per token. A model that sees
the previous token reaches it, so a GPT can approach it from ln V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class MarkovCorpus:
    vocab_size: int = 512
    """Tokens in the vocabulary, the end-of-document token (the last id) included."""
    branching: int = 8
    """Successors of each content token (besides EOD); fewer means a lower floor."""
    mean_doc_len: float = 256.0
    """Mean document length in content tokens (EOD not counted); lengths are geometric."""
    seed: int = 0
    """Seeds the chain itself (successors and weights), not the samples drawn from it."""
    concentration: float = 1.0
    """Dirichlet parameter of the transition weights; larger means more even weights."""

    transitions: np.ndarray = field(init=False, repr=False)
    """P, (V, V) float64: P[i, j] = probability that token j follows token i."""
    stationary: np.ndarray = field(init=False, repr=False)
    """pi, (V,) float64: the long-run share of each token in the stream."""
    entropy_rate: float = field(init=False)
    """H in nats per token: the exact floor of the expected next-token loss."""

    def __post_init__(self):
        # P is held dense (V x V float64), which bounds the vocabulary.
        if not isinstance(self.vocab_size, int) or not 3 <= self.vocab_size <= 4096:
            raise ValueError(
                f"MarkovCorpus.vocab_size must be an int in [3, 4096], got {self.vocab_size!r}"
            )
        if not isinstance(self.branching, int) or not 1 <= self.branching <= self.vocab_size - 1:
            raise ValueError(
                f"MarkovCorpus.branching {self.branching!r} must be in [1, {self.vocab_size - 1}]"
            )
        if not self.mean_doc_len >= 1:
            raise ValueError(f"MarkovCorpus.mean_doc_len must be >= 1, got {self.mean_doc_len}")
        if not self.concentration > 0:
            raise ValueError(f"MarkovCorpus.concentration must be > 0, got {self.concentration}")
        rng = np.random.default_rng(self.seed)
        n, k, q = self.vocab_size - 1, self.branching, 1.0 / self.mean_doc_len
        # Successor table of content tokens: k distinct content tokens each, then EOD.
        succ = np.argsort(rng.random((n, n)), axis=1)[:, :k]
        weights = rng.dirichlet(np.full(k, self.concentration), size=n) * (1.0 - q)
        self._succ = np.concatenate([succ, np.full((n, 1), n)], axis=1)
        self._cdf = np.cumsum(np.concatenate([weights, np.full((n, 1), q)], axis=1), axis=1)
        start = rng.dirichlet(np.full(n, self.concentration))
        self._start_cdf = np.cumsum(start)

        P = np.zeros((n + 1, n + 1))
        np.put_along_axis(P[:n], self._succ, np.concatenate([weights, np.full((n, 1), q)], 1), 1)
        P[n, :n] = start
        self.transitions = P
        self.stationary = stationary_distribution(P)
        self.entropy_rate = markov_entropy_rate(P, self.stationary)

    @property
    def eod_token(self) -> int:
        """The id that ends each document."""
        return self.vocab_size - 1

    def generate(self, num_tokens: int, seed: int = 0) -> np.ndarray:
        """A stream of `num_tokens` tokens: whole documents, each followed by EOD.

        Many chains run side by side (numpy, one step per loop iteration), each started at a
        document boundary and stopped at the first EOD after its share of steps: that is a
        stopping time, so their concatenation is an exact sample of one chain started at a
        boundary. Seeded by (corpus seed, `seed`).
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        rng = np.random.default_rng((self.seed, seed))
        chains = int(max(1, min(8192, num_tokens // (8 * self.mean_doc_len))))
        steps = -(-num_tokens // chains)
        eod = self.eod_token
        rows = np.empty((chains, steps), dtype=np.uint16)
        state = np.full(chains, eod, dtype=np.int64)
        for t in range(steps):
            state = self._step(state, rng)
            rows[:, t] = state
        # Chains not yet at a document boundary run on, alone, to their next EOD.
        tails: list[list[np.ndarray]] = [[] for _ in range(chains)]
        active = np.flatnonzero(state != eod)
        state = state[active]
        tail_idx, tail_tok = [], []
        while active.size:
            state = self._step(state, rng)
            tail_idx.append(active)
            tail_tok.append(state.astype(np.uint16))
            keep = state != eod
            active, state = active[keep], state[keep]
        if tail_idx:
            idx, tok = np.concatenate(tail_idx), np.concatenate(tail_tok)
            order = np.argsort(idx, kind="stable")  # keeps each chain's tokens in time order
            idx, tok = idx[order], tok[order]
            bounds = np.searchsorted(idx, np.arange(chains + 1))
            for c in range(chains):
                if bounds[c + 1] > bounds[c]:
                    tails[c].append(tok[bounds[c] : bounds[c + 1]])
        parts = []
        for c in range(chains):
            parts.append(rows[c])
            parts.extend(tails[c])
        return np.concatenate(parts)[:num_tokens]

    def _step(self, state: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One transition of every chain in `state` (token ids, int64)."""
        u = rng.random(state.size)
        nxt = np.empty_like(state)
        at_eod = state == self.eod_token
        if at_eod.any():
            # searchsorted's "right" side: u in [cdf[j-1], cdf[j]) picks j; the clip guards
            # against a last cdf entry a rounding error below 1.
            nxt[at_eod] = np.minimum(
                np.searchsorted(self._start_cdf, u[at_eod], side="right"), self.eod_token - 1
            )
        inner = ~at_eod
        s = state[inner]
        cdf = self._cdf[s]
        j = np.minimum((u[inner, None] >= cdf).sum(axis=1), cdf.shape[1] - 1)
        nxt[inner] = self._succ[s, j]
        return nxt


def stationary_distribution(P: np.ndarray) -> np.ndarray:
    """pi with pi P = pi and sum(pi) = 1, for an irreducible transition matrix P."""
    n = P.shape[0]
    A = P.T - np.eye(n)
    A[-1] = 1.0  # replace one (redundant) balance equation by the normalisation
    b = np.zeros(n)
    b[-1] = 1.0
    pi = np.clip(np.linalg.solve(A, b), 0.0, None)
    return pi / pi.sum()


def markov_entropy_rate(P: np.ndarray, pi: np.ndarray | None = None) -> float:
    """-sum_i pi_i sum_j P_ij ln P_ij: nats per token of the chain with transition matrix P."""
    pi = stationary_distribution(P) if pi is None else pi
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(P > 0, P * np.log(P), 0.0)
    return float(-(pi @ plogp.sum(axis=1)))
