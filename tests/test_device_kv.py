"""The ONNX Runtime engine with its KV cache in device memory (I/O binding at device
addresses, the path of the CUDA execution provider), run on the CPU provider with host
memory standing in for the device: the same binding code, the same byte accounting."""

import pytest

from lade_export.profile import resolve_profile
from lade_export.runtime import Decoder, collect
from lade_export.scheduler import Scheduler
from lade_export.specs import past_key_name


@pytest.fixture(scope="module")
def device_engine(stories_artifact):
    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine

    art = Artifact(stories_artifact)
    engine = OrtEngine(art.onnx_path, art.dims, device_kv=True)
    yield art, engine
    engine.close()


def _recording(engine):
    """Wrap ``engine.run`` to record (feeds' shapes, bytes uploaded, bytes copied) per step."""
    memory, run, steps = engine.device_memory, engine.run, []

    def recorded(feeds, with_logits=False):
        up, copied = memory.bytes_uploaded, memory.bytes_copied
        out = run(feeds, with_logits)
        steps.append({"step": feeds["input_ids"].shape[1], "past": feeds[past_key_name(0)].shape[1],
                      "n_logits": feeds["logits_positions"].shape[1], "mask": feeds["attention_mask"].nbytes,
                      "uploaded": memory.bytes_uploaded - up, "copied": memory.bytes_copied - copied})
        return out

    engine.run = recorded
    return steps


def test_a_step_uploads_only_its_tokens_positions_mask_and_logit_rows(device_engine, reference_greedy):
    art, engine = device_engine
    assert engine.kv_layout == "sequence-major" and type(engine.device_memory).__name__ == "HostMemory"
    decoder = Decoder(engine, (), art.max_context, art.tokenizer())
    steps = _recording(engine)
    try:
        cached = 0
        for case in reference_greedy["cases"][:2]:
            for profile in (resolve_profile("default"), None):
                result = decoder.generate(case["prompt_ids"], 128, profile)
                assert result.token_ids == case["greedy_ids"], profile
                cached += result.stats.cache_tokens
    finally:
        del engine.run
    assert max(s["past"] for s in steps) > 128 and any(s["step"] == 19 for s in steps)
    for s in steps:  # 8 bytes a token for ids and positions, 8 a logit row, the bool mask; no cache row
        assert s["uploaded"] - s["mask"] == 16 * s["step"] + 8 * s["n_logits"], s
    dims = engine.dims
    row = dims.num_layers * 2 * dims.kv_heads * dims.head_dim * 4
    assert sum(s["copied"] for s in steps) == row * cached  # each cached row moved once, on the device


def test_packed_passes_over_a_device_pool_equal_solo_runs(device_engine, stories_decoder, reference_greedy):
    """The scheduler's pool on the device: requests join, leave (the pool compacts, a write
    the engine did not make, so it uploads those rows) and each decodes its solo output."""
    art, engine = device_engine
    decoder = Decoder(engine, stories_decoder.stop_token_ids, art.max_context, art.tokenizer())
    specs = [(0, None, 96), (1, "default", 128), (2, "small", 40), (0, "paper", 64), (1, None, 20), (2, "default", 110)]
    cases = reference_greedy["cases"]
    solo = [stories_decoder.generate(cases[c]["prompt_ids"], n, resolve_profile(p) if p else None)
            for c, p, n in specs]
    scheduler = Scheduler(decoder, token_budget=48, width_policy="profile")
    streams = [scheduler.stream(cases[c]["prompt_ids"], n, resolve_profile(p) if p else None) for c, p, n in specs]
    got = [None] * len(streams)
    pending = list(range(len(streams)))
    while pending:  # interleave the readers in one thread: every pass serves the requests still running
        for i in list(pending):
            chunk = next(streams[i])
            got[i] = (got[i] or []) + [chunk]
            if chunk.final:
                pending.remove(i)
    scheduler.close()
    for (c, p, n), chunks, want in zip(specs, got, solo):
        result = collect(iter(chunks))
        assert (result.token_ids, result.stop_reason) == (want.token_ids, want.stop_reason), (c, p, n)
    assert max(k for k, _ in scheduler.pass_shapes) >= 4
    assert engine.device_memory.bytes_copied > 0


def test_without_a_device_the_engine_runs_as_before(stories_artifact, reference_greedy):
    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine

    art = Artifact(stories_artifact)
    engine = OrtEngine(art.onnx_path, art.dims)
    assert engine.device_memory is None
    case = reference_greedy["cases"][0]
    result = Decoder(engine, (), art.max_context).generate(case["prompt_ids"], 32, resolve_profile("small"))
    assert result.token_ids == case["greedy_ids"][:32]
    engine.close()
