"""Continuous batching on stories260K: requests sharing the scheduler's passes each decode
exactly what they decode alone (the single-request Decoder on the same engine), whatever
joins, leaves, is cancelled or fails beside them."""

import gc
import os
import threading
import time

import numpy as np
import pytest

from lade_export.errors import EngineError, GenerationError
from lade_export.profile import LookaheadProfile, resolve_profile
from lade_export.runtime import collect
from lade_export.sampling import SamplingParams
from lade_export.scheduler import Scheduler

from .engine_wrappers import WrappedEngine
from .test_tensorrt_double import V10, art10  # noqa: F401 - a session fixture: stories260K's TensorRT engines (double)
from .threads import run_in_threads

# (prompt case, profile, sampling, stop strings, max_new_tokens): eight requests that differ in every rule.
REQUESTS = [
    (0, None, None, (), 96),
    (1, "default", None, (), 128),
    (2, "small", None, (" the",), 80),
    (0, "paper", None, (), 64),
    (1, LookaheadProfile(1, 2, 0), SamplingParams(0.8, 0, 0.9, 3), (), 72),
    (2, LookaheadProfile(4, 2, 6), None, ("Lily",), 128),
    (0, None, SamplingParams(1.0, 20, 1.0, 11), (), 50),
    (1, "default", SamplingParams(0.7, 0, 1.0, 5), (".",), 100),
]


def _profile(p):
    return resolve_profile(p) if isinstance(p, str) else p


def _solo(decoder, reference_greedy, spec):
    case, prof, sampling, stop, n = spec
    return decoder.generate(reference_greedy["cases"][case]["prompt_ids"], n, _profile(prof), stop=stop,
                            sampling=sampling)


def _submit(scheduler, reference_greedy, spec):
    case, prof, sampling, stop, n = spec
    return scheduler.stream(reference_greedy["cases"][case]["prompt_ids"], n, _profile(prof), stop=stop,
                            sampling=sampling)


@pytest.fixture(scope="module")
def solo(stories_decoder, reference_greedy):
    return [_solo(stories_decoder, reference_greedy, spec) for spec in REQUESTS]


def _same(a, b):
    """Same output; and for a sampled request the same steps (the adaptive width policy
    may take a greedy request's steps narrower, never a sampled one's)."""
    steps = (a.stats.steps, b.stats.steps) if a.stats.decoding != "greedy" else ()
    return (a.token_ids, a.text, a.stop_reason, *steps[:1]) == (b.token_ids, b.text, b.stop_reason, *steps[1:])


def _run_concurrently(scheduler, reference_greedy, specs) -> list:
    """Each spec's request streamed from a thread of its own through ``scheduler``, which is
    closed afterwards; the results in the order of ``specs``."""
    results = [None] * len(specs)

    def run(i):
        results[i] = collect(_submit(scheduler, reference_greedy, specs[i]))

    run_in_threads(run, len(specs))
    scheduler.close()
    return results


@pytest.mark.parametrize("budget,chunk,policy", [(64, 512, "adaptive"), (12, 5, "adaptive"), (12, 5, "profile")],
                         ids=["defaults", "tight-budget-chunked-prefill", "tight-budget-profile-widths"])
def test_eight_concurrent_requests_each_equal_their_solo_run(stories_decoder, reference_greedy, solo, budget, chunk,
                                                             policy):
    scheduler = Scheduler(stories_decoder, token_budget=budget, prefill_chunk=chunk, width_policy=policy)
    for i, (got, want) in enumerate(zip(_run_concurrently(scheduler, reference_greedy, REQUESTS), solo)):
        assert _same(got, want), REQUESTS[i]
    assert max(n for n, _ in scheduler.pass_shapes) >= 4  # they did share passes
    if budget == 12:  # a pass over the budget is one request's step (a lookahead step wider than 12;
        # the adaptive policy narrows greedy steps to fit, so it may have none)
        wide = {n for n, rows in scheduler.pass_shapes if rows > 12}
        assert wide == {1} if policy == "profile" else wide <= {1}
    assert scheduler.pool.used == 0


def test_greedy_requests_equal_the_reference_oracle(stories_decoder, reference_greedy):
    scheduler = Scheduler(stories_decoder, token_budget=24, prefill_chunk=3)
    streams = [scheduler.stream(case["prompt_ids"], 128, prof, stop_token_ids=())  # the oracle ignores EOS
               for case in reference_greedy["cases"] for prof in (None, resolve_profile("default"))]
    results = [collect(s) for s in streams]
    scheduler.close()
    expected = [case["greedy_ids"] for case in reference_greedy["cases"] for _ in range(2)]
    assert [r.token_ids for r in results] == expected


def test_a_cancelled_request_and_a_late_one_leave_the_others_exact(stories_decoder, reference_greedy, solo):
    scheduler = Scheduler(stories_decoder, token_budget=32)
    cancel = threading.Event()
    case, prof, sampling, stop, n = REQUESTS[1]
    a = scheduler.stream(reference_greedy["cases"][case]["prompt_ids"], n, _profile(prof), cancel=cancel)
    b = _submit(scheduler, reference_greedy, REQUESTS[2])
    taken_a = [next(a) for _ in range(3)]
    cancel.set()
    rest_a = list(a)
    taken_b = [next(b) for _ in range(4)]
    late = _submit(scheduler, reference_greedy, REQUESTS[5])  # arrives while b decodes
    got_b = collect(iter(taken_b + list(b)))
    got_late = collect(late)
    scheduler.close()
    chunks_a = taken_a + rest_a
    ids_a = [t for c in chunks_a for t in c.token_ids]
    assert chunks_a[-1].stop_reason == "cancelled"
    assert 3 <= len(ids_a) < len(solo[1].token_ids) and ids_a == solo[1].token_ids[:len(ids_a)]
    assert _same(got_b, solo[2]) and _same(got_late, solo[5])


def test_a_closed_stream_frees_its_kv_columns_and_the_others_go_on(stories_decoder, reference_greedy, solo):
    scheduler = Scheduler(stories_decoder)
    a = _submit(scheduler, reference_greedy, REQUESTS[0])
    b = _submit(scheduler, reference_greedy, REQUESTS[3])
    for _ in range(5):
        next(a)
    a.close()
    got_b = collect(b)
    scheduler.close()
    assert _same(got_b, solo[3])
    assert scheduler.pool.used == 0 and scheduler.active_requests == 0


class _FailOn(WrappedEngine):
    """The stories engine, failing every pass that feeds token ``bad``."""

    def __init__(self, engine, bad):
        super().__init__(engine)
        self.bad = bad

    def run(self, feeds, with_logits=False):
        if np.any(feeds["input_ids"] == self.bad):
            raise EngineError(f"ONNX Runtime step failed: token {self.bad}")
        return self.engine.run(feeds, with_logits)


def test_an_engine_failure_fails_only_the_request_that_causes_it(stories_decoder, reference_greedy, solo):
    from lade_export.runtime import Decoder

    bad = 499  # in no prompt and in no solo output below
    assert all(bad not in s.token_ids for s in solo[:3])
    decoder = Decoder(_FailOn(stories_decoder.engine, bad), stories_decoder.stop_token_ids,
                      stories_decoder.max_context, stories_decoder.tokenizer)
    scheduler = Scheduler(decoder)
    good = [_submit(scheduler, reference_greedy, REQUESTS[i]) for i in range(3)]
    poisoned = scheduler.stream(reference_greedy["cases"][0]["prompt_ids"] + [bad, 300], 20)
    results = [collect(g) for g in good]
    with pytest.raises(EngineError, match="token 499"):
        collect(poisoned)
    scheduler.close()
    assert all(_same(r, s) for r, s in zip(results, solo[:3]))
    assert scheduler.pool.used == 0


class _SlowPrefill(WrappedEngine):
    """The stories engine, 50 ms slower on every pass of more than one row (prompt chunks here)."""

    def run(self, feeds, with_logits=False):
        if feeds["input_ids"].shape[1] > 1:
            time.sleep(0.05)
        return self.engine.run(feeds, with_logits)


def test_host_time_counts_decode_passes_only(stories_decoder, reference_greedy):
    """stats.host_s is decode time outside the engine: the engine time of the passes that
    prefilled the prompt (here 3 chunks, 150 ms) is not subtracted from the decode time
    (it was, so a long prompt made host_s 0)."""
    from lade_export.runtime import Decoder

    decoder = Decoder(_SlowPrefill(stories_decoder.engine), stories_decoder.stop_token_ids,
                      stories_decoder.max_context, stories_decoder.tokenizer)
    scheduler = Scheduler(decoder, prefill_chunk=5)
    result = scheduler.generate(reference_greedy["cases"][1]["prompt_ids"], 4)  # 14 prompt rows: 3 chunks
    scheduler.close()
    stats = result.stats
    assert stats.steps == 4 and stats.prefill_s >= 0.15
    assert 0 < stats.host_s < stats.decode_s


def test_a_host_failure_fails_only_that_request(stories_decoder, reference_greedy, solo):
    class Flaky:
        """A cancel event that breaks on its third look."""
        calls = 0

        def is_set(self):
            Flaky.calls += 1
            if Flaky.calls == 3:
                raise RuntimeError("cancel event broke")
            return False

    scheduler = Scheduler(stories_decoder)
    good = _submit(scheduler, reference_greedy, REQUESTS[1])
    broken = scheduler.stream(reference_greedy["cases"][2]["prompt_ids"], 40, None, cancel=Flaky())
    with pytest.raises(RuntimeError, match="cancel event broke"):
        collect(broken)
    assert _same(collect(good), solo[1])
    scheduler.close()
    assert Flaky.calls == 3 and scheduler.pool.used == 0


def test_a_consumer_that_stops_reading_is_paused_not_the_others(stories_decoder, reference_greedy, solo):
    scheduler = Scheduler(stories_decoder, max_unread=2)
    idle = _submit(scheduler, reference_greedy, REQUESTS[0])
    busy = collect(_submit(scheduler, reference_greedy, REQUESTS[3]))
    assert _same(busy, solo[3])
    with scheduler._cond:
        waiting = [r for r in scheduler._active if r.prompt == reference_greedy["cases"][0]["prompt_ids"]]
    assert waiting and len(waiting[0].out) == 2 and waiting[0].stats.steps == 2
    assert _same(collect(idle), solo[0])
    scheduler.close()


def test_paused_requests_leave_their_places_to_the_streams_read_next(stories_decoder, reference_greedy, solo):
    """Three streams opened up front and read newest first, two at a time in flight
    (max_batch=2): the first two pause with their unread chunks, the third is admitted
    beside them and runs, then each paused one resumes when read; every output is its solo
    run's and no pass carries more than max_batch decode steps."""
    scheduler = Scheduler(stories_decoder, max_batch=2, max_unread=2, timeline=True)
    specs = [REQUESTS[0], REQUESTS[3], REQUESTS[2]]
    streams = [_submit(scheduler, reference_greedy, spec) for spec in specs]
    results = [None] * 3

    def read():
        for i in reversed(range(3)):
            results[i] = collect(streams[i])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(300)
    stuck = reader.is_alive()
    scheduler.close()
    assert not stuck, "the reader waited on a request that paused ones kept out"
    assert all(_same(r, solo[REQUESTS.index(spec)]) for r, spec in zip(results, specs))
    assert max(p.steps for p in scheduler.timeline) == 2
    assert scheduler.pool.used == 0 and scheduler.active_requests == 0


class _CloseDuring(WrappedEngine):
    """The stories engine; once armed, its next pass closes the stream ``victim`` (as another
    thread's close lands while a pass runs)."""

    victim = None

    def run(self, feeds, with_logits=False):
        if self.victim is not None:
            victim, self.victim = self.victim, None
            victim.close()
        return self.engine.run(feeds, with_logits)


def test_a_stream_closed_during_the_last_pass_still_frees_its_columns(stories_decoder, reference_greedy):
    """A stream closed while another reader runs a pass cannot leave then (the pass holds the
    lead); when that pass is the last anyone waits for, the reader that ran it frees the
    closed request's columns on its way out instead of leaving them to a next pass."""
    from lade_export.runtime import Decoder

    engine = _CloseDuring(stories_decoder.engine)
    decoder = Decoder(engine, stories_decoder.stop_token_ids, stories_decoder.max_context, stories_decoder.tokenizer)
    scheduler = Scheduler(decoder)
    closed = scheduler.stream(reference_greedy["cases"][0]["prompt_ids"], 100)
    next(closed)
    last = scheduler.stream(reference_greedy["cases"][1]["prompt_ids"], 3)
    next(last), next(last)  # two of its three tokens: one pass (one greedy step) to go
    engine.victim = closed
    final = next(last)
    assert final.final and engine.victim is None  # its last pass ran, and closed the other stream during it
    assert scheduler.active_requests == 0 and scheduler.pool.used == 0
    scheduler.close()


def test_bad_requests_and_options_are_refused_in_one_line(stories_decoder, reference_greedy):
    with pytest.raises(GenerationError, match=r"token_budget must be an integer ≥ 1, got 0"):
        Scheduler(stories_decoder, token_budget=0)
    scheduler = Scheduler(stories_decoder, kv_tokens=100, token_budget=16, prefill_chunk=16, max_unread=1)
    ids = reference_greedy["cases"][0]["prompt_ids"]
    with pytest.raises(GenerationError, match=rf"prompt \+ max_new_tokens \({len(ids) + 120} tokens\) exceed the "
                                              r"scheduler's KV pool of 100 tokens \(kv_tokens\)"):
        scheduler.stream(ids, 120)
    with pytest.raises(GenerationError, match="max_new_tokens must be an integer ≥ 1, got 0"):
        scheduler.stream(ids, 0)
    running = scheduler.stream(ids, 60)
    next(running)  # then the request is paused with one chunk unread (max_unread=1): still running at close
    scheduler.close()
    with pytest.raises(GenerationError, match="^the scheduler was closed while the request ran$"):
        list(running)
    with pytest.raises(GenerationError, match="^the scheduler is closed$"):
        scheduler.stream(ids, 8)


def test_a_kv_pool_that_could_hold_no_request_is_refused(stories_decoder):
    """``kv_tokens`` below 2 (a prompt token and one new token) would make a scheduler that
    refuses every request: refused at construction, as the CLI's --kv-tokens is."""
    for value in (1, 0, True, 2.5):
        with pytest.raises(GenerationError) as err:
            Scheduler(stories_decoder, kv_tokens=value)
        assert str(err.value) == f"kv_tokens must be an integer ≥ 2, got {value!r}"
    assert Scheduler(stories_decoder, kv_tokens=2).kv_tokens == 2


def test_requests_wait_for_room_in_the_kv_pool(stories_decoder, reference_greedy, solo):
    ids = reference_greedy["cases"][0]["prompt_ids"]
    scheduler = Scheduler(stories_decoder, kv_tokens=len(ids) + 100)  # one request at a time fits
    streams = [_submit(scheduler, reference_greedy, REQUESTS[0]) for _ in range(3)]
    results = [collect(s) for s in streams]
    scheduler.close()
    assert all(_same(r, solo[0]) for r in results)
    assert {n for n, _ in scheduler.pass_shapes} == {1}


# -- the one-call API with batching=True -------------------------------------------------------------


@pytest.fixture(scope="module")
def models(stories_artifact):
    import lade_export

    plain, batched = lade_export.load(stories_artifact), lade_export.load(stories_artifact, batching=True)
    yield plain, batched
    plain.close()
    batched.close()


API_REQUESTS = [
    dict(prompt="Once upon a time", max_new_tokens=60, profile="default"),
    dict(prompt="The little dog", max_new_tokens=70, lookahead=False, stop=" the"),
    dict(prompt="Lily and Tom went to the park", max_new_tokens=50, profile="small", temperature=0.9, seed=4),
    dict(prompt="One day, a bird", max_new_tokens=80, profile="paper", stop=["Lily", "."]),
    dict(prompt="Tim had a red ball", max_new_tokens=40, temperature=0.6, top_k=30, seed=1),
    dict(prompt="There was a big tree", max_new_tokens=64, profile="1,2,0"),
]


def test_generate_from_many_threads_with_batching_equals_the_unbatched_model(models):
    plain, batched = models
    assert batched.scheduler is not None and plain.scheduler is None
    want = [plain.generate(**kw) for kw in API_REQUESTS]
    got = [None] * len(API_REQUESTS)

    def run(i):
        got[i] = batched.generate(**API_REQUESTS[i])

    run_in_threads(run, len(API_REQUESTS))
    for kw, g, w in zip(API_REQUESTS, got, want):
        assert (g.token_ids, g.text, g.stop_reason) == (w.token_ids, w.text, w.stop_reason), kw
    assert max(n for n, _ in batched.scheduler.pass_shapes) >= 3


def test_a_batched_stream_cancels_and_closes_like_an_unbatched_one(models, reference_greedy):
    plain, batched = models
    stream = batched.stream("Once upon a time", max_new_tokens=100, profile="small")
    first = [next(stream) for _ in range(3)]
    stream.cancel()
    rest = list(stream)
    assert rest[-1].stop_reason == "cancelled" and stream.result.stop_reason == "cancelled"
    ids = [t for c in first + rest for t in c.token_ids]
    assert ids == reference_greedy["cases"][0]["greedy_ids"][:len(ids)] and len(ids) < 100
    with batched.stream("The little dog", max_new_tokens=100) as closing:
        next(closing)
    other = batched.generate("The little dog", max_new_tokens=30)
    assert other.token_ids == plain.generate("The little dog", max_new_tokens=30).token_ids
    assert batched.scheduler.active_requests == 0 and batched.scheduler.pool.used == 0


def test_a_stream_closed_or_dropped_before_its_first_chunk_leaves_the_scheduler(stories_artifact, reference_greedy):
    """A stream never read (closed, left through a ``with`` by an exception, or dropped) ends
    its request: its batch slot and KV room come back. (Its generator never started, so its
    ``finally`` never ran: nine such streams used to fill max_batch and hang the next request.)"""
    import lade_export

    with lade_export.load(stories_artifact, batching=True, max_batch=2) as model:
        for _ in range(3):
            with pytest.raises(ValueError):
                with model.stream("Once upon a time", max_new_tokens=200, profile="greedy"):
                    raise ValueError("the client left before the first chunk")
            model.stream("Once upon a time", max_new_tokens=200).close()
            dropped = model.stream("The little dog", max_new_tokens=200)
            del dropped
            gc.collect()
        done = []
        worker = threading.Thread(target=lambda: done.append(model.generate(reference_greedy["cases"][0]["prompt_ids"],
                                                                            max_new_tokens=20, profile="greedy")))
        worker.start()
        worker.join(timeout=60)
        assert done and done[0].token_ids == reference_greedy["cases"][0]["greedy_ids"][:20]
        assert model.scheduler.active_requests == 0 and model.scheduler.pool.used == 0


def test_a_stream_admitted_by_others_passes_and_closed_unread_frees_its_room_at_once(stories_decoder,
                                                                                     reference_greedy):
    """A stream that another reader's passes admitted and prefilled, closed (or dropped)
    without ever being read, leaves at the close: no later pass need come for its columns
    and reservation to come back."""
    scheduler = Scheduler(stories_decoder)
    prompt = reference_greedy["cases"][0]["prompt_ids"]
    for end in ("close", "drop"):
        short = scheduler.stream(prompt, 3)
        unread = scheduler.stream(prompt, 200)
        assert collect(short).token_ids == reference_greedy["cases"][0]["greedy_ids"][:3]
        assert scheduler.active_requests == 1 and scheduler.pool.used > 0  # admitted and prefilled beside it
        if end == "close":
            unread.close()
        else:
            del unread
            gc.collect()
        assert scheduler.active_requests == 0 and scheduler.pool.used == 0 and scheduler._reserved == 0
    scheduler.close()


def test_a_stream_closed_from_another_thread_ends_its_reader_with_a_last_chunk(stories_artifact):
    import lade_export

    with lade_export.load(stories_artifact, batching=True) as model:
        stream = model.stream("Once upon a time", max_new_tokens=400, profile="greedy")
        got = []
        reader = threading.Thread(target=lambda: got.extend(stream))
        reader.start()
        while not got:
            time.sleep(0.001)
        stream.close()  # the reader is inside next(): the request ends at the next pass boundary
        reader.join(timeout=60)
        assert not reader.is_alive() and got[-1].stop_reason == "cancelled"
        assert sum(len(c.token_ids) for c in got) < 400
        assert model.scheduler.active_requests == 0 and model.scheduler.pool.used == 0


def test_a_timeout_ends_a_request_still_waiting_for_a_slot_or_in_its_prefill(stories_artifact):
    """``timeout_s`` holds from the submission: a request waiting for admission, or whose long
    prompt is still being prefilled in chunks, ends at the first pass boundary after it, as a
    cancelled one does (it used to wait for a slot and for its whole prefill first)."""
    import lade_export

    with lade_export.load(stories_artifact, batching=True, max_batch=1, kv_tokens=420) as model:
        holder = model.stream("Once upon a time", max_new_tokens=400, profile="greedy")
        next(holder)  # holds the only slot, and once paused (unread) still the pool's room (~405 of 420 tokens)
        t0 = time.perf_counter()
        waiting = model.generate("The little dog", max_new_tokens=20, timeout_s=0.05)
        assert waiting.stop_reason == "timeout" and waiting.token_ids == []
        assert time.perf_counter() - t0 < 5
        holder.close()
        long = model.stream(list(range(1, 300)), max_new_tokens=4, timeout_s=0.001)
        assert list(long)[-1].stop_reason == "timeout" and long.result.token_ids == []
        assert model.scheduler.active_requests == 0 and model.scheduler.pool.used == 0


# Requests TensorRT engines small (steps ≤ 9) and wide (≤ 31) of art10 cover.
TENSORRT_REQUESTS = [REQUESTS[0], (1, "wide", None, (), 128), REQUESTS[2], REQUESTS[4], REQUESTS[5], REQUESTS[6]]


def test_packed_passes_on_tensorrt_engines_equal_solo_runs(art10, reference_greedy, monkeypatch):
    """TensorRT (the test double, which runs the engine's ONNX graph): the scheduler's
    packed passes run in the engines' packed optimization profile over the pool kept on the
    device, and every request decodes what it decodes alone on the same engines."""
    import lade_export

    from .trt_double import install

    state = install(monkeypatch, version=V10)
    with lade_export.load(art10[0], "tensorrt") as alone:
        solo = [_solo(alone.decoder, reference_greedy, spec) for spec in TENSORRT_REQUESTS]
    with lade_export.load(art10[0], "tensorrt", batching=True) as model:
        scheduler = model.scheduler
        before = len(state.executions)
        got = _run_concurrently(scheduler, reference_greedy, TENSORRT_REQUESTS)
    for spec, g, want in zip(TENSORRT_REQUESTS, got, solo):  # steps may differ: the width policy narrows under load
        assert (g.token_ids, g.text, g.stop_reason) == (want.token_ids, want.text, want.stop_reason), spec
    packed = [e for e in state.executions[before:] if e["profile"] == 2]
    assert max(n for n, _ in scheduler.pass_shapes) >= 4 and packed and max(e["step"] for e in packed) > 31
    assert state.gpu.bytes_on_device > 0  # accepted rows moved into the pool on the device


def test_batching_with_tensorrt_engines_built_before_the_packed_profile_is_refused_in_one_line(art10, tmp_path,
                                                                                             monkeypatch):
    import json
    import shutil

    import lade_export

    from .trt_double import install

    out = tmp_path / "old"
    shutil.copytree(art10[0], out)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["engines"]:
        del entry["optimization_profiles"]["packed"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    install(monkeypatch, version=V10)
    import sys  # the plans as TensorRT would have built them then: two optimization profiles
    monkeypatch.setattr(sys.modules["tensorrt"].ICudaEngine, "num_optimization_profiles", property(lambda self: 2))
    with pytest.raises(GenerationError, match=r"^batching=True needs TensorRT engines with a packed optimization "
                                              r"profile; these were built before batching existed: rebuild with "
                                              r"--engine tensorrt$"):
        lade_export.load(out, backend="tensorrt", batching=True, verify="none")
    with lade_export.load(out, backend="tensorrt", verify="none") as model:  # unbatched, they decode as before
        assert model.generate([1, 403, 407], max_new_tokens=4).token_ids


def _serve_plan(scheduler, reference_greedy, specs, plan, clients, gaps=None) -> list:
    """Run ``plan`` = ``[(spec index, action, after)]`` through ``scheduler`` from ``clients``
    threads (client k takes entries k, k + clients, …, one request at a time). ``action``
    "run" reads to the end; "cancel" sets the request's cancel event and "close" closes its
    stream after ``after + 1`` chunks. ``gaps[j]``: seconds client waits before submitting
    entry j (random arrival). Returns ``[(spec index, action, chunks)]`` in plan order."""
    outcomes = [None] * len(plan)

    def client(k):
        for j in range(k, len(plan), clients):
            spec, action, after = plan[j]
            if gaps is not None:
                time.sleep(gaps[j])
            case, prof, sampling, stop, n = specs[spec]
            cancel = threading.Event()
            stream = scheduler.stream(reference_greedy["cases"][case]["prompt_ids"], n, _profile(prof), stop=stop,
                                      sampling=sampling, cancel=cancel)
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                if action != "run" and len(chunks) == after + 1:
                    if action == "close":
                        stream.close()
                        break
                    cancel.set()
            outcomes[j] = (spec, action, chunks)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def _assert_exact_or_prefix(outcomes, solo) -> None:
    """Every finished request of ``outcomes`` equals its solo run; every cut one is a prefix of it."""
    for spec, action, chunks in outcomes:
        want = solo[spec]
        ids = [t for c in chunks for t in c.token_ids]
        if chunks[-1].final and chunks[-1].stop_reason != "cancelled":
            assert (ids, chunks[-1].stop_reason) == (want.token_ids, want.stop_reason), (spec, action)
        else:
            assert action != "run" and ids == want.token_ids[:len(ids)], (spec, action)


def test_random_arrivals_and_cancels_keep_every_request_exact_and_free_the_pool(stories_decoder, reference_greedy,
                                                                                 solo):
    """A random schedule (fixed seed): 48 requests drawn from REQUESTS arrive in waves from
    six client threads; about one in three is cancelled or closed after a random number of
    chunks. Every finished request equals its solo run, every cut one is a prefix of it,
    and the pool ends empty, never grown past what its requests reserved."""
    rng = np.random.default_rng(21)
    scheduler = Scheduler(stories_decoder, token_budget=int(rng.integers(8, 40)), max_batch=5)
    plan = [(int(rng.integers(len(REQUESTS))), str(rng.choice(["run", "run", "cancel", "close"])),
             int(rng.integers(0, 6))) for _ in range(48)]
    outcomes = _serve_plan(scheduler, reference_greedy, REQUESTS, plan, 6)
    scheduler.close()
    _assert_exact_or_prefix(outcomes, solo)
    assert scheduler.pool.used == 0 and scheduler.active_requests == 0
    widest = max(len(reference_greedy["cases"][c]["prompt_ids"]) + n for c, *_, n in REQUESTS)
    assert scheduler.pool.cache.capacity <= max(1024, 2 * 5 * widest)


#: REQUESTS cut to at most 24 new tokens: the soak's short requests.
SHORT = [(case, prof, sampling, stop, min(n, 24)) for case, prof, sampling, stop, n in REQUESTS]
#: RSS growth the soak allows, in bytes. Measured on a 2-core machine (4 runs of this soak's
#: schedule after its warm-up): 0.3–2.7 MiB over 500 requests (allocator arenas and ONNX
#: Runtime's buffers settling for new pass shapes; it does not grow run after run). A leak
#: of what a request holds would exceed it: a finished short request's KV alone is 24–39 tokens
#: × 1280 bytes (30–50 KB) on stories260K, 500 of them 15–24 MiB; the bound is 10 MiB.
SOAK_RSS_BOUND = 10 << 20


def _rss() -> int:
    """Resident set size of this process in bytes (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_soak_of_500_short_requests_leaves_no_kv_or_memory_behind(stories_decoder, reference_greedy):
    """Issue 21's soak: 500 short requests (SHORT) from six client threads with random
    arrival gaps (exponential, mean 3 ms) and about one in three cancelled or closed after
    a random number of chunks, after a warm-up of 60 such requests. Every finished request
    equals its solo run and every cut one is a prefix of it; afterwards no request is
    alive (no _Request object left), the pool holds no column and never grew past its
    first 1024-token buffers (``used`` 0, ``nbytes`` = 1024 × 1280 bytes: six requests of
    at most 39 tokens never need more), and RSS grew by less than SOAK_RSS_BOUND."""
    from lade_export import scheduler as scheduler_module

    solo = [_solo(stories_decoder, reference_greedy, spec) for spec in SHORT]
    rng = np.random.default_rng(500)
    scheduler = Scheduler(stories_decoder, token_budget=32, max_batch=6)

    def schedule(count):
        plan = [(int(rng.integers(len(SHORT))), str(rng.choice(["run", "run", "cancel", "close"])),
                 int(rng.integers(0, 4))) for _ in range(count)]
        return plan, rng.exponential(0.003, count)

    warm_plan, warm_gaps = schedule(60)
    _assert_exact_or_prefix(_serve_plan(scheduler, reference_greedy, SHORT, warm_plan, 6, warm_gaps), solo)
    gc.collect()
    rss_before = _rss()
    plan, gaps = schedule(500)
    outcomes = _serve_plan(scheduler, reference_greedy, SHORT, plan, 6, gaps)
    gc.collect()
    grown = _rss() - rss_before
    _assert_exact_or_prefix(outcomes, solo)
    assert {action for _, action, _ in outcomes} == {"run", "cancel", "close"}
    assert scheduler.pool.used == 0 and scheduler.active_requests == 0
    assert scheduler.pool.nbytes == 1024 * stories_decoder.dims.kv_bytes_per_token == 1310720
    assert not [o for o in gc.get_objects() if type(o) is scheduler_module._Request]
    assert grown < SOAK_RSS_BOUND, f"RSS grew {grown / 2**20:.1f} MiB over 500 requests"
    scheduler.close()


@pytest.fixture(scope="module")
def lade_int8_decoder(tmp_path_factory, stories_dir, stories_loaded):
    """stories260K int4 with the lade kernels' default integer compute (its own attention
    operator, AttentionRows, which reads the packed pass's block-diagonal mask)."""
    from lade_export.artifact import Artifact
    from lade_export.backends import open_engine
    from lade_export.export.build import build_artifact
    from lade_export.export.quantize import QuantSpec
    from lade_export.runtime import Decoder

    out = tmp_path_factory.mktemp("lade-int8") / "art"
    build_artifact(str(stories_dir), [resolve_profile("default-int4"), resolve_profile("default")], out,
                   loaded=stories_loaded, quantization=QuantSpec.for_precision("int4", kernels="lade"))
    art = Artifact(out)
    assert art.manifest["quantization"]["spec"]["compute"] == "int8"
    assert art.manifest["quantization"]["graph"]["attention_rows"] == 5  # every layer's attention is the kernels'
    return Decoder(open_engine(art, "ort"), art.stop_token_ids, art.max_context, art.tokenizer())


def test_packed_passes_on_the_integer_lade_kernels_equal_solo_runs(lade_int8_decoder, reference_greedy):
    specs = [(0, None, None, (), 64), (1, "default-int4", None, (), 80), (2, "default", None, (" the",), 72),
             (0, "small", None, (), 48), (1, None, SamplingParams(0.8, 0, 0.9, 3), (), 40),
             (2, "default-int4", None, ("Lily",), 96)]
    solo = [_solo(lade_int8_decoder, reference_greedy, spec) for spec in specs]
    scheduler = Scheduler(lade_int8_decoder)
    for i, (got, want) in enumerate(zip(_run_concurrently(scheduler, reference_greedy, specs), solo)):
        assert _same(got, want), specs[i]
    assert max(n for n, _ in scheduler.pass_shapes) >= 3  # they did share passes
    assert scheduler.pool.used == 0


# -- the load-adaptive width policy (lade_export/width_policy.py) ---------------------------------

#: Eight greedy requests with lookahead profiles (window, candidates, history lookup).
GREEDY_LOOKAHEAD = [
    (0, "default", None, (), 96),
    (1, "small", None, (" the",), 80),
    (2, "paper", None, (), 64),
    (0, LookaheadProfile(4, 2, 6), None, ("Lily",), 128),
    (1, LookaheadProfile(0, 2, 0, lookup=10, lookup_min_match=2), None, (), 100),
    (2, "default", None, (".",), 90),
    (0, "wide", None, (), 72),
    (1, LookaheadProfile(2, 3, 2, lookup=4), None, (), 110),
]


@pytest.mark.parametrize("cost", ["online", "busy", "free"])
def test_adaptive_widths_keep_eight_greedy_lookahead_requests_equal_to_their_solo_runs(stories_decoder,
                                                                                       reference_greedy, cost):
    """Eight concurrent greedy lookahead requests under the adaptive policy each give their
    solo output (the same tokens, text and stop; fewer or more steps): with the online
    cost fit, with a curve where every row costs twice a pass and no exploration (every
    step of a shared pass one token) and with free rows (a step with candidates as wide as the token budget
    lets it; one without is a one-token step: the window's rows alone accept nothing)."""
    from lade_export.width_policy import AdaptiveWidth, CostCurve

    solo = [_solo(stories_decoder, reference_greedy, spec) for spec in GREEDY_LOOKAHEAD]
    policy = {"online": "adaptive", "busy": AdaptiveWidth(CostCurve(1.0, 2.0), explore_every=0),
              "free": AdaptiveWidth(CostCurve(1.0, 0.0))}[cost]
    scheduler = Scheduler(stories_decoder, width_policy=policy)
    results = _run_concurrently(scheduler, reference_greedy, GREEDY_LOOKAHEAD)
    for spec, got, want in zip(GREEDY_LOOKAHEAD, results, solo):
        assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text, want.stop_reason), spec
    steps = sum(r.stats.steps for r in results)
    assert sum(scheduler.width_steps.values()) == steps
    assert 0 < sum(scheduler.width_passes.values()) <= scheduler.passes
    if cost == "busy":  # every shared pass is batched greedy; a request alone in a pass runs its profile
        alone = sum(n for (k, _), n in scheduler.pass_shapes.items() if k == 1)
        assert set(scheduler.width_steps) <= {"one-token", "profile"}
        assert scheduler.width_steps["one-token"] > 0.8 * steps
        assert scheduler.width_steps["profile"] <= alone
    if cost == "free":  # rows cost nothing: a step with candidates widens while the budget lets it
        w = scheduler.width_steps
        assert w["profile"] > w["candidates"] + w["half-window"] and w["profile"] > 0
        assert steps < sum(len(r.token_ids) for r in results)
    assert scheduler.pool.used == 0


HISTORY_LOOKUP = [(case, prof, None, (), n) for case, n in ((0, 96), (1, 80), (2, 64))
                  for prof in ("default-int4", LookaheadProfile(0, 2, 0, lookup=4))]


@pytest.mark.parametrize("cost", ["busy", "free"])
def test_steps_that_could_not_widen_are_not_prepared(stories_decoder, reference_greedy, prepare_calls, cost):
    """History-lookup requests (W = 0) sharing passes: where rows are dear (busy: a row costs
    twice a pass) a step whose best case could not pay for its rows is a one-token step whose
    candidates are never looked up, but for one in PREPARE_EVERY (its trie then judged in
    hindsight) and a request alone in its pass; where rows are free every step is prepared.
    Either way every output is its solo run's."""
    from lade_export.scheduler import PREPARE_EVERY
    from lade_export.width_policy import AdaptiveWidth, CostCurve

    solo = [_solo(stories_decoder, reference_greedy, spec) for spec in HISTORY_LOOKUP]
    calls = prepare_calls()
    policy = AdaptiveWidth(CostCurve(1.0, 2.0 if cost == "busy" else 0.0))
    scheduler = Scheduler(stories_decoder, width_policy=policy)
    results = _run_concurrently(scheduler, reference_greedy, HISTORY_LOOKUP)
    for spec, got, want in zip(HISTORY_LOOKUP, results, solo):
        assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text, want.stop_reason), spec
    steps = sum(r.stats.steps for r in results)
    assert not any(calls)  # a prepared step is the profile's
    if cost == "free":
        assert len(calls) == steps
    else:
        assert steps // PREPARE_EVERY - len(HISTORY_LOOKUP) <= len(calls) < steps / 3
        assert scheduler.width_steps["one-token"] >= 0.9 * steps


def test_adaptive_widths_leave_sampled_requests_equal_to_their_solo_runs(stories_decoder, reference_greedy, solo):
    """REQUESTS (sampled lookahead, sampled plain and greedy ones) under an adaptive policy
    whose cost curve narrows nearly every greedy step to one token (a greedy neighbour of a
    wide sampled step may keep its candidates where its acceptance, measured in hindsight,
    pays for them): the sampled requests keep their profile's steps and equal their solo
    runs step for step; the greedy ones their solo tokens."""
    from lade_export.width_policy import AdaptiveWidth, CostCurve

    scheduler = Scheduler(stories_decoder, width_policy=AdaptiveWidth(CostCurve(1.0, 2.0), explore_every=0))
    results = _run_concurrently(scheduler, reference_greedy, REQUESTS)
    for spec, got, want in zip(REQUESTS, results, solo):
        if spec[2] is not None:
            assert _same(got, want), spec
        else:
            assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text, want.stop_reason), spec
    sampled_lookahead = sum(r.stats.steps for spec, r in zip(REQUESTS, results) if spec[1] and spec[2])
    others = sum(r.stats.steps for spec, r in zip(REQUESTS, results) if not (spec[1] and spec[2]))
    alone = sum(n for (k, _), n in scheduler.pass_shapes.items() if k == 1)  # a lone request runs its profile
    profile = scheduler.width_steps["profile"]
    assert sampled_lookahead <= profile <= sampled_lookahead + alone and sampled_lookahead > 0
    w = scheduler.width_steps
    narrower = w["one-token"] + w["candidates"] + w["half-window"]
    assert narrower == others - (profile - sampled_lookahead), dict(w)
    assert w["one-token"] >= 0.8 * narrower, dict(w)


def test_the_timeline_accounts_for_every_pass_row_and_token(stories_decoder, reference_greedy, solo):
    """``timeline=True``: one record per pass, phases in order, no two passes overlapping;
    decode rows and prompt rows add up to the tokens fed (every request's prompt but its
    last token, and every decode step's rows), decode steps and accepted tokens to the
    requests' own counts; outputs unchanged. Off by default."""
    assert Scheduler(stories_decoder).timeline is None
    scheduler = Scheduler(stories_decoder, token_budget=24, prefill_chunk=7, timeline=True)
    results = _run_concurrently(scheduler, reference_greedy, REQUESTS)
    for spec, got, want in zip(REQUESTS, results, solo):
        assert _same(got, want), spec
    tl = scheduler.timeline
    assert len(tl) == scheduler.passes > 0
    for p in tl:
        assert p.start <= p.planned <= p.engine <= p.engine_end <= p.updated <= p.end
        assert p.steps + p.chunks >= 1 and p.decode_rows >= p.steps
    assert all(a.end <= b.start for a, b in zip(tl, tl[1:]))
    fed = sum(rows * n for (_, rows), n in scheduler.pass_shapes.items())
    assert sum(p.decode_rows + p.prefill_rows for p in tl) == fed
    prompts = [len(reference_greedy["cases"][spec[0]]["prompt_ids"]) - 1 for spec in REQUESTS]
    assert sum(p.prefill_rows for p in tl) == sum(prompts)
    for p in tl:  # prompt rows: up to prefill_chunk in a pass without decode steps, else up to the budget
        assert p.prefill_rows <= (7 if not p.steps else max(24 - p.decode_rows, 0))
    assert sum(p.steps for p in tl) == sum(r.stats.steps for r in results)
    assert sum(p.tokens for p in tl) == sum(len(r.token_ids) for r in results)
    assert sum(p.decode_rows for p in tl if p.steps == 1 and not p.chunks) >= sum(
        1 for p in tl if p.steps == 1 and not p.chunks)
