"""The TensorRT path end to end on stories260K against the test double of TensorRT 10/11
and cuda-bindings (tests/trt_double.py): build, precision plans, runtime engine choice,
the lean runtime, check, and every error path with its one-line message. The double
runs the engines' ONNX graph with ONNX Runtime, so generations give real tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from lade_export.cli import main
from lade_export.errors import ArtifactError, BackendUnavailableError, EngineError, GenerationError
from lade_export.profile import resolve_profile

from . import trt_double
from .trt_double import FakeGpu, install

ROOT = Path(__file__).resolve().parent.parent
V10, V11 = "10.16.1.11", "11.4.0.106"
#: docs/errors.md rows asserted here (row id → the test that asserts its message).
DOCUMENTED_ROWS = {
    "tensorrt-missing": "test_without_tensorrt_the_error_names_the_full_and_the_lean_packages",
    "tensorrt-version": "test_an_unsupported_tensorrt_version_is_one_line",
    "tensorrt-no-gpu": "test_without_a_gpu_or_cuda_wrapper_nothing_starts",
    "tensorrt-lean-not-version-compatible": "test_the_lean_runtime_refuses_engines_built_without_version_compatible",
    "tensorrt-other-version": "test_an_engine_of_another_tensorrt_version_is_refused",
    "tensorrt-other-gpu": "test_an_engine_for_another_gpu_is_refused_unless_hardware_compatible",
    "tensorrt-profile-not-covered": "test_a_profile_no_engine_covers_is_refused_naming_the_limits",
    "tensorrt-step-not-covered": "test_each_step_runs_in_the_optimization_profile_that_covers_it",
    "tensorrt-batching-beyond-packed": "test_batching_checks_the_scheduler_against_the_engines_packed_optimization_profile",
    "tensorrt-execution-failed": "test_an_execution_failure_is_an_engine_error",
    "tensorrt-reduced-parity": "test_a_reduced_precision_graph_beyond_its_bound_stops_the_build",
}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _build(out: Path, stories_dir, version: str, *extra, kinds=("full",)):
    with pytest.MonkeyPatch.context() as mp:
        state = install(mp, version=version, kinds=kinds)
        result = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--out", out, *extra)
        assert result.exit_code == 0, result.output
        return state


@pytest.fixture(scope="session")
def art10(tmp_path_factory, stories_dir):
    """TensorRT 10, fp16, engines small (step ≤ 9) then wide (step ≤ 31), version-compatible."""
    out = tmp_path_factory.mktemp("trt10") / "art"
    state = _build(out, stories_dir, V10, "--precision", "fp16", "--profile", "small", "--profile", "wide",
                   "--version-compatible")
    return out, state


@pytest.fixture(scope="session")
def art11(tmp_path_factory, stories_dir):
    """TensorRT 11, fp16, engine wide (not version-compatible)."""
    out = tmp_path_factory.mktemp("trt11") / "art"
    state = _build(out, stories_dir, V11, "--precision", "fp16", "--profile", "wide")
    return out, state


def _copy(src, tmp_path, edit=None):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    if edit:
        m = json.loads((dst / "manifest.json").read_text())
        edit(m)
        (dst / "manifest.json").write_text(json.dumps(m))
    return dst


# -- building: precision the way each version expects ------------------------------------

def test_tensorrt11_builds_fp16_as_a_strongly_typed_network_from_a_float16_export(art11):
    out, state = art11
    (build,) = state.builds
    assert build["strongly_typed"] and build["precision_flags"] == []
    assert "HALF" in build["weight_dtypes"]  # the graph itself is float16 ...
    assert {t["dtype"] for t in build["inputs"] + build["outputs"]} == {"INT64", "BOOL", "FLOAT"}  # ... I/O float32
    entry = json.loads((out / "manifest.json").read_text())["engines"][0]
    assert entry["tensorrt_version"] == V11
    assert entry["precision_plan"] == {"tensorrt_major": 11, "network": "strongly typed", "graph_dtype": "float16",
                                       "builder_flags": [], "cleared_flags": [], "io_dtype": "float32"}
    parity = entry["graph_parity"]
    assert parity["checked"] and parity["max_rel_bound"] == 2e-2
    assert all(c["argmax_equal"] and 0 < c["rel"] < 2e-2 for c in parity["cases"])
    assert [c["label"] for c in parity["cases"]] == ["prefill", "lookahead W5 N4 G5", "greedy"]


def test_tensorrt10_builds_fp16_with_the_builder_flag_on_the_float32_graph(art10):
    out, state = art10
    assert [b["profiles"][1]["input_ids"][2][1] for b in state.builds] == [9, 31]  # small, then wide
    for build in state.builds:
        assert not build["strongly_typed"] and build["precision_flags"] == ["FP16"]
        assert build["weight_dtypes"] == ["FLOAT"] and build["version_compatible"]
        assert build["profiles"][0]["input_ids"][2] == [1, 256] and build["profiles"][0]["past_key_values.0.key"][2][1] == 0
    entries = json.loads((out / "manifest.json").read_text())["engines"]
    assert [e["precision_plan"]["builder_flags"] for e in entries] == [["FP16"], ["FP16"]]
    assert all(e["graph_parity"] is None and e["tensorrt_version"] == V10 and e["compute_capability"] == "9.0"
               for e in entries)


@pytest.mark.parametrize("version", [V10, V11])
def test_fp32_clears_tf32_and_keeps_the_float32_graph(tmp_path, stories_dir, version):
    state = _build(tmp_path / "a", stories_dir, version, "--precision", "fp32", "--profile", "small",
                   "--hardware-compatible")
    (build,) = state.builds
    assert not build["tf32"] and build["precision_flags"] == [] and build["weight_dtypes"] == ["FLOAT"]
    assert build["hardware_compatibility"] == "AMPERE_PLUS"
    assert build["strongly_typed"] == (version == V11)


def test_bf16_on_tensorrt11_exports_bfloat16_and_records_why_its_graph_is_not_checked_on_the_cpu(tmp_path,
                                                                                               stories_dir):
    state = _build(tmp_path / "a", stories_dir, V11, "--precision", "bf16", "--profile", "small")
    assert "BF16" in state.builds[0]["weight_dtypes"]
    entry = json.loads((tmp_path / "a" / "manifest.json").read_text())["engines"][0]
    assert entry["graph_parity"] == {"checked": False, "reason": "ONNX Runtime has no bfloat16 CPU kernels; lade-export "
                                                                 "check compares the engines with PyTorch on the GPU"}


def test_timing_cache_is_written_and_reused_and_progress_is_reported(tmp_path, stories_dir):
    cache = tmp_path / "timing.cache"
    with pytest.MonkeyPatch.context() as mp:
        install(mp, version=V10)
        first = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--profile", "small",
                       "--timing-cache", cache, "--out", tmp_path / "a")
        assert first.exit_code == 0, first.output
        assert cache.read_bytes() == b"TRTCACHE1"
        second = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--profile", "small",
                        "--profile", "wide", "--timing-cache", cache, "--out", tmp_path / "b")
        assert second.exit_code == 0
        assert cache.read_bytes() == b"TRTCACHE3"  # one entry per build, accumulated across builds
    assert "TensorRT Building engine 0/2" in first.stderr and "TensorRT Building engine 2/?" in first.stderr


@pytest.mark.parametrize("version", ["9.3.0", "12.0.1"])
def test_an_unsupported_tensorrt_version_is_one_line(tmp_path, stories_dir, monkeypatch, version):
    install(monkeypatch, version=version)
    result = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--out", tmp_path / "a")
    assert result.exit_code == 2
    assert one_line(result) == (f"error: TensorRT {version} is not supported: lade-export builds and runs engines with "
                                "TensorRT 10 or 11 (pip install 'tensorrt>=10,<12')")
    assert os.listdir(tmp_path) == []


def test_without_tensorrt_the_error_names_the_full_and_the_lean_packages(tmp_path, stories_dir, stories_artifact,
                                                                        monkeypatch):
    install(monkeypatch, version=None)
    result = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--out", tmp_path / "a")
    assert result.exit_code == 2
    line = one_line(result)
    assert line.startswith("error: TensorRT is not installed; the full TensorRT builds and runs engines: ")
    assert "pip install 'lade-export[tensorrt]'" in line and "pip install 'lade-export[tensorrt-lean]'" in line
    run = invoke("generate", stories_artifact, "--backend", "tensorrt", "--prompt", "hi")
    assert run.exit_code == 2
    assert one_line(run) == f"error: {stories_artifact} has no TensorRT engines; build it with --engine tensorrt"


def test_with_only_the_lean_runtime_a_build_says_it_cannot_build(tmp_path, stories_dir, monkeypatch):
    install(monkeypatch, version=V11, kinds=("lean",))
    result = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--out", tmp_path / "a")
    assert result.exit_code == 2
    assert one_line(result).startswith("error: TensorRT is not installed; only the tensorrt_lean runtime is installed, "
                                       "which cannot build engines; the full TensorRT builds")


def test_parser_rejection_and_build_failure_are_one_line(tmp_path, stories_artifact, monkeypatch):
    from lade_export.export.optimization_profiles import optimization_profiles
    from lade_export.export.tensorrt_build import build_engine

    state = install(monkeypatch, version=V10)
    shapes = optimization_profiles(resolve_profile("small"), ModelDimsOf(stories_artifact))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(ArtifactError, match=r"^TensorRT's ONNX parser rejected .*bad.onnx: ModelImporter.cpp:1: "
                                            r"failed to parse [^\n]*$"):
        build_engine(bad, shapes, precision="fp32")
    del shapes["decode"]["input_ids"]
    with pytest.raises(ArtifactError, match=r"^TensorRT failed to build an engine from .*model.onnx \(see the TensorRT "
                                            r"log above\)$"):
        build_engine(stories_artifact / "model.onnx", shapes, precision="fp32")
    assert state.log[-1] == ("[E] IBuilder::buildSerializedNetwork: optimization profile 1 has no shape for input "
                             "input_ids")
    with pytest.raises(ArtifactError, match="precision must be one of fp32, fp16, bf16, got 'int8'"):
        build_engine(bad, shapes, precision="int8")


def ModelDimsOf(art):  # noqa: N802 - reads like a type
    from lade_export.artifact import Artifact

    return Artifact(art).dims


# -- dry run -------------------------------------------------------------------------------

def test_dry_run_prints_the_precision_plan_for_10_and_11_without_tensorrt(tmp_path, stories_dir, monkeypatch):
    install(monkeypatch, version=None)
    result = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--dry-run", "--profile", "small",
                    "--profile", "wide", "--out", tmp_path / "x")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.count("  precision plan (no TensorRT installed):") == 2
    assert text.count("    TensorRT 10: weakly typed network from the float32 graph, builder flag FP16; I/O float32 "
                      "(KV cache and logits as in the graph contract)") == 2
    assert text.count("    TensorRT 11: strongly typed network from the step exported in float16 (RMSNorm and softmax "
                      "in float32), no precision flags; I/O float32 (KV cache and logits as in the graph contract)") == 2
    assert os.listdir(tmp_path) == []


def test_dry_run_prints_only_the_installed_versions_plan(tmp_path, stories_dir, monkeypatch):
    install(monkeypatch, version=V10, kinds=("lean",))
    result = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--dry-run", "--precision", "fp32",
                    "--out", tmp_path / "x")
    assert "  precision plan (installed TensorRT 10):\n    TensorRT 10: weakly typed network from the float32 graph, " \
           "TF32 off; I/O float32" in result.stdout
    assert "TensorRT 11:" not in result.stdout


# -- running: engine choice, runtimes, errors ---------------------------------------------

def test_generate_through_tensorrt_gives_the_oracle_tokens(art10, reference_greedy, monkeypatch):
    import lade_export

    out, _ = art10
    state = install(monkeypatch, version=V10)
    with lade_export.load(out, "tensorrt") as model:
        for case in reference_greedy["cases"]:
            for profile in ("wide", "small", None):
                result = model.generate(case["prompt_ids"], max_new_tokens=128, profile=profile,
                                        lookahead=profile is not None, stop_token_ids=())  # the oracle ignores EOS
                assert result.token_ids == case["greedy_ids"], (case["prompt"], profile)
        assert "TensorRT 10.16.1.11 full runtime (tensorrt) on GPU 0" in model.engine.runtime_description
    assert any(e["step"] > 9 for e in state.executions)


def test_generate_runs_lookahead_steps_on_the_engine_that_covers_the_profile(art10, monkeypatch):
    out, _ = art10
    state = install(monkeypatch, version=V10)
    result = invoke("generate", out, "--backend", "tensorrt", "--profile", "wide", "--prompt", "Once upon a time",
                    "--max-new-tokens", 60)
    assert result.exit_code == 0, result.output
    # the artifact's first engine is "small" (steps ≤ 9); wide's steps of 31 tokens need the second
    assert [d["decode_max_step"] for d in state.deserialized] == [31]
    assert {(e["decode_max_step"], e["profile"]) for e in state.executions} == {(31, 0), (31, 1)}
    assert 9 < max(e["step"] for e in state.executions if e["past"] > 0) <= 31
    assert "[tensorrt] TensorRT 10.16.1.11 full runtime (tensorrt) on GPU 0 (compute capability 9.0); engines used: " \
           "wide" in result.stderr
    small = invoke("generate", out, "--backend", "tensorrt", "--profile", "small", "--prompt", "Once upon a time",
                   "--max-new-tokens", 20)
    assert small.exit_code == 0 and "engines used: small" in small.stderr
    assert small.stdout[:40] == result.stdout[:40]


def test_check_profile_returns_the_requests_engine_and_keeps_nothing(art10, monkeypatch):
    from lade_export.feeds import example_feeds

    engine, _ = _engine(art10[0], monkeypatch)
    feeds = example_feeds(engine.dims, step=9, past=100)
    feeds["logits_positions"] = feeds["logits_positions"][:, :7]
    assert engine.check_profile(resolve_profile("wide")) == "wide"  # steps ≤ 31: only wide's decode profile covers
    assert engine.check_profile(resolve_profile("small")) == "small"
    assert engine.check_profile(resolve_profile("wide")) == "wide"
    # the latest check steers nothing: without a plan the smallest covering engine, with one the plan's
    assert engine.optimization_profile_for(feeds) == "small:decode"
    assert engine.optimization_profile_for(feeds, plan="wide") == "wide:decode"
    assert engine.optimization_profile_for(feeds, plan="small") == "small:decode"
    with pytest.raises(GenerationError, match=r"^no TensorRT engine 'paper' here \(engines: small, wide\)$"):
        engine.run(feeds, plan="paper")
    engine.close()


def test_concurrent_requests_of_different_profiles_each_run_on_their_own_engine(art10, reference_greedy,
                                                                                monkeypatch):
    """Two requests validated one after the other (small, then wide) and decoded in two
    threads at once: each step runs on the engine its own profile chose, whatever the
    other request checked or loaded, and both equal plain greedy decoding."""
    import threading

    import lade_export
    from lade_export.runtime import collect

    out, _ = art10
    state = install(monkeypatch, version=V10)
    case = reference_greedy["cases"][0]
    with lade_export.load(out, "tensorrt") as model:
        decoder = model.decoder
        engine, real_run, lock = model.engine, model.engine.run, threading.Lock()
        seen = {"small": [], "wide": []}  # request -> (plan passed, engine that executed) per step

        def spy(feeds, with_logits=False, plan=None):
            with lock:  # the engine runs one step at a time anyway; this pairs each run with its execution
                result = real_run(feeds, with_logits, plan=plan)
                seen[threading.current_thread().name].append((plan, state.executions[-1]["decode_max_step"]))
            return result

        engine.run = spy
        streams = {name: decoder.stream(case["prompt_ids"], 64, resolve_profile(name), stop_token_ids=())  # the oracle
                   for name in ("small", "wide")}  # ignores EOS
        barrier, results = threading.Barrier(2), {}

        def consume(name):
            barrier.wait()
            results[name] = collect(streams[name])

        threads = [threading.Thread(target=consume, args=(name,), name=name) for name in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        del engine.run
        assert sorted(model.engine.loaded_engines) == ["small", "wide"]
    assert seen["small"] and set(seen["small"]) == {("small", 9)}  # prefill and every lookahead step
    assert seen["wide"] and set(seen["wide"]) == {("wide", 31)}
    assert max(r.stats.steps for r in results.values()) > 1
    for name in ("small", "wide"):
        assert results[name].token_ids == case["greedy_ids"][:64], name


def test_a_profile_no_engine_covers_is_refused_naming_the_limits(art10, monkeypatch):
    out, _ = art10
    install(monkeypatch, version=V10)
    result = invoke("generate", out, "--backend", "tensorrt", "--profile", "paper", "--prompt", "hi")
    assert result.exit_code == 2
    assert one_line(result) == (
        "error: profile 'paper' needs steps of up to 57 tokens (36 logit rows), more than any TensorRT engine here "
        "covers (small: steps ≤ 9, ≤ 7 logit rows; wide: steps ≤ 31, ≤ 21 logit rows); rebuild with --engine "
        "tensorrt --profile paper")


def test_each_step_runs_in_the_optimization_profile_that_covers_it(art10, monkeypatch):
    from lade_export.artifact import Artifact
    from lade_export.backends.tensorrt import TensorRTEngine
    from lade_export.feeds import causal_feeds, empty_past_feeds, example_feeds

    out, _ = art10
    state = install(monkeypatch, version=V10)
    art = Artifact(out)
    engine = TensorRTEngine(art, engine="small")
    dims = art.dims
    def step(n, past, rows):
        feeds = example_feeds(dims, step=n, past=past)
        feeds["logits_positions"] = feeds["logits_positions"][:, :rows]
        return feeds

    prefill = {**causal_feeds(list(range(3, 40)), 0), **empty_past_feeds(dims)}
    assert engine.optimization_profile_for(prefill) == "small:prefill"
    assert engine.optimization_profile_for(step(9, 100, 7)) == "small:decode"
    # 8 logit rows (more than W + G·(N−1) + 1) or 10 tokens: beyond decode, a packed pass of the scheduler
    assert engine.optimization_profile_for(step(9, 100, 8)) == "small:packed"
    assert engine.optimization_profile_for(step(10, 100, 7)) == "small:packed"
    assert engine.optimization_profile_for(step(512, 4095, 512)) == "small:packed"  # 8 requests' pool × 512
    assert engine.optimization_profile_for(step(513, 100, 7)) is None  # more rows than the prefill chunk
    assert engine.optimization_profile_for(step(9, 4096, 7)) is None
    assert engine.optimization_profile_for(step(1, 0, 1)) == "small:prefill"
    engine.run(prefill)
    engine.run(step(9, 100, 7))
    engine.run(step(12, 700, 12))
    assert [(e["profile"], e["step"], e["past"]) for e in state.executions] == [(0, 37, 0), (1, 9, 100), (2, 12, 700)]
    ctx_calls = [c for p in engine.plans for ctx in p.contexts.values() for c in ctx.calls]
    assert {("set_optimization_profile_async", i) for i in range(3)} <= set(ctx_calls)
    with pytest.raises(GenerationError, match=r"^no TensorRT engine covers a step of 10 tokens \(batch 1\) with 4096 "
                                              r"cached tokens and 7 logit rows: small \(prefill ≤ 256 tokens; decode "
                                              r"steps ≤ 9 tokens, ≤ 7 logit rows, cache ≤ 511; packed passes ≤ 512 rows, "
                                              r"pool ≤ 4095\); rebuild with larger --max-prompt/--max-context/--max-batch$"):
        engine.run(step(10, 4096, 7))
    engine.close()
    engine.close()


def test_logits_are_copied_back_only_when_asked(art10, monkeypatch):
    from lade_export.artifact import Artifact
    from lade_export.backends.tensorrt import TensorRTEngine
    from lade_export.feeds import example_feeds

    out, _ = art10
    state = install(monkeypatch, version=V10)
    engine = TensorRTEngine(Artifact(out))
    feeds = example_feeds(engine.dims, step=5, past=7)
    fast = engine.run(feeds)
    before = state.gpu.bytes_to_host
    full = engine.run(feeds, with_logits=True)
    logits_bytes = full["logits"].nbytes
    assert "logits" not in fast and full["logits"].shape == (1, 5, 512) and full["logits"].dtype == np.float32
    assert state.gpu.bytes_to_host - before == before + logits_bytes  # same outputs plus the logits
    np.testing.assert_array_equal(fast["next_token_ids"], full["next_token_ids"])
    assert full["next_token_ids"].tolist() == full["logits"].argmax(-1).tolist()


def test_an_execution_failure_is_an_engine_error(art10, monkeypatch):
    out, _ = art10
    state = install(monkeypatch, version=V10)
    state.fail_execute = True
    result = invoke("generate", out, "--backend", "tensorrt", "--prompt", "Once upon a time")
    assert result.exit_code == 1
    assert one_line(result) == ("error: TensorRT failed to run engines/small.plan (optimization profile 0, prefill) on a "
                                "step of 4 tokens with 0 cached; see the TensorRT log above")
    assert state.log[-1] == "[E] IExecutionContext::enqueueV3: injected failure"


def test_a_token_id_outside_the_vocabulary_fails_inside_the_engine_as_an_engine_error(art10, monkeypatch):
    import lade_export
    from lade_export.errors import GenerationError
    from lade_export.feeds import causal_feeds, empty_past_feeds

    out, _ = art10
    install(monkeypatch, version=V10)
    with lade_export.load(out, "tensorrt") as model:
        with pytest.raises(GenerationError, match=r"^token id 100000 is outside the vocabulary \(0\.\.511\)$"):
            model.generate([1, 100000, 5], max_new_tokens=2)  # the runtime refuses it before any step
        feeds = {**causal_feeds([1, 100000], 0), **empty_past_feeds(model.engine.dims)}
        with pytest.raises(EngineError, match=r"^TensorRT failed to run engines/small.plan \(optimization profile 0, "
                                              r"prefill\) on a step of 2 tokens"):
            model.engine.run(feeds)  # a caller below the runtime gets the engine's failure, in one line


def test_the_lean_runtime_runs_version_compatible_engines(art10, reference_greedy, monkeypatch):
    out, _ = art10
    state = install(monkeypatch, version=V10, kinds=("lean",))
    case = reference_greedy["cases"][0]
    result = invoke("generate", out, "--backend", "tensorrt", "--prompt", case["prompt"], "--max-new-tokens", 40)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(case["text"][:60])
    assert "TensorRT 10.16.1.11 lean runtime (tensorrt_lean)" in result.stderr
    assert state.deserialized[0]["runtime"] == "lean"


def test_a_later_runtime_runs_version_compatible_engines(art10, monkeypatch):
    out, _ = art10
    state = install(monkeypatch, version=V11, kinds=("lean",))
    result = invoke("generate", out, "--backend", "tensorrt", "--prompt", "Once", "--max-new-tokens", 8)
    assert result.exit_code == 0, result.output
    assert state.deserialized[0]["runtime"] == "lean"


def test_the_lean_runtime_refuses_engines_built_without_version_compatible(art11, monkeypatch):
    out, _ = art11
    install(monkeypatch, version=V11, kinds=("lean",))
    result = invoke("generate", out, "--backend", "tensorrt", "--prompt", "hi")
    assert result.exit_code == 2
    assert one_line(result) == (
        "error: engines/wide.plan was built without --version-compatible, which the lean runtime (tensorrt_lean) "
        "needs; rebuild with --version-compatible, or install the full TensorRT (pip install 'lade-export[tensorrt]')")


def test_tensorrt11_fp16_engine_decodes_lookahead_equal_to_greedy(art11, reference_greedy, monkeypatch):
    import lade_export

    out, _ = art11
    install(monkeypatch, version=V11)
    with lade_export.load(out, "tensorrt") as model:
        case = reference_greedy["cases"][1]
        greedy = model.generate(case["prompt_ids"], max_new_tokens=64, lookahead=False)
        ahead = model.generate(case["prompt_ids"], max_new_tokens=64, profile="wide")
    assert ahead.token_ids == greedy.token_ids and len(greedy.token_ids) > 20
    assert ahead.stats.steps < greedy.stats.steps


@pytest.mark.parametrize("runtime_version,message", [
    ("10.8.0.43", "error: engine engines/wide.plan was built with TensorRT 11.4.0.106 and needs this exact version; "
                  "this runtime is 10.8.0.43: rebuild it here (or build with --version-compatible)"),
    ("11.4.1.2", "error: engine engines/wide.plan was built with TensorRT 11.4.0.106 and needs this exact version; "
                 "this runtime is 11.4.1.2: rebuild it here (or build with --version-compatible)"),
])
def test_an_engine_of_another_tensorrt_version_is_refused(art11, monkeypatch, runtime_version, message):
    out, _ = art11
    install(monkeypatch, version=runtime_version)
    result = invoke("generate", out, "--backend", "tensorrt", "--prompt", "hi")
    assert result.exit_code == 2 and one_line(result) == message


def test_an_engine_for_another_gpu_is_refused_unless_hardware_compatible(art11, monkeypatch, tmp_path):
    out, _ = art11
    install(monkeypatch, version=V11, gpu=FakeGpu(capability=(8, 9)))
    result = invoke("generate", out, "--backend", "tensorrt", "--prompt", "hi")
    assert result.exit_code == 2
    assert one_line(result) == ("error: engine engines/wide.plan was built for compute capability 9.0, this GPU is "
                                "8.9; rebuild it here or with --hardware-compatible")


@pytest.mark.parametrize("gpu,cuda,message", [
    (FakeGpu(devices=None), True, "TensorRT is installed but no usable CUDA GPU (cudaGetDeviceCount: "
                                  "cudaErrorInsufficientDriver)"),
    (FakeGpu(devices=0), True, "TensorRT is installed but no CUDA GPU is visible (cudaGetDeviceCount: 0)"),
    (FakeGpu(), False, "TensorRT is installed but the CUDA wrapper is not installed: pip install cuda-bindings "
                       "(NVIDIA's CUDA runtime bindings; match the driver's CUDA major)"),
])
def test_without_a_gpu_or_cuda_wrapper_nothing_starts(art11, tmp_path, stories_dir, monkeypatch, gpu, cuda, message):
    from lade_export.backends.tensorrt_install import tensorrt_unavailable_reason
    from lade_export.export.tensorrt_build import builder_unavailable_reason

    out, _ = art11
    install(monkeypatch, version=V11, gpu=gpu, cuda=cuda)
    assert tensorrt_unavailable_reason() == message
    assert builder_unavailable_reason() == message
    build = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--out", tmp_path / "a")
    assert build.exit_code == 2 and one_line(build) == f"error: {message}"
    assert not (tmp_path / "a").exists()
    run = invoke("generate", out, "--backend", "tensorrt", "--prompt", "hi")
    assert run.exit_code == 2 and one_line(run) == f"error: {message}"


def test_an_unknown_engine_name_and_a_runtime_kind_that_is_not_installed(art10, monkeypatch):
    from lade_export.artifact import Artifact
    from lade_export.backends.tensorrt import TensorRTEngine

    out, _ = art10
    install(monkeypatch, version=V10)
    with pytest.raises(ArtifactError, match=r"has no TensorRT engine 'paper'; it has small, wide$"):
        TensorRTEngine(Artifact(out), engine="paper")
    with pytest.raises(BackendUnavailableError, match=r"^the TensorRT dispatch runtime is not installed; the lean"):
        TensorRTEngine(Artifact(out), runtime="dispatch")


def _engine(out, monkeypatch, version=V10, **kw):
    from lade_export.artifact import Artifact
    from lade_export.backends.tensorrt import TensorRTEngine

    state = install(monkeypatch, version=version)
    return TensorRTEngine(Artifact(out, verify="none"), **kw), state


def test_tensorrt_refusals_at_run_time_are_engine_errors_naming_the_call(art10, tmp_path, monkeypatch):
    from lade_export.feeds import example_feeds

    def widen(m):  # the manifest claims a larger decode optimization profile than the plan has
        m["engines"][0]["optimization_profiles"]["decode"]["input_ids"]["max"] = [1, 12]
        m["engines"][0]["optimization_profiles"]["decode"]["position_ids"]["max"] = [1, 12]
        m["engines"][0]["optimization_profiles"]["decode"]["attention_mask"]["max"][2] = 12

    engine, state = _engine(_copy(art10[0], tmp_path, widen), monkeypatch, engine="small")
    feeds = example_feeds(engine.dims, step=12, past=3)
    feeds["logits_positions"] = feeds["logits_positions"][:, :5]
    with pytest.raises(EngineError, match=r"^TensorRT rejected shape \[1, 12\] of input_ids in engines/small.plan "
                                          r"\(optimization profile 1, decode\); the optimization profile allows "
                                          r"\[1, 1\] to \[1, 12\]$"):
        engine.run(feeds)
    assert "Parameter check failed" in state.log[-1]


@pytest.mark.parametrize("break_it,error,message", [
    ("address", EngineError, r"^TensorRT rejected the device address of input_ids in engines/small.plan \(optimization "
                             r"profile 1, decode\)$"),
    ("out_address", EngineError, r"^TensorRT rejected the device address of logits in engines/small.plan"),
    ("shape", EngineError, r"^TensorRT could not infer the shape of output logits in engines/small.plan \(optimization "
                           r"profile 1, decode\): \[-1, -1, 512\]$"),
    ("context", EngineError, r"^TensorRT cannot create an execution context for engines/small.plan \(out of GPU "
                             r"memory\?\)$"),
    ("profile", EngineError, r"^TensorRT cannot select optimization profile 1 \(decode\) of engines/small.plan$"),
    ("bf16", ArtifactError, r"^engines/small.plan: I/O tensor logits is DataType.BF16; the runtime exchanges float32, "
                            r"int64 and bool tensors \(rebuild the engine\)$"),
    ("profiles", ArtifactError, r"^engines/small.plan has 4 optimization profiles; the manifest lists 3 \(prefill, "
                                r"decode, packed\)$"),
    ("corrupt", ArtifactError, r"^TensorRT 10.16.1.11 \(full runtime\) cannot deserialize engines/small.plan; see the "
                               r"TensorRT log above$"),
    ("malloc", EngineError, r"^CUDA cudaMalloc of [\d,]+ bytes failed: cudaErrorMemoryAllocation$"),
])
def test_each_refusal_of_the_tensorrt_api_is_one_clear_error(art10, tmp_path, monkeypatch, break_it, error, message):
    from lade_export.feeds import example_feeds

    out = _copy(art10[0], tmp_path)
    if break_it == "corrupt":
        (out / "engines" / "small.plan").write_bytes(b"garbage")
    engine, state = _engine(out, monkeypatch, engine="small")
    trt = sys.modules["tensorrt"]
    ctx_cls, eng_cls = trt.IExecutionContext, trt.ICudaEngine
    if break_it == "address":
        monkeypatch.setattr(ctx_cls, "set_tensor_address", lambda self, name, ptr: False)
    elif break_it == "out_address":
        real = ctx_cls.set_tensor_address
        monkeypatch.setattr(ctx_cls, "set_tensor_address",
                            lambda self, name, ptr: name != "logits" and real(self, name, ptr))
    elif break_it == "shape":
        real_shape = ctx_cls.get_tensor_shape
        monkeypatch.setattr(ctx_cls, "get_tensor_shape", lambda self, name: (-1, -1, 512) if name == "logits"
                            else real_shape(self, name))
    elif break_it == "context":
        monkeypatch.setattr(eng_cls, "create_execution_context", lambda self: None)
    elif break_it == "profile":
        monkeypatch.setattr(ctx_cls, "set_optimization_profile_async", lambda self, i, s: False)
    elif break_it == "bf16":
        real_dtype = eng_cls.get_tensor_dtype
        monkeypatch.setattr(eng_cls, "get_tensor_dtype",
                            lambda self, name: trt.bfloat16 if name == "logits" else real_dtype(self, name))
    elif break_it == "profiles":
        monkeypatch.setattr(eng_cls, "num_optimization_profiles", property(lambda self: 4))
    elif break_it == "malloc":
        state.gpu.memory_limit = 100
    with pytest.raises(error, match=message):
        engine.run(example_feeds(engine.dims, step=3, past=2))


def test_the_cuda_wrapper_frees_everything_and_reports_cuda_errors(monkeypatch):
    from lade_export.backends.cuda import CudaDevice

    state = install(monkeypatch, version=None)
    device = CudaDevice(0)
    assert device.compute_capability == "9.0"
    buf = device.allocate(10)
    assert buf.nbytes == 256  # never an empty allocation
    host = np.arange(64, dtype=np.int32)
    device.upload(buf, host)
    back = np.zeros_like(host)
    device.download(back, buf)
    device.synchronize()
    assert back.tolist() == host.tolist()
    device.upload(buf, np.zeros(0, np.float32))  # empty tensors copy nothing
    device.close()
    device.close()
    assert state.gpu.memory == {} and state.gpu.streams == set()
    with pytest.raises(EngineError, match="^CUDA cudaSetDevice failed: cudaErrorInvalidDevice$"):
        CudaDevice(3)


def test_the_runtime_imports_neither_torch_nor_the_builder(art10):
    """A service: lean runtime + cuda-bindings + numpy (the double stands in for both) —
    a fresh interpreter that loads and generates never imports torch, onnx, or anything of
    the export side (the builder is lade_export.export.tensorrt_build)."""
    out, _ = art10
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from _pytest.monkeypatch import MonkeyPatch
from tests.trt_double import install
install(MonkeyPatch(), version={V10!r}, kinds=("lean",))
import lade_export
model = lade_export.load({str(out)!r}, "tensorrt")
result = model.generate("Once upon a time", max_new_tokens=12, profile="small")
export_side = sorted(m for m in sys.modules if m.startswith("lade_export.export"))
print(model.engine.runtime_kind, len(result.token_ids), "torch" in sys.modules, "onnx" in sys.modules,
      ",".join(export_side) or "-")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["lean", "12", "False", "False", "-"]


# -- check -----------------------------------------------------------------------------------

def test_check_runs_every_engine_on_the_feeds_its_profiles_cover(art10, monkeypatch):
    out, _ = art10
    state = install(monkeypatch, version=V10)
    result = invoke("check", out)
    assert result.exit_code == 0, result.output
    assert "check passed" in result.stdout
    # small's packed optimization profile (the scheduler's passes, up to 512 rows) covers the wide step its decode
    # optimization profile does not
    assert "no optimization profile covers" not in result.stdout
    for name in ("tensorrt:small", "tensorrt:wide"):
        assert f"{name}" in result.stdout
    # prefill feeds in the prefill optimization profile, every step with a cache in the decode one, else the packed one
    assert state.executions and all((e["past"] == 0) == (e["profile"] == 0) for e in state.executions)
    assert sorted((e["decode_max_step"], e["profile"], e["step"]) for e in state.executions if e["profile"]) == \
        sorted([(9, 1, 1), (9, 1, 9), (9, 2, 31), (31, 1, 1), (31, 1, 9), (31, 1, 31)])


def test_check_bounds_reduced_precision_engines_relatively(art11, monkeypatch):
    out, _ = art11
    install(monkeypatch, version=V11)
    result = invoke("check", out)
    assert result.exit_code == 0, result.output
    assert "tensorrt:wide" in result.stdout and "check passed" in result.stdout


def test_check_without_a_tensorrt_runtime_says_the_engines_were_not_checked(art10, monkeypatch):
    out, _ = art10
    install(monkeypatch, version=None)
    result = invoke("check", out)
    assert result.exit_code == 0, result.output
    assert "note: TensorRT engines not checked: TensorRT is not installed; the lean runtime only runs" in \
        result.stdout.replace("\n", " ")


def test_check_fails_naming_the_engine_output_and_case_that_differ(art10, monkeypatch):
    out, _ = art10
    state = install(monkeypatch, version=V10)
    state.perturb = lambda name, profile, value: value + 0.5 if name == "logits" and profile == 1 else value
    result = invoke("check", out)
    assert result.exit_code == 1
    line = one_line(result)
    assert line.startswith("error: check failed: tensorrt:small: output logits differs from PyTorch at ")
    assert "tensorrt:wide: output logits differs from PyTorch at " in line
    for part in line.split("; "):  # every named case ran in the decode optimization profile, where the logits were wrong
        assert part.split(" at ", 1)[1].split(":")[0].endswith("(decode)"), part


def test_check_names_the_case_that_failed_not_a_later_passing_one():
    from lade_export.export.check import compare_runner

    ref = [{"logits": np.array([1.0, -1.0])}, {"logits": np.array([100.0, 3.0])}, {"logits": np.array([2.0, 1.0])}]
    # case A fails on the relative bound with a small difference; case B passes with a larger one
    got = [{"logits": np.array([1.0001, -1.0])}, {"logits": np.array([100.0005, 3.0])}, {"logits": np.array([2.0, 1.0])}]
    (err,) = compare_runner("onnxruntime", ["logits"], ["A", "B", "C"], ref, got, max_abs=1e-3, max_rel=1e-5)
    assert (err.case, err.ok) == ("A", False)
    assert err.max_abs == pytest.approx(1e-4)
    ids = compare_runner("x", ["next_token_ids"], ["A", "B"], [{"next_token_ids": np.array([[3]])}] * 2,
                         [{"next_token_ids": np.array([[4]])}, {"next_token_ids": np.array([[3]])}], 1e-3, 1e-5)
    assert (ids[0].case, ids[0].ok) == ("A", False)
    shape = compare_runner("x", ["next_token_ids"], ["A"], [{"next_token_ids": np.array([[3]])}],
                           [{"next_token_ids": np.array([[3, 4]])}], 1e-3, 1e-5)
    assert (shape[0].ok, shape[0].max_abs) == (False, float("inf"))


def test_reduced_precision_takes_float16_or_bfloat16_only(stories_loaded):
    from lade_export.graph import DecoderStep
    from lade_export.export.precision import ReducedPrecisionStep

    step = DecoderStep(stories_loaded.model).eval()
    with pytest.raises(ValueError, match="^dtype must be one of float16, bfloat16, got 'int8'$"):
        ReducedPrecisionStep(step, "int8")
    half = ReducedPrecisionStep(step, "float16")
    assert half.inner.inv_freq.dtype.is_floating_point and str(half.inner.inv_freq.dtype) == "torch.float32"
    assert str(next(half.inner.parameters()).dtype) == "torch.float16"
    assert str(next(step.parameters()).dtype) == "torch.float32"  # the float32 step is left as it was


# -- the double itself ----------------------------------------------------------------------------

SURFACE = json.loads((ROOT / "tests" / "data" / "tensorrt_lean_api.json").read_text())


@pytest.mark.parametrize("version", [V10, V11])
def test_the_double_only_offers_runtime_api_the_real_lean_runtime_has(monkeypatch, version):
    state = install(monkeypatch, version=version, kinds=("lean",))
    fake = sys.modules["tensorrt_lean"]
    real = SURFACE[version.split(".")[0]]
    for cls in ("Runtime", "ICudaEngine", "IExecutionContext", "Logger", "DataType", "TensorIOMode", "BuilderFlag",
                "HardwareCompatibilityLevel", "MemoryPoolType"):
        ours = {n for n in dir(getattr(fake, cls)) if not n.startswith("_")}
        assert ours <= set(real[cls]), (cls, sorted(ours - set(real[cls])))
    for name in ("float32", "float16", "bfloat16", "int64", "int32", "bool"):
        assert name in real["module"]
    assert ("FP16" in real["BuilderFlag"]) == (version == V10) == hasattr(fake.BuilderFlag, "FP16")
    assert state.major == int(version[:2])


def test_the_recorded_api_matches_an_installed_lean_runtime():
    try:
        import tensorrt_lean_bindings as real  # noqa: F401 - only where the lean wheels are installed
    except ImportError:
        pytest.skip("the lean runtime wheels are not installed (pip install tensorrt-lean-cu12); the recorded API "
                    "stays as read from 10.16.1.11 and 11.4.0.106")
    recorded = SURFACE[str(real.__version__).split(".")[0]]
    for cls, names in recorded.items():
        if cls not in ("__version__", "module"):
            assert set(names) <= {n for n in dir(getattr(real, cls)) if not n.startswith("_")}, cls


def test_the_double_refuses_a_runtime_without_a_gpu(monkeypatch):
    install(monkeypatch, version=V11, gpu=FakeGpu(devices=None))
    trt = sys.modules["tensorrt"]
    with pytest.raises(RuntimeError, match="without a usable CUDA GPU"):
        trt.Runtime(trt.Logger())
    assert trt_double.MAGIC == b"TRTDOUBLE1"


def test_a_broken_tensorrt_install_is_one_line(monkeypatch):
    import importlib

    from lade_export.backends import tensorrt_install as installed
    from lade_export.export import tensorrt_build

    install(monkeypatch, version=None)
    real = importlib.import_module

    def fake(name, *a):
        if name == "tensorrt":
            raise RuntimeError("This is a placeholder package; the real wheel is on pypi.nvidia.com\nmore")
        if name == "tensorrt_lean":
            raise ModuleNotFoundError("No module named 'tensorrt_lean_bindings'", name="tensorrt_lean_bindings")
        return real(name, *a)

    monkeypatch.setattr(installed.importlib, "import_module", fake)
    with pytest.raises(BackendUnavailableError, match=r"^tensorrt cannot be imported \(RuntimeError: This is a "
                                                      r"placeholder package; the real wheel is on pypi.nvidia.com\); "
                                                      r"the full TensorRT builds"):
        tensorrt_build.import_builder()
    assert installed.installed_tensorrt_major() is None
    with pytest.raises(BackendUnavailableError, match=r"^tensorrt_lean cannot be imported \(missing "
                                                      r"tensorrt_lean_bindings\); the lean runtime only runs"):
        installed.import_runtime("lean")


def test_precision_plans_refuse_other_versions_and_precisions():
    from lade_export.export.tensorrt_build import precision_plan

    with pytest.raises(BackendUnavailableError, match="^TensorRT 12 is not supported: lade-export builds engines with "
                                                      "TensorRT 10 or 11$"):
        precision_plan("fp16", 12)
    assert precision_plan("bf16", 10)["builder_flags"] == ["BF16"]
    assert precision_plan("bf16", 11)["graph_dtype"] == "bfloat16"


def test_feeds_without_an_input_are_covered_by_no_optimization_profile(art10, monkeypatch):
    from lade_export.feeds import example_feeds

    engine, _ = _engine(art10[0], monkeypatch)
    feeds = example_feeds(engine.dims, step=1, past=3)
    del feeds["attention_mask"]
    assert engine.optimization_profile_for(feeds) is None
    feeds["attention_mask"] = np.ones((1, 4), bool)  # wrong rank
    assert engine.optimization_profile_for(feeds) is None
    engine.close()


def test_a_reduced_precision_graph_beyond_its_bound_stops_the_build(tmp_path, stories_dir, monkeypatch):
    from lade_export.export import tensorrt_build

    install(monkeypatch, version=V11)
    monkeypatch.setitem(tensorrt_build.PRECISION_BOUNDS, "fp16", (float("inf"), 1e-9))
    result = invoke("build", "--model", stories_dir, "--engine", "tensorrt", "--profile", "small",
                    "--out", tmp_path / "a")
    assert result.exit_code == 1
    assert one_line(result).startswith("error: parity check (fp16 graph vs float32 PyTorch) failed at prefill (step ")
    assert "(bound 1e-09), argmax equal True" in one_line(result)
    assert os.listdir(tmp_path) == []


def test_the_cuda_wrapper_without_a_device_and_with_an_unnamed_error(monkeypatch):
    from lade_export.backends import cuda

    state = install(monkeypatch, version=None, gpu=FakeGpu(devices=0))
    with pytest.raises(BackendUnavailableError, match=r"^no CUDA GPU is visible \(cudaGetDeviceCount: 0\)$"):
        cuda.CudaDevice()
    state.gpu.devices = 1
    runtime = sys.modules["cuda.bindings.runtime"]
    monkeypatch.setattr(runtime, "cudaGetErrorName", lambda err: 1 / 0)
    device = cuda.CudaDevice()
    with pytest.raises(EngineError, match=r"^CUDA cudaFree failed: 1$"):  # the error's number when it has no name
        device._check(runtime.cudaFree(12345), "cudaFree")
    device.close()


def test_documented_tensorrt_rows_name_their_tests():
    doc = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    rows = {line.split("`")[1]: line for line in doc.splitlines() if line.startswith("| `tensorrt-")}
    assert set(rows) == set(DOCUMENTED_ROWS)
    for row, test in DOCUMENTED_ROWS.items():
        assert f"({test})" in rows[row] and callable(globals()[test]), row


# -- the KV cache stays on the device ----------------------------------------------------

def test_a_step_uploads_only_its_tokens_positions_mask_and_logit_rows(art10, reference_greedy, monkeypatch):
    """Host→device bytes of every step, counted by the double: input_ids and position_ids
    (8 bytes a token each), logits_positions (8 a row) and the bool mask (step × keys) —
    nothing of the cache, however long it is; the accepted rows' keys and values are moved
    into the device copy of the cache from the step's present buffers on the device."""
    import lade_export

    state = install(monkeypatch, version=V10)
    with lade_export.load(art10[0], "tensorrt") as model:
        case = reference_greedy["cases"][0]
        cached = 0
        for profile in ("wide", None):
            result = model.generate(case["prompt_ids"], max_new_tokens=128, profile=profile,
                                    lookahead=profile is not None, stop_token_ids=())  # the oracle ignores EOS
            assert result.token_ids == case["greedy_ids"], profile
            cached += result.stats.cache_tokens
    steps = [e for e in state.executions if e["past"] > 0]
    assert len(steps) > 100 and max(e["past"] for e in steps) > 128
    assert any(e["step"] == 31 for e in steps)  # lookahead steps of the wide engine
    for e in state.executions:
        assert e["bytes_to_device"] - e["mask_bytes"] == 16 * e["step"] + 8 * e["n_logits"], e
    dims = model.engine.dims
    row = dims.num_layers * 2 * dims.kv_heads * dims.head_dim * 4  # one token's keys and values, all layers
    assert state.gpu.bytes_on_device == row * cached  # every cached row moved once, on the device


def test_the_device_copy_follows_writes_the_engine_did_not_make():
    """KVMirror on host memory: rows an append copied from the latest step are copied
    "on the device", rows of any other write are uploaded, and the copy equals the host
    cache after each kind of write."""
    from lade_export.backends.cuda import HostMemory, KVMirror
    from lade_export.kv_cache import KVCache
    from lade_export.specs import ModelDims, past_key_name, present_key_name, present_value_name

    dims = ModelDims(num_layers=2, heads=2, kv_heads=2, head_dim=4, hidden=8, vocab=16, max_context=64,
                     tied_embeddings=False)
    rng = np.random.default_rng(0)
    memory, cache = HostMemory(), KVCache(dims, 40)
    names = list(cache.feeds())
    mirror = KVMirror(memory, cache, names)
    row = 2 * 4 * 4

    def device():
        out = {}
        for name in names:
            host = np.empty((1, cache.length, 2, 4), np.float32)
            memory.download(host, mirror.buffer, mirror.offsets[name])
            out[name] = host
        return out

    def step(width):
        outs = {n(i): rng.standard_normal((1, width, 2, 4)).astype(np.float32) for i in range(2)
                for n in (present_key_name, present_value_name)}
        device_buffers = {}
        for name, value in outs.items():
            buf = memory.allocate(value.nbytes)
            memory.upload(buf, value)
            device_buffers["past_key_values." + name[len("present."):]] = (buf, 0)
        return outs, (outs[present_key_name(0)], device_buffers)

    def sync(latest):
        """(bytes uploaded, bytes copied on the device) by one sync."""
        up, copied = memory.bytes_uploaded, memory.bytes_copied
        mirror.sync(cache, cache.feeds(), latest)
        return memory.bytes_uploaded - up, memory.bytes_copied - copied

    outs, latest = step(5)
    cache.append(outs)  # a prefill: every row kept
    assert sync(latest) == (0, 4 * 5 * row)
    outs, latest = step(7)
    cache.append(outs, np.array([0, 3, 4, 6]))  # lookahead: four accepted rows of seven
    assert sync(latest) == (0, 4 * 4 * row)
    for name, value in device().items():
        np.testing.assert_array_equal(value, cache.feeds()[name])
    outs, _ = step(3)
    cache.append(outs)  # an append of outputs that are not the engine's latest: uploaded
    assert sync(latest) == (4 * 3 * row, 0)
    assert sync(latest) == (0, 0)  # nothing written since
    cache.keys[0][:, 2:4] = 7.0  # a pool moving columns: a write outside append
    cache.length = 10
    assert sync(latest) == (4 * 10 * row, 0)
    for name, value in device().items():
        np.testing.assert_array_equal(value, cache.feeds()[name])
    assert device()[past_key_name(0)][0, 2, 0, 0] == 7.0
    cache.rewrote(6)  # a write a pool declares (regions): rows from 6 on
    assert sync(latest) == (4 * 4 * row, 0)
    for _ in range(9):  # more writes than the log keeps: the whole cache again
        cache.rewrote(9)
    assert sync(latest) == (4 * 10 * row, 0)


def test_batching_checks_the_scheduler_against_the_engines_packed_optimization_profile(art10, monkeypatch):
    engine, _ = _engine(art10[0], monkeypatch)
    assert engine.packed_limits == (512, 4096)  # max(token budget 64, prefill chunk 512, S); 8 requests × 512
    engine.check_batching(64, 512, 4096)  # the scheduler's defaults on stories260K's context
    for options in ((64, 600, 4096), (64, 512, 5000)):
        with pytest.raises(GenerationError, match=r"^the scheduler's passes \(token budget 64, prefill chunk \d+, pool "
                                                  r"of \d+ tokens\) exceed the TensorRT engines' packed optimization "
                                                  r"profile \(512 rows, 4096 pool tokens\): give the scheduler smaller options "
                                                  r"\(Scheduler\(model.decoder, token_budget=…, prefill_chunk=…, "
                                                  r"kv_tokens=…\)\) or rebuild the engines with a larger --max-context$"):
            engine.check_batching(*options)
    engine.close()
