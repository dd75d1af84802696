"""N-gram machinery of lookahead decoding: the n-gram pool, the lookahead window, and
the per-step layout (token ids, position ids, 4-D attention mask, logits rows).

Algorithm: Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding", arXiv 2402.02057 (Sections 3.1–3.3).

Step layout (feed order), with ``p`` = tokens already in the KV cache, ``L = N − 1``:

    row 0                         last accepted token            position p
    rows 1 + l·W + j              window level l, column j       position p + 1 + l + j
                                  (l in 0..L−1, j in 0..W−1)
    rows 1 + L·W + i              verification trie node i       position p + 1 + depth(i)
                                  (the candidates merged by shared prefix)

Mask (over this step's columns; every cached column is visible to every row):

* row 0 sees itself;
* window token (l, j) sees row 0, level-0 tokens of columns 0..j, and the tokens of
  levels 1..l in its own column j — exactly the tokens at positions p .. p+1+l+j, so
  each column's levels form one n-gram trajectory (the paper's Fig. 2(b));
* trie node i sees row 0, its ancestors and itself (so a candidate token sees exactly
  the candidate's earlier tokens, as with one branch per candidate, but shared prefixes
  are fed once).

Logits are read at row 0, at the W last-level window rows (they extend each column's
trajectory to a full n-gram and become the next level), and at every trie node.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np



class NGramPool:
    """Per first token, up to G distinct (N−1)-token continuations; the most recent kept.

    Stored as flat arrays in the spirit of llama.cpp's lookahead example:
    ``grams`` int64 [vocab, G, N−1], ``stamp`` int64 [vocab, G] (insertion clock, 0 =
    empty). Inserting an existing continuation refreshes its stamp; inserting into a full
    row evicts the oldest.

    Args:
        vocab: vocabulary size (keys are token ids in ``[0, vocab)``).
        levels: N − 1, tokens per continuation.
        capacity: G, continuations kept per key (0 disables the pool).
    """

    def __init__(self, vocab: int, levels: int, capacity: int):
        self.levels = levels
        self.capacity = capacity
        self.grams = np.zeros((vocab, max(capacity, 1), levels), dtype=np.int64)
        self.stamp = np.zeros((vocab, max(capacity, 1)), dtype=np.int64)
        self.clock = 0

    def insert(self, key: int, continuation) -> None:
        """Add one n-gram ``(key, *continuation)``; ``continuation`` has N−1 token ids."""
        if self.capacity == 0:
            return
        self.clock += 1
        row = self.grams[key]
        stamps = self.stamp[key]
        cont = np.asarray(continuation, dtype=np.int64)
        same = np.flatnonzero((stamps > 0) & np.all(row == cont, axis=1))
        slot = int(same[0]) if same.size else int(np.argmin(stamps))
        row[slot] = cont
        stamps[slot] = self.clock

    def insert_sequence(self, tokens) -> None:
        """Add every n-gram of ``tokens`` (length ≥ N), oldest first."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n = self.levels + 1
        for i in range(len(tokens) - n + 1):
            self.insert(int(tokens[i]), tokens[i + 1: i + n])

    def candidates(self, key: int) -> np.ndarray:
        """Continuations for ``key``, most recent first: int64 [C, N−1], C ≤ G."""
        if self.capacity == 0:
            return np.zeros((0, self.levels), dtype=np.int64)
        stamps = self.stamp[key]
        order = np.argsort(-stamps, kind="stable")
        order = order[stamps[order] > 0]
        return self.grams[key, order]

    def __len__(self) -> int:
        return int(np.count_nonzero(self.stamp))


def chain_parents(n_candidates: int, levels: int) -> tuple:
    """Trie parents of ``n_candidates`` disjoint chains of ``levels`` tokens (no shared prefix)."""
    return tuple(-1 if k == 0 else c * levels + k - 1 for c in range(n_candidates) for k in range(levels))


@lru_cache(maxsize=4096)
def step_template(window: int, levels: int, parents: tuple):
    """Position offsets, step-local mask and logits rows for one layout (cached, read-only).

    Args:
        window: W.
        levels: N − 1.
        parents: the verification trie, node i's parent node index (−1: a child of the
            last accepted token); parents precede children.

    Returns:
        ``(offsets, mask, logit_rows)``: ``offsets`` int64 [step] (position − p),
        ``mask`` bool [step, step] (step-local part of the attention mask),
        ``logit_rows`` int64 [1 + W + nodes] (rows whose logits are read).
    """
    w, L = window, levels
    base = 1 + L * w
    step = base + len(parents)
    offsets = np.zeros(step, dtype=np.int64)
    mask = np.zeros((step, step), dtype=bool)
    mask[:, 0] = True
    win = lambda lev, col: 1 + lev * w + col  # noqa: E731 - row index of window token
    for lev in range(L):
        for col in range(w):
            r = win(lev, col)
            offsets[r] = 1 + lev + col
            mask[r, [win(0, j) for j in range(col + 1)]] = True
            mask[r, [win(k, col) for k in range(1, lev + 1)]] = True
    for node, parent in enumerate(parents):
        r = base + node
        offsets[r] = 1 if parent < 0 else offsets[base + parent] + 1
        mask[r, r] = True
        if parent >= 0:
            mask[r, base:] |= mask[base + parent, base:]
    logit_rows = np.concatenate([[0], [win(L - 1, j) for j in range(w)], np.arange(base, step)]).astype(np.int64)
    for arr in (offsets, mask, logit_rows):
        arr.setflags(write=False)
    return offsets, mask, logit_rows


def build_trie(candidates) -> tuple[list[int], tuple, dict]:
    """Merge candidate token sequences into a prefix tree.

    Args:
        candidates: sequences of token ids (any lengths ≥ 1), in priority order.

    Returns:
        ``(tokens, parents, children)``: one entry per trie node, parents before
        children; ``parents[i]`` is −1 for a first token; ``children`` maps
        ``(parent node, token)`` to the child node.
    """
    tokens: list[int] = []
    parents: list[int] = []
    children: dict = {}
    for cand in candidates:
        parent = -1
        for tok in cand:
            key = (parent, int(tok))
            node = children.get(key)
            if node is None:
                node = len(tokens)
                children[key] = node
                tokens.append(int(tok))
                parents.append(parent)
            parent = node
    return tokens, tuple(parents), children


@dataclasses.dataclass
class StepLayout:
    """Inputs of one lookahead step (batch 1) and what is needed to read its outputs.

    Attributes:
        input_ids: int64 [step].
        position_ids: int64 [step], ``past_len + offsets``.
        step_mask: bool [step, step], the step-local mask (cached template).
        logit_rows: int64 [n_logits].
        past_len: tokens in the KV cache.
        trie_tokens: token of each verification-trie node.
        trie_parents: parent node of each trie node (−1: follows the last token).
        window: W of the layout (0 for a plain greedy step).
        levels: N − 1 of the layout.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    step_mask: np.ndarray
    logit_rows: np.ndarray
    past_len: int
    trie_tokens: list
    trie_parents: tuple
    window: int = 0
    levels: int = 1

    @classmethod
    def single(cls, token: int, past_len: int) -> "StepLayout":
        """A plain greedy step: ``token`` at position ``past_len``, its logits read."""
        offsets, mask, rows = step_template(0, 1, ())
        return cls(np.asarray([token], dtype=np.int64), past_len + offsets, mask, rows, past_len, [], ())

    def children(self, node: int) -> list[tuple[int, int]]:
        """``[(token, child node)]`` of trie ``node`` (−1: the root, after the last
        token), in candidate priority order."""
        by_parent = self.__dict__.get("_by_parent")
        if by_parent is None:
            by_parent = {}
            for i, (parent, token) in enumerate(zip(self.trie_parents, self.trie_tokens)):
                by_parent.setdefault(parent, []).append((token, i))
            self.__dict__["_by_parent"] = by_parent
        return by_parent.get(node, [])

    def logit_row(self, node: int) -> int:
        """Index into the ``n_logits`` axis of trie ``node``'s logits (−1: row 0)."""
        return 0 if node < 0 else 1 + self.window + node

    @property
    def trie_base(self) -> int:
        """Row of the first verification-trie node: 1 + W·(N − 1)."""
        return 1 + self.window * self.levels

    @property
    def step(self) -> int:
        return len(self.input_ids)

    def attention_mask(self) -> np.ndarray:
        """bool [1, 1, step, past_len + step]: all cached columns visible, then the step mask."""
        full = np.ones((self.step, self.past_len + self.step), dtype=bool)
        full[:, self.past_len:] = self.step_mask
        return full[None, None]

    def feeds(self, batch: int = 1) -> dict:
        """Graph feeds (without the KV cache) for this step; ``batch`` copies of the row."""
        rep = lambda a: np.repeat(a[None], batch, axis=0)  # noqa: E731
        return {
            "input_ids": rep(self.input_ids),
            "position_ids": rep(self.position_ids),
            "attention_mask": np.repeat(self.attention_mask(), batch, axis=0),
            "logits_positions": rep(self.logit_rows),
        }


class HistoryIndex:
    """Where each short n-gram of the sequence ended, for prompt-lookup style candidates
    (Saxena 2023, "Prompt Lookup Decoding"): what followed earlier occurrences of the
    sequence's longest matching suffix (3, 2, then 1 tokens) is a strong guess in answers
    that repeat their prompt or themselves.

    The length of a continuation follows the strength of its match: a 3-token match keeps
    up to ``length`` tokens, a 2-token match half of them, a 1-token match at most 2 —
    weak matches rarely run long, and every proposed token widens the step.
    """

    MAX_MATCH = 3  # longest suffix matched: _index builds the 1-, 2- and 3-token n-grams
    ENDS_KEPT = 4  # most recent end positions remembered per n-gram

    def __init__(self):
        self.ends: dict = {}
        self.indexed = 0  # positions [0, indexed) are in the index

    @staticmethod
    def span(match: int, length: int) -> int:
        """Tokens proposed after a ``match``-token suffix match, for a budget of ``length``."""
        if match >= 3:
            return length
        if match == 2:
            return max(1, (length + 1) // 2)
        return min(length, 2)

    def _index(self, sequence: list) -> None:
        """Index the n-grams (1 to 3 tokens) ending at positions ``indexed … len − 2`` (every
        position but the last). Runs in the scheduler's planning, a prompt's whole length at
        its first step, so the n-grams are built from the last three tokens held in locals."""
        n = len(sequence)
        start = self.indexed
        if start >= n - 1:
            return
        ends_of, kept = self.ends, self.ENDS_KEPT
        b = sequence[start - 1] if start >= 1 else None  # the token before `end`
        a = sequence[start - 2] if start >= 2 else None  # the one before that
        for end in range(start, n - 1):
            c = sequence[end]
            keys = ((c,), (b, c), (a, b, c)) if end >= 2 else ((c,), (b, c)) if end == 1 else ((c,),)
            for key in keys:
                ends = ends_of.get(key)
                if ends is None:
                    ends_of[key] = [end]
                else:
                    ends.append(end)
                    if len(ends) > kept:
                        del ends[0]
            a, b = b, c
        self.indexed = n - 1

    def lookup(self, sequence: list, length: int, branches: int = 1, min_match: int = 1) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of the sequence's suffix: the longest
        match first, most recent occurrence first, each :meth:`span` tokens long.

        Args:
            sequence: every token so far (prompt and output).
            length: K, the most tokens of one continuation.
            branches: how many continuations (with distinct first tokens) to return.
            min_match: shortest suffix match (tokens) that counts.
        """
        self._index(sequence)
        n = len(sequence)
        found: list[list[int]] = []
        firsts = set()
        for m in range(min(self.MAX_MATCH, n), min_match - 1, -1):
            for end in reversed(self.ends.get(tuple(sequence[n - m:]), ())):
                cont = sequence[end + 1: min(end + 1 + self.span(m, length), n)]
                if cont and cont[0] not in firsts:
                    firsts.add(cont[0])
                    found.append(cont)
                    if len(found) >= branches:
                        return found
        return found
