"""Decoding from a built artifact imports no export-time framework: a fresh interpreter
imports every run-time module of the README's pipeline table, loads the stories260K
artifact, decodes (lookahead, plain greedy, and through the scheduler) and then must
have neither torch, transformers, onnx nor onnxscript in ``sys.modules``.

Unlike tests/test_thin_install.py (which makes those imports fail, as on the base
install), nothing is blocked here: a module that imports one of them, even inside a
``try``, is caught by name."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The export side: these may import torch and the ONNX tool chain; every other module of
#: the package is a run-time module (the layout is the rule: README, *Pipeline*).
EXPORT_SIDE = ("lade_export.graph", "lade_export.export")
#: Run as programs, not imported (``python -m lade_export.cli`` would start the CLI).
PROGRAMS = ("lade_export.cli.__main__",)


def _package_modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "lade_export").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


#: Every run-time module: the package minus its export side — the artifact, n-grams,
#: algorithm, decoding loop, text, API, batching, serving, engines, benchmarks (compare,
#: tune and their peers decode from an artifact on the base install) and the CLI (it
#: parses, and imports a command's modules when the command runs). The PyTorch reference
#: engine (``export/torch_engine.py``) is on the export side.
RUNTIME_MODULES = tuple(m for m in _package_modules()
                        if m not in PROGRAMS and not any(m == e or m.startswith(e + ".") for e in EXPORT_SIDE))
#: Export-time frameworks no run-time module may import.
EXPORT_ONLY = ("torch", "transformers", "onnx", "onnxscript")

SCRIPT = """
import importlib, json, sys, types

# Triton provides triton_python_backend_utils to the models it runs; triton_model reads one constant at import.
stub = types.ModuleType("triton_python_backend_utils")
stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
sys.modules["triton_python_backend_utils"] = stub
modules, export_only, artifact, prompt = json.loads(sys.argv[1])
after = {}
for name in modules:
    importlib.import_module(name)
    after[name] = sorted(m for m in export_only if m in sys.modules)
import lade_export
with lade_export.load(artifact) as model:
    look = model.generate(prompt, max_new_tokens=64, profile="default")
    plain = model.generate(prompt, max_new_tokens=64, lookahead=False)
with lade_export.load(artifact, batching=True) as model:
    batched = model.generate(prompt, max_new_tokens=64, profile="default")
print(json.dumps({"imports": after, "loaded": sorted(m for m in export_only if m in sys.modules),
                  "tokens": [look.token_ids, plain.token_ids, batched.token_ids], "steps": look.stats.steps}))
"""


def test_every_module_the_readme_pipeline_names_is_on_one_side_of_the_layout():
    """The README's pipeline table names modules by path; each is a file of the package, and
    the run-time ones among them are imported by the test below."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Pipeline"):readme.index("## The step graph")]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    named = set(re.findall(r"([a-z_/]+)\.py", table))  # lade_export/x/y.py, serving/y.py or y.py beside them
    assert len(named) >= 40, sorted(named)
    modules = set(_package_modules())
    for path in named:
        dotted = path.removeprefix("lade_export/").replace("/", ".")
        hits = [m for m in modules if m == "lade_export." + dotted or m.endswith("." + dotted)]
        assert hits, f"the README's pipeline table names {path}.py, which is not in the package"
    runtime = set(RUNTIME_MODULES)
    assert {"lade_export.runtime", "lade_export.ngram", "lade_export.scheduler", "lade_export.api",
            "lade_export.backends.onnxruntime", "lade_export.serving.openai_api", "lade_export.cli"} <= runtime
    assert "lade_export.graph" not in runtime and "lade_export.export.build" not in runtime


def test_run_time_modules_and_a_decode_import_no_export_framework(stories_artifact, reference_greedy, tmp_path):
    case = reference_greedy["cases"][0]
    args = json.dumps([list(RUNTIME_MODULES), list(EXPORT_ONLY), str(stories_artifact), case["prompt_ids"]])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, args], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    culprit = next(((name, got) for name, got in report["imports"].items() if got), None)
    assert culprit is None, f"importing {culprit[0]} imported {', '.join(culprit[1])}"
    assert report["loaded"] == []
    look, plain, batched = report["tokens"]
    assert plain == case["greedy_ids"][:len(plain)] and len(plain) >= 32  # a real decode: the oracle's tokens
    assert look == plain and batched == plain  # exact: lookahead (alone and batched) equals greedy
    assert report["steps"] < len(look)  # lookahead accepted more than one token in some step
