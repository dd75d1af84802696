"""The decoding algorithm as an object: one state per request, driven by the decoding loop.

Life cycle of one decode step (the loop in :mod:`lade_export.runtime` is only this)::

    layout  = state.prepare(last_token, past_len)      # what to feed
    outputs = engine.run({**layout.feeds(), **cache.feeds()})
    verdict = state.update(layout, outputs)            # what was accepted, what to cache
    cache.append(outputs, verdict.kept_rows, layout.step)  # unless verdict.stop_reason

:class:`GreedyState` is plain greedy decoding (one token per step);
:class:`LookaheadState` is lookahead decoding (Fu, Bailis, Stoica, Zhang, "Break the
Sequential Dependency of LLM Inference Using Lookahead Decoding", arXiv 2402.02057):
it owns the sequence, the Jacobi window, the n-gram pool and the history index, and
its greedy verification is exact — every accepted token is the argmax the model gives
after exactly the accepted prefix, so the output equals plain greedy output.

Both share :class:`StopRules` (stop token ids, ``max_new_tokens``, and a per-token text
check for stop strings), applied token by token inside an accepted block, so a stop in
the middle of a block ends the output exactly where greedy decoding would, and a decoding
rule from :mod:`lade_export.sampling` — :class:`~lade_export.sampling.GreedyRule` (argmax;
candidates accepted when equal to it) or :class:`~lade_export.sampling.SamplingRule`
(temperature, top-k, top-p; candidates accepted by the rule that keeps plain sampling's
distribution). The Jacobi window always advances on the argmax predictions.

A step may be narrower than its profile (:class:`StepCap`, chosen per step by the
scheduler's width policy, :mod:`lade_export.width_policy`): fewer window columns (only
those advance; the others keep their tokens), fewer pool candidates, shorter history
continuations, down to a one-token step. Verification is unchanged, so a greedy output
is the same whatever caps its steps had; without a cap a step is its profile's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .ngram import HistoryIndex, NGramPool, StepLayout, build_trie, step_template
from .profile import GREEDY, LookaheadProfile, request_profile
from .sampling import GreedyRule, SamplingParams, new_rule


@dataclasses.dataclass
class Verdict:
    """What one decode step decided.

    Attributes:
        accepted: token ids emitted this step, in order (≥ 1), already cut by the stop rules.
        kept_rows: step rows whose keys/values join the KV cache, one per accepted token
            (row 0 and the matched trie nodes); None means every row (a plain step).
        stop_reason: ``"stop_token" | "stop_string" | "max_new_tokens"`` when the
            generation ends with this step, else None.
    """

    accepted: list[int]
    kept_rows: np.ndarray | None
    stop_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class StepCap:
    """Upper bounds of one lookahead step, below its profile's (each is clipped to it).

    Attributes:
        window: Jacobi window columns fed and advanced (0: no window rows; the window is
            left as it is).
        guesses: n-gram pool candidates verified (0: none).
        lookup: tokens of a history-lookup candidate, K (0: no history lookup).

    ``StepCap(0, 0, 0)`` is a one-token step: the last token alone, its argmax (or draw)
    the next token.
    """

    window: int
    guesses: int
    lookup: int


#: A one-token step.
ONE_TOKEN = StepCap(0, 0, 0)


class StopRules:
    """When a generation ends, checked token by token.

    Args:
        stop_token_ids: ids that end generation (the stop token is emitted, nothing after).
        max_new_tokens: most tokens to emit (≥ 1).
        on_token: optional ``callable(token_id) -> bool``, called for every emitted token
            in order; True means a stop string just completed (see
            :class:`lade_export.detokenize.TextStream`).
    """

    def __init__(self, stop_token_ids=(), max_new_tokens: int = 1 << 62, on_token: Callable[[int], bool] | None = None):
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_new_tokens = max_new_tokens
        self.on_token = on_token
        self.emitted = 0

    def cut(self, proposed: list[int]) -> tuple[list[int], str | None]:
        """The prefix of ``proposed`` that is emitted, and the stop reason if one fired."""
        out = []
        for token in proposed:
            out.append(token)
            self.emitted += 1
            if token in self.stop_token_ids:
                return out, "stop_token"
            if self.on_token is not None and self.on_token(token):
                return out, "stop_string"
            if self.emitted >= self.max_new_tokens:
                return out, "max_new_tokens"
        return out, None


class GreedyState:
    """Plain decoding, one token per step: the last token is fed and the rule picks the next
    (greedy: the argmax; sampling: a draw from the filtered distribution).

    Args:
        prompt_ids: the prompt's token ids.
        rules: stop rules (default: none).
        rule: the decoding rule (default: :class:`~lade_export.sampling.GreedyRule`).
    """

    def __init__(self, prompt_ids, rules: StopRules | None = None, rule=None):
        self.sequence = [int(t) for t in prompt_ids]
        self.rules = rules or StopRules()
        self.rule = rule or GreedyRule()

    @property
    def needs_logits(self) -> bool:
        """Whether :meth:`update` reads ``logits`` (sampling) or only ``next_token_ids``."""
        return self.rule.needs_logits

    def prepare(self, last_token: int, past_len: int) -> StepLayout:
        """One token at position ``past_len``; its logits row is read."""
        return StepLayout.single(last_token, past_len)

    def verify(self, layout: StepLayout, outputs: dict) -> tuple[list[int], np.ndarray | None]:
        """The rule's choice after the last token (logits row 0)."""
        return [self.rule.choose(outputs, 0, [])[0]], None

    def update(self, layout: StepLayout, outputs: dict) -> Verdict:
        """Verify the step's outputs, apply the stop rules, extend the sequence.

        Args:
            layout: what :meth:`prepare` returned for this step.
            outputs: the engine's outputs for it (``next_token_ids`` int64 [1, n_logits];
                ``logits`` float [1, n_logits, vocab] when :attr:`needs_logits`).
        """
        proposed, kept = self.verify(layout, outputs)
        accepted, reason = self.rules.cut(proposed)
        if kept is not None:
            kept = kept[: len(accepted)]
        self.observe(accepted)
        return Verdict(accepted, kept, reason)

    def observe(self, accepted: list[int]) -> None:
        """Append newly accepted tokens to the sequence."""
        self.sequence += accepted


class LookaheadState(GreedyState):
    """Window, pool and history of one lookahead generation.

    Args:
        profile: the lookahead profile (W, N, G, K).
        vocab: vocabulary size.
        prompt_ids: the prompt's token ids (window initialisation, pool seeding, history).
        rules: stop rules (default: none).
        rule: the decoding rule that verifies candidates (default: greedy).
        seed: seed of the window's initial draw from the prompt tokens.
    """

    def __init__(self, profile: LookaheadProfile, vocab: int, prompt_ids, rules: StopRules | None = None,
                 rule=None, seed: int = 0):
        super().__init__(prompt_ids, rules, rule)
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
        self.history = HistoryIndex()

    def candidates(self, last_token: int, cap: StepCap | None = None) -> list:
        """Verification candidates after ``last_token``: the history-lookup continuations
        (up to ``lookup_branches`` of up to K tokens, when the profile has ``lookup`` > 0),
        then the pool's (N−1)-grams, most recent first. ``cap`` bounds K (``cap.lookup``)
        and the pool candidates kept (the first ``cap.guesses``)."""
        lookup = self.profile.lookup if cap is None else min(cap.lookup, self.profile.lookup)
        cands = []
        if lookup and self.sequence and self.sequence[-1] == last_token:
            cands += self.history.lookup(self.sequence, lookup, self.profile.lookup_branches,
                                         self.profile.lookup_min_match)
        pooled = self.pool.candidates(last_token)
        if cap is not None:
            pooled = pooled[:max(cap.guesses, 0)]
        cands += [list(c) for c in pooled]
        return cands

    def prepare(self, last_token: int, past_len: int, cap: StepCap | None = None) -> StepLayout:
        """Layout of the next step: ``last_token`` at position ``past_len``, the window,
        and the verification trie of :meth:`candidates`.

        Args:
            last_token: the last accepted token (row 0).
            past_len: tokens in the KV cache (row 0's position).
            cap: optional bounds below the profile (:class:`StepCap`): only the first
                ``min(cap.window, W)`` window columns are fed (and advanced by
                :meth:`verify`), and the candidates are bounded as in :meth:`candidates`.
                None: the profile's full step.
        """
        window = self.profile.window if cap is None else min(max(cap.window, 0), self.profile.window)
        bare = cap is not None and window == 0 and cap.guesses <= 0 and cap.lookup <= 0
        tokens, parents, _ = build_trie([] if bare else self.candidates(last_token, cap))  # bare: one token
        offsets, mask, logit_rows = step_template(window, self.levels, parents)
        columns = self.window if window == self.profile.window else self.window[:, :window]
        ids = np.concatenate([[last_token], columns.reshape(-1), tokens]).astype(np.int64)
        return StepLayout(ids, past_len + offsets, mask, logit_rows, past_len, tokens, parents, window, self.levels)

    def verify(self, layout: StepLayout, outputs: dict) -> tuple[list[int], np.ndarray]:
        """Verification of the trie, then the window update.

        Walking the trie from its root (the last token), the rule chooses the token after
        the current node among the node's children (the candidates): greedy takes the
        argmax and accepts the child equal to it; sampling accepts a child with the
        probability that keeps plain sampling's distribution
        (:class:`lade_export.sampling.SamplingRule`). An accepted child's row joins the
        cache and the walk continues from it; otherwise the chosen token ends the step.
        So at least one token is accepted, and with greedy the longest verified prefix
        among all candidates wins. Then the window's column trajectories plus the last
        level's argmax predictions go into the pool as n-grams, the levels shift up and
        the predictions become the last level (the paper's Algorithm 1).

        A step with neither window nor trie (a one-token step) is verified as
        :class:`GreedyState` verifies one: the same choice, its one row kept (None).

        Returns:
            ``(proposed tokens, kept rows)`` before the stop rules.
        """
        if layout.window == 0 and not layout.trie_tokens:
            return [self.rule.choose(outputs, 0, [])[0]], None
        accepted: list[int] = []
        kept = [0]
        node = -1
        while True:
            token, child = self.rule.choose(outputs, layout.logit_row(node), layout.children(node))
            accepted.append(token)
            if child is None:
                break
            kept.append(layout.trie_base + child)
            node = child
        w = layout.window
        if w:
            self._advance_window(outputs["next_token_ids"][0, 1: 1 + w])
        return accepted, np.asarray(kept, dtype=np.int64)

    def _advance_window(self, last_level_preds: np.ndarray) -> None:
        """Pool the column n-grams of the step's w ≤ W window columns (levels 0..N−2 plus
        the predictions, int64 [w]) and shift those columns' levels; the other columns
        keep their tokens (a capped step fed only the first w)."""
        w = last_level_preds.shape[0]
        if w == 0:
            return
        grams = np.concatenate([self.window[:, :w], last_level_preds[None, :]], axis=0)  # [N, w]
        for j in range(w):
            self.pool.insert(int(grams[0, j]), grams[1:, j])
        self.window[:, :w] = grams[1:]

    def observe(self, accepted: list[int]) -> None:
        """Append newly accepted tokens to the sequence and add the n-grams that end in
        them to the pool (they are verified text)."""
        super().observe(accepted)
        if self.pool.capacity == 0:  # G = 0: the pool keeps nothing
            return
        n = self.levels + 1
        tail = self.sequence[-(n - 1 + len(accepted)):]
        self.pool.insert_sequence(tail)


def new_state(profile: LookaheadProfile | None, vocab: int, prompt_ids, rules: StopRules | None = None,
              sampling: SamplingParams | None = None):
    """The state for a request: :class:`GreedyState` for plain greedy decoding
    (:data:`~lade_export.profile.GREEDY`, or any spelling of it
    :func:`~lade_export.profile.request_profile` takes), else :class:`LookaheadState`;
    deciding by ``sampling`` (None or temperature 0: greedy)."""
    rule = new_rule(sampling)
    profile = request_profile(profile)
    if profile is GREEDY:
        return GreedyState(prompt_ids, rules, rule)
    return LookaheadState(profile, vocab, prompt_ids, rules, rule)
