"""Decoding on stories260K: lookahead equals the reference greedy oracle, stops are exact,
state is per generation, and bad requests fail before any work."""

import pytest

from lade_export.errors import GenerationError
from lade_export.profile import GREEDY, LookaheadProfile, resolve_profile

PROFILES = [resolve_profile("default"), resolve_profile("small"), resolve_profile("paper"), LookaheadProfile(1, 2, 0),
            LookaheadProfile(4, 2, 6)]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_lookahead_equals_reference_greedy_oracle(stories_decoder, reference_greedy, profile):
    for case in reference_greedy["cases"]:  # stop ids off: the oracle ignores EOS
        result = stories_decoder.generate(case["prompt_ids"], 128, profile, stop_token_ids=())
        assert result.token_ids == case["greedy_ids"], case["prompt"]
        assert result.stats.new_tokens == 128
        assert sum(k * v for k, v in result.stats.acceptance_histogram.items()) == 128


def test_greedy_mode_equals_oracle_and_compresses_nothing(stories_decoder, reference_greedy):
    case = reference_greedy["cases"][0]
    result = stories_decoder.generate(case["prompt_ids"], 128, GREEDY, stop_token_ids=())
    assert result.token_ids == case["greedy_ids"]
    assert result.stats.steps == 128 and result.stats.compression_ratio == 1.0


def test_lookahead_compresses_on_stories(stories_decoder, reference_greedy):
    case = reference_greedy["cases"][1]
    result = stories_decoder.generate(case["prompt_ids"], 128, resolve_profile("default"), stop_token_ids=())
    assert result.stats.steps < 100
    assert result.stats.compression_ratio > 1.25


def _fresh_mid_block_token(blocks):
    """A token that first occurs strictly inside a multi-token block (not first, not last)."""
    seen = set()
    for block in blocks:
        for i, tok in enumerate(block):
            if 0 < i < len(block) - 1 and tok not in seen:
                return tok
            seen.add(tok)
    return None


def test_stop_token_accepted_mid_block_ends_output_there(stories_decoder, reference_greedy):
    profile = resolve_profile("default")
    case = reference_greedy["cases"][1]
    blocks, blocks_after = [], []
    stories_decoder.generate(case["prompt_ids"], 128, profile, on_tokens=blocks.append, stop_token_ids=())
    stop = _fresh_mid_block_token(blocks)
    assert stop is not None, "no multi-token block with a fresh middle token"
    look = stories_decoder.generate(case["prompt_ids"], 128, profile, on_tokens=blocks_after.append,
                                    stop_token_ids=[stop])
    greedy = stories_decoder.generate(case["prompt_ids"], 128, GREEDY, stop_token_ids=[stop])
    expected = case["greedy_ids"][: case["greedy_ids"].index(stop) + 1]
    assert look.token_ids == expected == greedy.token_ids
    assert look.stop_reason == "stop_token" and look.token_ids[-1] == stop
    # the final step emitted a cut block: the same step without the stop id accepted more
    assert blocks_after[:-1] == blocks[: len(blocks_after) - 1]
    assert len(blocks_after[-1]) < len(blocks[len(blocks_after) - 1])


def test_several_stop_ids_all_count(stories_decoder, reference_greedy):
    case = reference_greedy["cases"][0]
    ids = case["greedy_ids"]
    first_a, first_b = ids.index(426), ids.index(13)  # "." and newline
    result = stories_decoder.generate(case["prompt_ids"], 128, resolve_profile("small"), stop_token_ids=[426, 13])
    assert result.token_ids == ids[: min(first_a, first_b) + 1]


def test_max_new_tokens_cuts_inside_a_block(stories_decoder, reference_greedy):
    case = reference_greedy["cases"][1]
    for n in (1, 2, 3, 7, 13):
        result = stories_decoder.generate(case["prompt_ids"], n, resolve_profile("default"))
        assert result.token_ids == case["greedy_ids"][:n]
        assert result.stop_reason == "max_new_tokens"


def test_consecutive_generations_on_one_decoder_equal_fresh_runs(stories_artifact, stories_decoder, reference_greedy):
    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine
    from lade_export.runtime import Decoder

    profile = resolve_profile("default")
    a, b = reference_greedy["cases"][0]["prompt_ids"], reference_greedy["cases"][2]["prompt_ids"]
    first = stories_decoder.generate(a, 96, profile)
    second = stories_decoder.generate(b, 96, profile)
    again = stories_decoder.generate(a, 96, profile)
    art = Artifact(stories_artifact)
    fresh = lambda ids: Decoder(OrtEngine(art.onnx_path, art.dims), art.stop_token_ids, art.max_context).generate(  # noqa: E731
        ids, 96, profile)
    fresh_a, fresh_b = fresh(a), fresh(b)
    assert first.token_ids == again.token_ids == fresh_a.token_ids
    assert first.stats.steps == again.stats.steps == fresh_a.stats.steps
    assert second.token_ids == fresh_b.token_ids and second.stats.steps == fresh_b.stats.steps


def test_torch_backend_gives_the_same_tokens(stories_loaded, reference_greedy):
    from lade_export.export.torch_engine import TorchEngine
    from lade_export.runtime import Decoder

    decoder = Decoder(TorchEngine(stories_loaded.model), [], 512)
    for case in reference_greedy["cases"]:
        assert decoder.generate(case["prompt_ids"], 128, resolve_profile("small")).token_ids == case["greedy_ids"]


def test_context_overflow_is_refused_before_any_work(stories_decoder):
    with pytest.raises(GenerationError, match=r"prompt \(5 tokens\) \+ max_new_tokens \(508\) = 513 exceeds the model's "
                                              r"context of 512 tokens"):
        stories_decoder.generate([1, 403, 407, 261, 378], 508, resolve_profile("default"))


@pytest.mark.parametrize("bad", [0, -3])
def test_max_new_tokens_must_be_positive(stories_decoder, bad):
    with pytest.raises(GenerationError, match=f"max_new_tokens must be an integer ≥ 1, got {bad}"):
        stories_decoder.generate([1, 403], bad)


def test_empty_prompt_ids_are_refused(stories_decoder):
    with pytest.raises(GenerationError, match="empty prompt"):
        stories_decoder.generate([], 8)


def test_text_is_decoded(stories_decoder, reference_greedy):
    case = reference_greedy["cases"][0]
    result = stories_decoder.generate(case["prompt_ids"], 24, resolve_profile("default"))
    assert result.text.startswith(", there was a little girl named Lily.")


def test_the_kv_cache_is_never_copied_per_step(stories_artifact, reference_greedy):
    """Every step hands the engine views of the same preallocated buffers (one address per
    layer, growing length), and ONNX Runtime's engine passes them on as they are."""
    import numpy as np

    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine
    from lade_export.runtime import Decoder

    art = Artifact(stories_artifact)
    engine = OrtEngine(art.onnx_path, art.dims)
    seen = []
    real_run = engine.session.run

    def spy_session_run(names, feeds):
        key = feeds["past_key_values.0.key"]
        seen.append((key.__array_interface__["data"][0], key.shape[1], key.flags.owndata, key.flags.c_contiguous))
        return real_run(names, feeds)

    engine.session = type("Spy", (), {"run": staticmethod(spy_session_run), "get_outputs": engine.session.get_outputs})()
    case = reference_greedy["cases"][0]
    result = Decoder(engine, [], 512).generate(case["prompt_ids"], 64, resolve_profile("default"))
    assert result.token_ids == case["greedy_ids"][:64]
    steps = seen[1:]  # after the prefill (an empty cache)
    assert len(steps) == result.stats.steps and len(steps) > 10
    assert len({address for address, *_ in steps}) == 1  # one buffer, never reallocated or copied
    assert all(not owns and contiguous for _, _, owns, contiguous in steps)  # views, contiguous
    lengths = [n for _, n, _, _ in steps]  # the cache grows by the accepted tokens, step after step
    assert lengths[0] == len(case["prompt_ids"]) - 1 and np.all(np.diff(lengths) >= 1)
    assert lengths[-1] < len(case["prompt_ids"]) + 64 - 1
