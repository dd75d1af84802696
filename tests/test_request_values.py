"""Request values at their edges on stories260K: temperatures too small to sample with,
numpy numbers, timeouts and empty stop strings, through the API, the CLI and Triton's
request parsing."""

import math

import numpy as np
import pytest
from click.testing import CliRunner

import lade_export
from lade_export.cli import main
from lade_export.errors import GenerationError
from lade_export.sampling import GREEDY_BELOW, SamplingParams, SamplingRule, filtered_probs, sample
from lade_export.serving import protocol

from .test_serving import SETTINGS, _inputs


@pytest.fixture(scope="module")
def model(stories_artifact):
    m = lade_export.load(stories_artifact)
    yield m
    m.close()


def _case(reference_greedy):
    return reference_greedy["cases"][0]


# -- temperatures below the sampling threshold ---------------------------------------------

@pytest.mark.parametrize("temperature", [1e-308, 5e-324, 1e-300, 1e-7, np.nextafter(GREEDY_BELOW, 0)])
@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "plain"])
def test_a_temperature_below_the_threshold_is_greedy(model, reference_greedy, temperature, lookahead):
    case = _case(reference_greedy)
    r = model.generate(case["prompt_ids"], max_new_tokens=40, temperature=temperature, top_k=5, top_p=0.9, seed=3,
                       lookahead=lookahead)
    assert r.token_ids == case["greedy_ids"][:40]
    assert r.stats.decoding == "greedy"


def test_the_threshold_itself_samples():
    assert GREEDY_BELOW == 1e-5
    assert SamplingParams(1e-5).greedy is False and SamplingParams(1e-5).describe() == "sampling T=1e-05"
    assert SamplingParams(9.9e-6).greedy is True and SamplingParams(9.9e-6).describe() == "greedy"
    probs = filtered_probs(np.array([0.0, 3.0, 2.5, 3.0 - 1e-3], dtype=np.float32), SamplingParams(GREEDY_BELOW))
    assert np.isfinite(probs).all() and probs.argmax() == 1 and probs.sum() == pytest.approx(1.0)


def test_cli_tiny_temperature_decodes_greedily(stories_artifact, reference_greedy):
    greedy = CliRunner().invoke(main, ["generate", str(stories_artifact), "--prompt", "Once upon a time",
                                       "--max-new-tokens", "24", "--greedy"], catch_exceptions=False)
    tiny = CliRunner().invoke(main, ["generate", str(stories_artifact), "--prompt", "Once upon a time",
                                     "--max-new-tokens", "24", "--temperature", "1e-308"], catch_exceptions=False)
    assert tiny.exit_code == 0, tiny.output
    assert tiny.stdout == greedy.stdout and len(tiny.stdout) > 20
    assert ", greedy] steps " in tiny.stderr


def test_non_finite_logits_never_reach_a_token_choice():
    message = "the model's logits are not finite (NaN or infinity); no token can be sampled from them"
    params = SamplingParams(0.8, top_p=0.9)
    for bad in (np.nan, np.inf):
        logits = np.array([0.5, bad, 1.0], dtype=np.float32)
        with pytest.raises(GenerationError) as info:
            filtered_probs(logits, params)
        assert str(info.value) == message
        rule = SamplingRule(params)
        with pytest.raises(GenerationError) as info:
            rule.choose({"logits": logits[None, None]}, 0, [(2, 7)])
        assert str(info.value) == message
    # A temperature that divides the logits into overflow, given to the filter directly.
    with pytest.raises(GenerationError) as info:
        filtered_probs(np.array([1.0, 2.0], dtype=np.float32), SamplingParams(1e-308))
    assert str(info.value) == message
    rng = np.random.default_rng(0)
    for probs in (np.array([0.2, np.nan, 0.3]), np.zeros(3)):
        with pytest.raises(GenerationError) as info:
            sample(probs, rng)
        assert str(info.value) == "no token has a finite positive probability; cannot sample"


# -- numpy numbers --------------------------------------------------------------------------

def test_sampling_params_accept_numpy_numbers_as_plain_ones():
    p = SamplingParams(np.float32(0.7), np.int64(40), np.float64(0.95), np.uint64(7))
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (float(np.float32(0.7)), 40, 0.95, 7)
    assert [type(v) for v in (p.temperature, p.top_k, p.top_p, p.seed)] == [float, int, float, int]
    assert SamplingParams(np.int32(1)).temperature == 1.0
    for kwargs, message in ((dict(top_k=np.bool_(True)), "top_k must be an integer ≥ 0 (0: off), got True"),
                            (dict(temperature=np.float32(-0.5)), "temperature must be a number ≥ 0, got -0.5"),
                            (dict(temperature=1.0, seed=np.int64(-1)), "seed must be an integer ≥ 0, got -1"),
                            (dict(temperature=1.0, top_k=np.float64(3.0)), "top_k must be an integer ≥ 0 (0: off), got 3.0"),
                            (dict(temperature=True), "temperature must be a number ≥ 0, got True")):
        with pytest.raises(GenerationError) as info:
            SamplingParams(**kwargs)
        assert str(info.value) == message


def test_api_accepts_numpy_numbers(model, reference_greedy):
    case = _case(reference_greedy)
    plain = model.generate(case["prompt_ids"], max_new_tokens=32, temperature=0.7, top_k=40, top_p=0.95, seed=7)
    numpy = model.generate(case["prompt_ids"], max_new_tokens=np.int64(32), temperature=np.float32(0.7),
                           top_k=np.int64(40), top_p=np.float64(0.95), seed=np.int64(7))
    assert numpy.token_ids == plain.token_ids and len(numpy.token_ids) == 32
    assert numpy.stats.decoding == "sampling T=0.7 top-k 40 top-p 0.95 seed 7"
    greedy = model.generate(case["prompt_ids"], max_new_tokens=np.int32(12), timeout_s=np.float64(60))
    assert greedy.token_ids == case["greedy_ids"][:12]
    with pytest.raises(GenerationError) as info:
        model.generate(case["prompt_ids"], max_new_tokens=np.bool_(True))
    assert str(info.value) == "max_new_tokens must be an integer ≥ 1, got True"
    n = len(case["prompt_ids"])
    # a numpy integer near its type's largest value: the context check adds in Python, not wrapping at 16 or 64 bits
    for big in (np.int16(32767), np.int32(2**31 - 1), np.int64(2**63 - 1), np.uint64(2**64 - 1)):
        with pytest.raises(GenerationError) as info:
            model.generate(case["prompt_ids"], max_new_tokens=big, timeout_s=30)  # a wrapped sum would decode on
        assert str(info.value) == (f"prompt ({n} tokens) + max_new_tokens ({int(big)}) = {n + int(big)} exceeds the "
                                   f"model's context of 512 tokens")


def test_api_takes_numpy_token_ids(model, reference_greedy):
    case = _case(reference_greedy)
    ids = case["prompt_ids"]
    assert model.encode(np.array(ids, dtype=np.int64)) == ids
    assert model.encode([np.int32(t) for t in ids]) == ids and all(type(t) is int for t in model.encode(tuple(ids)))
    r = model.generate(np.array(ids), max_new_tokens=16)
    assert r.token_ids == case["greedy_ids"][:16]
    for bad in (np.array(ids, dtype=np.float32), [1, True], np.array([ids])):
        with pytest.raises(GenerationError) as info:
            model.encode(bad)
        assert str(info.value) == "prompt must be text, a list of chat messages, or a list of token ids"


# -- timeouts -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -1, 0, 0.0, -math.inf, "5", True, np.float32("nan")])
def test_timeout_must_be_a_finite_positive_number(model, reference_greedy, value):
    with pytest.raises(GenerationError) as info:
        model.stream(_case(reference_greedy)["prompt_ids"], max_new_tokens=4, timeout_s=value)
    shown = repr(value.item() if isinstance(value, np.generic) else value)  # numpy numbers shown as plain ones
    assert str(info.value) == f"timeout_s must be a finite number of seconds > 0, got {shown}"
    assert model.decoder.active_requests == 0


def test_a_tiny_timeout_still_times_out(model, reference_greedy):
    r = model.generate(_case(reference_greedy)["prompt_ids"], max_new_tokens=100, timeout_s=1e-9)
    assert r.stop_reason == "timeout" and r.token_ids == []


# -- empty stop strings ---------------------------------------------------------------------

EMPTY_STOP = "stop strings must not be empty"


@pytest.mark.parametrize("stop", ["", ["", "x"], ("x", "")])
def test_api_refuses_an_empty_stop_string(model, stop):
    with pytest.raises(GenerationError) as info:
        model.stream("Once upon a time", max_new_tokens=4, stop=stop)
    assert str(info.value) == EMPTY_STOP
    assert model.decoder.active_requests == 0


def test_cli_and_triton_refuse_an_empty_stop_string_with_the_same_message(stories_artifact):
    result = CliRunner().invoke(main, ["generate", str(stories_artifact), "--prompt", "hi", "--stop", "",
                                       "--max-new-tokens", "4"], catch_exceptions=False)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {EMPTY_STOP}" and result.stdout == ""
    with pytest.raises(GenerationError) as info:
        protocol.parse_request(_inputs(prompt="hi", stop=["."] + [""]), SETTINGS)
    assert str(info.value) == EMPTY_STOP


# -- values of other types, and text that UTF-8 cannot hold ---------------------------------

@pytest.mark.parametrize("request_values, message", [
    (dict(prompt="Once upon a time \ud800"),
     "the prompt is not valid Unicode text: a lone surrogate U+D800 at character 17"),
    (dict(prompt=[{"role": "user", "content": "hi \udc00"}]),
     "messages[0].content is not valid Unicode text: a lone surrogate U+DC00 at character 3"),
    (dict(prompt="Once upon a time", stop=5), "stop must be a list of strings, got 5"),
    (dict(prompt="Once upon a time", stop=[5]), "stop strings must be strings, got 5"),
    (dict(prompt="Once upon a time", stop=b"x"), "stop must be a list of strings, got b'x'"),
    (dict(prompt="Once upon a time", stop=["\ud800"]),
     "a stop string is not valid Unicode text: a lone surrogate U+D800 at character 0"),
    (dict(prompt="Once upon a time", cancel=True),
     "cancel must be a threading.Event (anything with is_set()), got bool"),
    (dict(prompt=[{"role": "user", "content": None}]),
     "messages[0].content must be a string or a list of text parts, got nothing"),
    (dict(prompt=[{"role": "user"}]), "messages[0].content must be a string or a list of text parts, got nothing"),
    (dict(prompt=[{"role": "user", "content": 5}]), "messages[0].content must be a string or a list of text parts, got int"),
    (dict(prompt=[{"content": "hi"}]), "messages[0] needs a string role"),
    (dict(prompt=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
     "messages[0].content: only text parts ({type: text, text}) are supported"),
], ids=["surrogate", "message-surrogate", "stop-int", "stop-list-int", "stop-bytes", "stop-surrogate", "cancel-bool",
        "content-none", "content-missing", "content-int", "role-missing", "content-image"])
def test_values_of_the_wrong_kind_are_one_typed_line_before_any_work(model, request_values, message):
    from .test_control_tokens import _stories_chat

    request_values = dict(request_values)
    prompt = request_values.pop("prompt")
    with pytest.raises(GenerationError) as err:
        if isinstance(prompt, list):  # stories260K has no chat template: its tokenizer with one (what encode calls)
            _stories_chat().apply_chat_template(prompt)
        else:
            model.generate(prompt, max_new_tokens=4, **request_values)
    assert str(err.value) == message


def test_text_parts_of_a_message_read_as_their_joined_string():
    from .test_control_tokens import _stories_chat

    tok = _stories_chat()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Once upon"}, {"type": "text", "text": " a time"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "Once upon a time"}])
