"""Every command that only reads an artifact works on the base install (no torch,
transformers, onnx or matplotlib): each runs here in a subprocess where importing those
modules fails, as it does after ``pip install lade-export``. ``check`` (it runs the
PyTorch reference) says in one line which extra it needs. .ci/run repeats the main
ones in a real venv made with ``pip install .``."""

import json
import subprocess
import sys

import lade_export

#: The export and bench extras' modules; on the base install none of them imports.
BLOCKED = ("torch", "transformers", "onnx", "onnxscript", "onnxslim", "safetensors", "gguf", "accelerate",
           "polygraphy", "matplotlib")
SHIM = ("import sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # import fails with ModuleNotFoundError, find_spec says absent\n"
        "from lade_export.cli import main\n"
        "sys.argv = ['lade-export'] + sys.argv[1:]\n"
        "main()\n")


def thin(*args, cwd):
    return subprocess.run([sys.executable, "-c", SHIM, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_inspect_runs_without_the_export_extra(stories_artifact, tmp_path):
    proc = thin("inspect", stories_artifact, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    files = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith("  ok")]
    assert files == list(json.loads((stories_artifact / "manifest.json").read_text())["files"])
    as_json = thin("inspect", "--json", stories_artifact, cwd=tmp_path)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["source"]["kind"] == "hf-dir"


def test_generate_triton_tune_and_compare_run_without_the_export_extra(stories_artifact, tmp_path):
    ref = lade_export.load(stories_artifact).generate("Once upon a time", max_new_tokens=20)
    gen = thin("generate", stories_artifact, "--prompt", "Once upon a time", "--max-new-tokens", 20, "--check-greedy",
               cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout == ref.text + "\n" and gen.stderr.splitlines()[-1].startswith("identical to greedy: yes")

    repo = thin("triton", stories_artifact, "--out", tmp_path / "repo", cwd=tmp_path)
    assert repo.returncode == 0, repo.stderr
    assert (tmp_path / "repo" / "stories260K" / "config.pbtxt").is_file()

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "The cat", "Lily saw")))
    tuned = thin("tune", stories_artifact, "--dataset", prompts, "--limit", 2, "--max-new-tokens", 8,
                 "--candidate", "1,2,1", "--validate-dataset", "none", "--out", tmp_path / "t.toml", cwd=tmp_path)
    assert tuned.returncode == 0, tuned.stderr
    assert "[lookahead]" in (tmp_path / "t.toml").read_text()

    compared = thin("compare", stories_artifact, "--dataset", prompts, "--limit", 2, "--max-new-tokens", 8,
                    "--out", tmp_path / "cmp", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "(no speedup.png: plotting needs pip install 'lade-export[bench]')" in compared.stdout
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["results.jsonl", "summary.csv", "summary.md"]


def test_check_names_the_extra_it_needs_in_one_line(stories_artifact, tmp_path):
    proc = thin("check", stories_artifact, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == ("error: lade-export check needs torch, which this install lacks: a CPU build of PyTorch "
                           "first (pip install torch --index-url https://download.pytorch.org/whl/cpu), then "
                           "pip install 'lade-export[export]'\n")
