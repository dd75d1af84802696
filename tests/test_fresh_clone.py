"""What a user meets on a fresh clone: prompt sets found through LADE_DATASETS or a file
path (and a one-line answer saying how when they are not there), the shipped profiles in
the repository's profiles/ folder and in the package, help that lists them all, and build
output made only of the project's own progress lines."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from click.testing import CliRunner

from lade_export.cli import main
from lade_export.evaluation.datasets import load_prompts
from lade_export.errors import GenerationError
from lade_export.profile import bundled_profile_names, bundled_profiles_dir

from .conftest import tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ["default", "default-int4", "gpu-large", "greedy-only", "paper", "small", "wide"]


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_named_prompt_sets_come_from_lade_datasets(stories_artifact, tmp_path, monkeypatch):
    (tmp_path / "sets" / "mt_bench").mkdir(parents=True)
    (tmp_path / "sets" / "mt_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 7, "turns": ["Once upon a time", "and then?"]}) + "\n")
    monkeypatch.setenv("LADE_DATASETS", str(tmp_path / "sets"))
    assert [(p.id, p.text) for p in load_prompts("mt_bench")] == [("7", "Once upon a time")]
    result = invoke("generate", stories_artifact, "--prompt-from", "mt_bench:0", "--max-new-tokens", 12, "--greedy")
    direct = invoke("generate", stories_artifact, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--greedy")
    assert result.exit_code == 0 and result.stdout == direct.stdout != ""


def test_a_missing_prompt_set_says_how_to_point_at_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LADE_DATASETS", str(tmp_path))
    try:
        load_prompts("gsm8k")
    except GenerationError as err:
        message = str(err)
    assert message == (f"dataset gsm8k not found at {tmp_path}/gsm8k/test.jsonl (from LADE_DATASETS); set LADE_DATASETS "
                       "to a folder holding mt_bench/question.jsonl, humaneval/HumanEval.jsonl.gz and gsm8k/test.jsonl "
                       "(gsm8k/test.jsonl: https://raw.githubusercontent.com/openai/grade-school-math/master/"
                       "grade_school_math/data/test.jsonl; docs/datasets.md lists all three), or give the path of a "
                       "JSONL file of prompts instead of the name")
    doc = (ROOT / "docs" / "errors.md").read_text()
    rest = message.split(" not found at ")[1].split("; ", 1)[1]  # after the path: what errors.md's row gives
    before, _, after = rest.partition("(gsm8k/test.jsonl: ")
    assert before in doc and after.split("; ", 1)[1] in doc
    from lade_export.evaluation.datasets import DATASET_SOURCES  # the addresses the errors give are the guide's
    assert all(url in (ROOT / "docs" / "datasets.md").read_text() for url in DATASET_SOURCES.values())
    assert "LADE_DATASETS" in (ROOT / "docs" / "datasets.md").read_text()


def test_without_lade_datasets_the_folder_beside_the_checkout_is_found(tmp_path, monkeypatch):
    from lade_export.evaluation.datasets import datasets_root

    monkeypatch.delenv("LADE_DATASETS", raising=False)
    monkeypatch.chdir(tmp_path)  # neither ./shared nor ../shared from here
    beside = ROOT.parent / "shared" / "datasets"
    if (beside / "mt_bench").is_dir():  # a checkout placed beside shared/, as the README describes
        assert datasets_root() == beside
    else:
        assert datasets_root() == tmp_path.parent / "shared" / "datasets"  # the fallback the message names


def test_a_quantized_build_says_which_prompts_its_agreement_was_measured_on(tmp_path, monkeypatch):
    from lade_export.evaluation.datasets import datasets_root
    from lade_export.export.build_checks import PARITY_PROMPT, quality_prompts

    class Words:  # a tokenizer of one id per character, without a chat template
        chat_template = None

        def __call__(self, text):
            return type("Encoded", (), {"input_ids": [ord(c) % 100 for c in text]})()

    monkeypatch.setenv("LADE_DATASETS", str(tmp_path))  # no MT-Bench there
    ids, label = quality_prompts(Words(), chat=False)
    assert ids == [[ord(c) % 100 for c in PARITY_PROMPT]]
    assert label == (f"the build's parity prompt (MT-Bench not found under {tmp_path}: set LADE_DATASETS to the "
                     "datasets folder)")
    assert datasets_root() == tmp_path
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "turns": [f"question {i}"]}) + "\n" for i in range(6)))
    ids, label = quality_prompts(Words(), chat=False)
    assert label == "the first 4 MT-Bench questions" and len(ids) == 4


def test_a_prompt_file_path_works_with_prompt_from(stories_artifact, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": "The cat"}) + "\n\n" + json.dumps({"prompt": "Once upon a time"}) + "\n")
    result = invoke("generate", stories_artifact, "--prompt-from", f"{prompts}:1", "--max-new-tokens", 12, "--greedy")
    direct = invoke("generate", stories_artifact, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--greedy")
    assert result.exit_code == 0 and result.stdout == direct.stdout != ""
    assert "LADE_DATASETS" in invoke("generate", "--help").stdout


def test_shipped_profiles_live_in_the_top_level_profiles_folder():
    assert sorted(p.stem for p in (ROOT / "profiles").glob("*.toml")) == SHIPPED
    assert not (ROOT / "lade_export" / "profiles").exists()
    assert bundled_profiles_dir() == ROOT / "profiles" and bundled_profile_names() == SHIPPED


def test_pyproject_installs_every_package_and_maps_the_profiles():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lade_export").rglob("__init__.py")
                   if "__pycache__" not in p.parts)
    assert sorted(tool["packages"]) == sorted(found + ["lade_export.profiles"])
    assert tool["package-dir"] == {"lade_export.profiles": "profiles"}
    assert tool["package-data"]["lade_export.profiles"] == ["*.toml"]


def test_build_help_lists_every_shipped_profile():
    text = "".join(invoke("build", "--help").stdout.split())  # help wraps lines, also at hyphens
    assert f"shippedname({','.join(SHIPPED)})" in text


PROGRESS = re.compile(r"^\[ *\d+\.\d+s\] |^built |^note: ")


def _build_stderr(source, out):
    proc = subprocess.run([sys.executable, "-m", "lade_export.cli", "build", "--model", str(source), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_builds_print_only_their_own_progress_lines(tmp_path, stories_dir):
    # a GGUF source (transformers' converter draws a tqdm bar) and a fused-attention export
    # (the trace warns about the fused step's Python int)
    fused = tiny_checkpoint(tmp_path / "tiny", num_hidden_layers=2)
    for source, out in ((stories_dir / "llama2c" / "stories260K.gguf", tmp_path / "gguf"), (fused, tmp_path / "fused")):
        err = _build_stderr(source, out)
        strays = [line for line in err.splitlines() if not PROGRESS.match(line)]
        assert strays == [] and "%|" not in err and "Warning" not in err, err
    assert json.loads((tmp_path / "fused" / "manifest.json").read_text())["graph"]["attention"] == "group-query-attention"


def test_docs_and_examples_keep_artifacts_out_of_setuptools_build_folder():
    # build/ is setuptools' (build/lib); the README's artifacts live in artifacts/ (ignored by git)
    examples = [p for p in (ROOT / "examples").rglob("*") if p.is_file() and "build" not in p.parent.parts]
    stale = {str(p.relative_to(ROOT)) for p in [*ROOT.glob("docs/*.md"), *examples]
             if re.search(r"(?<![\w/.-])build/(smollm2|stories)", p.read_text(errors="replace"))}
    assert stale == set()
    assert "/artifacts/" in (ROOT / ".gitignore").read_text().split()


def test_the_cpp_runner_script_says_how_to_call_it():
    proc = subprocess.run(["bash", str(ROOT / "examples" / "cpp" / "run.sh")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr == "usage: bash examples/cpp/run.sh ARTIFACT_DIR [MAX_NEW_TOKENS]\n"
    assert "bash examples/cpp/run.sh artifacts/smollm2" in (ROOT / "examples" / "cpp" / "README.md").read_text()


def test_the_cpp_runner_names_the_extra_when_pybind11_is_missing(tmp_path):
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\ncase "$*" in *pybind11*) exit 1;; esac\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    env = {**__import__("os").environ, "PATH": f"{shim.parent}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "cpp" / "run.sh"), "artifacts/smollm2"], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr == f"error: pybind11 is not installed in the environment of {shim}: pip install 'lade-export[cpp]'\n"
    assert "pybind11 is not installed in the environment of PYTHON: pip install 'lade-export[cpp]'" in \
        (ROOT / "docs" / "errors.md").read_text()


def test_an_onnxruntime_older_than_the_lade_kernels_need_is_refused_in_one_line(stories_artifact, tmp_path,
                                                                               monkeypatch):
    # pyproject allows onnxruntime >= 1.18; docs/embedding.md says --kernels lade artifacts need >= 1.29
    import onnxruntime
    import pytest

    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine
    from lade_export.errors import BackendUnavailableError

    monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
    library = tmp_path / "liblade_kernels.so"
    library.write_bytes(b"\x7fELF")  # refused before ONNX Runtime would read it
    artifact = Artifact(stories_artifact)
    with pytest.raises(BackendUnavailableError) as info:
        OrtEngine(artifact.onnx_path, artifact.dims, custom_ops=library)
    assert str(info.value) == (f"{artifact.onnx_path.parent} computes with lade kernels, which need onnxruntime>=1.29 "
                               "(installed: 1.20.1); pip install -U 'onnxruntime>=1.29'")
    assert "which need\nonnxruntime>=1.29 (installed: 1.20.1); pip install -U 'onnxruntime>=1.29'`" in (ROOT / "docs" / "embedding.md").read_text()
