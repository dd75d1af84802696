"""Exactness as a property: for random prompts and random small profiles, lookahead
output equals greedy output on the same engine (stories260K, ONNX Runtime)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lade_export.profile import LookaheadProfile


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.lists(st.integers(min_value=3, max_value=511), min_size=0, max_size=24),
    w=st.integers(0, 6),
    n=st.integers(2, 5),
    g=st.integers(0, 6),
    k=st.sampled_from([0, 0, 3, 8]),
    max_new=st.integers(1, 48),
)
def test_lookahead_equals_greedy_for_random_prompts_and_profiles(stories_decoder, body, w, n, g, k, max_new):
    prompt = [1] + body
    profile = LookaheadProfile(w, n, g, lookup=k)
    greedy = stories_decoder.generate(prompt, max_new, None)
    look = stories_decoder.generate(prompt, max_new, profile)
    assert look.token_ids == greedy.token_ids
    assert look.stop_reason == greedy.stop_reason
    assert look.stats.steps <= greedy.stats.steps


def test_generation_to_the_full_context_stays_exact(stories_decoder, reference_greedy):
    prompt = reference_greedy["cases"][0]["prompt_ids"]
    budget = 512 - len(prompt)
    greedy = stories_decoder.generate(prompt, budget, None, stop_token_ids=())  # the oracle ignores EOS
    look = stories_decoder.generate(prompt, budget, LookaheadProfile(7, 5, 7), stop_token_ids=())
    assert len(greedy.token_ids) == budget == 507
    assert look.token_ids == greedy.token_ids
    assert look.token_ids[:128] == reference_greedy["cases"][0]["greedy_ids"]
    assert look.stats.cache_tokens <= 512 and greedy.stats.cache_tokens <= 512
    assert look.stats.steps < greedy.stats.steps
