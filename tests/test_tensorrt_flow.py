"""Everything around TensorRT that runs without it: optimization-profile shapes, engine
plans, the dry run, the missing-TensorRT error, and graph sanitizing."""

import os

import pytest
from click.testing import CliRunner

from lade_export.cli import main
from lade_export.errors import BackendUnavailableError, ProfileError
from lade_export.specs import ModelDims
from lade_export.export.optimization_profiles import axis_ranges, engine_plans, optimization_profiles
from lade_export.profile import LookaheadProfile, resolve_profile

STORIES = ModelDims(num_layers=5, heads=8, kv_heads=4, head_dim=8, hidden=64, vocab=512, max_context=512,
                    tied_embeddings=False)
SMOLLM2 = ModelDims(num_layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, vocab=49152, max_context=8192,
                    tied_embeddings=True)


@pytest.mark.parametrize(
    "profile,step,rows",
    [
        (LookaheadProfile(5, 4, 5), 31, 21),  # 1 + (5+5)*3 = 31; 1 + 5 + 5*3 = 21
        (LookaheadProfile(7, 5, 7), 57, 36),  # 1 + 14*4 = 57;     1 + 7 + 28 = 36
        (LookaheadProfile(2, 3, 2), 9, 7),  # 1 + 4*2 = 9;         1 + 2 + 4 = 7
        (LookaheadProfile(15, 5, 15), 121, 76),  # 1 + 30*4 = 121; 1 + 15 + 60 = 76
        (LookaheadProfile(4, 2, 0), 5, 5),  # no verification branch: 1 + 4*1 = 5
    ],
)
def test_decode_optimization_profile_step_is_one_plus_window_and_guesses_times_levels(profile, step, rows):
    shapes = optimization_profiles(profile, SMOLLM2, max_batch=4, max_prompt=1024, max_context=2048)
    dec, pre = shapes["decode"], shapes["prefill"]
    assert dec["input_ids"] == {"min": [1, 1], "opt": [1, step], "max": [4, step]}
    assert dec["position_ids"] == dec["input_ids"]
    assert dec["logits_positions"] == {"min": [1, 1], "opt": [1, rows], "max": [4, rows]}
    assert dec["attention_mask"] == {"min": [1, 1, 1, 1], "opt": [1, 1, step, 1024 + step],
                                     "max": [4, 1, step, 2047 + step]}
    assert dec["past_key_values.29.value"] == {"min": [1, 0, 3, 64], "opt": [1, 1024, 3, 64], "max": [4, 2047, 3, 64]}
    assert pre["input_ids"] == {"min": [1, 1], "opt": [1, 1024], "max": [4, 1024]}
    assert pre["attention_mask"] == {"min": [1, 1, 1, 1], "opt": [1, 1, 1024, 1024], "max": [4, 1, 1024, 1024]}
    assert pre["past_key_values.0.key"] == {"min": [1, 0, 3, 64], "opt": [1, 0, 3, 64], "max": [4, 0, 3, 64]}
    assert len(dec) == 4 + 2 * 30


def test_defaults_use_the_model_context_and_half_of_it_for_prompts():
    shapes = optimization_profiles(resolve_profile("wide"), STORIES)
    assert shapes["prefill"]["input_ids"]["max"] == [1, 256]
    assert shapes["decode"]["past_key_values.0.key"]["max"] == [1, 511, 4, 8]
    assert shapes["decode"]["attention_mask"]["max"] == [1, 1, 31, 542]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_batch": 0, "max_prompt": 10, "max_context": 512}, "max batch must be ≥ 1, got 0"),
        ({"max_batch": 1, "max_prompt": 512, "max_context": 512}, "max prompt must be in 1..511"),
        ({"max_batch": 1, "max_prompt": 10, "max_context": 100}, "its largest step (121 tokens) does not fit"),
    ],
)
def test_invalid_bounds_are_rejected(kwargs, message):
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        axis_ranges(LookaheadProfile(15, 5, 15), **kwargs)


def test_engine_plans_name_files_after_profiles_and_refuse_duplicates():
    plans = engine_plans([resolve_profile("default"), resolve_profile("paper")], STORIES, precision="bf16")
    assert [p["file"] for p in plans] == ["engines/default.plan", "engines/paper.plan"]
    assert plans[1]["optimization_profiles"]["decode"]["input_ids"]["max"] == [1, 57]
    assert plans[0]["precision"] == "bf16"
    with pytest.raises(ProfileError, match="two profiles are named 'default'"):
        engine_plans([resolve_profile("default"), resolve_profile("default")], STORIES)


def test_dry_run_prints_two_engines_and_writes_nothing(tmp_path, stories_dir):
    out = tmp_path / "X"
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--engine", "tensorrt", "--dry-run",
                                       "--profile", "wide", "--profile", "paper",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "engine engines/wide.plan: profile wide (W=5, N=4, G=5)" in text
    assert "engine engines/paper.plan: profile paper (W=7, N=5, G=7)" in text
    assert text.count("optimization profile 0 (prefill):") == 2
    assert text.count("optimization profile 1 (decode):") == 2
    assert "input_ids                            min [1, 1]  opt [1, 57]  max [1, 57]" in text
    assert "past_key_values.{0..4}.key/.value    min [1, 0, 4, 8]  opt [1, 256, 4, 8]  max [1, 511, 4, 8]" in text
    assert "nothing was written" in text
    assert os.listdir(tmp_path) == []


def test_without_tensorrt_the_build_fails_in_one_line_and_writes_nothing(tmp_path, stories_dir):
    out = tmp_path / "X"
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--engine", "tensorrt",
                                       "--profile", "default", "--profile", "paper", "--out", str(out)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: TensorRT is not installed; the full TensorRT builds and runs engines: pip install "
                     "'lade-export[tensorrt]' (tensorrt from NVIDIA's index pypi.nvidia.com, on a machine with an NVIDIA "
                     "GPU); the lean runtime only runs engines built with --version-compatible: pip install "
                     "'lade-export[tensorrt-lean]' (tensorrt-lean and cuda-bindings, from PyPI)"]
    assert os.listdir(tmp_path) == []


def test_tensorrt_runtime_engine_says_what_is_missing(stories_artifact, tmp_path):
    import json
    import shutil

    from lade_export.artifact import Artifact
    from lade_export.backends.tensorrt import TensorRTEngine

    art = tmp_path / "art"
    shutil.copytree(stories_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["engines"] = [{"file": "engines/default.plan", "profile": manifest["profiles"][0]}]  # a valid entry, its plan absent
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BackendUnavailableError, match=r"^TensorRT is not installed; the lean runtime only runs engines "
                                                      r"built with --version-compatible: pip install "
                                                      r"'lade-export\[tensorrt-lean\]'.*'lade-export\[tensorrt\]'"):
        TensorRTEngine(Artifact(art, verify="none"))


def test_sanitized_graph_is_smaller_and_keeps_parity(tmp_path, stories_loaded, stories_artifact, reference_greedy):
    import onnx

    from lade_export.export.parity import check_parity
    from lade_export.graph import DecoderStep, export_onnx
    from lade_export.export.sanitize import sanitize_onnx

    step = DecoderStep(stories_loaded.model).eval()
    raw = export_onnx(step, tmp_path / "raw.onnx", slim=False)
    counts = sanitize_onnx(raw, tmp_path / "clean.onnx")
    assert counts["nodes_after"] < counts["nodes_before"] * 0.6
    cases = check_parity(step, tmp_path / "clean.onnx", reference_greedy["cases"][1]["prompt_ids"],
                         resolve_profile("paper"))
    assert all(c.ok() for c in cases), cases
    # build slims by default: the artifact's graph is already the small one
    built = len(onnx.load(str(stories_artifact / "model.onnx")).graph.node)
    assert built <= counts["nodes_after"]


def test_packed_optimization_profile_covers_the_schedulers_passes_over_its_pool():
    """Batch 1, up to max(token budget 64, prefill chunk 512, S) rows over the scheduler's
    default pool of 8 requests × the model's context, even when the engines' context is lower."""
    shapes = optimization_profiles(LookaheadProfile(15, 5, 15), SMOLLM2, max_batch=4, max_prompt=1024,
                                   max_context=2048)
    packed = shapes["packed"]
    assert list(shapes) == ["prefill", "decode", "packed"]
    assert packed["input_ids"] == {"min": [1, 1], "opt": [1, 64], "max": [1, 512]}
    assert packed["logits_positions"] == packed["input_ids"]
    assert packed["past_key_values.0.key"] == {"min": [1, 0, 3, 64], "opt": [1, 4096, 3, 64],
                                               "max": [1, 65535, 3, 64]}
    assert packed["attention_mask"] == {"min": [1, 1, 1, 1], "opt": [1, 1, 64, 4160], "max": [1, 1, 512, 66047]}
    wide = optimization_profiles(LookaheadProfile(40, 15, 40), SMOLLM2, max_context=2048)["packed"]
    assert wide["input_ids"]["max"] == [1, 1 + 80 * 14]  # a lookahead step wider than the chunk runs alone
    small = optimization_profiles(LookaheadProfile(2, 3, 2), STORIES, packed_rows=16, packed_tokens=100)["packed"]
    assert small["input_ids"]["max"] == [1, 16] and small["past_key_values.0.key"]["max"] == [1, 99, 4, 8]
    with pytest.raises(ProfileError, match=r"^packed rows must be ≥ the profile's largest step \(31 tokens; a step "
                                           r"wider than the token budget runs alone\), got 16$"):
        optimization_profiles(LookaheadProfile(5, 4, 5), STORIES, packed_rows=16)
