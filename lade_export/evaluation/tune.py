"""``lade-export tune``: pick the lookahead profile with the best measured wall-clock
speedup on this engine and machine, and prove it on held-out prompts.

1. Step-cost curve: latency of one forward pass vs step size at a realistic cache
   length (the price of a wider lookahead step on this hardware).
2. Acceptance and speed for every profile of a grid on a sample of the workload's
   prompts, interleaved with plain greedy on the same prompts (exactness checked).
3. The best profile by measured speedup (total greedy decode time / total profile decode
   time) is re-measured against greedy on held-out prompts of the same workload, and on
   prompts of a *different* workload (``validation``): a speedup that holds only on the
   prompts it was tuned on is not one.
4. If it does not beat greedy on both, the tuned profile is the greedy setting
   (``enabled = false``): a tuned profile is never slower than greedy as measured.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..errors import CheckFailedError, GenerationError, ProfileError
from ..profile import GREEDY, LookaheadProfile

GRIDS = {
    # (W, N, G, K, B): short steps with history lookup (1–3 branches) beside the paper's wider shapes
    "default": [(1, 2, 1, 10, 1), (1, 2, 1, 10, 2), (1, 2, 2, 8, 2), (1, 3, 2, 6, 2), (2, 3, 2, 8, 1), (1, 2, 0, 12, 3),
                (2, 4, 3, 8, 1), (5, 4, 5, 0, 1)],
    "tiny": [(1, 2, 1, 0), (2, 3, 2, 4)],
}


def grid_profiles(spec) -> list[LookaheadProfile]:
    """Profiles of a named grid (``default``, ``tiny``) or of ``W,N,G[,K[,B]]`` strings."""
    if isinstance(spec, str):
        if spec not in GRIDS:
            raise ProfileError(f"unknown grid {spec!r}; use {', '.join(GRIDS)} or --candidate W,N,G[,K[,B]]")
        spec = GRIDS[spec]
    profiles = []
    for item in spec:
        try:
            values = [int(x) for x in item.split(",")] if isinstance(item, str) else list(item)
        except ValueError:  # not integers: "abc", "1.5,3,2", "", "1,,2"
            values = []
        if len(values) not in (3, 4, 5):
            raise ProfileError(f"grid entry {item!r}: want W,N,G, W,N,G,K or W,N,G,K,B (integers)")
        w, n, g, k, b = values + [0, 1][len(values) - 3:]
        profiles.append(LookaheadProfile(w, n, g, name=f"w{w}n{n}g{g}k{k}" + (f"b{b}" if b != 1 else ""), lookup=k,
                                         lookup_branches=b))
    return profiles


def measure_step_costs(engine, sizes=(1, 2, 4, 8, 16, 32, 64), past: int = 256, repeats: int = 5) -> list[dict]:
    """Median latency (seconds) of one forward pass per step size at ``past`` cached tokens.

    Feeds are random tokens with a causal mask; logits are read at every row (the most a
    lookahead step reads is fewer). Returns ``[{"step", "seconds", "relative"}]`` with
    ``relative`` = latency / latency at step 1.
    """
    from ..feeds import example_feeds

    rows = []
    base = None
    for size in sizes:
        if past + size > engine.dims.max_context:
            break
        # The engine's own cache layout (for head-major-shared: a buffer the step writes into, past + step long).
        feeds = example_feeds(engine.dims, step=size, past=past, kv_layout=engine.kv_layout, dtype=engine.kv_dtype)
        engine.run(feeds)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            engine.run(feeds)
            times.append(time.perf_counter() - t)
        sec = float(np.median(times))
        base = base or sec
        rows.append({"step": size, "seconds": sec, "relative": sec / base})
    return rows


@dataclasses.dataclass
class Trial:
    """A profile's totals over prompts, next to greedy's on the same prompts."""

    profile: LookaheadProfile
    new_tokens: int = 0
    steps: int = 0
    decode_s: float = 0.0
    greedy_decode_s: float = 0.0

    @property
    def compression(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def speedup(self) -> float:
        return self.greedy_decode_s / self.decode_s if self.decode_s else 0.0


def _measure(decoder, prompts_ids, profiles, max_new_tokens, progress) -> list[Trial]:
    trials = [Trial(p) for p in profiles]
    for ids in prompts_ids:
        budget = min(max_new_tokens, decoder.max_context - len(ids))
        base = decoder.generate(ids, budget, GREEDY)
        for trial in trials:
            res = decoder.generate(ids, budget, trial.profile)
            if res.token_ids != base.token_ids:
                raise CheckFailedError(f"profile {trial.profile.name} differs from greedy; lookahead must be exact")
            trial.new_tokens += res.stats.new_tokens
            trial.steps += res.stats.steps
            trial.decode_s += res.stats.decode_s
            trial.greedy_decode_s += base.stats.decode_s
            if progress:
                progress(1)
    return trials


@dataclasses.dataclass
class TuneResult:
    """What :func:`tune` measured and chose."""

    step_costs: list
    trials: list
    best: Trial
    held_out: Trial
    chosen: LookaheadProfile
    name: str = "tuned"
    skipped: list = dataclasses.field(default_factory=list)
    validation: Trial | None = None
    validation_label: str = ""

    def toml(self, dataset: str, env: dict) -> str:
        """The chosen profile as TOML, with the measurements as comments."""
        lines = [f"tuned by lade-export tune on {env.get('date')} · {env.get('cpu')} · {env.get('cores')} cores",
                 f"workload: {dataset}", "", "step-cost curve (one forward pass, past = 256):"]
        lines += [f"  step {r['step']:>3}: {1000 * r['seconds']:7.1f} ms  ({r['relative']:.2f}x step 1)"
                  for r in self.step_costs]
        lines += ["", "grid on the sample prompts (speedup = greedy decode time / profile decode time):"]
        for t in sorted(self.trials, key=lambda t: -t.speedup):
            p = t.profile
            lines.append(f"  W={p.window} N={p.ngram} G={p.guesses} K={p.lookup} B={p.lookup_branches}: "
                         f"compression {t.compression:.2f}, "
                         f"speedup {t.speedup:.2f}x, max step {p.max_step}")
        h = self.held_out
        lines += ["", f"held-out check of {self.best.profile.name}: compression {h.compression:.2f}, "
                      f"speedup {h.speedup:.2f}x over {h.new_tokens} tokens"]
        if self.validation is not None:
            v = self.validation
            lines.append(f"other-workload check ({self.validation_label}): compression {v.compression:.2f}, "
                         f"speedup {v.speedup:.2f}x over {v.new_tokens} tokens")
        if not self.chosen.enabled:
            lines.append("no profile beat greedy on this machine: this file is the greedy setting")
        if self.skipped:
            lines += ["", f"{len(self.skipped)} record(s) left out (they do not fit the model's context):"]
            lines += [f"  {line}" for line in self.skipped]
        chosen = dataclasses.replace(self.chosen, name=self.name)
        return chosen.to_toml(description=f"tuned for {dataset}", comments="\n".join(lines))


def tune(decoder, prompts_ids: list, profiles: list, max_new_tokens: int, progress=None,
         validation_ids: list | None = None, validation_label: str = "") -> TuneResult:
    """Measure the grid on the first half of ``prompts_ids`` and verify the winner on the
    rest and on ``validation_ids`` (another workload's prompts).

    Args:
        decoder: :class:`lade_export.runtime.Decoder` on the engine to tune for.
        prompts_ids: token ids of the workload's prompts (≥ 2).
        profiles: the grid.
        max_new_tokens: per generation.
        progress: optional ``callable(advance_by)``.
        validation_ids: token ids of prompts from a different workload (None: no such check).
        validation_label: what they are, for the report.

    Raises:
        ProfileError: fewer than 2 prompts or an empty grid.
        GenerationError: a prompt leaves no room for a new token in the context (the
            runtime's check, naming the prompt's index; the CLI leaves such records out
            beforehand with :func:`lade_export.evaluation.compare.fit_prompts`).
        CheckFailedError: a profile's output differs from greedy.
    """
    if len(prompts_ids) < 2:
        raise ProfileError("tune needs at least 2 prompts (a sample and a held-out part); raise --limit")
    if not profiles:
        raise ProfileError("tune needs at least one candidate profile")
    for i, ids in enumerate(prompts_ids):
        try:
            decoder.check_request(len(ids), 1)
        except GenerationError as err:
            raise GenerationError(f"tuning prompt {i} does not fit the context: {err}") from None
    half = (len(prompts_ids) + 1) // 2
    sample, held = prompts_ids[:half], prompts_ids[half:]
    costs = measure_step_costs(decoder.engine)
    trials = _measure(decoder, sample, profiles, max_new_tokens, progress)
    best = max(trials, key=lambda t: t.speedup)
    held_out = _measure(decoder, held, [best.profile], max_new_tokens, progress)[0]
    validation = _measure(decoder, validation_ids, [best.profile], max_new_tokens, progress)[0] \
        if validation_ids else None
    if best.speedup > 1.0 and held_out.speedup > 1.0 and (validation is None or validation.speedup > 1.0):
        chosen = best.profile
    else:
        chosen = LookaheadProfile(1, 2, 0, name="tuned", enabled=False)
    return TuneResult(costs, trials, best, held_out, chosen, validation=validation, validation_label=validation_label)
