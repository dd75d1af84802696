"""bench/gpu.sh: its help, and its whole pipeline on the CPU (--smoke) with the stories260K
GGUF standing in for SmolLM2 — split, receive, join with sha256, build, compare, batched
serving, archive."""

import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.sh"


def gpu_sh(*args, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_documents_what_it_runs_and_how_the_weights_travel():
    result = gpu_sh("--help")
    assert result.returncode == 0
    text = result.stdout
    for fact in ("first 16\nMT-Bench prompts", "PyTorch backend, float16, on CUDA", "gpu-<GPU>-torch-fp16/",
                 "gpu-<GPU>-ort-cuda/", "gpu-<GPU>-tensorrt-fp16/", "two parts under 48 MiB", "64 MiB",
                 "prepare [--gguf FILE]", "receive", "run [--out DIR]", "--smoke", "gguf and onnxslim",
                 'carry=[".gpu/part1", ".gpu/datasets", ".whl"]', "under 8 minutes",
                 "bench/serve_batched.py", "concurrency 1, 2, 4, 8 with 16 requests", "gpu-<GPU>-serving-<backend>.json",
                 "packed optimization profile", "--no-serving"):
        assert fact in text, fact
    assert gpu_sh().returncode == 2
    bad = gpu_sh("run", "--frobnicate")
    assert bad.returncode == 2 and bad.stderr.strip() == ("error: unknown option --frobnicate (see: bash bench/gpu.sh "
                                                          "--help)")


def test_the_pipeline_runs_end_to_end_on_the_cpu(tmp_path, stories_dir):
    gguf = stories_dir / "llama2c" / "stories260K.gguf"
    env = {"LADE_GPU_WORK": tmp_path / "w", "LADE_GPU_STAGE": tmp_path / "stage"}
    dry = gpu_sh("prepare", "--gguf", gguf, "--no-wheels", "--dry-run", env_extra=env)
    assert dry.returncode == 0, dry.stderr
    assert "nothing was written" in dry.stdout and not (tmp_path / "w").exists()
    prep = gpu_sh("prepare", "--gguf", gguf, "--no-wheels", env_extra=env)
    assert prep.returncode == 0, prep.stderr
    assert (tmp_path / "w" / "part0" / "stories260K.gguf.part0").read_bytes() == gguf.read_bytes()
    assert len((tmp_path / "w" / "datasets" / "mt_bench" / "question.jsonl").read_text().splitlines()) == 16
    got = gpu_sh("receive", env_extra=env)
    assert got.returncode == 0, got.stderr
    (tmp_path / "w" / "part0" / "stories260K.gguf.part0").unlink()  # the working tree was replaced between calls
    dry_run = gpu_sh("run", "--smoke", "--dry-run", "--out", tmp_path / "r", env_extra=env)
    assert dry_run.returncode == 0, dry_run.stderr
    assert "would run:" in dry_run.stdout and "cli.py compare" in dry_run.stdout and "nothing was run" in dry_run.stdout
    assert "bench/serve_batched.py" in dry_run.stdout and "--concurrency 1 2 --requests 2" in dry_run.stdout
    no_serving = gpu_sh("run", "--smoke", "--dry-run", "--no-serving", "--out", tmp_path / "r", env_extra=env)
    assert no_serving.returncode == 0 and "serve_batched" not in no_serving.stdout
    result = gpu_sh("run", "--smoke", "--out", tmp_path / "r", "--tar", tmp_path / "r.tgz", env_extra=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "r" / "gpu-cpu-smoke-torch-fp32" / "summary.csv")))
    assert [r["config"] for r in rows] == ["greedy", "small"]
    assert all(r["exact"] == r["prompts"] == "2" for r in rows)
    assert "SmolLM2-135M-Instruct, mt_bench, cpu-smoke, torch-fp32" in \
        (tmp_path / "r" / "gpu-cpu-smoke-torch-fp32" / "summary.md").read_text()
    serving = json.loads((tmp_path / "r" / "gpu-cpu-smoke-serving-torch-fp32.json").read_text())
    runs = serving["runs"]  # batched serving: both decodings, both levels, threads and the scheduler
    assert {(r["decoding"], r["concurrency"], r["mode"]) for r in runs} == \
        {(d, c, m) for d in ("greedy", "default") for c in (1, 2) for m in ("threads", "scheduler")}
    assert all(r["equal_to_solo"] == r["requests"] == 2 for r in runs)
    assert "--backend torch --device cpu --dtype float32" in serving["command"]
    assert "| greedy | 2 | scheduler |" in (tmp_path / "r" / "gpu-cpu-smoke-serving-torch-fp32.md").read_text()
    with tarfile.open(tmp_path / "r.tgz") as tar:
        names = set(tar.getnames())
    assert {"gpu-cpu-smoke-env.txt", "gpu-cpu-smoke-torch-fp32/summary.md", "gpu-cpu-smoke-torch-fp32/results.jsonl",
            "gpu-cpu-smoke-torch-fp32/speedup.png", "gpu-cpu-smoke-serving-torch-fp32.json",
            "gpu-cpu-smoke-serving-torch-fp32.md"} <= names


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_damaged_or_missing_weights_stop_the_run_in_one_line(tmp_path, stories_dir, damage):
    gguf = stories_dir / "llama2c" / "stories260K.gguf"
    env = {"LADE_GPU_WORK": tmp_path / "w", "LADE_GPU_STAGE": tmp_path / "stage"}
    assert gpu_sh("prepare", "--gguf", gguf, "--no-wheels", env_extra=env).returncode == 0
    part0 = tmp_path / "w" / "part0" / "stories260K.gguf.part0"
    if damage == "corrupt":
        data = bytearray(part0.read_bytes())
        data[100] ^= 1
        part0.write_bytes(bytes(data))
    else:
        part0.unlink()
    result = gpu_sh("run", "--smoke", "--dry-run", "--out", tmp_path / "r", env_extra=env)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    if damage == "corrupt":
        assert last == f"error: sha256 of the joined stories260K.gguf does not match {tmp_path}/w/part1/SHA256"
    else:
        assert last.startswith("error: the first part of stories260K.gguf is gone (the machine was released between "
                               "the calls?)")
