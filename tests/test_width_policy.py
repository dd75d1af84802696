"""The load-adaptive width policy (lade_export/width_policy.py): its decisions on given
cost curves and acceptance, the online cost fit, and the lookahead state's capped steps
(a narrower step keeps the state consistent; greedy output does not depend on the widths)."""

import math
import threading

import numpy as np
import pytest

from lade_export.errors import GenerationError
from lade_export.lookahead import ONE_TOKEN, LookaheadState, StepCap
from lade_export.profile import LookaheadProfile, resolve_profile
from lade_export.runtime import collect
from lade_export.scheduler import Scheduler
from lade_export.ngram import build_trie, step_template
from lade_export.width_policy import (AdaptiveWidth, CostCurve, OnlineCostCurve, Option, ProfileWidth, make_policy,
                                      narrowed, width_caps)

from .threads import run_in_threads


def _menu(candidates_tokens=1.6, profile_tokens=2.0, candidates_rows=5, profile_rows=12):
    return [Option("one-token", ONE_TOKEN, 1, 1.0), Option("candidates", StepCap(0, 2, 6), candidates_rows,
                                                          candidates_tokens),
            Option("profile", None, profile_rows, profile_tokens)]


# -- decisions on a given cost curve ----------------------------------------------------------

def test_a_busy_pass_runs_one_token_steps():
    # 8 requests; a row costs 0.2 of a pass's fixed cost: 8 greedy steps make 8 tokens for 2.6,
    # and the best extra (+0.6 tokens for 4 rows, +0.8) is worth 0.75 tokens per unit < 3.08.
    policy = AdaptiveWidth(CostCurve(1.0, 0.2))
    assert policy.choose([_menu() for _ in range(8)], context=0, budget=64) == [0] * 8


def test_a_request_that_accepts_a_lot_keeps_its_width_at_low_load():
    policy = AdaptiveWidth(CostCurve(1.0, 0.05))
    assert policy.choose([_menu(profile_tokens=3.0)], context=0, budget=64) == [2]
    # the same cost, a request whose guesses rarely land: its one-token step is the better buy
    assert policy.choose([_menu(candidates_tokens=1.02, profile_tokens=1.04)], context=0, budget=64) == [0]
    # both in one pass: only the one that accepts widens
    assert policy.choose([_menu(candidates_tokens=1.02, profile_tokens=1.04), _menu(profile_tokens=3.0)],
                         context=0, budget=64) == [0, 2]


def test_attention_over_the_pool_narrows_steps_as_the_context_grows():
    policy = AdaptiveWidth(CostCurve(1.0, 0.02, 1e-3))
    menus = [_menu(profile_tokens=2.2) for _ in range(2)]
    assert policy.choose(menus, context=0, budget=64) == [2, 2]
    assert policy.choose(menus, context=4096, budget=64) == [0, 0]


def test_widening_stays_within_the_token_budget():
    policy = AdaptiveWidth(CostCurve(1.0, 0.0))  # rows are free: every request would take its profile
    picks = policy.choose([_menu(profile_rows=8) for _ in range(3)], context=0, budget=12)
    rows = sum(_menu(profile_rows=8)[k].rows for k in picks)
    assert rows <= 12 and picks.count(2) == 1
    assert policy.choose([_menu(profile_rows=8) for _ in range(3)], context=0, budget=64) == [2, 2, 2]


def test_free_window_rows_are_taken_even_when_they_expect_no_more_tokens():
    # the window classes verify the candidates' trie: on a curve where rows cost nothing the
    # profile is taken for its window's n-grams; where they cost anything, it is not
    same = [_menu(candidates_tokens=1.6, profile_tokens=1.6) for _ in range(2)]
    assert AdaptiveWidth(CostCurve(1.0, 0.0)).choose(same, context=0, budget=64) == [2, 2]
    assert AdaptiveWidth(CostCurve(1.0, 0.01)).choose(same, context=0, budget=64) == [1, 1]


def test_a_request_with_one_option_keeps_it():
    # sampled requests get a one-option menu (their profile's step); its rows are part of the
    # pass's cost: beside a 12-row step (2.5 tokens for 3.6) the neighbour's candidates (+0.6
    # tokens for +0.8) pay, beside a one-token step (2 tokens for 1.4) they do not
    sampled = [Option("profile", None, 12, 1.5)]
    policy = AdaptiveWidth(CostCurve(1.0, 0.2))
    assert policy.choose([sampled, _menu()], context=0, budget=64) == [0, 1]
    assert policy.choose([[Option("one-token", None, 1, 1.0)], _menu()], context=0, budget=64) == [0, 0]


def test_a_request_due_for_exploration_runs_its_widest_step_once_even_when_busy():
    policy = AdaptiveWidth(CostCurve(1.0, 0.2), explore_every=4)
    trackers = [policy.tracker() for _ in range(3)]  # new requests are due
    trackers[1].observe("profile", 1, 4, widest=True)
    assert policy.choose([_menu() for _ in range(3)], context=0, budget=64, trackers=trackers) == [2, 0, 2]
    assert policy.choose([_menu() for _ in range(3)], context=0, budget=20, trackers=trackers) == [2, 0, 0]  # budget
    for t in trackers:
        t.observe("profile", 1, 4, widest=True)
    for _ in range(4):  # four narrow steps, then due again
        assert policy.choose([_menu() for _ in range(3)], context=0, budget=64, trackers=trackers) == [0, 0, 0]
        for t in trackers:
            t.observe("one-token", 1, 0)
    assert policy.choose([_menu() for _ in range(3)], context=0, budget=64, trackers=trackers) == [2, 2, 2]
    never = AdaptiveWidth(CostCurve(1.0, 0.2), explore_every=0)
    assert never.choose([_menu()], context=0, budget=64, trackers=[never.tracker()]) == [0]


def test_the_profile_bounds_every_class():
    for name in ("default", "small", "paper", "wide", "default-int4"):
        prof = resolve_profile(name)
        caps = width_caps(prof)
        assert caps[0] == ("one-token", ONE_TOKEN) and caps[-1][1] == StepCap(prof.window, prof.guesses, prof.lookup)
        for _, cap in caps:
            assert cap.window <= prof.window and cap.guesses <= prof.guesses and cap.lookup <= prof.lookup
    assert [w for w, _ in width_caps(resolve_profile("default-int4"))] == ["one-token", "profile"]
    assert [w for w, _ in width_caps(resolve_profile("default"))] == ["one-token", "candidates", "profile"]
    assert [w for w, _ in width_caps(resolve_profile("paper"))] == ["one-token", "candidates", "half-window",
                                                                     "profile"]


# -- acceptance and the cost fit ------------------------------------------------------------------

def test_acceptance_starts_at_the_prior_and_follows_the_request():
    policy = AdaptiveWidth(CostCurve(1.0, 0.1), prior={"profile": 0.5})
    a = policy.tracker()
    assert a.expected("one-token", 10) == 1.0 and a.expected("profile", 0) == 1.0
    assert a.expected("profile", 2) == pytest.approx(1 + 0.5 + 0.25)  # 1 + α + α²
    for _ in range(30):  # every candidate token of a 4-deep trie accepted but the last: α → 3/4
        a.observe("profile", 4, depth=4)
    assert a.rate("profile") == pytest.approx(0.75, abs=0.03)
    assert a.expected("profile", 10) > a.expected("profile", 2) > 2.0
    b = policy.tracker()  # a new request starts from what every request's recent steps gave
    assert 0.5 < b.rate("profile") < a.rate("profile")
    for _ in range(30):  # a request whose guesses never land
        b.observe("profile", 1, depth=6)
    assert b.expected("profile", 6) < 1.2


def test_the_online_cost_curve_fits_measured_passes_and_ignores_preempted_ones():
    rng = np.random.default_rng(5)
    curve = OnlineCostCurve(refit_every=8)
    a, b, c = 0.010, 0.0012, 2e-6
    for _ in range(200):
        rows, ctx = int(rng.integers(1, 40)), int(rng.integers(0, 1500))
        seconds = (a + rows * (b + c * ctx)) * (1 + 0.02 * rng.standard_normal())
        if rng.random() < 0.1:
            seconds *= 4  # a pass that waited out a neighbour's process
        curve.observe(rows, ctx, seconds)
    curve.refit()
    assert curve.a == pytest.approx(a, rel=0.15)
    assert curve.b == pytest.approx(b, rel=0.15)
    assert curve.c == pytest.approx(c, rel=0.25)
    assert min(curve.a, curve.b, curve.c) >= 0


def test_the_online_cost_curve_fits_lazily_when_a_choice_needs_it():
    curve = OnlineCostCurve(refit_every=64)
    prior = (curve.a, curve.b, curve.c)
    for rows in range(1, 101):  # passes of a scheduler with nothing to narrow: no fit is paid for
        curve.observe(rows % 17 + 1, 100, 0.010 + 0.002 * (rows % 17 + 1))
    assert (curve.a, curve.b, curve.c) == prior
    assert curve(1, 100) == pytest.approx(0.012, rel=0.05)  # evaluated: fitted to the 100 passes first
    fitted = (curve.a, curve.b, curve.c)
    for _ in range(63):
        curve.observe(1, 100, 0.05)
    curve(1, 100)
    assert (curve.a, curve.b, curve.c) == fitted  # 63 new passes < refit_every
    curve.observe(1, 100, 0.05)
    curve(1, 100)
    assert (curve.a, curve.b, curve.c) != fitted


def test_a_size_measured_often_is_priced_by_its_own_passes_not_the_line():
    # a convex engine: one-request rows cheap, rows past eight dear; the line through every
    # size misprices both ends, a size with enough passes of its own is priced by their median
    curve = OnlineCostCurve(refit_every=8)
    true = {1: 3.2e-3, 4: 4.9e-3, 8: 8.5e-3, 14: 15.9e-3}
    for k in range(64):
        for rows, seconds in true.items():
            if rows != 14 or k < 4:  # the wide size seen only 4 times: the line prices it
                curve.observe(rows, 300, seconds)
    assert curve(8, 300) == pytest.approx(8.5e-3, rel=1e-6)
    assert curve(4, 300) == pytest.approx(4.9e-3, rel=1e-6)
    assert curve(14, 300) == pytest.approx(curve.fitted(14, 300))
    assert abs(curve.fitted(4, 300) / 4.9e-3 - 1) > 0.05  # the line is off by more than 5% there
    # six more rows on an 8-row pass cost at least what the line says they add
    assert curve.extra(8, 6, 300) == pytest.approx(max(curve.fitted(14, 300) - 8.5e-3,
                                                       curve.fitted(14, 300) - curve.fitted(8, 300)))
    # passes moved to another context along the fitted c
    assert curve(8, 500) == pytest.approx(8.5e-3 + curve.c * 8 * 200, rel=1e-6)
    # a size not run among the last 256 passes is priced by the line again
    for _ in range(256):
        curve.observe(4, 300, 4.9e-3)
    assert curve(8, 300) == pytest.approx(curve.fitted(8, 300))
    assert curve(4, 300) == pytest.approx(4.9e-3, rel=1e-6)


def test_widened_steps_that_accept_less_than_expected_calibrate_the_policy():
    policy = AdaptiveWidth(CostCurve(1.0, 0.05))
    menu = [_menu(candidates_tokens=1.6, profile_tokens=1.7)]
    assert policy.calibration == 1.0
    assert policy.choose(menu * 2, context=0, budget=64) == [1, 1]  # +0.6 tokens for 4 rows (0.2) pays
    for _ in range(40):  # its bets: 1.5 extra tokens expected, 0.5 accepted
        policy.observe_widened(1.5, 0.5)
    # decayed sums 8.7 / 26.1 and the prior 2 / 2: (8.7 + 2) / (26.1 + 2)
    assert policy.calibration == pytest.approx(0.38, abs=0.01)
    assert policy.choose(menu * 2, context=0, budget=64) == [0, 0]  # +0.23 calibrated tokens for 0.2: not
    assert policy.choose([_menu(candidates_tokens=3.0, profile_tokens=3.0)], context=0, budget=64) == [1]
    for _ in range(3000):  # choices that widen nothing: what was measured fades, the prior returns
        policy.choose([[Option("one-token", ONE_TOKEN, 1, 1.0)]] * 2, context=0, budget=64)
    assert policy.calibration > 0.95
    policy.observe_widened(1.0, 5.0)
    assert 1.0 < policy.calibration <= 2.0


def test_a_step_is_worth_preparing_only_where_its_best_case_could_pay():
    policy = AdaptiveWidth(CostCurve(1.0, 0.2))
    # 4 one-token steps: 4 tokens for 1.8, the bar 1.05·4/1.8 tokens per unit; d rows cost 0.2·d
    need = policy.preparation_bar(rows=4, tokens=4, context=0, depth=6)
    assert need == pytest.approx([1.05 * 4 / 1.8 * 0.2 * d for d in range(1, 7)])
    history = resolve_profile("default-int4")  # W = 0, K = 6
    new = policy.tracker()  # α = the prior 0.4: 0.4 + 0.16 + … < 0.467·d at every depth
    assert not policy.worth_preparing(new, history, need)
    sure = policy.tracker()
    for _ in range(40):  # every candidate accepted: α → 1, d extra tokens for d rows
        sure.observe("profile", 7, depth=6)
    assert policy.worth_preparing(sure, history, need)
    assert policy.worth_preparing(new, resolve_profile("default"), need)  # a Jacobi window: always prepared
    assert policy.worth_preparing(new, history, AdaptiveWidth(CostCurve(1.0, 0.0)).preparation_bar(4, 4, 0, 6))
    for _ in range(40):  # the policy's bets came in at a third: the same sure request is no longer worth it
        policy.observe_widened(3.0, 1.0)
    bars = [policy.preparation_bar(rows=4, tokens=4, context=0, depth=6) for _ in range(16)]
    assert all(bar is need for bar in bars[:15])  # a pass shape's bar serves its next 15 passes
    assert bars[15] == pytest.approx([d / policy.calibration for d in need])
    assert not policy.worth_preparing(sure, history, bars[15])


def test_options_are_refused_in_one_line():
    with pytest.raises(GenerationError, match=r"^width_policy must be 'adaptive' or 'profile', got 'wide'$"):
        make_policy("wide")
    with pytest.raises(GenerationError, match=r"^cost coefficient b must be a finite number ≥ 0, got -1$"):
        CostCurve(1.0, -1)
    with pytest.raises(GenerationError, match=r"^margin must be in \[0, 10\), got -0.5$"):
        AdaptiveWidth(margin=-0.5)
    with pytest.raises(GenerationError, match=r"^explore_every must be an integer ≥ 0, got 1.5$"):
        AdaptiveWidth(explore_every=1.5)
    assert isinstance(make_policy("profile"), ProfileWidth) and isinstance(make_policy("adaptive"), AdaptiveWidth)


# -- capped steps of the lookahead state ---------------------------------------------------------

def _fake_outputs(layout, token):
    return {"next_token_ids": np.full((1, len(layout.logit_rows)), token, dtype=np.int64)}


def test_a_step_without_window_rows_leaves_the_window_and_a_narrow_one_advances_only_its_columns():
    prompt = list(range(3, 40))
    state = LookaheadState(LookaheadProfile(3, 3, 2, lookup=4), 64, prompt)
    before = state.window.copy()
    lay = state.prepare(prompt[-1], len(prompt) - 1, StepCap(0, 2, 4))
    assert lay.window == 0 and lay.step == 1 + len(lay.trie_tokens)
    state.update(lay, _fake_outputs(lay, 7))
    assert np.array_equal(state.window, before)
    lay = state.prepare(7, len(prompt), StepCap(1, 2, 4))
    state.update(lay, _fake_outputs(lay, 9))
    assert np.array_equal(state.window[:, 1:], before[:, 1:])  # columns 1 and 2 untouched
    assert state.window[-1, 0] == 9 and state.window[0, 0] == before[1, 0]  # column 0 shifted up a level
    one = state.prepare(9, len(prompt) + 1, ONE_TOKEN)
    assert one.step == 1 and list(one.logit_rows) == [0] and one.trie_tokens == []


def test_a_cap_wider_than_the_profile_is_the_profile():
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    state = LookaheadState(LookaheadProfile(2, 3, 2, lookup=3), 16, prompt)
    full = state.prepare(prompt[-1], 7)
    big = state.prepare(prompt[-1], 7, StepCap(9, 9, 9))
    assert np.array_equal(full.input_ids, big.input_ids) and np.array_equal(full.step_mask, big.step_mask)
    assert full.step <= state.profile.max_step
    window_only = state.prepare(prompt[-1], 7, StepCap(2, 0, 0))
    assert window_only.step == 1 + 2 * 2 and window_only.trie_tokens == []
    pool_only = state.prepare(prompt[-1], 7, StepCap(0, 2, 0))  # the pool's 2-grams after 6, no history
    assert pool_only.trie_tokens == [t for c in state.pool.candidates(6) for t in c]


def _fields(layout):
    return (layout.input_ids.tolist(), layout.position_ids.tolist(), layout.step_mask.tolist(),
            layout.logit_rows.tolist(), layout.past_len, list(layout.trie_tokens), tuple(layout.trie_parents),
            layout.window, layout.levels)


@pytest.mark.parametrize("profile", [LookaheadProfile(3, 3, 2, lookup=4), LookaheadProfile(4, 2, 6),
                                     LookaheadProfile(1, 4, 3, lookup=5), LookaheadProfile(0, 2, 0, lookup=10,
                                                                                           lookup_min_match=2)])
def test_a_class_cut_from_the_profile_step_is_the_step_prepare_builds_with_its_cap(profile):
    """narrowed(profile step, cap) has every field of prepare(last, past, cap) for each width
    class, along a sequence that repeats itself (history and pool candidates, a trie of
    several branches) and with window columns advanced by steps."""
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(3, 12, size=30)]
    state = LookaheadState(profile, 16, prompt)
    seen = set()
    for k in range(40):
        last, past = state.sequence[-1], len(state.sequence) - 1
        full = state.prepare(last, past)
        for width, cap in width_caps(profile):
            assert _fields(narrowed(full, cap)) == _fields(state.prepare(last, past, cap)), (k, width)
            seen.add((width, len(full.trie_tokens) > 0))
        state.update(full, _fake_outputs(full, int(rng.integers(3, 12))))
    assert any(has_trie for _, has_trie in seen) and ("one-token", True) in seen


def test_acceptance_in_hindsight_of_a_trie_a_narrowed_step_did_not_verify():
    """A greedy step run as one token leaves its trie unverified; once the sequence holds
    the tokens after it, the classes that would have verified it are credited with what
    they would have accepted (1 + the trie path matching the continuation)."""
    policy = AdaptiveWidth(CostCurve(1.0, 0.1), prior={"profile": 0.5})
    a = policy.tracker()
    tokens, parents, _ = build_trie([[4, 5, 6, 7], [4, 9], [8]])  # depth 4
    offsets, mask, rows = step_template(0, 1, parents)
    from lade_export.ngram import StepLayout
    layout = StepLayout(np.asarray([3, *tokens]), 10 + offsets, mask, rows, 10, tokens, parents, 0, 1)
    seq = [1, 2, 3]
    a.defer(len(seq), layout, 4, ("candidates", "profile"))
    a.defer(len(seq), layout, 4, ())  # no class verifies the trie: nothing kept
    a.resolve(seq + [4])
    assert len(a.pending) == 1 and a.sums == {}  # 4 matches: not decided yet
    a.resolve(seq + [4, 5, 6])
    assert len(a.pending) == 1 and a.sums == {}
    a.resolve(seq + [4, 5, 6, 2])  # the path 4 5 6 then 2 ≠ 7: 3 extra tokens, then a rejection
    assert a.pending == [] and a.sums == {"candidates": [3.0, 1.0], "profile": [3.0, 1.0]}
    a.defer(4, layout, 4, ("profile",))
    a.resolve(seq + [4, 4, 5, 6, 7])  # all four: no rejection
    assert a.sums["profile"] == pytest.approx([0.9 * 3 + 4, 0.9 * 1])
    a.defer(9, layout, 4, ("profile",))
    a.resolve(seq + [4, 4, 5, 6, 7, 1])
    assert len(a.pending) == 1  # the token after position 9 is not known yet
    a.resolve(seq + [4, 4, 5, 6, 7, 1, 2])  # a first token no branch starts with: nothing extra
    assert a.sums["profile"] == pytest.approx([0.81 * 3 + 0.9 * 4, 0.81 + 1])
    assert a.since_widest == a.policy.explore_every  # hindsight is no step of the request's own


def _lookahead_runs_without_stops(decoder, reference_greedy, max_new_tokens, **scheduler_options):
    """Every reference case with the default and paper profiles, all at once through one
    Scheduler(decoder, **scheduler_options), stop ids off (the oracle ignores EOS); returns
    the closed scheduler and the results in case × profile order."""
    scheduler = Scheduler(decoder, **scheduler_options)
    streams = [scheduler.stream(case["prompt_ids"], max_new_tokens, resolve_profile(p), stop_token_ids=())
               for case in reference_greedy["cases"] for p in ("default", "paper")]
    results = [collect(s) for s in streams]
    scheduler.close()
    return scheduler, results


def test_a_decode_step_is_prepared_once_whatever_its_width(stories_decoder, reference_greedy, prepare_calls):
    """Each lookahead decode step calls ``prepare`` once, in passes where the policy narrows
    it and in passes that defer it (a tight budget); outputs stay the reference's."""
    calls = prepare_calls()
    scheduler, results = _lookahead_runs_without_stops(stories_decoder, reference_greedy, 96, token_budget=16,
                                                       width_policy=RandomWidths(5))
    assert [r.token_ids for r in results] == [c["greedy_ids"][:96] for c in reference_greedy["cases"] for _ in range(2)]
    assert len(calls) == sum(r.stats.steps for r in results) and not any(calls)  # the profile's step, once each
    assert scheduler.width_steps["one-token"] > 0 and scheduler.width_steps["profile"] > 0


class RandomWidths(AdaptiveWidth):
    """Test policy: every request's class drawn at random each pass (any widths, any order)."""

    def __init__(self, seed):
        super().__init__(CostCurve(1.0, 0.1))
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()

    def choose(self, menus, context, budget, trackers=None):
        with self.lock:
            return [int(self.rng.integers(len(m))) for m in menus]


def test_greedy_output_does_not_depend_on_the_widths_of_its_steps(stories_decoder, reference_greedy):
    """stories260K: lookahead requests whose every step gets a random width class (one-token,
    candidates, half window, profile) give the reference greedy tokens."""
    scheduler, results = _lookahead_runs_without_stops(stories_decoder, reference_greedy, 128,
                                                       width_policy=RandomWidths(3))
    assert [r.token_ids for r in results] == [c["greedy_ids"] for c in reference_greedy["cases"] for _ in range(2)]
    assert set(scheduler.width_steps) == {"one-token", "candidates", "half-window", "profile"}
    assert sum(scheduler.width_steps.values()) == sum(r.stats.steps for r in results)


@pytest.mark.slow
def test_smollm2_adaptive_widths_keep_concurrent_requests_equal_to_their_solo_runs(smollm2_decoder):
    """SmolLM2 fp32: four greedy lookahead requests and a sampled one through the adaptive
    policy with its online cost curve; greedy outputs equal their solo runs, the sampled
    one equals its solo run step for step (it keeps its profile)."""
    from lade_export.sampling import SamplingParams

    from .conftest import mt_bench_prompts

    ids = [smollm2_decoder.tokenizer.encode_prompt(t, chat=True) for t in mt_bench_prompts(4)]
    reqs = [(ids[0], 40, resolve_profile("default"), None), (ids[1], 40, resolve_profile("small"), None),
            (ids[2], 40, LookaheadProfile(0, 2, 0, lookup=10, lookup_min_match=2), None),
            (ids[3], 40, resolve_profile("default"), None),
            (ids[0], 32, resolve_profile("default"), SamplingParams(0.8, 0, 0.9, 7))]
    solo = [smollm2_decoder.generate(p, n, prof, sampling=s) for p, n, prof, s in reqs]
    scheduler = Scheduler(smollm2_decoder, width_policy="adaptive")
    results = [None] * len(reqs)

    def run(i):
        p, n, prof, s = reqs[i]
        results[i] = scheduler.generate(p, n, prof, sampling=s)

    run_in_threads(run, len(reqs))
    scheduler.close()
    for got, want in zip(results, solo):
        assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text, want.stop_reason)
    assert results[-1].stats.steps == solo[-1].stats.steps
    assert sum(scheduler.width_steps.values()) == sum(r.stats.steps for r in results)
    assert math.isfinite(scheduler.width_policy.cost(8, 256))


def test_load_with_batching_takes_the_width_policy(stories_artifact):
    import lade_export

    model = lade_export.load(stories_artifact, batching=True)
    assert isinstance(model.scheduler.width_policy, AdaptiveWidth)  # the default
    model.close()
    model = lade_export.load(stories_artifact, batching=True, width_policy="profile")
    assert isinstance(model.scheduler.width_policy, ProfileWidth)
    model.close()
    with pytest.raises(GenerationError, match=r"^width_policy must be 'adaptive' or 'profile', got 'none'$"):
        lade_export.load(stories_artifact, batching=True, width_policy="none")


def test_load_with_batching_takes_the_schedulers_options(stories_artifact):
    import lade_export

    model = lade_export.load(stories_artifact, batching=True, max_batch=3, token_budget=32, kv_tokens=600)
    s = model.scheduler
    assert (s.max_batch, s.token_budget, s.kv_tokens) == (3, 32, 600)
    model.close()
    with pytest.raises(GenerationError, match=r"^max_batch must be an integer ≥ 1, got 0$"):
        lade_export.load(stories_artifact, batching=True, max_batch=0)
