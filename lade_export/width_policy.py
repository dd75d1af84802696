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
policy picks from it (:func:`narrowed`; the same layout ``prepare`` builds with the cap). A class with no more rows than a narrower
one is dropped for that step (with no candidates this step, a W = 0 profile has only
``one-token``). A step never exceeds its profile: the profile is the upper bound.

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
  for a pass of ``rows`` rows, measured from the start of its planning to the end of its
  commit (the engine's run and the host work around it: every request's ``prepare``,
  the packing, each request's verification, text and stop checks; a lookahead step's host
  work is part of what its rows cost), whose rows attend over ``context`` cached tokens: the whole
  pool where every row's scores span it (the compact pool), the pass's mean request cache
  length where each request holds a region and the engine's attention skips the others'
  (``Scheduler._attended``).
  :class:`OnlineCostCurve` fits it online from the scheduler's own decode passes (rows,
  pool tokens, seconds), not from probe passes at load: probes would lengthen every
  load, and on a shared machine a few probes measure the neighbours' load of that moment,
  while the scheduler's passes measure the very engine, threads and contexts it serves
  with, and keep doing so as load and contexts change. Until the passes have spanned a few
  widths, a prior shape stands in (``a = 1, b = 0.17, c = 5e-4`` one-token-step units:
  the lade int8 kernels' curve on SmolLM2 at 256 and 1024 cached tokens in
  ``bench/results/step-costs.md``), scaled to the measured seconds. The fit is weighted
  least squares over the last 256 decode passes plus the prior's pseudo-passes, refitted
  after 2, 4, 8 … passes and then every 64, lazily (when a choice needs it), with passes more than 3 MADs above the fit dropped (a preempted pass
  on a shared machine) and coefficients kept ≥ 0. :class:`CostCurve` is a fixed curve
  (deterministic: tests inject one).
* **Acceptance**: per request and width class, the chance ``α`` that a candidate token
  is accepted once its prefix was, estimated from the request's recent steps of that class
  — the steps it ran at that class, and, in hindsight, the steps that were narrowed below
  it: a greedy request's continuation is the same whatever widths its steps had, so once
  its next tokens are known, the trie a one-token step left unverified is scored with
  what verifying it would have accepted (:meth:`Acceptance.resolve`), measuring wide
  steps' acceptance without spending their rows —
  (exponentially decayed, memory ≈ 10 steps, :class:`Acceptance`) and shrunk toward the
  estimate over every request's recent steps of the class (itself starting from
  :data:`PRIOR_ACCEPT`); a step whose trie is ``D`` tokens deep is then expected to accept
  ``1 + α + … + α^D`` tokens (this step's trie: a request with a long history match is
  worth more rows than one with a 1-token pool guess). A one-token step, or a step with
  no candidates, accepts exactly 1. The estimate is myopic: it credits a step with the
  tokens it accepts, not with the n-grams its window rows add to the pool for later
  steps; the window classes verify the same trie as ``candidates``, so they expect the
  same tokens for more rows, and the adaptive policy feeds window rows only at
  exploration steps (below) or where rows cost nothing. (The CPU profiles' windows are
  W ≤ 1 anyway: their tokens come mostly from history lookup and the pool's verified
  n-grams, which every accepted token still feeds.)

Decision (:meth:`AdaptiveWidth.choose`), per pass with more than one decode step (a request
alone in its pass runs its profile's step, exactly what it does without a scheduler:
its profile was chosen for a lone request, and the myopic estimate below would undervalue
its window): start every request at its narrowest
class (greedy requests at a one-token step: batched greedy), then repeatedly widen the
request whose next class adds the most expected tokens per extra second of the pass,
while that marginal rate beats the pass's current tokens per second by ``margin`` (5%)
and the rows fit the token budget (rows the curve prices at nothing are taken whenever they fit,
even for no more expected tokens: a window's rows add n-grams to the pool). This maximizes the pass's expected tokens per second
(greedily); the start is batched greedy and every move is expected to beat it, so the
policy does not lose to batched greedy unless its estimates are wrong. At low load a
request that accepts a lot keeps its profile's width; as passes fill up the marginal rows
cost more than they bring and requests fall back to one-token steps. Exploration
(``explore_every`` > 0; off by default since acceptance is measured in hindsight): a
request's first step, and one step after every ``explore_every`` narrower ones, is its
widest class whatever the estimate (budget permitting). On the int4 integer path, where a
row costs ~0.2–0.3 of a one-token pass, exploring every 32 steps cost more than it
brought (2026-12-01: the adaptive policy at 0.84–0.89× batched greedy at 2 and 4
requests; ``bench/results/serving.md``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np

from .errors import GenerationError
from .lookahead import ONE_TOKEN, StepCap
from .ngram import StepLayout, step_template

#: Width classes, narrowest first.
WIDTHS = ("one-token", "candidates", "half-window", "profile")

#: Prior tokens per step of each class (before any request has run it).
#: Prior chance that a candidate token is accepted after its prefix was (before any request
#: ran the class; see :class:`Acceptance`).
PRIOR_ACCEPT = {"candidates": 0.4, "half-window": 0.4, "profile": 0.4}

#: Prior step-cost shape (a, b, c) in one-token-step units (see the module docstring).
PRIOR_COST = (1.0, 0.17, 5e-4)


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


class CostCurve:
    """A fixed step-cost curve ``cost(rows, context) = a + b·rows + c·rows·context``.

    Args:
        a: seconds of a pass whatever its rows (weights read once, launch, host work).
        b: seconds per row (MatMuls, LM head).
        c: seconds per row per cached token of the pool (attention over the pool).

    Raises:
        GenerationError: a coefficient that is negative or not a finite number.
    """

    def __init__(self, a: float, b: float, c: float = 0.0):
        for name, v in (("a", a), ("b", b), ("c", c)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise GenerationError(f"cost coefficient {name} must be a finite number ≥ 0, got {v!r}")
        if a + b <= 0:
            raise GenerationError("a cost curve needs a > 0 or b > 0")
        self.a, self.b, self.c = float(a), float(b), float(c)

    def __call__(self, rows: int, context: int = 0) -> float:
        """Seconds of a pass of ``rows`` rows over ``context`` cached pool tokens."""
        return self.a + rows * (self.b + self.c * context)

    def observe(self, rows: int, context: int, seconds: float) -> None:
        """A measured pass (a fixed curve ignores it)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(a={self.a:.3g}, b={self.b:.3g}, c={self.c:.3g})"


class OnlineCostCurve(CostCurve):
    """The step-cost curve fitted online from measured passes (see the module docstring).

    Args:
        prior: ``(a, b, c)`` shape in any unit (scaled to the measurements).
        samples: measured passes kept (the most recent).
        refit_every: new passes before the curve is refitted; fits are lazy (when the
            curve is next evaluated), so a scheduler whose requests have nothing to narrow
            (plain greedy or sampled requests only) never pays for one.
        prior_weight: total weight of the prior's pseudo-passes, in passes.
    """

    _GRID = [(r, ctx) for r in (1, 2, 4, 8, 16, 32, 64) for ctx in (0, 512, 2048)]

    def __init__(self, prior=PRIOR_COST, *, samples: int = 256, refit_every: int = 64, prior_weight: float = 8.0):
        super().__init__(*prior)
        self.prior = tuple(float(v) for v in prior)
        self.samples: deque = deque(maxlen=samples)
        self.refit_every = refit_every
        self.prior_weight = prior_weight
        self._since = 0

    def observe(self, rows: int, context: int, seconds: float) -> None:
        """Add a measured decode pass: ``rows`` rows over ``context`` pool tokens took
        ``seconds`` (from its planning to its commit, see the module docstring)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.samples.append((rows, context, seconds))
        self._since += 1

    def __call__(self, rows: int, context: int = 0) -> float:
        # Due when the new passes are half of those kept (fits at 2, 4, 8 … passes) or refit_every.
        if self._since and self._since >= min(self.refit_every, max(1, len(self.samples) // 2)):
            self._since = 0
            self.refit()
        return super().__call__(rows, context)

    def refit(self) -> None:
        """Refit ``a, b, c`` to the kept passes and the scaled prior."""
        if not self.samples:
            return
        data = np.asarray(self.samples, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 0] * data[:, 1]])
        y = data[:, 2]
        pa, pb, pc = self.prior
        shape = x @ np.array([pa, pb, pc])
        scale = float(np.median(y / shape))
        grid = np.asarray(self._GRID, dtype=np.float64)
        xp = np.column_stack([np.ones(len(grid)), grid[:, 0], grid[:, 0] * grid[:, 1]])
        yp = scale * (xp @ np.array([pa, pb, pc]))
        wp = np.full(len(grid), self.prior_weight / len(grid))
        keep = np.ones(len(y), dtype=bool)
        for _ in range(2):
            coef = _nonnegative_lstsq(np.vstack([x[keep], xp]), np.concatenate([y[keep], yp]),
                                      np.concatenate([np.ones(int(keep.sum())), wp]))
            resid = y - x @ coef
            mad = float(np.median(np.abs(resid - np.median(resid)))) * 1.4826
            keep = resid <= 3 * mad if mad > 0 else np.ones(len(y), dtype=bool)
        if coef[0] + coef[1] > 0:
            self.a, self.b, self.c = (float(v) for v in coef)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient ≥ 0 (three unknowns: the best
    feasible fit over the subsets of free coefficients)."""
    sw = np.sqrt(w)[:, None]
    best, best_err = np.zeros(x.shape[1]), math.inf
    n = x.shape[1]
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(x[:, cols] * sw, y * sw[:, 0], rcond=None)
        if np.any(sol < 0):
            continue
        coef = np.zeros(n)
        coef[cols] = sol
        err = float(np.sum(w * (y - x @ coef) ** 2))
        if err < best_err:
            best, best_err = coef, err
    return best


class Acceptance:
    """One request's recent acceptance per width class.

    Model: each candidate token of the trie's deepest path is accepted, given the tokens
    before it were, with probability ``α`` (per request and class), so a step whose trie
    is ``D`` tokens deep accepts ``1 + α + α² + … + α^D = 1 + α·(1 − α^D)/(1 − α)`` tokens
    in expectation. ``α`` is the maximum-likelihood estimate of that geometric model over
    the request's recent steps (exponentially decayed: extra tokens accepted over extra
    tokens accepted plus rejections, a step that accepted all ``D`` having no rejection),
    shrunk toward the pooled estimate over every request's recent steps of the class
    (itself starting from :data:`PRIOR_ACCEPT`).

    Args:
        policy: the :class:`AdaptiveWidth` whose pooled estimates are the prior.
    """

    __slots__ = ("policy", "sums", "since_widest", "pending")

    def __init__(self, policy: "AdaptiveWidth"):
        self.policy = policy
        self.sums: dict = {}  # class -> [decayed extra tokens accepted, decayed rejections]
        self.since_widest = policy.explore_every  # steps since its widest class ran (a new request: due)
        self.pending: list = []  # [(sequence length, layout, depth, classes)] of tries not verified (hindsight)

    @property
    def due(self) -> bool:
        """Whether the request's next step should be its widest (exploration, see
        :class:`AdaptiveWidth`)."""
        every = self.policy.explore_every
        return every > 0 and self.since_widest >= every

    def rate(self, width: str) -> float:
        """``α`` of class ``width``: the chance a candidate token is accepted after its prefix was."""
        s, f = self.sums.get(width, (0.0, 0.0))
        w = self.policy.prior_steps
        return (s + w * self.policy.pooled(width)) / (s + f + w)

    def expected(self, width: str, depth: int) -> float:
        """Expected tokens of a step of class ``width`` whose trie is ``depth`` tokens deep
        (exactly 1 for ``one-token`` or an empty trie)."""
        if width == "one-token" or depth <= 0:
            return 1.0
        a = min(self.rate(width), 0.999)
        return 1.0 + a * (1.0 - a ** depth) / (1.0 - a)

    def observe(self, width: str, tokens: int, depth: int, widest: bool = False) -> None:
        """A step of class ``width`` with a trie ``depth`` deep accepted ``tokens`` tokens;
        ``widest``: it was the widest of the request's classes that pass."""
        self.since_widest = 0 if widest else self.since_widest + 1
        self._fold(width, tokens, depth)

    def defer(self, length: int, layout, depth: int, widths) -> None:
        """A greedy step ran narrower than the trie it had: ``layout`` (its profile step,
        whose trie is ``depth`` tokens deep) was prepared when the sequence held ``length``
        tokens, and the classes ``widths`` would have verified that trie. What they would
        have accepted is known once the tokens after ``length`` are (:meth:`resolve`)."""
        if depth > 0 and widths:
            self.pending.append((length, layout, depth, tuple(widths)))

    def resolve(self, sequence: list) -> None:
        """Fold in, for every deferred trie whose outcome ``sequence`` now decides, the
        tokens a step verifying it would have accepted: greedy verification accepts, after
        the step's last token, the trie path that equals the greedy continuation (which
        ``sequence`` is, whatever widths the steps had), so a step would have accepted 1 +
        the length of the trie path matching ``sequence[length:]``. Decided when the path
        meets a token it does not match, or when ``depth`` tokens matched. This is the
        acceptance of the wider classes measured without spending their rows."""
        if not self.pending:
            return
        n, keep = len(sequence), []
        for length, layout, depth, widths in self.pending:
            node, matched, decided = -1, 0, False
            for token in sequence[length:length + depth]:
                child = next((c for t, c in layout.children(node) if t == token), None)
                if child is None:
                    decided = True
                    break
                node, matched = child, matched + 1
            if decided or matched >= depth or n >= length + depth:
                for width in widths:
                    self._fold(width, 1 + matched, depth)
            else:
                keep.append((length, layout, depth, widths))
        self.pending = keep

    def _fold(self, width: str, tokens: int, depth: int) -> None:
        if width == "one-token" or depth <= 0:
            return
        extra = min(max(tokens - 1, 0), depth)
        rejected = 1.0 if extra < depth else 0.0
        d = self.policy.memory
        s, f = self.sums.get(width, (0.0, 0.0))
        self.sums[width] = [d * s + extra, d * f + rejected]
        self.policy.observe_pooled(width, extra, rejected)


class ProfileWidth:
    """Every request's step is its profile's (no narrowing; the token budget only defers)."""

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
        pick = [0] * len(menus)
        rows = sum(m[0].rows for m in menus)
        for i, menu in enumerate(menus):  # exploration first: requests due for their widest step
            if trackers is not None and len(menu) > 1 and trackers[i].due:
                extra = menu[-1].rows - menu[0].rows
                if rows + extra <= budget:
                    pick[i] = len(menu) - 1
                    rows += extra
        tokens = sum(m[k].tokens for m, k in zip(menus, pick))
        cost = self.cost(rows, context)
        while True:
            best = None
            for i, menu in enumerate(menus):
                cur = menu[pick[i]]
                for j in range(pick[i] + 1, len(menu)):
                    opt = menu[j]
                    extra_rows = opt.rows - cur.rows
                    gain = opt.tokens - cur.tokens
                    if extra_rows <= 0 or gain < 0 or rows + extra_rows > budget:
                        continue
                    extra_cost = self.cost(rows + extra_rows, context) - cost
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
    if value == "adaptive":
        return AdaptiveWidth()
    if value == "profile":
        return ProfileWidth()
    if isinstance(value, (AdaptiveWidth, ProfileWidth)) or hasattr(value, "choose"):
        return value
    raise GenerationError(f"width_policy must be 'adaptive' or 'profile', got {value!r}")
