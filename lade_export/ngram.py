"""N-gram machinery of lookahead decoding: the n-gram pool, the lookahead window, and
the per-step layout (token ids, position ids, 4-D attention mask, logits rows).

Algorithm: Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding", arXiv 2402.02057 (Sections 3.1–3.3).

Step layout (feed order), with ``p`` = tokens already in the KV cache, ``L = N − 1``:

    row 0                         last accepted token            position p
    rows 1 + l·W + j              window level l, column j       position p + 1 + l + j
                                  (l in 0..L−1, j in 0..W−1)
    rows 1 + L·W + c·L + k        candidate c, token k           position p + 1 + k
                                  (c in 0..C−1, k in 0..L−1)

Mask (over this step's columns; every cached column is visible to every row):

* row 0 sees itself;
* window token (l, j) sees row 0, level-0 tokens of columns 0..j, and the tokens of
  levels 1..l in its own column j — exactly the tokens at positions p .. p+1+l+j, so
  each column's levels form one n-gram trajectory (the paper's Fig. 2(b));
* candidate token (c, k) sees row 0 and candidate c's tokens 0..k.

Logits are read at row 0, at the W last-level window rows (they extend each column's
trajectory to a full n-gram and become the next level), and at every candidate row.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from .profile import LookaheadProfile


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


@lru_cache(maxsize=256)
def step_template(window: int, levels: int, n_candidates: int):
    """Position offsets, step-local mask and logits rows for one layout (cached, read-only).

    Returns:
        ``(offsets, mask, logit_rows)``: ``offsets`` int64 [step] (position − p),
        ``mask`` bool [step, step] (step-local part of the attention mask),
        ``logit_rows`` int64 [1 + W + C·L] (rows whose logits are read).
    """
    w, L, c = window, levels, n_candidates
    step = 1 + L * w + c * L
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
    base = 1 + L * w
    for cand in range(c):
        for k in range(L):
            r = base + cand * L + k
            offsets[r] = 1 + k
            mask[r, base + cand * L: r + 1] = True
    logit_rows = np.concatenate([[0], [win(L - 1, j) for j in range(w)], np.arange(base, step)]).astype(np.int64)
    for arr in (offsets, mask, logit_rows):
        arr.setflags(write=False)
    return offsets, mask, logit_rows


@dataclasses.dataclass
class StepLayout:
    """Inputs of one lookahead step (batch 1) and what is needed to read its outputs.

    Attributes:
        input_ids: int64 [step].
        position_ids: int64 [step], ``past_len + offsets``.
        step_mask: bool [step, step], the step-local mask (cached template).
        logit_rows: int64 [n_logits].
        past_len: tokens in the KV cache.
        candidates: int64 [C, N−1] verification candidates fed this step.
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    step_mask: np.ndarray
    logit_rows: np.ndarray
    past_len: int
    candidates: np.ndarray

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


@dataclasses.dataclass
class Verdict:
    """What one lookahead step decided.

    Attributes:
        accepted: token ids accepted this step, in order (1 ≤ len ≤ N).
        kept_rows: step rows whose keys/values join the cache (row 0 and the matched
            candidate tokens), same length as ``accepted``.
    """

    accepted: list[int]
    kept_rows: np.ndarray


class LookaheadState:
    """Window and pool of one generation; builds each step and digests its outputs.

    Args:
        profile: the (W, N, G) profile.
        vocab: vocabulary size.
        prompt_ids: the prompt's token ids (window initialisation, pool seeding).
        seed: seed of the window's initial draw from the prompt tokens.
    """

    def __init__(self, profile: LookaheadProfile, vocab: int, prompt_ids, seed: int = 0):
        self.profile = profile
        self.levels = profile.levels
        self.pool = NGramPool(vocab, self.levels, profile.guesses)
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        rng = np.random.default_rng(seed)
        source = prompt if prompt.size else np.zeros(1, dtype=np.int64)
        # Window [N−1, W]: initial guesses drawn from the prompt's tokens (as in the paper).
        self.window = rng.choice(source, size=(self.levels, profile.window)).astype(np.int64)
        if profile.seed_pool_from_prompt:
            self.pool.insert_sequence(prompt)
        self._layout: StepLayout | None = None

    def build_step(self, last_token: int, past_len: int) -> StepLayout:
        """Layout of the next step: ``last_token`` at position ``past_len``, the window,
        and the pool's candidates keyed by ``last_token``."""
        cands = self.pool.candidates(last_token)
        offsets, mask, logit_rows = step_template(self.profile.window, self.levels, len(cands))
        ids = np.concatenate([[last_token], self.window.reshape(-1), cands.reshape(-1)]).astype(np.int64)
        self._layout = StepLayout(ids, past_len + offsets, mask, logit_rows, past_len, cands)
        return self._layout

    def digest(self, next_ids: np.ndarray) -> Verdict:
        """Consume the step's greedy predictions and return what is accepted.

        Args:
            next_ids: int64 [n_logits], argmax at ``logit_rows`` of the last built step.

        Verification: the model's prediction after the last token, ``t``, is always
        accepted; candidate c matches while its token k equals the prediction made at
        its token k−1 (``t`` for k = 0); the candidate with the longest match wins (the
        first one on a tie) and its predictions are accepted too. Then the window's
        column trajectories plus the last level's predictions go into the pool as
        n-grams, the levels shift up and the predictions become the last level.
        """
        layout = self._layout
        w, L = self.profile.window, self.levels
        t = int(next_ids[0])
        last_level_pred = next_ids[1: 1 + w]
        cand_pred = next_ids[1 + w:].reshape(-1, L)
        accepted = [t]
        kept = [0]
        if len(layout.candidates):
            expected = np.concatenate([np.full((len(cand_pred), 1), t), cand_pred[:, :-1]], axis=1)
            run = np.cumprod(layout.candidates == expected, axis=1).sum(axis=1)
            best = int(np.argmax(run))
            m = int(run[best])
            if m:
                accepted += [int(x) for x in cand_pred[best, :m]]
                base = 1 + L * w + best * L
                kept += list(range(base, base + m))
        # New n-grams: (level 0, …, level L−1, prediction) along each column.
        grams = np.concatenate([self.window, last_level_pred[None, :]], axis=0)  # [N, W]
        for j in range(w):
            self.pool.insert(int(grams[0, j]), grams[1:, j])
        self.window = grams[1:].copy()
        return Verdict(accepted, np.asarray(kept, dtype=np.int64))

    def observe_output(self, tokens) -> None:
        """Add the n-grams that end in newly accepted output (``tokens`` = the last
        N−1+k tokens of the sequence, k new) to the pool; they are verified text."""
        self.pool.insert_sequence(tokens)
