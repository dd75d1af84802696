"""The manifest matches its documented schema (docs/manifest.md)."""

import re
from pathlib import Path

from lade_export.artifact import SCHEMA_VERSION, Artifact

DOC = (Path(__file__).resolve().parent.parent / "docs" / "manifest.md").read_text(encoding="utf-8")


def documented_keys(section: str) -> set:
    body = DOC.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in body.splitlines():
        m = re.match(r"\| (`[^|]+`) \|", line)
        if m and not m.group(1).startswith("`in ") and not m.group(1).startswith("`out "):
            keys.update(re.findall(r"`([a-z_0-9]+)`", m.group(1)))
    return keys


def test_top_level_model_and_graph_keys_are_documented(stories_artifact):
    m = Artifact(stories_artifact).manifest
    assert m["schema_version"] == SCHEMA_VERSION == 2
    optional = {"quantization"}  # int4/int8 builds only (tests/test_quantize.py checks it)
    assert set(m) <= documented_keys("Top-level keys") and documented_keys("Top-level keys") - set(m) <= optional
    assert set(m["model"]) == documented_keys("`model`")
    graph_optional = {"custom_ops"}  # --kernels lade builds only (tests/test_kernels.py checks it)
    assert set(m["graph"]) <= documented_keys("`graph`") and documented_keys("`graph`") - set(m["graph"]) <= graph_optional


def test_engine_entry_keys_are_documented():
    from lade_export.specs import ModelDims
    from lade_export.export.optimization_profiles import engine_plans
    from lade_export.profile import resolve_profile

    plan = engine_plans([resolve_profile("small")], ModelDims(2, 2, 1, 4, 8, 16, 64, False))[0]
    built_by_tensorrt = {"tensorrt_version", "compute_capability", "build_s", "precision_plan", "graph_parity",
                         "sanitize", "sha256"}
    assert set(plan) | built_by_tensorrt == documented_keys("`engines[]` (TensorRT)")


def test_tensor_table_matches_the_graph(stories_artifact):
    m = Artifact(stories_artifact).manifest
    for spec in m["graph"]["inputs"] + m["graph"]["outputs"]:
        name = re.sub(r"\.\d+\.", ".{i}.", spec["name"])
        assert f"`{name}`" in DOC, name
        assert spec["dtype"] in ("int64", "bool", "float32")
    assert [s["name"] for s in m["graph"]["inputs"][:4]] == ["input_ids", "position_ids", "attention_mask",
                                                             "logits_positions"]
    assert m["graph"]["inputs"][2]["shape"] == ["batch", 1, "step", "past+step"]
    assert m["files"]["model.onnx"]["bytes"] == (stories_artifact / "model.onnx").stat().st_size


def test_a_built_engine_entry_has_exactly_the_documented_keys(tmp_path, stories_dir, monkeypatch):
    """With the TensorRT test double (tests/trt_double.py) standing in for TensorRT 11."""
    import json

    from click.testing import CliRunner

    from lade_export.cli import main

    from .trt_double import install

    install(monkeypatch, version="11.4.0.106")
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), "--engine", "tensorrt", "--precision",
                                       "fp32", "--profile", "small", "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads((tmp_path / "a" / "manifest.json").read_text())["engines"]
    assert set(entry) == documented_keys("`engines[]` (TensorRT)")
    assert set(entry["precision_plan"]) == {"tensorrt_major", "network", "graph_dtype", "builder_flags",
                                            "cleared_flags", "io_dtype"}


# The typed manifest (lade_export/manifest.py): a build's JSON reads and writes back unchanged,
# optional keys get their defaults, unknown keys are kept as docs/manifest.md's versioning allows.

#: A lade build's ``quantization`` section, with the values of a SmolLM2 int4 build (int8 compute).
LADE_QUANTIZATION = {
    "spec": {"bits": 4, "head_bits": 8, "block_size": 32, "lookahead_exact": True, "kernels": "lade",
             "compute": "int8", "activations": "int8 per row and block of 32", "layers": "minmax (GGML Q4_1)",
             "head_and_embedding": "absmax (GGML Q8_0)"},
    "graph": {"matmuls": 121, "embedding": "shared with the LM head", "bytes_before": 538061508,
              "bytes_after": 98767503, "attention_rows": 30},
    "quality": {"sequences": 4, "positions": 256, "top1_agreement": 0.96484375, "max_abs_logit_diff": 1.8829355239868164},
    "kernels": {"library": "kernels/liblade_kernels.so", "compute": "int8",
                "paths": {"int8": ["amx", "avx512vnni", "avxvnni", "avx2", "portable"], "float32": ["avx512", "portable"]},
                "path_at_build": "avx512vnni"},
}


def _on_disk(artifact_dir):
    import json

    return json.loads((artifact_dir / "manifest.json").read_text(encoding="utf-8"))


def _with_manifest(tmp_path, artifact_dir, data):
    """A copy of the artifact whose manifest is ``data``."""
    import json
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(artifact_dir, copy)
    (copy / "manifest.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return copy


def test_a_built_manifest_round_trips_key_for_key(stories_artifact):
    import json

    from lade_export.manifest import Manifest

    data = _on_disk(stories_artifact)
    m = Artifact(stories_artifact).spec
    assert m == Manifest.from_dict(data)
    assert m.to_dict() == data
    assert json.dumps(m.to_dict(), indent=2) == json.dumps(data, indent=2)  # the same order too
    assert Manifest.from_dict(m.to_dict()) == m
    assert m.model.dims.num_layers == data["model"]["dims"]["num_layers"] == 5
    assert [p.name for p in m.profiles] == ["default", "small"] and m.default_profile == "default"
    assert [t.name for t in m.graph.inputs[:4]] == ["input_ids", "position_ids", "attention_mask", "logits_positions"]
    assert m.files["model.onnx"].bytes == (stories_artifact / "model.onnx").stat().st_size


def test_quantization_and_engine_sections_round_trip(stories_artifact):
    from lade_export.manifest import Manifest
    from lade_export.export.optimization_profiles import engine_plans
    from lade_export.profile import resolve_profile

    data = _on_disk(stories_artifact)
    (plan,) = engine_plans([resolve_profile("small")], Artifact(stories_artifact).dims)
    engine = {**plan, "tensorrt_version": "10.16.1.11", "compute_capability": "9.0", "build_s": 41.5,
              "precision_plan": {"tensorrt_major": 10, "network": "weakly typed", "graph_dtype": "float32",
                                 "builder_flags": ["FP16"], "cleared_flags": [], "io_dtype": "float32"},
              "graph_parity": None, "sanitize": {"nodes_before": 900, "nodes_after": 850}, "sha256": "ab" * 32}
    data = {**data, "graph": {**data["graph"], "precision": "int4", "custom_ops": "kernels/liblade_kernels.so"},
            "engines": [engine], "quantization": LADE_QUANTIZATION}
    keys = list(data)  # quantization before files, as the build writes it
    data = {k: data[k] for k in keys[:keys.index("engines") + 1] + ["quantization", "files"]}
    m = Manifest.from_dict(data)
    assert m.to_dict() == data and list(m.to_dict()) == list(data)
    assert list(m.to_dict()["graph"]) == ["file", "external_data", "opset", "precision", "lookahead_exact",
                                          "custom_ops", "mask", "attention", "kv_cache", "kv_layout", "inputs",
                                          "outputs"]
    assert m.quantization.spec.compute == m.kernel_compute == "int8"
    assert m.quantization.kernels.paths["float32"] == ("avx512", "portable")
    assert m.quantization.graph.bytes_after == 98767503 and m.quantization.quality.positions == 256
    (e,) = m.engines
    assert e.lookahead_profile == resolve_profile("small") and e.precision == "fp16" and e.graph_parity is None
    assert e.optimization_profiles == plan["optimization_profiles"]


def test_optional_keys_read_with_their_documented_defaults_and_still_decode(tmp_path, stories_artifact):
    """A manifest of an earlier schema-2 build (no precision, attention, kv_cache,
    lookahead_exact, rope, parity.transformers, lookup_min_match) opens with the defaults
    docs/manifest.md gives and decodes the same tokens."""
    import lade_export

    data = _on_disk(stories_artifact)
    for key in ("precision", "attention", "kv_cache", "lookahead_exact", "kv_layout", "mask"):
        del data["graph"][key]
    del data["model"]["rope"], data["parity"]["transformers"], data["timings_s"]
    for p in data["profiles"]:
        del p["lookup_min_match"], p["max_step"]
    old = _with_manifest(tmp_path, stories_artifact, data)
    m = Artifact(old).spec
    assert (m.graph.precision, m.graph.attention, m.graph.kv_cache, m.graph.lookahead_exact) == \
        ("fp32", "onnx-ops", "sequence-major", True)
    assert m.graph.custom_ops is None and m.model.rope is None and m.parity.transformers is None
    assert m.quantization is None and m.kernel_compute == "float32"
    assert [p.lookup_min_match for p in m.profiles] == [1, 1]
    written = m.to_dict()
    assert written["graph"]["precision"] == "fp32" and "rope" not in written["model"] and "timings_s" not in written
    prompt = "Once upon a time"
    assert lade_export.load(old).generate(prompt, max_new_tokens=12).token_ids == \
        lade_export.load(stories_artifact).generate(prompt, max_new_tokens=12).token_ids


def test_unknown_keys_are_kept_and_unknown_profile_keys_ignored(tmp_path, stories_artifact):
    """docs/manifest.md: readers ignore keys they do not know. The typed sections keep them
    (written back by to_dict, after the known keys); a profile entry ignores them."""
    data = _on_disk(stories_artifact)
    data["future_section"] = {"a": 1}
    data["graph"]["future_flag"] = True
    data["model"]["rope"]["future"] = [1, 2]
    data["tokenizer"]["future"] = "x"
    data["files"]["model.onnx"]["future"] = 0
    data["profiles"][0]["future_knob"] = 3
    art = Artifact(_with_manifest(tmp_path, stories_artifact, data))
    m = art.spec
    assert m.extra == {"future_section": {"a": 1}} and m.graph.extra == {"future_flag": True}
    assert m.model.rope.extra == {"future": [1, 2]} and m.tokenizer.extra == {"future": "x"}
    assert m.files["model.onnx"].extra == {"future": 0}
    assert m.profiles == Artifact(stories_artifact).spec.profiles
    written = m.to_dict()
    del data["profiles"][0]["future_knob"]
    assert written == data
    assert list(written)[-1] == "future_section" and list(written["graph"])[-1] == "future_flag"
    assert art.manifest["profiles"][0]["future_knob"] == 3  # artifact.manifest: the JSON as on disk


def test_manifest_refusals_are_one_line(tmp_path, stories_artifact):
    import pytest

    from lade_export.errors import ArtifactError
    from lade_export.manifest import Manifest

    data = _on_disk(stories_artifact)
    cases = [
        (lambda d: d.pop("graph"), "manifest lacks graph; rebuild with lade-export build"),
        (lambda d: d["graph"].clear(), "manifest lacks graph.file, graph.opset, graph.inputs, graph.outputs; rebuild "
                                       "with lade-export build"),
        (lambda d: d["tokenizer"].pop("file"), "manifest lacks tokenizer.file; rebuild with lade-export build"),
        (lambda d: d["files"]["model.onnx"].pop("bytes"), "manifest lacks files.model.onnx.bytes; rebuild with "
                                                          "lade-export build"),
        (lambda d: d["graph"]["inputs"][0].pop("dtype"), "manifest lacks graph.inputs[0].dtype; rebuild with "
                                                         "lade-export build"),
        (lambda d: d["profiles"][1].update(ngram=1), "manifest has profiles[1]: profile 'small': ngram (N) must be "
                                                     "≥ 2, got 1; rebuild with lade-export build"),
        (lambda d: d.update(engines={}), "manifest lacks engines (a list); rebuild with lade-export build"),
        (lambda d: d.update(schema_version=1), "schema_version 1 is not supported by this lade-export (expects 2); "
                                               "rebuild with lade-export build"),
        # present but null, or another kind of JSON value (hand edits): refused, not read as None
        (lambda d: d["graph"].update(file=None), "manifest lacks graph.file; rebuild with lade-export build"),
        (lambda d: d["graph"].update(file=5, opset="17"), "manifest lacks graph.file (a string), graph.opset (an "
                                                          "integer); rebuild with lade-export build"),
        (lambda d: d["source"].update(model=None), "manifest lacks source.model; rebuild with lade-export build"),
        (lambda d: d["tokenizer"].update(file=5), "manifest lacks tokenizer.file (a string); rebuild with "
                                                  "lade-export build"),
        (lambda d: d["tokenizer"].update(chat_template=5), "manifest lacks tokenizer.chat_template (a string); "
                                                           "rebuild with lade-export build"),
        (lambda d: d["files"]["model.onnx"].update(sha256=5, bytes="x"),
         "manifest lacks files.model.onnx.sha256 (a string), files.model.onnx.bytes (an integer); rebuild with "
         "lade-export build"),
        (lambda d: d["model"].update(stop_token_ids=["x"]), "manifest lacks model.stop_token_ids (a list of "
                                                            "integers); rebuild with lade-export build"),
        (lambda d: d["model"].update(stop_token_ids=[True]), "manifest lacks model.stop_token_ids (a list of "
                                                             "integers); rebuild with lade-export build"),
    ]
    import copy

    for edit, message in cases:
        d = copy.deepcopy(data)
        edit(d)
        with pytest.raises(ArtifactError) as err:
            Manifest.from_dict(d, where="m.json")
        assert str(err.value) == f"m.json: {message}"
