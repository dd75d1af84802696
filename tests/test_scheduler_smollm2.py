"""Continuous batching on SmolLM2-135M-Instruct (the GroupQueryAttention fp32 build):
requests sharing passes each decode exactly what they decode alone on the same engine."""

import threading

import pytest

from lade_export.profile import LookaheadProfile, resolve_profile
from lade_export.runtime import collect
from lade_export.sampling import SamplingParams
from lade_export.scheduler import Scheduler

from .conftest import mt_bench_prompts

pytestmark = pytest.mark.slow


def _requests(decoder):
    texts = mt_bench_prompts(4)
    ids = [decoder.tokenizer.encode_prompt(t, chat=True) for t in texts]
    return [
        (ids[0], 48, None, None, ()),
        (ids[1], 64, resolve_profile("default"), None, ()),
        (ids[2], 40, LookaheadProfile(1, 2, 0, lookup=10), SamplingParams(0.8, 0, 0.9, 7), ()),
        (ids[3], 56, resolve_profile("default"), None, ("\n\n",)),
    ]


def _run(runner, req, **kw):
    ids, n, prof, sampling, stop = req
    return runner.stream(ids, n, prof, sampling=sampling, stop=stop, **kw)


def test_concurrent_requests_with_a_late_and_a_cancelled_one_equal_their_solo_runs(smollm2_decoder):
    requests = _requests(smollm2_decoder)
    solo = [collect(_run(smollm2_decoder, r)) for r in requests]
    scheduler = Scheduler(smollm2_decoder, token_budget=32, prefill_chunk=24)  # long prompts prefill in chunks
    results = [None] * 3

    def run(i):
        results[i] = collect(_run(scheduler, requests[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    cancel = threading.Event()
    cancelled = _run(scheduler, requests[1], cancel=cancel)
    taken = [next(cancelled) for _ in range(2)]
    cancel.set()
    taken += list(cancelled)
    late = threading.Thread(target=run, args=(2,))  # arrives while the first two decode
    late.start()
    last = collect(_run(scheduler, requests[3]))
    for t in threads + [late]:
        t.join()
    scheduler.close()
    for got, want in zip(results + [last], solo[:3] + solo[3:]):
        assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text, want.stop_reason)
    ids = [t for c in taken for t in c.token_ids]
    assert taken[-1].stop_reason == "cancelled" and ids == solo[1].token_ids[:len(ids)]
    assert max(n for n, _ in scheduler.pass_shapes) >= 3
    assert scheduler.pool.used == 0
