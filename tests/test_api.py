"""The embeddable runtime on stories260K: the one-call API, streaming text, stop strings,
cancellation, timeouts and many requests on one engine — every output checked against
the reference greedy oracle or the serial run."""

import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest

import lade_export
from lade_export.errors import GenerationError, ProfileError
from lade_export.profile import GREEDY, LookaheadProfile, bundled_profiles_dir, load_profile, request_profile
from lade_export.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(stories_artifact):
    m = lade_export.load(stories_artifact)
    yield m
    m.close()


def _oracle(reference_greedy, i=0):
    return reference_greedy["cases"][i]


@pytest.mark.parametrize("batching", [False, True], ids=["unbatched", "scheduler"])
def test_generate_through_the_api_imports_neither_torch_nor_transformers(stories_artifact, reference_greedy, batching):
    code = (
        "import sys, lade_export\n"
        f"m = lade_export.load({str(stories_artifact)!r}, batching={batching})\n"
        "r = m.generate('Once upon a time', max_new_tokens=30, profile='default')\n"
        "print(r.token_ids)\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ids, modules = proc.stdout.strip().splitlines()
    assert eval(ids) == _oracle(reference_greedy)["greedy_ids"][:30]
    assert modules == "False False"


def test_plain_text_prompt_without_chat_template_matches_the_oracle(model, reference_greedy):
    case = _oracle(reference_greedy)
    assert model.encode("Once upon a time") == case["prompt_ids"]
    result = model.generate("Once upon a time", max_new_tokens=40)
    assert result.token_ids == case["greedy_ids"][:40]
    assert result.text == model.tokenizer.decode(case["greedy_ids"][:40])
    assert result.stop_reason == "max_new_tokens"
    assert model.default_profile.name == "default"


def test_streamed_chunks_concatenate_to_the_result(model, reference_greedy):
    stream = model.stream("Once upon a time", max_new_tokens=64, profile="small")
    chunks = list(stream)
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == stream.result.text
    assert [t for c in chunks for t in c.token_ids] == stream.result.token_ids == _oracle(reference_greedy)["greedy_ids"][:64]
    assert stream.result.stats.steps == len(chunks)  # one chunk per decode step
    assert any(len(c.token_ids) > 1 for c in chunks)  # lookahead accepted blocks


def test_inline_profiles_with_four_numbers_and_greedy(model, reference_greedy):
    ids = _oracle(reference_greedy, 1)["prompt_ids"]
    expected = _oracle(reference_greedy, 1)["greedy_ids"][:48]
    assert model.generate(ids, max_new_tokens=48, profile="1,2,1,10").token_ids == expected
    plain = model.generate(ids, max_new_tokens=48, lookahead=False)
    assert plain.token_ids == expected and plain.stats.steps == 48
    assert model.generate(ids, max_new_tokens=48, profile=LookaheadProfile(3, 3, 3)).token_ids == expected


def test_every_spelling_of_plain_greedy_is_the_greedy_profile(model, reference_greedy):
    off = load_profile(bundled_profiles_dir() / "greedy-only.toml")  # enabled = false
    assert off.name == "greedy-only" and not off.enabled
    spellings = [model.resolve_profile("greedy"), model.resolve_profile(GREEDY), model.resolve_profile(off),
                 model.resolve_profile("small", lookahead=False), model.resolve_profile(None, lookahead=False),
                 request_profile(None), request_profile("greedy"), request_profile(LookaheadProfile(3, 4, 2, enabled=False))]
    assert all(p is GREEDY for p in spellings)
    assert model.resolve_profile(None) is model.default_profile and model.resolve_profile("small").name == "small"
    case = _oracle(reference_greedy, 2)
    for kwargs in (dict(profile="greedy"), dict(profile=GREEDY), dict(profile=off), dict(lookahead=False),
                   dict(profile="small", lookahead=False)):
        result = model.generate(case["prompt_ids"], max_new_tokens=40, **kwargs)
        assert result.token_ids == case["greedy_ids"][:40] and result.stats.steps == 40, kwargs
    look = model.generate(case["prompt_ids"], max_new_tokens=40, profile="default")
    assert look.token_ids == case["greedy_ids"][:40] and look.stats.steps < 40


@pytest.mark.parametrize("batching", [False, True], ids=["unbatched", "scheduler"])
def test_stop_token_ids_are_per_request(stories_artifact, reference_greedy, batching):
    """Concurrent requests with their own stop ids each stop at their own first one, as
    plain greedy decoding does; a request that gives none keeps the artifact's (the
    oracle has no EOS in its 128 tokens, so it runs to the end)."""
    case = _oracle(reference_greedy, 0)
    ids = case["greedy_ids"]
    specs = [([426], "default"), ([13, 426], "small"), ((), "default"), (None, "small"), ([ids[20]], "greedy")]
    with lade_export.load(stories_artifact, batching=batching) as model:
        assert model.decoder.stop_token_ids == frozenset([2])
        results = [None] * len(specs)

        def run(i, stops, profile):
            results[i] = model.generate(case["prompt_ids"], max_new_tokens=128, profile=profile, stop_token_ids=stops)

        threads = [threading.Thread(target=run, args=(i, *spec)) for i, spec in enumerate(specs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert model.decoder.stop_token_ids == frozenset([2])
    for (stops, profile), result in zip(specs, results):
        end = min((ids.index(t) + 1 for t in stops or () if t in ids), default=128)
        assert result.token_ids == ids[:end], (stops, profile)
        assert result.stop_reason == ("stop_token" if end < 128 else "max_new_tokens"), (stops, profile)
    assert len(results[0].token_ids) == ids.index(426) + 1 < 128


def test_sampling_object_and_flat_keywords_decode_alike(model, reference_greedy):
    case = _oracle(reference_greedy, 1)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    for profile in ("greedy", "small"):
        by_object = model.generate(case["prompt_ids"], max_new_tokens=32, profile=profile, sampling=params)
        flat = model.generate(case["prompt_ids"], max_new_tokens=32, profile=profile, temperature=0.9, top_p=0.9,
                              seed=5)
        assert by_object.token_ids == flat.token_ids and by_object.stats.decoding == "sampling T=0.9 top-p 0.9 seed 5"
    greedy = model.generate(case["prompt_ids"], max_new_tokens=32, sampling=SamplingParams())
    assert greedy.token_ids == case["greedy_ids"][:32] and greedy.stats.decoding == "greedy"


def _shortest_prefix_containing(tok, ids, stop):
    """Fewest leading ids whose text contains ``stop``."""
    return next(k for k in range(len(ids) + 1) if stop in tok.decode(ids[:k]))


def test_stop_string_inside_a_block_accepted_in_one_step(model, reference_greedy):
    # the "wide" profile (W=5, N=4, G=5) accepts blocks of several tokens on this prompt
    case = _oracle(reference_greedy, 1)
    tok = model.tokenizer
    full = model.generate(case["prompt_ids"], max_new_tokens=128, profile="wide")
    chunks = list(model.stream(case["prompt_ids"], max_new_tokens=128, profile="wide"))
    # a block of ≥ 3 tokens whose 2nd+3rd tokens' text first appears there: a stop string
    # that completes in the middle of a block accepted in one step
    starts = [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    found = None
    for chunk, n_before in zip(chunks, starts):
        if len(chunk.token_ids) >= 4:
            stop = tok.decode(full.token_ids[: n_before + 3])[len(tok.decode(full.token_ids[: n_before + 1])):]
            if stop.strip() and _shortest_prefix_containing(tok, full.token_ids, stop) == n_before + 3:
                found = (chunk, n_before, stop)
                break
    assert found is not None
    block, n_before, stop = found
    result = model.generate(case["prompt_ids"], max_new_tokens=128, profile="wide", stop=stop)
    cut = n_before + 3
    assert result.stop_reason == "stop_string"
    assert result.token_ids == full.token_ids[:cut]
    assert result.text == full.text[: full.text.index(stop)]


def test_stop_string_spanning_tokens_and_several_strings(model, reference_greedy):
    case = _oracle(reference_greedy, 0)
    greedy = case["greedy_ids"]
    text = model.tokenizer.decode(greedy[:128])
    stop = "girl na"  # " girl" and " named" are separate tokens: the string spans them
    result = model.generate(case["prompt_ids"], max_new_tokens=128, profile="small", stop=[stop, "park"])
    assert result.text == text[: text.index(stop)]
    assert result.token_ids == greedy[: len(result.token_ids)]
    assert stop in model.tokenizer.decode(result.token_ids)
    assert stop not in model.tokenizer.decode(result.token_ids[:-1])
    earlier = model.generate(case["prompt_ids"], max_new_tokens=128, profile="small", stop=["park", "Lily"])
    assert earlier.text == text[: text.index("Lily")]  # the first match in the text wins
    streamed = "".join(c.text for c in model.stream(case["prompt_ids"], max_new_tokens=128, stop=[stop]))
    assert streamed == result.text  # no part of the stop string was streamed


def test_greedy_and_lookahead_stop_at_the_same_token(model, reference_greedy):
    case = _oracle(reference_greedy, 2)
    stops = ["the", ". ", "!"]
    look = model.generate(case["prompt_ids"], max_new_tokens=128, profile="default", stop=stops)
    plain = model.generate(case["prompt_ids"], max_new_tokens=128, lookahead=False, stop=stops)
    assert look.token_ids == plain.token_ids and look.text == plain.text
    assert look.stop_reason == plain.stop_reason == "stop_string"


def test_cancel_mid_stream_frees_the_cache_and_the_engine_keeps_serving(model, reference_greedy):
    case = _oracle(reference_greedy, 0)
    decoder = model.decoder
    stream = model.stream(case["prompt_ids"], max_new_tokens=200, profile="default")
    first = next(stream)
    assert decoder.active_requests == 1 and decoder.kv_cache_bytes > 0
    frame_cache = [v for v in stream._chunks.gi_frame.f_locals.values() if type(v).__name__ == "KVCache"][0]
    watch = weakref.ref(frame_cache)
    del frame_cache
    stream.cancel()
    rest = list(stream)
    assert rest[-1].stop_reason == "cancelled" and len(rest) == 1  # stopped before its next step
    got = first.token_ids + rest[-1].token_ids
    assert got == case["greedy_ids"][: len(got)] and len(got) < 200
    assert stream.result.stop_reason == "cancelled"
    del stream, rest
    gc.collect()
    assert watch() is None
    assert decoder.active_requests == 0 and decoder.kv_cache_bytes == 0
    again = model.generate(case["prompt_ids"], max_new_tokens=64)
    assert again.token_ids == case["greedy_ids"][:64]


def test_closing_a_stream_early_ends_the_request(model, reference_greedy):
    case = _oracle(reference_greedy, 1)
    with model.stream(case["prompt_ids"], max_new_tokens=100) as stream:
        for i, _ in enumerate(stream):
            if i == 2:
                break
    assert model.decoder.active_requests == 0
    event = threading.Event()
    event.set()
    cancelled = model.generate(case["prompt_ids"], max_new_tokens=100, cancel=event)
    assert cancelled.stop_reason == "cancelled" and cancelled.token_ids == [] and cancelled.stats.steps == 0
    timed_out = model.generate(case["prompt_ids"], max_new_tokens=100, timeout_s=1e-9)  # 0 is refused
    assert timed_out.stop_reason == "timeout" and timed_out.token_ids == []


def test_closing_a_stream_from_another_thread_inside_a_step_cancels_it(model, reference_greedy, monkeypatch):
    """A generator cannot be closed while its reader's thread runs it ("generator already
    executing"): close() from another thread then asks the request to stop before its next
    step, and the reader gets the last chunk, "cancelled" (it raised a raw ValueError)."""
    case = _oracle(reference_greedy, 1)
    engine, inside, release, calls = model.decoder.engine, threading.Event(), threading.Event(), []
    run = engine.run

    def held_run(feeds, **kw):  # the third step waits inside the engine until released
        calls.append(1)
        if len(calls) == 3:
            inside.set()
            release.wait(30)
        return run(feeds, **kw)

    monkeypatch.setattr(engine, "run", held_run)
    stream = model.stream(case["prompt_ids"], max_new_tokens=100, lookahead=False)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    assert inside.wait(30)
    stream.close()  # the reader is inside next(): no error here
    release.set()
    reader.join(30)
    assert not reader.is_alive() and chunks[-1].final and chunks[-1].stop_reason == "cancelled"
    assert len(calls) == 3 and model.decoder.active_requests == 0  # no step after the one it was in


def test_eight_threads_with_different_prompts_and_profiles_equal_their_serial_runs(model, reference_greedy):
    prompts = ["Once upon a time", "Tom and Sue went to the beach.", "The little dog", "One day, a girl named Lily",
               "The sun was shining", "Ben had a red ball", "Mom said", "A big bird"]
    profiles = ["default", "small", "1,2,1,10", None, "paper", "3,3,3", "default", "2,4,2,4"]
    serial = [model.generate(p, max_new_tokens=80, profile=f, lookahead=f is not None, stop=["!"])
              for p, f in zip(prompts, profiles)]
    results = [None] * 8
    errors = []
    barrier = threading.Barrier(8)

    def work(i):
        try:
            barrier.wait()
            stream = model.stream(prompts[i], max_new_tokens=80, profile=profiles[i], lookahead=profiles[i] is not None,
                                  stop=["!"])
            text = "".join(c.text for c in stream)
            results[i] = (text, stream.result)
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for (text, result), ref in zip(results, serial):
        assert result.token_ids == ref.token_ids and text == ref.text == result.text
    assert model.decoder.active_requests == 0


def test_prompt_token_ids_outside_the_vocabulary_are_refused(model):
    for ids in ([99999], [1, -1]):
        with pytest.raises(GenerationError) as info:
            model.generate(ids, max_new_tokens=2)
        assert str(info.value) == f"token id {ids[-1]} is outside the vocabulary (0..511)"
    assert model.decoder.active_requests == 0


def test_unknown_backend_and_dtype_are_refused(stories_artifact):
    from lade_export.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"^unknown backend 'nope': ort, torch, tensorrt$"):
        lade_export.load(stories_artifact, backend="nope")
    with pytest.raises(GenerationError, match=r"^dtype must be float32, float16 or bfloat16, got 'fp16'$"):
        lade_export.load(stories_artifact, backend="torch", dtype="fp16")
    for threads in (0, -1, 1.5, True):  # the CLI's --threads is ≥ 1 too
        with pytest.raises(GenerationError, match=r"^threads must be an integer ≥ 1 \(None: one per core\), got "):
            lade_export.load(stories_artifact, threads=threads)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(max_new_tokens=600), GenerationError,
     "prompt (5 tokens) + max_new_tokens (600) = 605 exceeds the model's context of 512 tokens"),
    (dict(max_new_tokens=0), GenerationError, "max_new_tokens must be an integer ≥ 1, got 0"),
    (dict(profile="nope"), ProfileError, "profile file not found: nope"),
    (dict(profile=3), ProfileError,
     'profile must be a name, a TOML path, W,N,G[,K[,B]], "greedy" or a LookaheadProfile, got int 3'),
    (dict(lookahead="no"), ProfileError, "lookahead must be True or False, got 'no'"),
    (dict(profile="100,5,100"), ProfileError, "its largest step (801 tokens) does not fit the model's context of 512"),
    (dict(chat=True), GenerationError, "this model has no chat template; pass plain text (--no-chat)"),
    (dict(stop_token_ids=[2, 512]), GenerationError,
     "stop_token_ids must be a list of token ids (integers 0..511), got 512"),
    (dict(stop_token_ids="2"), GenerationError, "stop_token_ids must be a list of token ids (integers 0..511), got '2'"),
    (dict(stop_token_ids=2), GenerationError, "stop_token_ids must be a list of token ids (integers 0..511), got 2"),
    (dict(stop_token_ids=[None]), GenerationError,
     "stop_token_ids must be a list of token ids (integers 0..511), got None"),
    (dict(stop_token_ids=[True]), GenerationError,
     "stop_token_ids must be a list of token ids (integers 0..511), got True"),
    (dict(sampling=SamplingParams(0.8), temperature=0.8, seed=1), GenerationError,
     "give sampling= or temperature=, seed=, not both (sampling= holds temperature, top_k, top_p and seed)"),
    (dict(sampling={"temperature": 0.8}), GenerationError, "sampling must be a SamplingParams, got dict"),
    (dict(temperature=-1), GenerationError, "temperature must be a number ≥ 0, got -1"),
])
def test_bad_requests_fail_before_any_work(model, kwargs, error, message):
    with pytest.raises(error) as info:
        model.stream("Once upon a time", **kwargs)
    assert message in str(info.value)
    assert model.decoder.active_requests == 0


LLAMA2_STYLE_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set sys = false %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' }}"
    "{% if loop.first and sys %}{{ '<<SYS>>\\n' + sys + '\\n<</SYS>>\\n\\n' }}{% endif %}"
    "{{ message['content'] | trim + ' [/INST]' }}"
    "{% else %}{% generation %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}{{ {'k': 'é'} | tojson }}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "system", "content": "You are kind."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello, friend."}, {"role": "user", "content": "  Where is the café? 😀 "}],
]


def test_chat_template_renders_like_transformers(stories_dir, tmp_path):
    from transformers import AutoTokenizer

    from lade_export.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(stories_dir)
    hf.chat_template = LLAMA2_STYLE_TEMPLATE
    ours = Tokenizer(stories_dir / "tokenizer.json", LLAMA2_STYLE_TEMPLATE, hf.special_tokens_map, hf.bos_token_id)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ref = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref
            assert ours.render_chat(messages, gen) == hf.apply_chat_template(messages, add_generation_prompt=gen,
                                                                             tokenize=False)
    with pytest.raises(GenerationError, match="chat template: roles must alternate user/assistant"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_a_chat_template_that_fails_while_rendering_is_one_error(stories_dir):
    """A template (the artifact's data) whose expression raises while it renders is a
    GenerationError naming what failed, not the template engine's traceback."""
    from lade_export.tokenizer import Tokenizer

    for template, message in (
            ("{{ 1/0 }}", "chat template failed: ZeroDivisionError: division by zero"),
            ("{{ messages[0].content + 1 }}", 'chat template failed: TypeError: can only concatenate str (not "int") '
                                              'to str'),
            ("{{ messages[5].content }}", "chat template: list object has no element 5")):  # jinja2's own error
        ours = Tokenizer(stories_dir / "tokenizer.json", template, {}, None)
        with pytest.raises(GenerationError) as err:
            ours.apply_chat_template([{"role": "user", "content": "hi"}])
        assert str(err.value) == message
    ours = Tokenizer(stories_dir / "tokenizer.json", "{{ bos_token }}", {"bos_token": "<s>"}, None)
    with pytest.raises(TypeError, match="got values for bos_token, which the tokenizer sets itself"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}], bos_token="<x>")  # the caller's mistake


def test_readme_python_example_runs_as_written(stories_artifact, tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = readme.split("## Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "smollm2").symlink_to(stories_artifact)  # the README's path, a stories build behind it
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "steps" in proc.stdout and "compression" in proc.stdout


def test_a_refused_scheduler_option_closes_the_engine_load_opened(stories_artifact, monkeypatch):
    import lade_export.backends as backends

    opened = []
    real = backends.open_engine

    def recording(*args, **kwargs):
        opened.append(real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(backends, "open_engine", recording)
    with pytest.raises(GenerationError, match=r"^token_budget must be an integer ≥ 1, got 0$"):
        lade_export.load(stories_artifact, batching=True, token_budget=0)
    assert len(opened) == 1 and opened[0].session is None  # closed, not left to the collector


def test_a_closed_model_refuses_in_one_typed_line(stories_artifact):
    model = lade_export.load(stories_artifact)
    model.close()
    with pytest.raises(GenerationError, match=r"^the model was closed \(Model.close\); load it again to decode$"):
        model.generate("Once upon a time", max_new_tokens=4)
