"""Lookahead with sampling keeps the distribution of plain sampling (stories260K, ONNX Runtime).

For a prompt with a repetitive prefix (so the n-gram pool proposes candidates that get
verified often), thousands of seeded draws of the first tokens are compared with the
model's exact distribution, computed on the same engine by the chain rule
P(t1) · P(t2 | t1) · P(t3 | t1 t2) with the same temperature / top-k / top-p filtering.
Pearson's chi-square goodness-of-fit test decides, at significance α = 1e-4 (the
critical value comes from the chi-square distribution with the test's degrees of
freedom). Plain sampling passes the same test, so lookahead matches plain sampling; a
deliberately wrong acceptance rule (accept a candidate whenever it is the argmax) fails it.
The draws use fixed seeds, so the test's outcome does not change from run to run.
"""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from lade_export.feeds import causal_feeds, empty_past_feeds, run_sequence_major
from lade_export.profile import GREEDY, LookaheadProfile
from lade_export.sampling import SamplingParams, SamplingRule, filtered_probs

# The pool's n-grams keyed by "The" (from the prompt) are the model's likely continuations,
# and the model spreads its probability over them: candidates are verified and often
# accepted, but no single one is certain.
PROMPT = "The dog was happy. The cat was sad. The bird was happy. The"
ALPHA = 1e-4
DRAWS = 2000
SETTINGS = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=20)]
PROFILES = [LookaheadProfile(2, 3, 3, name="w2n3g3"), LookaheadProfile(1, 2, 2, lookup=6, name="w1n2g2k6")]


class ExactDistribution:
    """The model's filtered next-token distribution after any token sequence, on the engine."""

    def __init__(self, engine, params):
        self.engine, self.params, self.cache = engine, params, {}

    def next(self, ids: tuple) -> np.ndarray:
        if ids not in self.cache:
            out = run_sequence_major(self.engine, {**causal_feeds(list(ids), 0), **empty_past_feeds(self.engine.dims)},
                                         with_logits=True)
            self.cache[ids] = filtered_probs(out["logits"][0, 0], self.params)
        return self.cache[ids]

    def sequence(self, prompt: list, tokens: tuple) -> float:
        p = 1.0
        for i, t in enumerate(tokens):
            p *= self.next(tuple(prompt) + tokens[:i])[t]
        return p


def chi_square(samples: list[tuple], exact: ExactDistribution, prompt: list) -> tuple[float, float, int]:
    """Pearson's statistic of the observed sequences against the exact distribution, with
    every sequence expected fewer than 5 times (and all unobserved mass) pooled in one bin.

    Returns:
        ``(statistic, critical value at ALPHA, degrees of freedom)``.
    """
    n = len(samples)
    observed: dict = {}
    for s in samples:
        observed[s] = observed.get(s, 0) + 1
    expected = {s: n * exact.sequence(prompt, s) for s in observed}
    assert all(e > 0 for e in expected.values()), "a sequence of probability 0 was sampled"
    big = [s for s in observed if expected[s] >= 5]
    stat = sum((observed[s] - expected[s]) ** 2 / expected[s] for s in big)
    pooled_obs = n - sum(observed[s] for s in big)
    pooled_exp = n - sum(expected[s] for s in big)
    bins = len(big)
    if pooled_exp > 1e-9:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    df = bins - 1
    return stat, float(scipy_stats.chi2.isf(ALPHA, df)), df


def draw(decoder, prompt, params, profile, n_tokens, draws=DRAWS):
    """``draws`` seeded samples of ``n_tokens`` after ``prompt``, stop ids off (every
    sample has ``n_tokens`` tokens, as the exact distribution counts them)."""
    samples, checked, accepted, steps = [], 0, 0, 0
    for seed in range(draws):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
        r = decoder.generate(prompt, n_tokens, profile, sampling=p, stop_token_ids=())
        samples.append(tuple(r.token_ids))
        checked += r.stats.drafts_checked
        accepted += r.stats.drafts_accepted
        steps += r.stats.steps
    return samples, checked, accepted, steps


@pytest.fixture(scope="module")
def prompt_ids(stories_decoder):
    return stories_decoder.tokenizer.encode(PROMPT)


@pytest.mark.parametrize("params", SETTINGS, ids=["T0.8-top_p0.9", "T1.0-top_k20"])
def test_plain_sampling_matches_the_exact_distribution(stories_decoder, prompt_ids, params):
    exact = ExactDistribution(stories_decoder.engine, params)
    samples, checked, _, steps = draw(stories_decoder, prompt_ids, params, None, 3)
    stat, critical, df = chi_square(samples, exact, prompt_ids)
    assert checked == 0 and steps == 3 * DRAWS
    assert stat < critical, f"chi-square {stat:.1f} ≥ {critical:.1f} (df {df})"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
@pytest.mark.parametrize("params", SETTINGS, ids=["T0.8-top_p0.9", "T1.0-top_k20"])
def test_lookahead_sampling_matches_the_exact_distribution(stories_decoder, prompt_ids, params, profile):
    exact = ExactDistribution(stories_decoder.engine, params)
    samples, checked, accepted, steps = draw(stories_decoder, prompt_ids, params, profile, 3)
    stat, critical, df = chi_square(samples, exact, prompt_ids)
    print(f"\n{profile.name} {params.describe()}: {checked} candidate tokens checked, {accepted} accepted, "
          f"{3 * DRAWS / steps:.2f} tokens per step; chi-square {stat:.1f} < {critical:.1f} (df {df})")
    assert checked >= DRAWS and accepted >= DRAWS // 2  # the verifier really ran on candidates
    assert steps < 3 * DRAWS  # and accepted some of them
    assert stat < critical, f"chi-square {stat:.1f} ≥ {critical:.1f} (df {df})"


@pytest.mark.parametrize("params", SETTINGS[1:], ids=["T1.0-top_k20"])
def test_a_token_after_a_forced_prefix_matches(stories_decoder, prompt_ids, params):
    """Greedy tokens are forced into the context (at least eight, up to one the pool has
    candidates after); the next sampled token, at a later position of the answer, has the
    exact distribution under lookahead."""
    from lade_export.lookahead import LookaheadState

    greedy = stories_decoder.generate(prompt_ids, 48, GREEDY, stop_token_ids=()).token_ids
    k = next(k for k in range(8, 48)
             if LookaheadState(PROFILES[0], 512, prompt_ids + greedy[:k]).candidates(greedy[k - 1]))
    context = prompt_ids + greedy[:k]
    exact = ExactDistribution(stories_decoder.engine, params)
    samples, checked, _, _ = draw(stories_decoder, context, params, PROFILES[0], 1)
    stat, critical, df = chi_square(samples, exact, context)
    assert checked >= DRAWS // 2
    assert stat < critical, f"chi-square {stat:.1f} ≥ {critical:.1f} (df {df})"


def test_accepting_the_argmax_candidate_fails_the_same_test(stories_decoder, prompt_ids, monkeypatch):
    """The test can fail: a verifier that accepts a candidate whenever it is the model's
    argmax (instead of with probability P(c)) over-produces the likeliest continuations."""

    def wrong(self, outputs, row, children):
        logits = outputs["logits"][0, row]
        for token, child in children:
            self.checked += 1
            if token == int(np.argmax(logits)):
                self.accepted += 1
                return token, child
        return real(self, outputs, row, [])

    real = SamplingRule.choose
    monkeypatch.setattr(SamplingRule, "choose", wrong)
    params = SETTINGS[0]
    exact = ExactDistribution(stories_decoder.engine, params)
    samples, _, accepted, _ = draw(stories_decoder, prompt_ids, params, PROFILES[0], 3)
    stat, critical, df = chi_square(samples, exact, prompt_ids)
    print(f"\nwrong rule (accept the argmax candidate): chi-square {stat:.1f} > {critical:.1f} (df {df})")
    assert accepted > 0
    assert stat > critical, f"the wrong rule passed: chi-square {stat:.1f} < {critical:.1f} (df {df})"


@pytest.mark.parametrize("profile", [None, PROFILES[0]], ids=["plain", "lookahead"])
def test_same_seed_same_output_run_after_run(stories_artifact, profile):
    import lade_export

    model = lade_export.load(stories_artifact)
    kwargs = dict(max_new_tokens=64, temperature=0.9, top_k=40, top_p=0.95, profile=profile,
                  lookahead=profile is not None)
    runs = [model.generate("Once upon a time", seed=7, **kwargs) for _ in range(3)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert runs[0].text == runs[2].text and len(runs[0].token_ids) > 10
    other = model.generate("Once upon a time", seed=8, **kwargs)
    assert other.token_ids != runs[0].token_ids


def test_temperature_zero_is_greedy(stories_decoder, reference_greedy):
    case = reference_greedy["cases"][0]
    r = stories_decoder.generate(case["prompt_ids"], 40, PROFILES[0], sampling=SamplingParams(0.0, top_k=5, seed=1))
    assert r.token_ids == case["greedy_ids"][:40]


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature must be a number ≥ 0, got -1.0"),
    (dict(temperature=1.0, top_k=-2), "top_k must be an integer ≥ 0 (0: off), got -2"),
    (dict(temperature=1.0, top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(temperature=1.0, seed=-5), "seed must be an integer ≥ 0, got -5"),
])
def test_bad_sampling_parameters_are_refused(kwargs, message):
    from lade_export.errors import GenerationError

    with pytest.raises(GenerationError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_top_k_and_top_p_filter_like_transformers():
    import torch
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    rng = np.random.default_rng(0)
    for vocab in (50, 3000):
        logits = rng.standard_normal(vocab).astype(np.float32) * 3
        for params in (SamplingParams(0.7, top_p=0.8), SamplingParams(1.3, top_k=17), SamplingParams(1.0, 10, 0.5)):
            x = torch.from_numpy(logits)[None]
            x = TemperatureLogitsWarper(params.temperature)(None, x)
            if params.top_k:
                x = TopKLogitsWarper(params.top_k)(None, x)
            if params.top_p < 1:
                x = TopPLogitsWarper(params.top_p)(None, x)
            ref = torch.softmax(x, -1)[0].double().numpy()
            ours = filtered_probs(logits, params)
            assert np.array_equal(ours > 0, ref > 0)
            assert np.max(np.abs(ours - ref)) < 1e-6
