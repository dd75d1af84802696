"""Lookahead width adapted to load: per pass, how wide each request's step is.

Lookahead decoding (Fu, Bailis, Stoica, Zhang, arXiv 2402.02057) buys fewer steps with
wider ones. Alone, a request's spare rows are nearly free where the step-cost curve is
flat; in a packed pass (:mod:`lade_export.scheduler`) every row is paid by every request
of the pass, so the rows a request spends on guesses must be paid by the tokens they
accept. :class:`AdaptiveWidth` decides, each pass, the width of every request's step from
two inputs, and :class:`ProfileWidth` keeps every request at its profile (the behaviour
before this module).

Width classes (:data:`WIDTHS`, narrowest first) of a request with profile (W, N, G, K),
each a :class:`~lade_export.lookahead.StepCap` the request's profile bounds:

=============== ====================== ======================================= ==========
class           cap (window, G, K)     rows                                    exists
=============== ====================== ======================================= ==========
``one-token``   (0, 0, 0)              1                                       always
``candidates``  (0, G, K)              1 + trie nodes                          W ≥ 1
``half-window`` (⌈W/2⌉, G, K)          1 + ⌈W/2⌉·(N−1) + trie nodes            W ≥ 2
``profile``     (W, G, K)              1 + W·(N−1) + trie nodes (≤ max_step)   always
=============== ====================== ======================================= ==========

The three wider classes verify the same trie (the same candidates), so one
``prepare`` gives every class's rows exactly: the scheduler prepares each decode step
once, at its profile (kept while the token budget defers it), and cuts the class the
policy picks from it (:func:`narrowed`; the same layout ``prepare`` builds with the cap).
A class with no more rows than a narrower one is dropped for that step (with no
candidates this step, a W = 0 profile has only ``one-token``). A step never exceeds its
profile: the profile is the upper bound.

Exactness. Greedy verification is exact at any width (every accepted token is the argmax
after exactly the accepted prefix), so a greedy request's output is the same whatever
widths its steps had, and the policy may narrow greedy requests freely. A capped step
keeps the lookahead state consistent: only the window columns it fed advance (a step
without window rows leaves the window as it is), fewer candidates are a smaller trie,
and the pool still learns every accepted n-gram. A sampled request's output for a seed
depends on the candidates it is shown (each one verified consumes a uniform draw of its
generator, :class:`~lade_export.sampling.SamplingRule`), and its window feeds later
candidates, so any narrowing would change its output against its solo run: sampled
requests always run their profile's step (they are counted in the pass's cost like any
other). Requests without lookahead are one-token steps.

Inputs:

* **The step-cost curve** ``cost(rows, context) = a + b·rows + c·rows·context`` seconds
  for a pass of ``rows`` rows over ``context`` cached tokens, fitted online from the
  scheduler's own decode passes (:class:`~lade_export.width_cost.OnlineCostCurve`) or
  fixed (:class:`~lade_export.width_cost.CostCurve`, importable from here too: the
  policy's argument); what it measures and how it is fitted: :mod:`lade_export.width_cost`.
* **Acceptance**: per request and width class, the chance ``α`` that a candidate token
  is accepted once its prefix was, from the request's recent steps of the class (and, in
  hindsight, those narrowed below it), shrunk toward every request's estimate (itself
  starting from :data:`PRIOR_ACCEPT`); a step whose trie is ``D`` tokens deep is expected
  to accept ``1 + α + … + α^D`` tokens (:class:`~lade_export.width_acceptance.Acceptance`,
  :mod:`lade_export.width_acceptance`). The estimate is myopic: it does not credit the
  n-grams a window's rows add to the pool, so the policy feeds window rows only at
  exploration steps (below) or where rows cost nothing.

Decision (:meth:`AdaptiveWidth.choose`), per pass with more than one decode step (a request
alone in its pass runs its profile's step, exactly what it does without a scheduler:
its profile was chosen for a lone request, and the myopic estimate would undervalue its
window): start every request at its narrowest class (greedy requests at a one-token
step: batched greedy), then repeatedly widen the request whose next class adds the most
expected tokens per extra second of the pass, while that marginal rate beats the pass's
current tokens per second by ``margin`` (5%) and the rows fit the token budget (rows the
curve prices at nothing are taken whenever they fit, even for no more expected tokens: a
window's rows add n-grams to the pool). This maximizes the pass's expected tokens per
second (greedily); the start is batched greedy and every move is expected to beat it, so the
policy does not lose to batched greedy unless its estimates are wrong (below: how they are
kept honest). At low load a request that accepts a lot keeps its profile's width; as passes
fill up the marginal rows cost more than they bring and requests fall back to one-token steps.
Exploration (``explore_every`` > 0; off by default since acceptance is measured in
hindsight): a request's first step, and one step after every ``explore_every`` narrower
ones, is its widest class whatever the estimate (budget permitting). On the int4 integer
path, where a row costs a sizeable share of a one-token pass, exploring every 32 steps cost
more than it brought (the figures: ``bench/results/design-figures.md``, *Adaptive width*).

Calibration. The requests the policy widens are those whose recent steps accepted the most,
and those regress: on SmolLM2's int4 engine, chat prompts at 2–8 requests, its widened
steps accepted 0.5–0.6 of the extra tokens expected of them, and the passes it widened made
fewer tokens per second than batched greedy's. So the policy keeps the ratio of extra tokens
its widened steps accepted to those it expected (decayed over ≈ 20 widened steps, starting
from 1 with the weight of :data:`CALIBRATION_PRIOR` tokens, clamped to [0.1, 2]:
:attr:`AdaptiveWidth.calibration`) and multiplies every expected gain by it. What it learnt
fades a little at every choice it makes (a pass where some request could widen:
:data:`CALIBRATION_THAW`), so a ratio learnt under one load is tried again later. The cost side is measured the same way: a pass size the
scheduler ran often is priced by its own recent passes, not by the fitted line
(:meth:`~lade_export.width_cost.OnlineCostCurve.__call__`).

Steps not prepared. Preparing a history-lookup step (looking its candidates up, building its
trie and layout) and cutting it down again is host work a batched greedy step does not do
(SmolLM2's int4 engine at 4 requests: ~0.7 ms a pass outside the engine against batched
greedy's ~0.45, of a ~5 ms pass), the main reason ``default-int4`` lost to batched greedy
there. So before a pass's steps are prepared, the
scheduler asks :meth:`AdaptiveWidth.worth_preparing` of each greedy request whose profile
has no Jacobi window, in a pass of several decode steps: if even the best case its acceptance allows (a single chain of ``d``
candidate tokens, ``d`` up to its profile's deepest, each accepted at its measured rate,
calibrated) could not beat the bar :meth:`choose` would set
(:meth:`AdaptiveWidth.preparation_bar`), its step is a one-token step and its
candidates are not looked up. One such step in ``PREPARE_EVERY`` (8) of a request is
prepared anyway, so its trie is judged in hindsight and its acceptance keeps being measured
(a request whose text turns repetitive is noticed). Greedy output is the same at any width,
so this changes no token; the history index catches up on the tokens it skipped at the next
lookup.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .errors import GenerationError
from .lookahead import ONE_TOKEN, StepCap
from .ngram import StepLayout, step_template
from .width_acceptance import Acceptance
from .width_cost import PRIOR_COST, CostCurve, OnlineCostCurve

__all__ = ["POLICY_NAMES", "PRIOR_ACCEPT", "PRIOR_COST", "WIDTHS", "Acceptance", "AdaptiveWidth", "CostCurve",
           "OnlineCostCurve", "Option", "ProfileWidth", "candidate_depth", "make_policy", "narrowed", "width_caps"]

#: Width classes, narrowest first.
WIDTHS = ("one-token", "candidates", "half-window", "profile")

#: Calibration (:attr:`AdaptiveWidth.calibration`): weight of its prior ratio 1.0, in extra
#: tokens; decay per widened step observed (memory ≈ 20 steps); decay per choice (a pass
#: where some request could widen: ≈ 350 of them without a widened step halve what was
#: measured, so a calibration learnt under one load is tried again later).
CALIBRATION_PRIOR = 2.0
CALIBRATION_MEMORY = 0.95
CALIBRATION_THAW = 0.998

#: Prior chance that a candidate token is accepted after its prefix was (before any request
#: ran the class; see :class:`~lade_export.width_acceptance.Acceptance`).
PRIOR_ACCEPT = {"candidates": 0.4, "half-window": 0.4, "profile": 0.4}


def width_caps(profile) -> list[tuple[str, StepCap]]:
    """The width classes of a lookahead profile, narrowest first, as ``(class, cap)``;
    a class whose cap would equal another's is left out (the profile's own step is always
    ``profile``: for W = 0 there is no ``candidates`` class, for W = 1 no ``half-window``).

    Args:
        profile: an enabled :class:`~lade_export.profile.LookaheadProfile` (W, N, G, K).
    """
    w, g, k = profile.window, profile.guesses, profile.lookup
    caps = [("one-token", ONE_TOKEN)]
    if w > 0 and (g > 0 or k > 0):
        caps.append(("candidates", StepCap(0, g, k)))
    if w >= 2:
        caps.append(("half-window", StepCap(math.ceil(w / 2), g, k)))
    full = StepCap(w, g, k)
    if full != ONE_TOKEN:
        caps.append(("profile", full))
    return caps


def candidate_depth(profile) -> int:
    """Tokens of a lookahead profile's deepest verification candidate: K of its history
    lookup, or N − 1 of its pool's n-grams when it keeps any (G > 0); 0 when it has neither."""
    return max(profile.lookup, profile.levels if profile.guesses > 0 else 0)


def narrowed(layout: StepLayout, cap: StepCap) -> StepLayout:
    """The step of class ``cap`` cut from ``layout``, the request's profile step of this
    pass (``LookaheadState.prepare`` without a cap): the same step ``prepare(last, past,
    cap)`` would build, without building the trie again.

    The classes of :func:`width_caps` other than ``profile`` are the profile's step with
    fewer window columns (its first ``cap.window``; 0: none) and the same trie (they keep
    the profile's G and K, so ``prepare`` would find the same candidates), or a one-token
    step (``ONE_TOKEN``: row 0 alone). Ids of the kept window columns and the trie are
    taken from ``layout``'s rows; positions, mask and logit rows are the layout template
    of the narrower step (:func:`lade_export.ngram.step_template`, the one ``prepare``
    uses).

    Args:
        layout: the profile's step: ids int64 [1 + W·(N−1) + nodes].
        cap: a class's cap from :func:`width_caps` of the request's profile (``ONE_TOKEN``
            or ``(w ≤ W, G, K)``).
    """
    bare = cap.window <= 0 and cap.guesses <= 0 and cap.lookup <= 0
    window = 0 if bare else min(max(cap.window, 0), layout.window)
    tokens, parents = ([], ()) if bare else (layout.trie_tokens, layout.trie_parents)
    levels, full = layout.levels, layout.window
    offsets, mask, logit_rows = step_template(window, levels, parents)
    rows = [0] + [1 + lev * full + j for lev in range(levels) for j in range(window)]
    ids = np.concatenate([layout.input_ids[rows], np.asarray(tokens, dtype=np.int64)]).astype(np.int64)
    return StepLayout(ids, layout.past_len + offsets, mask, logit_rows, layout.past_len, tokens, parents, window,
                      levels)


@dataclasses.dataclass(frozen=True)
class Option:
    """One width a request's step may take this pass.

    Attributes:
        width: its class (:data:`WIDTHS`).
        cap: the :class:`~lade_export.lookahead.StepCap` (None: the profile's own step).
        rows: rows of the step.
        tokens: expected tokens accepted by the step (≥ 1).
    """

    width: str
    cap: StepCap | None
    rows: int
    tokens: float


class ProfileWidth:
    """Every request's step is its profile's (no narrowing; the token budget only defers)."""

    name = "profile"  # the width_policy option that names it (make_policy)
    adaptive = False

    def observe_pass(self, rows: int, context: int, seconds: float) -> None:
        """A measured decode pass (unused)."""

    def __repr__(self) -> str:
        return "ProfileWidth()"


class AdaptiveWidth:
    """Per-pass widths from the step-cost curve and each request's acceptance (module docstring).

    Args:
        cost: the step-cost curve (default: a fresh :class:`OnlineCostCurve`); a
            :class:`CostCurve` makes the decision deterministic.
        margin: an extra class is taken when its tokens per extra second beat the pass's
            tokens per second by this fraction (≥ 0).
        memory: decay of the acceptance averages per step, in (0, 1).
        prior_steps: weight of the pooled prior in a request's estimate, in candidate tokens.
        prior: acceptance rate ``α`` of each class before any request ran it (default
            :data:`PRIOR_ACCEPT`).
        explore_every: a request's step is its widest class (when the budget lets it) once
            it has run this many narrower steps, and so is its first step (0, the default:
            never; greedy requests' acceptance of wide steps is measured in hindsight, see
            :meth:`Acceptance.resolve`). It bounds what exploration costs to one step in
            ``explore_every``.

    Raises:
        GenerationError: an option out of range.
    """

    name = "adaptive"  # the width_policy option that names it (make_policy)
    adaptive = True

    def __init__(self, cost: CostCurve | None = None, *, margin: float = 0.05, memory: float = 0.9,
                 prior_steps: float = 3.0, prior: dict | None = None, explore_every: int = 0):
        if not (0 <= margin < 10):
            raise GenerationError(f"margin must be in [0, 10), got {margin!r}")
        if not (0 < memory < 1):
            raise GenerationError(f"memory must be in (0, 1), got {memory!r}")
        if isinstance(explore_every, bool) or not isinstance(explore_every, int) or explore_every < 0:
            raise GenerationError(f"explore_every must be an integer ≥ 0, got {explore_every!r}")
        self.explore_every = explore_every
        self.cost = cost if cost is not None else OnlineCostCurve()
        self.margin = margin
        self.memory = memory
        self.prior_steps = prior_steps
        self._pooled = {k: [2.0 * v, 2.0 * (1.0 - v)] for k, v in {**PRIOR_ACCEPT, **(prior or {})}.items()}
        self._widened = [0.0, 0.0]  # decayed [extra tokens accepted, extra tokens expected] of widened steps
        self._bars: dict = {}  # (rows, tokens, depth) -> [uses left, need]

    @property
    def calibration(self) -> float:
        """Extra tokens the policy's widened steps accepted per extra token it expected of
        them (decayed; 1.0 before any, clamped to [0.1, 2]): the factor its expected gains
        are multiplied by in :meth:`choose` (the module docstring, *Calibration*)."""
        got, expected = self._widened
        w = CALIBRATION_PRIOR
        return min(max((got + w) / (expected + w), 0.1), 2.0)

    def observe_widened(self, expected: float, accepted: float) -> None:
        """A step this policy widened (chose a class above the request's narrowest) expected
        ``expected`` extra tokens over the narrowest class (uncalibrated, as its :class:`Option`
        said) and accepted ``accepted`` extra tokens (its tokens − the narrowest class's)."""
        got, exp = self._widened
        self._widened = [CALIBRATION_MEMORY * got + max(accepted, 0.0), CALIBRATION_MEMORY * exp + max(expected, 0.0)]

    def tracker(self) -> Acceptance:
        """A new request's acceptance record."""
        return Acceptance(self)

    def pooled(self, width: str) -> float:
        """``α`` of class ``width`` over every request's recent steps."""
        s, f = self._pooled[width]
        return s / (s + f)

    def observe_pooled(self, width: str, extra: int, rejected: float) -> None:
        """Fold one step into the pooled estimate (memory ≈ 50 steps)."""
        s, f = self._pooled[width]
        self._pooled[width] = [0.98 * s + extra, 0.98 * f + rejected]

    def observe_pass(self, rows: int, context: int, seconds: float) -> None:
        """A measured decode pass, for the cost curve."""
        self.cost.observe(rows, context, seconds)

    def preparation_bar(self, rows: int, tokens: float, context: int, depth: int) -> list[float]:
        """What a greedy lookahead request's best case must reach for its step to be worth
        preparing in a pass whose decode steps at their narrowest have ``rows`` rows and
        expect ``tokens`` tokens: ``need[d − 1]``, for a trie ``d`` tokens deep (``d`` ≤
        ``depth``), is the fewest expected extra tokens (uncalibrated) that ``d`` extra rows
        must bring to beat ``1 + margin`` times the pass's tokens per second — the lowest bar
        :meth:`choose` sets, rows costing least on the narrowest pass (the curve being convex
        or linear). Computed for a pass and reused by the next 15 passes of the same rows,
        tokens and depth (the curve, the context and the calibration move slowly);
        :meth:`worth_preparing` compares a request with it.

        Args:
            rows: rows of the pass's decode steps at their narrowest (≥ 1).
            tokens: tokens they expect (one per one-token step).
            context: cached tokens a row attends over (as :meth:`choose`'s).
            depth: the deepest trie to price (the pass's deepest profile candidate).
        """
        key = (rows, tokens, depth)
        kept = self._bars.get(key)
        if kept is not None and kept[0] > 0:  # the same pass shape lately: reused for 16 passes
            kept[0] -= 1
            return kept[1]
        bar = (1 + self.margin) * tokens / self.cost(rows, context) / self.calibration
        need = [bar * max(extra, 0.0) for extra in self.cost.extras(rows, depth, context)]
        self._bars[key] = [15, need]
        return need

    def worth_preparing(self, tracker: Acceptance, profile, need: list[float]) -> bool:
        """Whether a greedy lookahead request's step could be widened at all this pass: False
        when even its best case — its trie a single chain, ``d`` tokens deep for some ``d`` up
        to its profile's deepest candidate, each token accepted with its ``profile`` class
        rate ``α`` — expects fewer extra tokens than ``need[d − 1]`` (:meth:`preparation_bar`).
        Such a step is a one-token step whatever its candidates, so the scheduler need not
        look them up or build its trie (``Scheduler._prepare``). Profiles with a Jacobi window
        are always prepared (their window rows feed the pool and may be free).

        Args:
            tracker: the request's :class:`Acceptance`.
            profile: its :class:`~lade_export.profile.LookaheadProfile`.
            need: :meth:`preparation_bar` of the pass.
        """
        if profile.window > 0:
            return True
        depth = min(candidate_depth(profile), len(need))
        a = min(tracker.rate("profile"), 0.999)  # W = 0: "profile" is its only class above one token
        gain, term = 0.0, 1.0
        for d in range(depth):
            term *= a
            gain += term
            if gain > need[d]:
                return True
        return False

    def choose(self, menus: list, context: int, budget: int, trackers: list | None = None) -> list[int]:
        """The option index of every request for one pass.

        Args:
            menus: per request, its :class:`Option` list, narrowest first (rows increasing);
                a request with one option (sampled, greedy) keeps it.
            context: cached tokens in the pool (every row attends over them).
            budget: most rows of the pass; widening stays within it (the narrowest
                options alone may exceed it: the scheduler then defers steps).
            trackers: per request, its :class:`Acceptance` (for exploration; None: none).

        Returns:
            ``[index into menus[i]]``.
        """
        got, exp = self._widened  # every choice forgets a little: a calibration learnt under one load thaws
        self._widened = [CALIBRATION_THAW * got, CALIBRATION_THAW * exp]
        scale = self.calibration
        pick = [0] * len(menus)
        rows = sum(m[0].rows for m in menus)
        for i, menu in enumerate(menus):  # exploration first: requests due for their widest step
            if trackers is not None and len(menu) > 1 and trackers[i].due:
                extra = menu[-1].rows - menu[0].rows
                if rows + extra <= budget:
                    pick[i] = len(menu) - 1
                    rows += extra
        tokens = sum(m[0].tokens + scale * (m[k].tokens - m[0].tokens) for m, k in zip(menus, pick))
        cost = self.cost(rows, context)
        while True:
            best = None
            for i, menu in enumerate(menus):
                cur = menu[pick[i]]
                for j in range(pick[i] + 1, len(menu)):
                    opt = menu[j]
                    extra_rows = opt.rows - cur.rows
                    gain = scale * (opt.tokens - cur.tokens)
                    if extra_rows <= 0 or gain < 0 or rows + extra_rows > budget:
                        continue
                    extra_cost = self.cost.extra(rows, extra_rows, context)
                    if extra_cost > 0:
                        if gain <= 0:
                            continue
                        rate = gain / extra_cost
                    else:  # rows that cost nothing are taken: a window's rows feed the pool for free
                        rate = math.inf
                    if best is None or rate > best[0]:
                        best = (rate, i, j, extra_rows, gain, extra_cost)
            if best is None or best[0] <= (1 + self.margin) * tokens / cost:
                return pick
            _, i, j, extra_rows, gain, extra_cost = best
            pick[i] = j
            rows += extra_rows
            tokens += gain
            cost += extra_cost

    def __repr__(self) -> str:
        return f"AdaptiveWidth(cost={self.cost!r}, margin={self.margin})"


def make_policy(value):
    """A width policy from an option: ``"adaptive"`` (:class:`AdaptiveWidth` with an
    online cost curve), ``"profile"`` (:class:`ProfileWidth`), or a policy object.

    Raises:
        GenerationError: any other value.
    """
    for policy in (AdaptiveWidth, ProfileWidth):
        if value == policy.name:
            return policy()
    if isinstance(value, (AdaptiveWidth, ProfileWidth)) or hasattr(value, "choose"):
        return value
    raise GenerationError(f"width_policy must be {' or '.join(map(repr, POLICY_NAMES))}, got {value!r}")


#: The policies an option names (:func:`make_policy`), each its class's ``name``.
POLICY_NAMES = (AdaptiveWidth.name, ProfileWidth.name)
