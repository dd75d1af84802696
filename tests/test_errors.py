"""Every bad input ends in one clear line and a non-zero exit (docs/errors.md lists them).

The CLI runs in-process through click's runner; each case asserts the exit status and
the message, and that the message is the one documented in docs/errors.md.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from lade_export.cli import main
from lade_export.errors import GenerationError

from .test_cli import PROGRESS
from .test_tensorrt_double import DOCUMENTED_ROWS as TENSORRT_ROWS

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _profile(tmp, text, name="p.toml"):
    f = tmp / name
    f.write_text(text)
    return f


def _copy_artifact(src, tmp):
    dst = tmp / "art"
    shutil.copytree(src, dst)
    return dst


def _model_dir(tmp, config=None, files=()):
    d = tmp / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def _truncated_checkpoint(tmp, stories_dir):
    d = tmp / "trunc"
    shutil.copytree(stories_dir, d)
    os.chmod(d, 0o755)
    st = d / "model.safetensors"
    os.chmod(st, 0o644)
    with open(st, "r+b") as fh:
        fh.truncate(st.stat().st_size // 2)
    return d


def _not_gguf(tmp):
    f = tmp / "weights.gguf"
    f.write_bytes(b"PK\x03\x04 not gguf")
    return f


def _edited_manifest(tmp, art, edit):
    """A copy of ``art`` whose manifest went through ``edit(manifest_dict)`` (a hand edit)."""
    a = _copy_artifact(art, tmp)
    m = json.loads((a / "manifest.json").read_text())
    edit(m)
    (a / "manifest.json").write_text(json.dumps(m))
    return a


def _flip_byte(tmp, art, name):
    a = _copy_artifact(art, tmp)
    f = a / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return a


def _grow(tmp, art, name):
    a = _copy_artifact(art, tmp)
    with open(a / name, "ab") as fh:
        fh.write(b"\0\0\0")
    return a


def _no_manifest(tmp, art):
    a = _copy_artifact(art, tmp)
    (a / "manifest.json").unlink()
    return a


def _half_gguf(tmp, stories_dir):
    src = stories_dir / "llama2c" / "stories260K.gguf"
    f = tmp / "half.gguf"
    f.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    return f


def _not_a_build(tmp):
    d = tmp / "mine"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    return d


def _dangling(tmp):
    """A symbolic link to a path (two folders deep) that does not exist."""
    link = tmp / "link"
    link.symlink_to(tmp / "missing" / "deep" / "target")
    return link


def _jsonl(tmp, text):
    f = tmp / "prompts.jsonl"
    f.write_text(text)
    return f


def _truncated_graph(tmp, art):
    a = _copy_artifact(art, tmp)
    with open(a / "model.onnx", "r+b") as f:
        f.truncate(1000)
    return a


def _non_utf8(tmp):
    f = tmp / "prompt.txt"
    f.write_bytes(b"caf\xe9 \xff")
    return f


def _stories_with_rope(tmp, stories_dir, rope):
    d = tmp / "roped"
    shutil.copytree(stories_dir, d)
    os.chmod(d, 0o755)
    config = json.loads((d / "config.json").read_text())
    config["rope_parameters"] = rope
    os.chmod(d / "config.json", 0o644)
    (d / "config.json").write_text(json.dumps(config))
    return d


def _fake_llama_cpp(tmp, script="#!/bin/sh\nexit 0\n"):
    """A folder with executable stand-ins for llama.cpp's two binaries (running ``script``)."""
    d = tmp / "llama-bin"
    d.mkdir()
    for name in ("llama-completion", "llama-lookahead"):
        (d / name).write_text(script)
        os.chmod(d / name, 0o755)
    return d


def _compare(t, a, *extra):
    prompts = _jsonl(t, json.dumps({"prompt": "Once upon a time"}) + "\n")
    return ["compare", a, "--dataset", prompts, "--limit", 1, "--max-new-tokens", 4, "--out", t / "o", *extra]

def _other_model(tmp, art):
    """A copy of ``art`` whose manifest says its model has another vocabulary (another model)."""
    other = tmp / "other"
    shutil.copytree(art, other)
    m = json.loads((other / "manifest.json").read_text())
    m["model"]["dims"]["vocab"] += 1
    (other / "manifest.json").write_text(json.dumps(m))
    return other


def _triton_repo(tmp, art):
    from lade_export.serving.repository import write_model_repository

    write_model_repository(art, tmp / "repo", name="m")
    return tmp / "repo"


def _foreign_model(tmp):
    d = tmp / "repo" / "m"
    d.mkdir(parents=True)
    (d / "config.pbtxt").write_text('backend: "onnxruntime"\n')  # someone else's model
    return tmp / "repo"

# (id, builder(tmp, stories_dir, artifact) -> argv, exit code, message substring)
CASES = [
    ("model-missing-path", lambda t, s, a: ["build", "--model", "/nonexistent/model", "--out", t / "o"], 2,
     "model path not found: /nonexistent/model"),
    ("generate-greedy-with-lookahead", lambda t, s, a: ["generate", a, "--prompt", "hi", "--greedy", "--lookahead"], 2,
     "--greedy means plain greedy decoding, without lookahead; drop --lookahead (lookahead with temperature 0 is "
     "the default)"),
    ("model-empty", lambda t, s, a: ["build", "--model", "", "--out", t / "o"], 2,
     "--model is empty; give a model directory, a .gguf file, a hub id or smollm2-135m-instruct"),
    ("model-not-regular-file", lambda t, s, a: ["build", "--model", "/dev/null", "--out", t / "o"], 2,
     "/dev/null is not a regular file (give a model directory, a .gguf file or a hub id)"),
    ("model-no-config", lambda t, s, a: ["build", "--model", _model_dir(t), "--out", t / "o"], 2,
     "has no config.json: not a Hugging Face model directory"),
    ("model-not-llama", lambda t, s, a: ["build", "--model", _model_dir(t, {"model_type": "gpt2"}), "--out", t / "o"], 2,
     "model_type 'gpt2' is not supported; lade-export handles LLaMA-family checkpoints"),
    ("model-truncated-safetensors", lambda t, s, a: ["build", "--model", _truncated_checkpoint(t, s), "--out", t / "o"],
     2, "cannot load checkpoint in"),
    ("model-not-gguf", lambda t, s, a: ["build", "--model", _not_gguf(t), "--out", t / "o"], 2,
     "is not a GGUF file"),
    ("model-hub-offline", lambda t, s, a: ["build", "--model", "org/name", "--out", t / "o"], 2,
     "cannot reach the Hugging Face hub to fetch 'org/name'"),
    ("model-rope-unsupported", lambda t, s, a: ["build", "--model", _model_dir(t, {"model_type": "llama", "rope_parameters": {
        "rope_type": "foo", "rope_theta": 10000.0}}), "--out", t / "o"], 2,
     "config.json: rope type 'foo' is not supported; lade-export exports rope types default, linear, yarn, llama3, "
     "proportional, longrope, dynamic"),
    ("build-rope-partial", lambda t, s, a: ["build", "--model", _stories_with_rope(t, s, {
        "rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5, "rope_theta": 10000.0}), "--out", t / "o"], 2,
     "rope type 'linear' with partial_rotary_factor 0.5: transformers' LLaMA rotates the whole head and cannot run this "
     "configuration, so there is no reference to export against (remove partial_rotary_factor or use rope type "
     "'proportional')"),
    ("model-truncated-gguf", lambda t, s, a: ["build", "--model", _half_gguf(t, s), "--out", t / "o"], 2,
     "cannot read GGUF half.gguf (truncated or corrupt?)"),
    ("profile-missing", lambda t, s, a: ["build", "--model", s, "--profile", t / "none.toml", "--out", t / "o"], 2,
     "profile file not found:"),
    ("profile-syntax", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                         _profile(t, "[lookahead]\nwindow = 3\nngram = = 4\n")], 2,
     "TOML syntax error: Invalid value (at line 3, column 9)"),
    ("profile-unknown-key", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                              _profile(t, "[lookahead]\nwindow=3\nngram=4\nguesses=2\nwidth=9\n")], 2,
     "unknown key(s) in [lookahead]: width; expected enabled, guesses, lookup, lookup_branches, lookup_min_match, "
     "ngram, seed_pool_from_prompt, window"),
    ("profile-min-match-range", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                                 _profile(t, "[lookahead]\nwindow=0\nngram=2\nguesses=0\nlookup=8\n"
                                                             "lookup_min_match=4\n")], 2,
     "lookup_min_match (M) must be 1, 2 or 3 (the longest suffix match the history index keeps), got 4"),
    ("profile-min-match-without-lookup", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                                          _profile(t, "[lookahead]\nwindow=1\nngram=3\nguesses=2\n"
                                                                      "lookup_min_match=2\n")], 2,
     "lookup_min_match applies to history lookup, which is off (lookup = 0); set lookup (K) ≥ 1 or drop "
     "lookup_min_match"),
    ("profile-branches-without-lookup", lambda t, s, a: ["generate", a, "--prompt", "hi", "--profile", "1,3,2,0,5"], 2,
     "profile '1,3,2,0,5': lookup_branches applies to history lookup, which is off (lookup = 0); set lookup (K) ≥ 1 or drop "
     "lookup_branches"),
    ("artifact-manifest-bad-dims", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m["model"]["dims"].update(vocab=-1)), "--prompt", "hi"], 2,
     "manifest has model.dims.vocab = -1 (sizes are positive integers, tied_embeddings true or false); rebuild with "
     "lade-export build"),
    ("artifact-manifest-wrong-kind", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m["graph"].update(file=5)), "--prompt", "hi"], 2,
     "manifest lacks graph.file (a string); rebuild with lade-export build"),
    ("artifact-file-not-listed", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m.update(files={})), "--prompt", "hi"], 2,
     "manifest.json: graph.file 'model.onnx' is not among the manifest's files, so it could not be checked; rebuild "
     "with lade-export build"),
    ("chat-template-fails", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m["tokenizer"].update(chat_template="{{ 1/0 }}")), "--prompt", "hi"], 2,
     "chat template failed: ZeroDivisionError: division by zero"),
    ("profile-inline-as-typed", lambda t, s, a: ["generate", a, "--prompt", "hi", "--profile", "0,1,0"], 2,
     "profile '0,1,0': ngram (N) must be ≥ 2, got 1"),
    ("artifact-is-a-file", lambda t, s, a: ["inspect", a / "model.onnx"], 2,
     "model.onnx is a file, not an artifact folder; give the folder that holds manifest.json ("),
    ("generate-sampling-option-greedy", lambda t, s, a: ["generate", a, "--prompt", "hi", "--top-k", 40], 2,
     "--top-k needs --temperature > 0 (without it decoding is greedy)"),
    ("profile-w-negative", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                             _profile(t, "[lookahead]\nwindow=-1\nngram=4\nguesses=2\n")], 2,
     "window (W) must be ≥ 0, got -1"),
    ("profile-n-below-2", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                            _profile(t, "[lookahead]\nwindow=3\nngram=1\nguesses=2\n")], 2,
     "ngram (N) must be ≥ 2, got 1"),
    ("profile-g-negative", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                             _profile(t, "[lookahead]\nwindow=3\nngram=4\nguesses=-1\n")], 2,
     "guesses (G) must be ≥ 0, got -1"),
    ("profile-not-integer", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                              _profile(t, '[lookahead]\nwindow="3"\nngram=4\nguesses=2\n')], 2,
     "window must be an integer, got '3'"),
    ("profile-exceeds-context", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                                  _profile(t, "[lookahead]\nwindow=100\nngram=5\nguesses=100\n")], 2,
     "its largest step (801 tokens) does not fit the model's context of 512 tokens"),
    ("profile-bad-name", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile",
                                           _profile(t, 'name = "../x"\n[lookahead]\nwindow=3\nngram=4\nguesses=2\n')],
     2, "profile name '../x' must be letters, digits, '.', '_' or '-' (it names engine files)"),
    ("profile-twice", lambda t, s, a: ["build", "--model", s, "--out", t / "o", "--profile", "small", "--profile",
                                        "small"], 2,
     "profile 'small' is given twice; each --profile needs its own name"),
    ("generate-context-exceeded", lambda t, s, a: ["generate", a, "--prompt", "Once upon a time",
                                                    "--max-new-tokens", 600], 2,
     "prompt (5 tokens) + max_new_tokens (600) = 605 exceeds the model's context of 512 tokens"),
    ("generate-max-new-tokens-zero", lambda t, s, a: ["generate", a, "--prompt", "hi", "--max-new-tokens", 0], 2,
     "max_new_tokens must be an integer ≥ 1, got 0"),
    ("generate-non-utf8-file", lambda t, s, a: ["generate", a, "--prompt-file", _non_utf8(t)], 2,
     "is not UTF-8 text (byte 3)"),
    ("generate-no-prompt", lambda t, s, a: ["generate", a], 2,
     "give --prompt TEXT, --prompt-file PATH or --prompt-from DATASET:INDEX"),
    ("generate-two-prompts", lambda t, s, a: ["generate", a, "--prompt", "hi", "--prompt-file", _non_utf8(t)], 2,
     "give only one of --prompt, --prompt-file"),
    ("generate-prompt-file-is-dir", lambda t, s, a: ["generate", a, "--prompt-file", t], 2,
     "Is a directory"),
    ("generate-prompt-from-not-json", lambda t, s, a: ["generate", a, "--prompt-from", f"{_jsonl(t, 'nope')}:0"], 2,
     "prompts.jsonl line 1: not JSON (Expecting value)"),
    ("generate-prompt-from-empty", lambda t, s, a: ["generate", a, "--prompt-from",
                                                     f"{_jsonl(t, json.dumps({'turns': []}))}:0"], 2,
     "prompts.jsonl record 0: the prompt must be a non-empty string"),
    ("generate-greedy-with-temperature", lambda t, s, a: ["generate", a, "--prompt", "hi", "--greedy", "--temperature",
                                                           0.7], 2,
     "--greedy means temperature 0; drop it to sample with --temperature"),
    ("generate-profile-without-lookahead", lambda t, s, a: ["generate", a, "--prompt", "hi", "--no-lookahead",
                                                            "--profile", "wide"], 2,
     "--profile wide asks for lookahead, which --no-lookahead turns off: give one of them"),
    ("generate-check-greedy-sampling", lambda t, s, a: ["generate", a, "--prompt", "hi", "--check-greedy",
                                                         "--temperature", 0.7], 2,
     "--check-greedy compares greedy outputs; it cannot be combined with --temperature > 0"),
    ("generate-stop-empty", lambda t, s, a: ["generate", a, "--prompt", "hi", "--stop", ""], 2,
     "stop strings must not be empty"),
    ("generate-bad-top-p", lambda t, s, a: ["generate", a, "--prompt", "hi", "--temperature", 1, "--top-p", 0], 2,
     "top_p must be in (0, 1], got 0.0"),
    ("compare-no-record-fits", lambda t, s, a: ["compare", a, "--dataset", _jsonl(t, json.dumps({"prompt": "dog " * 299})),
                                                 "--limit", 1, "--out", t / "o"], 2,
     "none of the 1 record(s) fits the model's context of 512 tokens (the first, "),
    ("compare-out-not-folder", lambda t, s, a: _compare(t, a)[:-2] + ["--out", _jsonl(t, "")], 2,
     "exists and is not a folder; give a folder for the results"),
    ("compare-empty-dataset", lambda t, s, a: ["compare", a, "--dataset", _jsonl(t, ""), "--out", t / "o"], 2,
     "has no prompts"),
    ("compare-also-other-model", lambda t, s, a: _compare(t, a, "--also", _other_model(t, a)), 2,
     "is a build of another model ("),
    ("tune-out-is-folder", lambda t, s, a: ["tune", a, "--out", t], 2,
     "is a folder; give the path of the profile TOML to write"),
    ("model-did-you-mean", lambda t, s, a: ["build", "--model", "smollm2", "--out", t / "o"], 2,
     "model path not found: smollm2 (did you mean --model smollm2-135m-instruct, the built-in SmolLM2-135M-Instruct?)"),
    ("tune-out-shipped", lambda t, s, a: ["tune", a, "--out", ROOT / "profiles" / "tuned.toml"], 2,
     "write tuned profiles elsewhere (e.g. --out tuned.toml) and pass that path to --profile"),
    ("dataset-path-not-found", lambda t, s, a: ["generate", a, "--prompt-from", "nope.jsonl:0"], 2,
     "dataset not found: nope.jsonl (give mt_bench, humaneval or gsm8k, found through LADE_DATASETS, or the path of a "
     "JSONL file with a prompt field per line)"),
    ("profile-inline-malformed", lambda t, s, a: ["generate", a, "--prompt", "hi", "--profile", "1.5,3,2"], 2,
     "inline profile '1.5,3,2' must be 3 to 5 comma-separated integers: W,N,G[,K[,B]]"),
    ("check-weights-size", lambda t, s, a: ["check", _grow(t, a, "model.onnx")], 2,
     "size mismatch for model.onnx: "),
    ("build-out-dangling-symlink", lambda t, s, a: ["build", "--model", s, "--out", _dangling(t)], 2,
     "is a symbolic link to "),
    ("build-block-size", lambda t, s, a: ["build", "--model", s, "--precision", "int4", "--block-size", 128,
                                          "--out", t / "o"], 2,
     "--block-size 128 does not divide the model's hidden size 64; give a power of two ≥ 16 that does (e.g. 32)"),
    ("build-attention-head-width", lambda t, s, a: ["build", "--model", s, "--attention", "group-query-attention",
                                                    "--out", t / "o"], 2,
     "--attention group-query-attention needs a head width that is a multiple of 16 (ONNX Runtime's kernel); this "
     "model's is 8: use --attention onnx-ops"),
    ("build-attention-tensorrt", lambda t, s, a: ["build", "--model", s, "--engine", "tensorrt", "--attention",
                                                  "group-query-attention", "--out", t / "o"], 2,
     "--attention group-query-attention is an ONNX Runtime contrib op that TensorRT cannot parse; --engine tensorrt "
     "takes --attention onnx-ops"),
    ("build-block-size-fp32", lambda t, s, a: ["build", "--model", s, "--block-size", 64, "--out", t / "o"], 2,
     "--block-size applies to int8/int4 ONNX Runtime builds (--precision int8 or int4); this build is fp32"),
    ("artifact-unknown-default-profile", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m.update(default_profile="nosuch")), "--prompt", "hi",
        "--max-new-tokens", 2], 2,
     "default_profile 'nosuch' is not one of its profiles (default, small); fix the manifest or rebuild"),
    ("artifact-manifest-lacks-keys", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m.update(graph={})), "--prompt", "hi"],
     2, "manifest.json: manifest lacks graph.file, graph.opset, graph.inputs, graph.outputs; rebuild with lade-export build"),
    ("inspect-damaged-file", lambda t, s, a: ["inspect", _truncated_graph(t, a)], 2,
     "files differ from the manifest (model.onnx: 1,000 bytes on disk, the manifest says "),
    ("generate-dtype-ort", lambda t, s, a: ["generate", a, "--dtype", "float16", "--prompt", "hi"], 2,
     "--dtype float16 applies to the torch backend; the ort backend computes in the artifact's precision (fp32, "
     "chosen at build time with --precision)"),
    ("build-tensorrt-flag-onnx", lambda t, s, a: ["build", "--model", s, "--max-prompt", 64, "--out", t / "o"], 2,
     "--max-prompt bounds the TensorRT engines; this build is for ONNX Runtime only: add --engine tensorrt or drop it"),
    ("build-timing-cache-onnx", lambda t, s, a: ["build", "--model", s, "--timing-cache", t / "c", "--dry-run",
                                                 "--out", t / "o"], 2,
     "--timing-cache is TensorRT's builder cache; this build is for ONNX Runtime only: add --engine tensorrt or drop it"),
    ("build-head-bits-fp32", lambda t, s, a: ["build", "--model", s, "--head-bits", "8", "--out", t / "o"], 2,
     "--head-bits 8 quantizes the head of an int8/int4 ONNX Runtime build; give --precision int8 or int4"),
    ("build-precision-tensorrt-int4", lambda t, s, a: ["build", "--model", s, "--engine", "tensorrt", "--precision",
                                                       "int4", "--out", t / "o"], 2,
     "--precision int4 makes MatMulNBits weights, which TensorRT cannot parse; --engine tensorrt takes fp16, bf16 or fp32"),
    ("build-kernels-fp32", lambda t, s, a: ["build", "--model", s, "--kernels", "lade", "--out", t / "o"], 2,
     "--kernels applies to int8/int4 ONNX Runtime builds (--precision int8 or int4); this build is fp32"),
    ("build-kernels-accuracy-level", lambda t, s, a: ["build", "--model", s, "--precision", "int4", "--kernels", "lade",
                                                      "--accuracy-level", 4, "--out", t / "o"], 2,
     "--accuracy-level picks the compute type of ONNX Runtime's MatMulNBits; --kernels lade takes --compute "
     "int8|float32 instead: drop --accuracy-level 4"),
    ("build-kernels-block-size", lambda t, s, a: ["build", "--model", s, "--precision", "int4", "--kernels", "lade",
                                                  "--block-size", 64, "--out", t / "o"], 2,
     "--kernels lade uses blocks of 32 weights (GGML's Q4_1/Q8_0); drop --block-size 64"),
    ("build-kernels-tensorrt", lambda t, s, a: ["build", "--model", s, "--engine", "tensorrt", "--kernels", "lade",
                                                "--out", t / "o"], 2,
     "--kernels lade makes ONNX Runtime custom operators, which TensorRT cannot parse; --engine tensorrt takes fp16, "
     "bf16 or fp32"),
    ("build-precision-onnx-fp16", lambda t, s, a: ["build", "--model", s, "--precision", "fp16", "--out", t / "o"], 2,
     "--precision fp16 is a TensorRT (or torch backend) precision; ONNX Runtime engines take fp32, int8 or int4"),
    ("build-int8-lookahead", lambda t, s, a: ["build", "--model", s, "--precision", "int8", "--profile", "default",
                                               "--out", t / "o"], 2,
     "computes one-token and multi-token steps differently (int8 activations), so lookahead would not be exact"),
    ("cli-usage", lambda t, s, a: ["generate", a, "--max-new-tokens", "abc"], 2,
     "Invalid value for '--max-new-tokens': 'abc' is not a valid integer. (see: lade-export generate --help)"),
    ("artifact-missing-dir", lambda t, s, a: ["generate", t / "nothing", "--prompt", "hi"], 2,
     "artifact directory not found:"),
    ("artifact-no-manifest", lambda t, s, a: ["generate", _no_manifest(t, a), "--prompt", "hi"], 2,
     "has no manifest.json: not a lade-export build"),
    ("artifact-schema-version", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m.update(schema_version=99)), "--prompt", "hi"], 2,
     "schema_version 99 is not supported by this lade-export (expects 2)"),
    ("artifact-onnx-checksum", lambda t, s, a: ["generate", _flip_byte(t, a, "model.onnx"), "--prompt", "hi"], 2,
     "checksum mismatch for model.onnx"),
    ("artifact-tokenizer-checksum",
     lambda t, s, a: ["generate", _flip_byte(t, a, "tokenizer/tokenizer.json"), "--prompt", "hi"], 2,
     "checksum mismatch for tokenizer/tokenizer.json"),
    ("artifact-weights-size", lambda t, s, a: ["generate", _grow(t, a, "model.onnx"), "--prompt", "hi"], 2,
     "size mismatch for model.onnx: "),
    ("artifact-manifest-incomplete", lambda t, s, a: ["generate", _edited_manifest(
        t, a, lambda m: m.pop("model")), "--prompt", "hi"], 2,
     "manifest lacks model; rebuild with lade-export build"),
    ("build-force-not-a-build", lambda t, s, a: ["build", "--model", s, "--out", _not_a_build(t), "--force"], 2,
     "it is not a lade-export build (no manifest.json)"),
    ("build-out-exists", lambda t, s, a: ["build", "--model", s, "--out", a], 2,
     "already exists; pass --force to replace it"),
    # a dry run refuses what the build would refuse; a folder or file not a build is refused without
    # --force as well (it would not help)
    ("build-out-exists", lambda t, s, a: ["build", "--model", s, "--out", a, "--dry-run"], 2,
     "already exists; pass --force to replace it"),
    ("build-force-not-a-build", lambda t, s, a: ["build", "--model", s, "--out", _not_a_build(t)], 2,
     "it is not a lade-export build (no manifest.json); give a new directory for --out"),
    ("build-force-not-a-build", lambda t, s, a: ["build", "--model", s, "--out", _jsonl(t, "x"), "--dry-run"], 2,
     "it is not a lade-export build (no manifest.json); give a new directory for --out"),
    ("peer-llama-cpp-missing", lambda t, s, a: _compare(t, a, "--peer", "llama.cpp-greedy"), 2,
     "the llama.cpp peers need llama.cpp's binaries: give --llama-cpp DIR or set LADE_LLAMA_CPP "
     "(build them with bench/build_llama_cpp.sh)"),
    ("peer-llama-cpp-not-found", lambda t, s, a: _compare(t, a, "--peer", "llama.cpp-greedy", "--llama-cpp",
                                                           t / "nowhere"), 2,
     "llama.cpp folder not found: "),
    ("peer-llama-cpp-no-binary", lambda t, s, a: _compare(t, a, "--peer", "llama.cpp-lookahead", "--llama-cpp", t), 2,
     "has no executable llama-completion (build it with bench/build_llama_cpp.sh)"),
    ("peer-llama-gguf-missing", lambda t, s, a: _compare(t, a, "--peer", "llama.cpp-greedy", "--llama-cpp",
                                                          _fake_llama_cpp(t), "--llama-gguf", t / "none.gguf"), 2,
     "none.gguf: file not found"),
    ("peer-llama-gguf-not-gguf", lambda t, s, a: _compare(t, a, "--peer", "llama.cpp-greedy", "--llama-cpp",
                                                           _fake_llama_cpp(t), "--llama-gguf", _not_gguf(t)), 2,
     "weights.gguf: not a GGUF file"),
    ("peer-llama-cpp-sampling", lambda t, s, a: _compare(t, a, "--peer", "llama.cpp-greedy", "--temperature", 0.7), 2,
     "--peer llama.cpp-greedy runs greedy only; drop --temperature or the llama.cpp peers"),
    ("peer-llama-cpp-crash", lambda t, s, a: _compare(
        t, a, "--peer", "llama.cpp-greedy", "--llama-gguf", s / "llama2c" / "stories260K.gguf", "--llama-cpp",
        _fake_llama_cpp(t, "#!/bin/sh\necho 'Illegal instruction' >&2\nkill -ILL $$\n")), 1,
     "llama-completion failed with exit status -4 (SIGILL): Illegal instruction"),
    ("out-not-writable", lambda t, s, a: ["build", "--model", s, "--out", "/sys/lade-export-test/o"], 2,
     "Invalid value for '--out': cannot write in /sys: Permission denied"),
    ("out-under-a-file", lambda t, s, a: _compare(t, a)[:-2] + ["--out", _jsonl(t, "") / "results"], 2,
     "is not a folder (see: lade-export compare --help)"),
    ("tune-out-not-writable", lambda t, s, a: ["tune", a, "--out", "/sys/t.toml"], 2,
     "Invalid value for '--out': cannot write in /sys: Permission denied"),
    ("triton-out-not-writable", lambda t, s, a: ["triton", a, "--out", "/sys/repo"], 2,
     "Invalid value for '--out': cannot write in /sys: Permission denied"),
    ("triton-out-exists", lambda t, s, a: ["triton", a, "--out", _triton_repo(t, a), "--name", "m"], 2,
     "already exists; pass --force to replace it"),
    ("triton-force-not-ours", lambda t, s, a: ["triton", a, "--out", _foreign_model(t), "--name", "m", "--force"], 2,
     "it is not a model written by lade-export triton (no lade_export.json)"),
    ("triton-bad-name", lambda t, s, a: ["triton", a, "--out", t / "repo", "--name", "../x"], 2,
     "model name '../x' must be letters, digits, '.', '_' or '-' (it names a directory)"),
    ("triton-out-is-a-file", lambda t, s, a: ["triton", a, "--out", _jsonl(t, "")], 2,
     "is a file; give the model repository's folder (created if missing)"),
    ("triton-instances", lambda t, s, a: ["triton", a, "--out", t / "repo", "--instances", 0], 2,
     "Invalid value for '--instances': 0 is not in the range 1<=x<="),
    ("triton-no-engines", lambda t, s, a: ["triton", a, "--out", t / "repo", "--backend", "tensorrt"], 2,
     "has no TensorRT engines; build it with --engine tensorrt, or serve with --backend ort"),
    ("triton-limit", lambda t, s, a: ["triton", a, "--out", t / "repo", "--max-new-tokens-limit", 600], 2,
     "--max-new-tokens-limit must be between 1 and 511 (the model's context is 512 tokens), got 600"),
    ("triton-greedy-reserved", lambda t, s, a: ["triton", a, "--out", t / "repo", "--profile",
                                                 _profile(t, 'name = "greedy"\n[lookahead]\nwindow=2\nngram=3\nguesses=2\n')],
     2, "profile name 'greedy' is reserved: on the server it means plain greedy decoding"),
    ("triton-path-and-copy", lambda t, s, a: ["triton", a, "--out", t / "repo", "--artifact-path", "/p",
                                               "--copy-artifact"], 2,
     "give --artifact-path or --copy-artifact, not both"),
    ("triton-scheduler-option-without-batching", lambda t, s, a: ["triton", a, "--out", t / "repo", "--no-batching",
                                                                   "--token-budget", 32], 2,
     "--token-budget is an option of the scheduler, and this model has none (--no-batching)"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line_and_exit_status(case, tmp_path, stories_dir, stories_artifact, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # deterministic "offline" for the hub case
    monkeypatch.delenv("LADE_LLAMA_CPP", raising=False)  # the peer cases name their binaries themselves
    _, build_args, code, message = case
    work = tmp_path / "w"
    work.mkdir()
    before = sorted(os.listdir(work))
    args = build_args(work, stories_dir, stories_artifact)
    before = sorted(os.listdir(work))
    result = invoke(*args)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert result.exit_code == code, result.output
    assert lines == [lines[0]] and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert message in DOC, f"docs/errors.md does not document: {message}"
    assert sorted(os.listdir(work)) == before  # nothing half-written (no "o", no temp dirs, no lock)


def test_a_file_given_as_the_artifact_is_named_a_file_by_every_command(tmp_path, stories_artifact):
    graph = stories_artifact / "model.onnx"
    expected = (f"error: {graph} is a file, not an artifact folder; give the folder that holds manifest.json "
                f"({stories_artifact})")
    for args in (["inspect", graph], ["generate", graph, "--prompt", "hi"], ["check", graph],
                 ["triton", graph, "--out", tmp_path / "repo"]):
        result = invoke(*args)
        assert (result.exit_code, result.stderr.strip()) == (2, expected), args
    assert not (tmp_path / "repo").exists()


def test_top_p_and_seed_without_temperature_are_refused_and_sampling_takes_them(stories_artifact):
    for option, value in (("--top-p", 0.9), ("--seed", 3)):
        result = invoke("generate", stories_artifact, "--prompt", "hi", option, value)
        assert (result.exit_code, result.stderr.strip()) == (
            2, f"error: {option} needs --temperature > 0 (without it decoding is greedy)")
    sampled = invoke("generate", stories_artifact, "--prompt", "hi", "--max-new-tokens", 4, "--temperature", 0.8,
                     "--top-p", 0.9, "--seed", 3)
    assert sampled.exit_code == 0, sampled.stderr


def test_tune_names_the_default_validation_set_when_it_is_missing(tmp_path, stories_artifact, monkeypatch):
    empty = tmp_path / "datasets"
    empty.mkdir()
    monkeypatch.setenv("LADE_DATASETS", str(empty))
    prompts = _jsonl(tmp_path, "".join(json.dumps({"prompt": f"Once upon a time {i}"}) + "\n" for i in range(2)))
    result = invoke("tune", stories_artifact, "--dataset", prompts, "--limit", 2, "--out", tmp_path / "t.toml")
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert line.startswith(f"error: dataset humaneval not found at {empty}/humaneval/") and "\n" not in line
    message = ("; tune verifies the winner on humaneval by default: --validate-dataset none skips it (or name another "
               "dataset)")
    assert line.endswith(message) and message in DOC
    named = invoke("tune", stories_artifact, "--dataset", prompts, "--limit", 2, "--out", tmp_path / "t.toml",
                   "--validate-dataset", "gsm8k")
    assert named.exit_code == 2 and "tune verifies" not in named.stderr  # a set the user named: its error alone
    assert not (tmp_path / "t.toml").exists()


def test_every_documented_row_has_a_test():
    rows = [line for line in DOC.splitlines() if line.startswith("| `")]
    ids = {c[0] for c in CASES} | {"gguf-bad-special-token", "build-kernels-no-headers", "artifact-kernels-missing",
                                   "build-kernels-bad-toolchain", "artifact-custom-ops-outside",
                                   "generate-torch-quantized", "check-quantized", "generate-empty-prompt", "build-force", "artifact-weights-checksum",
                                   "build-interrupted", "build-concurrent", "build-rope-capped",
                                   "build-parity-transformers", "prompt-file-bom", "compare-record-too-long", "missing-extra",
                                   "generate-profile-wider-than-step-room", "api-token-id-outside-vocab",
                                   "generate-tiny-temperature", "sampling-non-finite-logits", "api-timeout-not-positive",
                                   "api-numpy-numbers", "api-values-of-the-wrong-kind", "chat-control-strings", "dataset-not-found", "cpp-host-no-pybind11",
                                   "artifact-lade-kernels-old-onnxruntime",  # tests/test_fresh_clone.py
                                   # tests/test_cli.py
                                   "generate-prompt-file-stdin", "generate-interrupted", "generate-stdout-closed",
                                   # this file's own tests
                                   "tune-validate-dataset-missing", "dataset-unreadable", "tune-candidate-not-integers",
                                   "model-config-size", "artifact-dims-mismatch", "generate-prompt-file-too-long",
                                   # tests/test_kernels.py
                                   "build-kernels-headers-checksum", "build-compute-onnxruntime",
                                   "build-compute-int8-gqa", "kernels-path-forced",
                                   # tests/test_scheduler.py
                                   "api-batching-tensorrt", "api-batching-kv-pool", "api-scheduler-option",
                                   "api-scheduler-closed", "api-stop-token-ids", "api-sampling-and-flat-keywords",
                                   # tests/test_openai_server.py
                                   "serve-api-key-env-unset", "serve-port-in-use"} | \
        set(TENSORRT_ROWS)
    documented = {r.split("`")[1] for r in rows}
    assert documented == ids


def test_weights_are_hashed_only_when_asked(tmp_path, stories_artifact, monkeypatch):
    from lade_export import artifact

    monkeypatch.setattr(artifact, "QUICK_HASH_LIMIT", 1 << 20)  # stories' 1.2 MB graph plays the weights
    a = _flip_byte(tmp_path, stories_artifact, "model.onnx")
    artifact.Artifact(a)  # a plain open checks sizes only for large files
    result = invoke("generate", a, "--prompt", "hi", "--max-new-tokens", 2, "--verify")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: checksum mismatch for model.onnx: the file differs from the manifest; "
                                     "rebuild the artifact")
    check = invoke("check", a)
    assert check.exit_code == 1
    assert check.stderr.strip().splitlines()[-1].startswith("error: check failed: model.onnx: sha256 does not match")


def test_gguf_with_out_of_range_pad_id_loads_and_matches_oracle(tmp_path, stories_dir, reference_greedy):
    gguf = stories_dir / "llama2c" / "stories260K.gguf"
    out = tmp_path / "g"
    assert invoke("build", "--model", gguf, "--out", out).exit_code == 0
    result = invoke("generate", out, "--prompt", "Once upon a time", "--max-new-tokens", 128, "--greedy")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(reference_greedy["cases"][0]["text"][:200])


def test_empty_prompt_generates_from_bos(stories_artifact, reference_greedy):
    result = invoke("generate", stories_artifact, "--prompt", "", "--max-new-tokens", 12, "--greedy")
    assert result.exit_code == 0
    assert result.stdout.startswith("Once upon a time")
    assert "prefill 1 token in" in result.stderr


def test_force_replaces_only_after_success(tmp_path, stories_dir, stories_artifact):
    out = _copy_artifact(stories_artifact, tmp_path)
    old = (out / "manifest.json").read_text()
    bad = invoke("build", "--model", "/nonexistent", "--out", out, "--force")
    assert bad.exit_code == 2
    assert (out / "manifest.json").read_text() == old
    good = invoke("build", "--model", stories_dir, "--out", out, "--force", "--profile", "small")
    assert good.exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["profiles"][0]["name"] == "small"
    assert sorted(os.listdir(tmp_path)) == ["art"]


def test_missing_extra_is_one_line(tmp_path, stories_dir):
    # The base install has no torch: `build` must say which extra to install, in one line, and write nothing.
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; from lade_export.cli import main; "
            f"main(['build', '--model', {str(stories_dir)!r}, '--out', {str(tmp_path / 'o')!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert lines == ["error: lade-export build needs torch, which this install lacks: a CPU build of PyTorch first "
                     "(pip install torch --index-url https://download.pytorch.org/whl/cpu), then "
                     "pip install 'lade-export[export]'"]
    assert ("needs torch, which this install lacks: a CPU build of PyTorch first (pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu), then pip install 'lade-export[export]'") in DOC
    assert not (tmp_path / "o").exists()


def test_dtype_refusal_names_the_tensorrt_engines_precision(tmp_path, stories_artifact):
    from lade_export.artifact import Artifact
    from lade_export.backends import open_engine

    engines = [{"file": "engine-0.plan", "precision": "fp16"}, {"file": "engine-1.plan", "precision": "fp16"}]
    a = _edited_manifest(tmp_path, stories_artifact, lambda m: m.update(engines=engines))
    with pytest.raises(GenerationError) as err:
        open_engine(Artifact(a, verify="none"), "tensorrt", dtype="bfloat16")
    assert str(err.value) == ("--dtype bfloat16 applies to the torch backend; the tensorrt backend computes in the "
                              "artifact's precision (fp16, chosen at build time with --precision)")


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["model"].update(dims=None), "manifest lacks model.dims (an object)"),
    (lambda m: m["model"]["dims"].update(vocab="512"), "manifest has model.dims.vocab = '512'"),
    (lambda m: m["model"]["dims"].update(tied_embeddings=1), "manifest has model.dims.tied_embeddings = 1"),
    (lambda m: m.update(profiles=None), "manifest lacks profiles (a list)"),
])
def test_hand_edited_manifests_are_refused_in_one_line(tmp_path, stories_artifact, edit, message):
    a = _edited_manifest(tmp_path, stories_artifact, edit)
    for command in (["generate", a, "--prompt", "hi"], ["inspect", a], ["check", a]):
        result = invoke(*command)
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert message in result.stderr


def test_option_values_that_could_never_work_are_refused_before_any_work(tmp_path, stories_artifact, stories_dir):
    """Values a command used to take and then fail on (a traceback, a hang, a server that
    refuses every request, an option silently ignored, a failed check that was bad input):
    refused in one line, exit 2, before the command does anything."""
    from lade_export.cli.common import MAX_THREADS

    a, huge = stories_artifact, "99999999999999999999"
    cases = [
        (["generate", a, "--prompt", "hi", "--threads", 2 ** 31],
         f"Invalid value for '--threads': 2147483648 is not in the range 1<=x<={MAX_THREADS}."),
        (["build", "--model", stories_dir, "--out", tmp_path / "o", "--threads", huge],
         f"Invalid value for '--threads': {huge} is not in the range 1<=x<={MAX_THREADS}."),
        (["triton", a, "--out", tmp_path / "r", "--instances", huge],
         f"Invalid value for '--instances': {huge} is not in the range 1<=x<=1024."),
        (["serve", a, "--kv-tokens", 1], "Invalid value for '--kv-tokens': 1 is not in the range x>=2."),
        (["serve", a, "--host", ""], "Invalid value for '--host': must name an address (127.0.0.1, ::1; 0.0.0.0 for "
                                     "every interface), got ''"),
        (["serve", a, "--model-name", " "], "Invalid value for '--model-name': must name the model clients send "
                                            "(leave it out for the artifact folder's name), got ' '"),
        (["serve", a, "--drain-timeout", "nan"], "Invalid value for '--drain-timeout': must be a number, not nan"),
        (["check", a, "--max-abs", "nan"], "Invalid value for '--max-abs': must be a number, not nan"),
        (["check", a, "--max-rel", -1], "Invalid value for '--max-rel': -1.0 is not in the range x>0."),
        (_compare(tmp_path, a, "--profile", "small", "--profile", "small"),
         "profile 'small' is given twice; each --profile needs its own name"),
        (_compare(tmp_path, a, "--top-p", 0.5), "--top-p needs --temperature > 0 (without it decoding is greedy)"),
    ]
    for command, message in cases:
        result = invoke(*command)
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.splitlines()[0].startswith(f"error: {message}"), (command, result.stderr)
        assert len(result.stderr.splitlines()) == 1, result.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def test_a_cut_gzip_a_non_integer_candidate_and_a_model_without_layers_are_one_line(tmp_path, stories_artifact,
                                                                                     stories_dir):
    """Found by a hostile user's trial: a .jsonl.gz cut short was reported as an interrupt (exit
    130: gzip's EOFError, which click takes for ^D); tune --candidate abc and a config without
    layers ended in tracebacks."""
    import gzip

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"prompt": "Once upon"}\n')[:-4])
    config = json.loads((stories_dir / "config.json").read_text())
    model = tmp_path / "m"
    shutil.copytree(stories_dir, model)
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    cases = [
        (["generate", stories_artifact, "--no-chat", "--prompt-from", f"{cut}:0"],
         f"cannot read dataset {cut}: Compressed file ended before the end-of-stream marker was reached"),
        (["tune", stories_artifact, "--dataset", tmp_path / "none.jsonl", "--candidate", "abc", "--out",
          tmp_path / "t.toml"], "grid entry 'abc': want W,N,G, W,N,G,K or W,N,G,K,B (integers)"),
        (["build", "--model", model, "--out", tmp_path / "o"],
         f"{model / 'config.json'}: num_hidden_layers must be an integer ≥ 1, got 0"),
        # read up to what the context could hold, not until memory runs out
        (["generate", stories_artifact, "--no-chat", "--prompt-file", "/dev/zero"],
         "prompt file /dev/zero holds more than 131,072 bytes, more than the model's context of 512 tokens can hold"),
    ]
    for command, message in cases:
        result = invoke(*command)
        lines = result.stderr.strip().splitlines()  # build's progress lines come first
        assert (result.exit_code, lines[-1]) == (2, f"error: {message}"), command
        assert not any(line.startswith(("error", "Traceback")) for line in lines[:-1]), lines
    assert not (tmp_path / "o").exists() and not (tmp_path / "t.toml").exists()


@pytest.mark.parametrize("key,value,said", [("num_layers", 3, "(3 layers, 4 KV heads of 8)"),
                                            ("kv_heads", 8, "(5 layers, 8 KV heads of 8)"),
                                            ("head_dim", 16, "(5 layers, 4 KV heads of 16)")])
def test_manifest_dims_that_are_not_the_graphs_are_refused_by_generate_and_check(tmp_path, stories_artifact, key,
                                                                                 value, said):
    """A hand-edited model.dims: check passed, and generate failed at its first step with ONNX
    Runtime's message and exit 1 (a failed check's status)."""
    a = _edited_manifest(tmp_path, stories_artifact, lambda m: m["model"]["dims"].update({key: value}))
    message = (f"error: {a / 'manifest.json'}: model.dims {said} does not match the graph (5 layers, 4 KV heads of "
               "8); rebuild with lade-export build")
    for command in (["generate", a, "--no-chat", "--prompt", "Once", "--max-new-tokens", 4], ["check", a]):
        result = invoke(*command)
        lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[")]
        assert (result.exit_code, lines[-1:]) == (2, [message]), (command, result.stderr)
        assert not any(line.startswith(("error", "Traceback")) for line in lines[:-1]), lines


def test_inspect_shows_a_hand_edited_graph_list_as_it_is(tmp_path, stories_artifact):
    """A manifest whose graph lists no inputs or outputs (a hand edit; decoding does not read
    them) is shown as it is by inspect, without the cache rows it lacks (a KeyError before)."""
    for key in ("inputs", "outputs"):
        a = _edited_manifest(tmp_path / key, stories_artifact, lambda m: m["graph"].update({key: []}))
        result = invoke("inspect", a)
        assert result.exit_code == 0, result.output
        cache = "past_key_values.{0.." if key == "inputs" else "present.{0.."
        other = "present.{0.." if key == "inputs" else "past_key_values.{0.."
        assert cache not in result.stdout and other in result.stdout


def test_check_of_a_graph_onnx_runtime_rejects_is_one_line(tmp_path, stories_artifact):
    """A model.onnx ONNX Runtime cannot parse (cut short; its checksum recorded, as a build that
    wrote it broken would leave it): check says so in generate's one line, not with Polygraphy's
    InvalidProtobuf traceback."""
    import hashlib

    a = _copy_artifact(stories_artifact, tmp_path)
    cut = (a / "model.onnx").read_bytes()[:1000]
    (a / "model.onnx").write_bytes(cut)
    m = json.loads((a / "manifest.json").read_text())
    m["files"]["model.onnx"] = {"sha256": hashlib.sha256(cut).hexdigest(), "bytes": len(cut)}
    (a / "manifest.json").write_text(json.dumps(m))
    for command in (["generate", a, "--prompt", "hi"], ["check", a]):
        result = invoke(*command)
        assert result.exit_code == 2, (command, result.output)
        assert len(result.stderr.splitlines()) == 1
        assert result.stderr.startswith(f"error: ONNX Runtime cannot load {a / 'model.onnx'}: [ONNXRuntimeError] : "
                                        "7 : INVALID_PROTOBUF"), result.stderr


def test_json_and_toml_beyond_the_parsers_limits_are_one_line(tmp_path, stories_artifact):
    """A manifest nested deeper than the JSON parser recurses, or holding an integer longer
    than Python converts (4,300 digits), and a profile TOML with such an integer: one line,
    exit 2 (they were RecursionError / ValueError tracebacks)."""
    deep = _copy_artifact(stories_artifact, tmp_path / "deep")
    (deep / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    huge = _copy_artifact(stories_artifact, tmp_path / "huge")
    text = (huge / "manifest.json").read_text()
    (huge / "manifest.json").write_text(text.replace('"schema_version": 2', '"schema_version": ' + "9" * 5001, 1))
    assert text != (huge / "manifest.json").read_text()
    toml = tmp_path / "p.toml"
    toml.write_text("[lookahead]\nwindow = " + "9" * 5001 + "\nngram = 2\nguesses = 1\n")
    for command, message in (
            (["inspect", deep], f"error: {deep / 'manifest.json'}: unreadable manifest: maximum recursion depth "
                                "exceeded"),
            (["inspect", huge], f"error: {huge / 'manifest.json'}: unreadable manifest: Exceeds the limit (4300 "
                                "digits) for integer string conversion"),
            (["generate", stories_artifact, "--prompt", "hi", "--profile", toml],
             f"error: {toml}: unreadable TOML: Exceeds the limit (4300 digits) for integer string conversion")):
        result = invoke(*command)
        assert result.exit_code == 2, (command, result.output)
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(message), result.stderr


def test_a_file_system_error_no_check_foresaw_is_one_line(tmp_path, stories_dir, monkeypatch):
    import lade_export.export.build as build_module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "o" / "model.onnx.data"))

    monkeypatch.setattr(build_module, "build_artifact", full_disk)
    result = invoke("build", "--model", stories_dir, "--out", tmp_path / "o")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"error: No space left on device: {tmp_path / 'o' / 'model.onnx.data'}"]


def test_a_dry_run_does_not_probe_its_out_folder(stories_dir):
    result = invoke("build", "--out", "/sys/lade-export-test/o", "--model", stories_dir, "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "nothing was written"


def test_a_dry_run_refuses_what_the_build_refuses_once_it_has_the_model(tmp_path, stories_dir):
    """The checks that need the model (its hidden size, head width and context) run in a dry
    run too, with the build's messages; an accepted dry run names the attention it would export."""
    for options, message in (
            (["--precision", "int4", "--block-size", 128], "--block-size 128 does not divide the model's hidden size "
                                                           "64; give a power of two ≥ 16 that does (e.g. 32)"),
            (["--attention", "group-query-attention"], "--attention group-query-attention needs a head width that is "
                                                       "a multiple of 16 (ONNX Runtime's kernel); this model's is 8: "
                                                       "use --attention onnx-ops")):
        result = invoke("build", "--model", stories_dir, "--out", tmp_path / "o", "--dry-run", *options)
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [f"error: {message}"]
    result = invoke("build", "--model", stories_dir, "--out", tmp_path / "o", "--dry-run")
    assert result.exit_code == 0 and "attention: onnx-ops" in result.stdout.splitlines()
    assert not (tmp_path / "o").exists()


def test_a_cleanup_that_fails_after_an_interrupt_still_exits_130(tmp_path, stories_dir, monkeypatch):
    import lade_export.export.build as build_module

    def interrupted_then_cleanup_fails(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        finally:
            raise PermissionError(13, "Permission denied", str(tmp_path / ".o.lock"))

    monkeypatch.setattr(build_module, "build_artifact", interrupted_then_cleanup_fails)
    result = invoke("build", "--model", stories_dir, "--out", tmp_path / "o")
    assert result.exit_code == 130
    assert result.stderr.splitlines() == ["error: interrupted"]


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(files={}), "graph.file 'model.onnx' is not among the manifest's files, so it could not be checked"),
    (lambda m: m.update(engines=[{"file": ["x"]}]), "engines[0].file is ['x'], not a file name"),
    (lambda m: m["tokenizer"].update(files=[{"a": 1}]), "tokenizer.files[0] is {'a': 1}, not a file name"),
    (lambda m: m["files"].pop("tokenizer/tokenizer.json"),
     "tokenizer.file 'tokenizer/tokenizer.json' is not among the manifest's files"),
    # a hand edit must not make decoding load or hash a file outside the artifact
    (lambda m: (m["graph"].update(file="../elsewhere/model.onnx"),
                m["files"].update({"../elsewhere/model.onnx": m["files"]["model.onnx"]})),
     "files names '../elsewhere/model.onnx', which is not a path inside the artifact"),
    (lambda m: m["graph"].update(file="/tmp/model.onnx"), "graph.file '/tmp/model.onnx' is not a path inside the artifact"),
    (lambda m: m["files"].update({"/etc/passwd": {"sha256": "0" * 64, "bytes": 1}}),
     "files names '/etc/passwd', which is not a path inside the artifact"),
], ids=["files-empty", "engine-file-a-list", "tokenizer-file-an-object", "tokenizer-unlisted", "graph-file-parent",
        "graph-file-absolute", "files-absolute"])
def test_a_file_the_manifest_names_but_does_not_list_is_refused_by_every_command(tmp_path, stories_artifact, edit,
                                                                                   message):
    a = _edited_manifest(tmp_path, stories_artifact, edit)
    for command in (["generate", a, "--prompt", "hi"], ["inspect", a], ["check", a]):
        result = invoke(*command)
        assert result.exit_code == 2, (command, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {a / 'manifest.json'}: {message}"), (command, lines)
        assert lines[0].endswith("; rebuild with lade-export build"), lines
