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
    from lade_export.optimization_profiles import engine_plans
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
