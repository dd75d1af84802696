"""``lade-export check``: passes on real builds, fails on a perturbed weight or checksum."""

import hashlib
import json
import shutil

import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from lade_export.cli import main


def run_check(path):
    return CliRunner().invoke(main, ["check", str(path)])


def test_check_passes_on_stories(stories_artifact):
    result = run_check(stories_artifact)
    assert result.exit_code == 0, result.output
    assert "check passed" in result.stdout
    assert "lookahead W1 N3 G2" in result.stdout and "lookahead W2 N3 G2" in result.stdout


def _copy(src, tmp_path):
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


def test_check_fails_naming_the_output_when_a_weight_is_perturbed(tmp_path, stories_artifact):
    art = _copy(stories_artifact, tmp_path)
    model = onnx.load(str(art / "model.onnx"))
    init = next(i for i in model.graph.initializer if i.name == "norm.weight")
    arr = numpy_helper.to_array(init).copy()
    arr[:4] += 0.5
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, str(art / "model.onnx"))
    # keep the checksum consistent, so only the numbers can give it away
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["model.onnx"]["sha256"] = hashlib.sha256((art / "model.onnx").read_bytes()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run_check(art)
    assert result.exit_code == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: check failed: onnxruntime: output logits differs from PyTorch at ")
    assert "checksum" not in line


def test_check_fails_naming_the_file_when_a_checksum_does_not_match(tmp_path, stories_artifact):
    art = _copy(stories_artifact, tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["model.onnx"]["sha256"] = "0" * 64
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run_check(art)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: check failed: model.onnx: sha256 does not match the manifest")


@pytest.mark.slow
def test_check_passes_on_smollm2(smollm2_artifact):
    result = run_check(smollm2_artifact)
    assert result.exit_code == 0, result.output
    assert "check passed" in result.stdout
