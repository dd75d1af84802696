"""Decoding from a built artifact imports no export-time framework: a fresh interpreter
imports every run-time module of the README's pipeline table, loads the stories260K
artifact, decodes (lookahead, plain greedy, and through the scheduler) and then must
have neither torch, transformers, onnx nor onnxscript in ``sys.modules``.

Unlike tests/test_thin_install.py (which makes those imports fail, as on the base
install), nothing is blocked here: a module that imports one of them, even inside a
``try``, is caught by name."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The run-time modules the README's pipeline table names (artifact, n-grams, algorithm,
#: decode, text, API, batching, serving, engines) plus the benchmarks that decode from an
#: artifact on the base install (compare, tune and their peers), and the CLI (it parses and
#: imports a command's modules when the command runs). The torch engine
#: (``export/torch_engine.py``) is the export side's PyTorch reference and is not one of them.
RUNTIME_MODULES = (
    "lade_export",
    "lade_export.api",
    "lade_export.artifact",
    "lade_export.manifest",
    "lade_export.runtime",
    "lade_export.kv_cache",
    "lade_export.feeds",
    "lade_export.lookahead",
    "lade_export.ngram",
    "lade_export.sampling",
    "lade_export.profile",
    "lade_export.specs",
    "lade_export.tokenizer",
    "lade_export.detokenize",
    "lade_export.scheduler",
    "lade_export.packed",
    "lade_export.width_policy",
    "lade_export.kernels",
    "lade_export.backends",
    "lade_export.backends.onnxruntime",
    "lade_export.backends.cuda",
    "lade_export.backends.tensorrt",
    "lade_export.serving.protocol",
    "lade_export.serving.local",
    "lade_export.serving.repository",
    "lade_export.serving.openai_api",
    "lade_export.serving.triton_model",
    "lade_export.evaluation",
    "lade_export.evaluation.compare",
    "lade_export.evaluation.tune",
    "lade_export.evaluation.peers",
    "lade_export.cli",
)
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
