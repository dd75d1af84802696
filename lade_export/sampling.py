"""Sampling for plain and lookahead decoding: temperature, top-k, top-p, and the
verification rule that keeps lookahead's sampled output distributed exactly as plain
sampling.

Filtering follows transformers' logits processors, in their order: temperature
(``logits / T``), then top-k (keep the k largest logits, ties at the k-th kept), then
top-p (nucleus sampling, Holtzman et al. 2020, arXiv 1904.09751: sorted by probability,
drop the least likely tokens whose cumulative mass is ≤ 1 − p, always keeping the most
likely one), then softmax. Temperature 0 means greedy decoding, and so does any
temperature below :data:`GREEDY_BELOW` (1e-5); ``SamplingParams()`` is that rule. (Whether
a request looks ahead is its profile's business: :data:`lade_export.profile.GREEDY` is
plain decoding, one token per step, greedy or sampled by these parameters.)

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
import numbers

import numpy as np

from .errors import GenerationError

#: Temperatures in (0, GREEDY_BELOW) are greedy decoding: at such a temperature sampling is
#: argmax but for ties, and below ~1e-300 ``logits / temperature`` overflows to infinity.
GREEDY_BELOW = 1e-5

#: Top-p looks at this many most likely tokens first and sorts the whole vocabulary only
#: when their mass is not enough to decide the nucleus (exact either way).
_NUCLEUS_PREFETCH = 1024


def is_real_number(value) -> bool:
    """A Python or numpy real number, not a boolean."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_integer_number(value) -> bool:
    """A Python or numpy integer, not a boolean."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def shown_value(value) -> str:
    """A refused value as the message shows it: numpy numbers as plain ones (``0.5``, not
    ``np.float32(0.5)``)."""
    if isinstance(value, np.generic):
        return repr(value.item())
    return repr(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from the model's logits.

    Numbers may be Python's or numpy's (``np.float32(0.7)``, ``np.int64(40)``); they are
    kept as Python ``float`` / ``int``. Booleans are not numbers here.

    Attributes:
        temperature: float ≥ 0. At or above :data:`GREEDY_BELOW` (1e-5) it samples from
            ``softmax(logits / temperature)``; 0, and any temperature below 1e-5, is greedy
            decoding.
        top_k: int, keep only the k most likely tokens (0: off).
        top_p: float, keep the smallest set of most likely tokens whose mass reaches p (1.0: off).
        seed: int or None, seed of the request's random generator (None: fresh entropy);
            the same seed on the same engine and backend gives the same output.

    Raises:
        GenerationError: on construction, a value out of range or of another type.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not is_real_number(t) or not np.isfinite(t) or t < 0:
            raise GenerationError(f"temperature must be a number ≥ 0, got {shown_value(t)}")
        if not is_integer_number(self.top_k) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer ≥ 0 (0: off), got {shown_value(self.top_k)}")
        p = self.top_p
        if not is_real_number(p) or not 0 < p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {shown_value(p)}")
        if self.seed is not None and (not is_integer_number(self.seed) or self.seed < 0):
            raise GenerationError(f"seed must be an integer ≥ 0, got {shown_value(self.seed)}")
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("seed", int)):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, kind(value))  # numpy numbers become Python's

    @property
    def greedy(self) -> bool:
        """True when this is greedy decoding (temperature 0 or below :data:`GREEDY_BELOW`)."""
        return self.temperature < GREEDY_BELOW

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


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a token is sampled from.

    Args:
        logits: float [vocab], one row of the engine's ``logits`` output.
        params: temperature (> 0), top-k, top-p.

    Returns:
        float64 [vocab], non-negative, summing to 1; zero outside the kept tokens.

    Raises:
        GenerationError: the logits hold NaN or +infinity (or ``logits / temperature``
            overflows, for a temperature far below :data:`GREEDY_BELOW`): no NaN reaches a
            token choice.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.asarray(logits, dtype=np.float64) / params.temperature
        vocab = x.shape[0]
        if 0 < params.top_k < vocab:
            kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
            x[x < kth] = -np.inf
        probs = np.exp(x - x.max())
    total = probs.sum()
    if not (np.isfinite(total) and total > 0):
        raise GenerationError("the model's logits are not finite (NaN or infinity); no token can be sampled from them")
    probs /= total
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
    normalized): inverse CDF of one uniform draw; zero-probability tokens are never drawn.

    Raises:
        GenerationError: the total is not a finite positive number (NaN, or all zero).
    """
    cum = np.cumsum(probs)
    if not (np.isfinite(cum[-1]) and cum[-1] > 0):
        raise GenerationError("no token has a finite positive probability; cannot sample")
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
