"""The step-cost curve of the adaptive width policy (:mod:`lade_export.width_policy`):
``cost(rows, context) = a + b·rows + c·rows·context`` seconds for a pass of ``rows`` rows
whose rows attend over ``context`` cached tokens.

What a pass's seconds are: from the start of its planning to the end of its commit (the
engine's run and the host work around it: every request's ``prepare``, the packing, each
request's verification, text and stop checks; a lookahead step's host work is part of
what its rows cost). ``context``: the whole pool where every row's scores span it (the
compact pool), the pass's mean request cache length where each request holds a region and
the engine's attention skips the others' (``Scheduler._attended``).

:class:`OnlineCostCurve` fits the curve online from the scheduler's own decode passes
(rows, pool tokens, seconds), not from probe passes at load: probes would lengthen every
load, and on a shared machine a few probes measure the neighbours' load of that moment,
while the scheduler's passes measure the very engine, threads and contexts it serves
with, and keep doing so as load and contexts change. Until the passes have spanned a few
widths, a prior shape stands in (:data:`PRIOR_COST`, in one-token-step units: the lade
int8 kernels' curve on SmolLM2 at 256 and 1024 cached tokens in
``bench/results/step-costs.md``), scaled to the measured seconds. The fit is weighted
least squares over the last 256 decode passes plus the prior's pseudo-passes, refitted
after 2, 4, 8 … passes and then every 64, lazily (when a choice needs it), with passes
more than 3 MADs above the fit dropped (a preempted pass on a shared machine) and
coefficients kept ≥ 0. The line is only a shape: on a CPU engine a pass's cost is convex in
its rows (SmolLM2 int4 at two threads, one request: a row adds ~0.45 ms up to 4 rows and
~0.7–1.2 ms beyond), and a scheduler's passes sit mostly at a few sizes (its concurrency), so
the line through all of them overprices the common size and with it the pass's tokens per
second the policy compares against. A size with :data:`MEASURED_MIN` passes of its own among
the last 256 is therefore priced by their median (moved to the asked context along the
fitted ``c``);
what rows add to a pass (:meth:`OnlineCostCurve.extra`) is never less than the line says.
:class:`CostCurve` is a fixed curve (deterministic: tests inject one).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

from .errors import GenerationError

#: Prior step-cost shape (a, b, c) in one-token-step units (see the module docstring).
PRIOR_COST = (1.0, 0.17, 5e-4)

#: A pass size (rows) measured this many times is priced by its own recent passes (their
#: median), not by the fitted line; the most recent ``MEASURED_KEPT`` of a size are kept.
MEASURED_MIN = 8
MEASURED_KEPT = 32


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

    def extra(self, rows: int, more: int, context: int = 0) -> float:
        """Seconds that ``more`` rows add to a pass of ``rows`` rows over ``context`` cached tokens."""
        return self(rows + more, context) - self(rows, context)

    def extras(self, rows: int, most: int, context: int = 0) -> list[float]:
        """``[extra(rows, d, context) for d in 1 … most]`` (the pass itself priced once)."""
        base = self(rows, context)
        return [self(rows + d, context) - base for d in range(1, most + 1)]

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
        self._by_rows: dict = {}  # rows -> deque of (pass number, context, seconds) of its recent passes
        self._medians: dict = {}  # rows -> median of (seconds − c·rows·context) of its passes (cached)
        self._passes = 0  # passes observed

    def fitted(self, rows: int, context: int = 0) -> float:
        """Seconds of a pass by the fitted line alone (``a + b·rows + c·rows·context``)."""
        self._refit_if_due()
        return super().__call__(rows, context)

    def extra(self, rows: int, more: int, context: int = 0) -> float:
        """Seconds that ``more`` rows add to a pass of ``rows`` rows: the difference of
        :meth:`__call__` at the two sizes, and never less than the fitted line's (a size
        measured on its own and one extrapolated may disagree; the dearer reading stands)."""
        return max(self(rows + more, context) - self(rows, context),
                   self.fitted(rows + more, context) - self.fitted(rows, context))

    def extras(self, rows: int, most: int, context: int = 0) -> list[float]:
        """``[extra(rows, d, context) for d in 1 … most]``, the pass itself priced once."""
        base, slope = self(rows, context), self.b + self.c * context
        return [max(self(rows + d, context) - base, slope * d) for d in range(1, most + 1)]

    def observe(self, rows: int, context: int, seconds: float) -> None:
        """Add a measured decode pass: ``rows`` rows over ``context`` pool tokens took
        ``seconds`` (from its planning to its commit, see the module docstring)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.samples.append((rows, context, seconds))
        self._since += 1
        self._passes += 1
        self._by_rows.setdefault(rows, deque(maxlen=MEASURED_KEPT)).append((self._passes, context, seconds))
        self._medians.pop(rows, None)

    def __call__(self, rows: int, context: int = 0) -> float:
        """Seconds of a pass of ``rows`` rows over ``context`` cached tokens: the median of
        its size's passes among the last ``samples`` (256) observed, where at least
        :data:`MEASURED_MIN` are (each moved to ``context`` along the fitted ``c``), else the
        fitted line. A size not run lately falls back to the line: a price measured in a
        noisy spell does not outlive the passes the line is fitted to."""
        self._refit_if_due()
        seen = self._by_rows.get(rows)
        if seen is None:
            return super().__call__(rows, context)
        oldest = self._passes - self.samples.maxlen
        while seen and seen[0][0] <= oldest:
            seen.popleft()
            self._medians.pop(rows, None)
        if len(seen) >= MEASURED_MIN:
            at = self._medians.get(rows)
            if at is None:
                at = self._medians[rows] = statistics.median(t - self.c * rows * ctx for _, ctx, t in seen)
            return at + self.c * rows * context
        return super().__call__(rows, context)

    def _refit_if_due(self) -> None:
        # Due when the new passes are half of those kept (fits at 2, 4, 8 … passes) or refit_every.
        if self._since and self._since >= min(self.refit_every, max(1, len(self.samples) // 2)):
            self._since = 0
            self.refit()

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
            self._medians.clear()


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient ≥ 0 (three unknowns: the best
    feasible fit over the subsets of free coefficients)."""
    sw = np.sqrt(w)[:, None]
    full, *_ = np.linalg.lstsq(x * sw, y * sw[:, 0], rcond=None)
    if np.all(full >= 0):  # the unconstrained optimum is feasible: it is the constrained one
        return full
    best, best_err = np.zeros(x.shape[1]), math.inf
    n = x.shape[1]
    for mask in range(1, (1 << n) - 1):
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
