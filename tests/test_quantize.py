"""Weight-only quantized engines: exact block grids, int4 builds whose lookahead equals
greedy on the same engine, int8 builds that refuse lookahead, and SmolLM2's int4 engine
computing with the model's own 4-bit weights."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import lade_export
from lade_export.cli import main
from lade_export.errors import ProfileError
from lade_export.profile import resolve_profile
from lade_export.export.quantize import QuantSpec
from lade_export.export.weight_blocks import block_quant


def _dequantize(q, bits, block):
    """float [K, N] back from block_quant's MatMulNBits layout (the ops' arithmetic)."""
    packed = q["packed"]
    n, blocks, _ = packed.shape
    if bits == 4:
        vals = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, blocks, block).astype(np.float64)
    else:
        vals = packed.astype(np.float64)
    if q["zero_points"] is None:
        zp = np.full((n, blocks), 1 << (bits - 1))
    elif bits == 4:
        zp = np.stack([q["zero_points"] & 0xF, q["zero_points"] >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        zp = q["zero_points"]
    w = q["scales"][..., None].astype(np.float64) * (vals - zp[..., None])
    if q["residual"] is not None:
        w = w + q["residual"].T[..., None]
    return w.reshape(n, blocks * block).T


def test_minmax_recovers_a_q4_1_grid_exactly():
    rng = np.random.default_rng(0)
    k, n, block = 128, 40, 32
    d = rng.uniform(0.001, 0.05, size=(n, k // block, 1))
    m = rng.uniform(-0.5, 0.1, size=(n, k // block, 1))
    q = rng.integers(0, 16, size=(n, k // block, block))
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 blocks span the whole range: d = (max − min) / 15
    w = (d * q + m).reshape(n, k).T.astype(np.float32)  # [K, N], as a dequantized GGUF Q4_1 tensor
    out = block_quant(w, 4, block, "minmax")
    assert out["residual"] is not None  # Q4_1 minima are not multiples of d: the real zero point needs it
    assert np.max(np.abs(_dequantize(out, 4, block) - w)) < 1e-6


def test_absmax_recovers_a_q8_0_grid_exactly():
    rng = np.random.default_rng(1)
    k, n, block = 64, 24, 32
    d = rng.uniform(0.001, 0.02, size=(n, k // block, 1))
    q = rng.integers(-127, 128, size=(n, k // block, block))
    q[..., 0] = 127  # the block's absmax lands on ±127, as Q8_0 guarantees
    w = (d * q).reshape(n, k).T.astype(np.float32)
    out = block_quant(w, 8, block, "absmax")
    assert out["zero_points"] is None and out["residual"] is None
    assert np.max(np.abs(_dequantize(out, 8, block) - w)) < 1e-6


@pytest.fixture(scope="module")
def stories_int4(tmp_path_factory, stories_dir, stories_loaded):
    from lade_export.export.build import build_artifact

    out = tmp_path_factory.mktemp("int4") / "art"
    build_artifact(str(stories_dir), [resolve_profile("default-int4"), resolve_profile("default")], out,
                   loaded=stories_loaded, quantization=QuantSpec.for_precision("int4"))
    return out


def test_int4_build_records_its_quantization(stories_int4):
    m = json.loads((stories_int4 / "manifest.json").read_text())
    assert m["graph"]["precision"] == "int4" and m["graph"]["lookahead_exact"] is True
    q = m["quantization"]
    assert q["spec"]["bits"] == 4 and q["spec"]["accuracy_level"] == 1 and q["spec"]["head_bits"] == 0
    # 5 layers × 3 MatMuls: fused q/k/v, o, fused gate/up; down_proj (172 inputs, not a multiple of the
    # block of 32) stays float32
    assert q["graph"]["matmuls"] == 5 * 3 and q["graph"]["embedding"] == "float32"
    assert q["graph"]["bytes_after"] < q["graph"]["bytes_before"]
    assert q["quality"]["positions"] > 100 and 0.5 < q["quality"]["top1_agreement"] <= 1.0
    graph = onnx.load(str(stories_int4 / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("MatMulNBits") == 15 and all(
        next(a.i for a in n.attribute if a.name == "accuracy_level") == 1 for n in graph.graph.node
        if n.op_type == "MatMulNBits")
    assert m["default_profile"] == "default-int4"


def test_lookahead_equals_greedy_on_the_int4_engine(stories_int4, reference_greedy):
    assert_lookahead_equals_greedy(stories_int4, reference_greedy)


def assert_lookahead_equals_greedy(artifact, reference_greedy):
    """Seven profiles, wide and narrow, on the oracle's prompts: every output is the engine's
    greedy output (also used by tests/test_kernels.py)."""
    model = lade_export.load(artifact)
    for case in reference_greedy["cases"]:  # stop ids off: the oracle ignores EOS
        greedy = model.generate(case["prompt_ids"], max_new_tokens=128, lookahead=False, stop_token_ids=())
        for profile in ("default-int4", "default", "wide", "paper", "small", "2,3,2,6,2", "0,3,2,6,2"):
            look = model.generate(case["prompt_ids"], max_new_tokens=128, profile=profile, stop_token_ids=())
            assert look.token_ids == greedy.token_ids, profile
        assert look.stats.steps < greedy.stats.steps


def test_int8_builds_decode_without_lookahead_and_refuse_it(tmp_path, stories_dir, stories_loaded):
    from lade_export.export.build import build_artifact

    refused = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--precision", "int8", "--profile",
                                        "default", "--out", str(tmp_path / "x")])
    assert refused.exit_code == 2
    assert refused.stderr.strip().endswith(
        "--precision int8 with accuracy level 4 computes one-token and multi-token steps differently (int8 "
        "activations), so lookahead would not be exact; give --profile greedy-only, or build int4 (float32 compute)")
    out = tmp_path / "int8"
    build_artifact(str(stories_dir), [resolve_profile("greedy-only")], out, loaded=stories_loaded,
                   quantization=QuantSpec.for_precision("int8"))
    model = lade_export.load(out)
    assert model.artifact.manifest["graph"]["lookahead_exact"] is False
    plain = model.generate("Once upon a time", max_new_tokens=24)  # the default profile: greedy
    assert plain.stats.steps == 24
    with pytest.raises(ProfileError, match="this engine computes one-token and multi-token steps differently"):
        model.generate("Once upon a time", max_new_tokens=24, profile="default")


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["onnxruntime", "lade"])
def test_smollm2_int4_engine_computes_with_the_models_own_weights(tmp_path, smollm2_loaded, kernels):
    """SmolLM2's GGUF stores its layers as Q4_1 blocks of 32 (and its tied embedding as Q8_0):
    the int4 graph holds those exact weights — with the lade kernels the 8-bit head too — so
    with float32 compute it agrees with the float32 graph (teacher-forced on MT-Bench answers)
    to float32 noise, and lookahead stays exact on it."""
    from lade_export.export.build import build_artifact

    out = tmp_path / "smol4"
    manifest = build_artifact("smollm2-135m-instruct", [resolve_profile("default-int4")], out, loaded=smollm2_loaded,
                              quantization=QuantSpec.for_precision("int4", kernels=kernels,
                                                                                  compute="float32" if kernels == "lade" else None))
    quality = manifest["quantization"]["quality"]
    assert quality["top1_agreement"] == 1.0 and quality["max_abs_logit_diff"] < 1e-3
    # float32 head (113 MB) with ONNX Runtime's kernels; 8-bit head with the lade kernels (96 MB in all)
    share = 0.4 if kernels == "onnxruntime" else 0.2
    assert manifest["quantization"]["graph"]["bytes_after"] < share * manifest["quantization"]["graph"]["bytes_before"]
    model = lade_export.load(out)
    ids = model.encode("Name three rivers in Europe and one fact about each.")
    greedy = model.generate(ids, max_new_tokens=64, lookahead=False)
    own = model.generate(ids, max_new_tokens=64)  # its default profile: default-int4 (W=0, history lookup)
    assert manifest["default_profile"] == "default-int4"
    assert own.token_ids == greedy.token_ids and own.stats.steps <= 64
    assert model.generate(ids, max_new_tokens=64, profile="default").token_ids == greedy.token_ids


def test_compare_runs_the_int4_build_beside_the_float32_one(tmp_path, stories_artifact, stories_int4):
    import csv

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("Once upon a time", "The little dog")))
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "small", "--dataset", str(prompts),
                                       "--limit", "2", "--max-new-tokens", "32", "--also", str(stories_int4),
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # the int4 build runs its own default profile (default-int4) beside its greedy
    assert [r["config"] for r in records[:4]] == ["greedy", "small", "int4 greedy", "int4 default-int4"]
    assert all(r["exact"] for r in records)
    assert records[3]["reference"] == "int4 greedy" and records[3]["token_ids"] == records[2]["token_ids"]
    rows = {r["config"]: r for r in csv.DictReader((out / "summary.csv").open())}
    own = float(rows["int4 default-int4"]["decode_tok_s"]) / float(rows["int4 greedy"]["decode_tok_s"])
    assert abs(float(rows["int4 default-int4"]["speedup_vs_own_greedy"]) - own) < 1e-3
    assert "- **also**: int4: " in (out / "summary.md").read_text()
