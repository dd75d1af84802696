"""Sampling for plain and lookahead decoding: temperature, top-k, top-p, and the
verification rule that keeps lookahead's sampled output distributed exactly as plain
sampling.

Filtering follows transformers' logits processors, in their order: temperature
(``logits / T``), then top-k (keep the k largest logits, ties at the k-th kept), then
top-p (nucleus sampling, Holtzman et al. 2020, arXiv 1904.09751: sorted by probability,
drop the least likely tokens whose cumulative mass is ≤ 1 − p, always keeping the most
likely one), then softmax. Temperature 0 means greedy decoding.

Verification (:class:`SamplingRule`): lookahead's verification candidates are
deterministic drafts — n-grams from the pool and the history lookup, i.e. proposal
distributions that put all mass on one token. At a trie node whose children (distinct
tokens, in priority order) are the candidates, with the model's filtered distribution
``P`` at that node:

    for each candidate c:   accept c with probability P(c) / Σ P          (u ~ U[0, 1))
                            on rejection set P(c) = 0 (the residual distribution)
    if none was accepted:   sample the token from the residual P

This is speculative sampling's accept/reject rule (Leviathan et al. 2023, arXiv
2211.17192; Chen et al. 2023, arXiv 2302.01318) applied to several drafts in turn, as in
SpecInfer's multi-draft verification (Miao et al. 2024, arXiv 2305.09781) and lookahead
decoding's sampling verification (Fu et al. 2024, arXiv 2402.02057, Section 3.4): with a
one-hot draft ``q = δ_c`` the acceptance probability ``min(1, P(c)/q(c))`` is ``P(c)`` and
the residual ``norm(max(0, P − q))`` is ``P`` with ``c`` removed, so each emitted token
has exactly the distribution ``P`` of plain sampling. An accepted candidate moves the walk
to its trie node, where the same rule runs on the model's distribution after it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import GenerationError

#: Top-p looks at this many most likely tokens first and sorts the whole vocabulary only
#: when their mass is not enough to decide the nucleus (exact either way).
_NUCLEUS_PREFETCH = 1024


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from the model's logits.

    Attributes:
        temperature: > 0 samples from ``softmax(logits / temperature)``; 0 is greedy decoding.
        top_k: keep only the k most likely tokens (0: off).
        top_p: keep the smallest set of most likely tokens whose mass reaches p (1.0: off).
        seed: seed of the request's random generator (None: fresh entropy); the same seed
            on the same engine and backend gives the same output.

    Raises:
        GenerationError: on construction, a value out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise GenerationError(f"temperature must be a number ≥ 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer ≥ 0 (0: off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise GenerationError(f"seed must be an integer ≥ 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when this is greedy decoding (temperature 0)."""
        return self.temperature == 0

    def describe(self) -> str:
        """A short label, e.g. ``sampling T=0.8 top-p 0.9 seed 3`` or ``greedy``."""
        if self.greedy:
            return "greedy"
        parts = [f"sampling T={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        if self.seed is not None:
            parts.append(f"seed {self.seed}")
        return " ".join(parts)


GREEDY = SamplingParams()


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a token is sampled from.

    Args:
        logits: float [vocab], one row of the engine's ``logits`` output.
        params: temperature (> 0), top-k, top-p.

    Returns:
        float64 [vocab], non-negative, summing to 1; zero outside the kept tokens.
    """
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    vocab = x.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        probs[_outside_nucleus(probs, params.top_p)] = 0.0
        probs /= probs.sum()
    return probs


def _outside_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices removed by top-p: in ascending order of probability, those whose cumulative
    mass is ≤ 1 − top_p (the most likely token always stays)."""
    drop_mass = 1.0 - top_p
    vocab = probs.shape[0]
    if vocab > _NUCLEUS_PREFETCH:
        top = np.argpartition(probs, vocab - _NUCLEUS_PREFETCH)[vocab - _NUCLEUS_PREFETCH:]
        rest = 1.0 - probs[top].sum()
        if rest <= drop_mass:  # every token outside `top` is dropped; decide inside `top` only
            order = top[np.argsort(probs[top], kind="stable")]
            cum = rest + np.cumsum(probs[order])
            keep = np.zeros(vocab, dtype=bool)
            remove = cum <= drop_mass
            remove[-1] = False
            keep[order[~remove]] = True
            return np.flatnonzero(~keep)
    order = np.argsort(probs, kind="stable")
    remove = np.cumsum(probs[order]) <= drop_mass
    remove[-1] = False
    return order[remove]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token drawn from ``probs`` (float [vocab], non-negative, not necessarily
    normalized): inverse CDF of one uniform draw; zero-probability tokens are never drawn."""
    cum = np.cumsum(probs)
    return int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))


class SamplingRule:
    """Chooses tokens by sampling and verifies lookahead candidates with the accept/reject
    rule in the module docstring. One per request (it owns the request's random generator).

    Args:
        params: sampling parameters (temperature > 0).

    Attributes:
        checked: candidate tokens tested so far; accepted: how many of them were accepted.
    """

    needs_logits = True

    def __init__(self, params: SamplingParams):
        if params.greedy:
            raise GenerationError("SamplingRule needs temperature > 0 (temperature 0 is greedy decoding)")
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.checked = 0
        self.accepted = 0

    def choose(self, outputs: dict, row: int, children: list) -> tuple[int, int | None]:
        """The token after the trie node read at logits ``row``.

        Args:
            outputs: engine outputs with ``logits`` float [1, n_logits, vocab].
            row: index into ``n_logits`` of the node's logits (0: after the last token).
            children: ``[(token, child node)]``, the node's candidates in priority order.

        Returns:
            ``(token, child node)`` when a candidate is accepted, else ``(sampled token, None)``.
        """
        probs = filtered_probs(outputs["logits"][0, row], self.params)
        total = 1.0
        for token, child in children:
            self.checked += 1
            p = probs[token]
            if p > 0 and self.rng.random() * total < p:
                self.accepted += 1
                return token, child
            probs[token] = 0.0
            total -= p
        return sample(probs, self.rng), None


class GreedyRule:
    """Greedy decoding: the argmax (the engine's ``next_token_ids``) is the token; a
    candidate is accepted when it equals it (exact: output = plain greedy output)."""

    needs_logits = False

    def __init__(self):
        self.checked = 0
        self.accepted = 0

    def choose(self, outputs: dict, row: int, children: list) -> tuple[int, int | None]:
        """See :meth:`SamplingRule.choose`; reads ``next_token_ids`` int64 [1, n_logits]."""
        token = int(outputs["next_token_ids"][0, row])
        self.checked += len(children)
        for cand, child in children:
            if cand == token:
                self.accepted += 1
                return token, child
        return token, None


def new_rule(params: SamplingParams | None):
    """:class:`GreedyRule` for None or temperature 0, else :class:`SamplingRule`."""
    if params is None or params.greedy:
        return GreedyRule()
    return SamplingRule(params)
