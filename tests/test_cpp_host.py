"""The C++ host in examples/cpp, built with CMake against pybind11's embed API and run on
stories260K: four concurrent requests from C++ threads (one cancelled midway) share the
scheduler's passes and each gives its solo run's text (the Python API without a
scheduler), also with a small token budget and KV pool and without a scheduler; a Python
error reaches C++ as an exception with its message, a bad command line is one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lade_export
from lade_export.scheduler import MAX_BATCH, TOKEN_BUDGET

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lade_host(tmp_path_factory):
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        pytest.fail("cmake and g++ are needed to build examples/cpp")
    import pybind11

    build = tmp_path_factory.mktemp("cpp")
    configure = subprocess.run(["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(build),
                                f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"],
                               capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, timeout=600)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert "warning" not in compiled.stdout + compiled.stderr
    return build / "lade_host"


# the options as given to lade_host, and the scheduler options the run must report
RUNS = {"defaults": ([], {"max_batch": MAX_BATCH, "token_budget": TOKEN_BUDGET,
                          "kv_tokens": MAX_BATCH * 512, "width_policy": "adaptive"}),  # stories260K: 512 tokens
        # a budget of 4 rows defers or isolates every lookahead step; 256 KV tokens hold three of the
        # four requests (prompt + 64 each), so one waits for a place
        "small-budget-and-pool": (["--token-budget", "4", "--kv-tokens=256"],
                                  {"max_batch": 8, "token_budget": 4, "kv_tokens": 256, "width_policy": "adaptive"}),
        # every lookahead step at its profile's width, whatever the load
        "profile-width": (["--width-policy", "profile"], {"max_batch": MAX_BATCH, "width_policy": "profile"}),
        "no-batching": (["--no-batching"], None)}


@pytest.mark.parametrize("run", RUNS, ids=list(RUNS))
def test_cpp_threads_stream_the_python_api_text_and_cancel_one(lade_host, stories_artifact, run):
    options, applied = RUNS[run]
    proc = subprocess.run([str(lade_host), str(stories_artifact), "64", *options], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    [counters] = [line for line in proc.stderr.splitlines() if line.startswith("[scheduler] ")]
    scheduler = json.loads(counters.removeprefix("[scheduler] "))["scheduler"]
    assert [r["id"] for r in rows] == [0, 1, 2, 3, -1]
    model = lade_export.load(stories_artifact)  # no scheduler: each request alone on its own passes
    for row in rows[:4]:
        greedy = row["profile"] == "greedy"
        ref = model.generate(row["prompt"], max_new_tokens=64, profile=None if greedy else row["profile"],
                             lookahead=not greedy)
        if row["id"] == 3:  # cancelled after three streamed pieces
            assert row["stop_reason"] == "cancelled"
            assert 3 <= row["new_tokens"] < 64 and ref.text.startswith(row["text"]) and row["text"]
        else:
            assert row["text"] == ref.text and row["stop_reason"] == ref.stop_reason == "max_new_tokens"
            assert row["new_tokens"] == 64 and 1 <= row["steps"] <= 64  # steps: the scheduler may narrow a step under load
    # the streamed pieces went to the C++ callback (stderr), tagged by request
    assert all(f"[request {i}] " in proc.stderr for i in range(4))
    assert rows[4]["error"].startswith("ProfileError: profile file not found: no-such-profile (give a TOML path")
    if applied is None:  # --no-batching: no scheduler was loaded
        assert scheduler is None
        return
    assert {k: scheduler[k] for k in applied} == applied  # the options reached lade_export.load
    # the scheduler packed them: alone each decode step is a pass (and each prompt at least
    # one more); the four took fewer passes than their decode steps
    steps = sum(r["steps"] for r in rows[:4])
    assert scheduler["passes"] < steps, (scheduler, steps)
    assert scheduler["shared_passes"] > 0 and scheduler["most_requests_per_pass"] >= 2


def test_a_missing_artifact_is_a_one_line_error_in_cpp(lade_host, tmp_path):
    proc = subprocess.run([str(lade_host), str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: artifact directory not found: {tmp_path / 'none'}"


@pytest.mark.parametrize("args,message", [
    (["--token-budget", "abc"], "--token-budget must be an integer from 1 to 2147483647, got 'abc'"),
    (["--kv-tokens=0"], "--kv-tokens must be an integer from 2 to 2147483647, got '0'"),
    (["--kv-tokens", "1"], "--kv-tokens must be an integer from 2 to 2147483647, got '1'"),
    (["--kv-tokens", "99999999999"], "--kv-tokens must be an integer from 2 to 2147483647, got '99999999999'"),
    (["--token-budget"], "--token-budget needs a value"),
    (["12x"], "MAX_NEW_TOKENS must be an integer from 1 to 2147483647, got '12x'"),
    (["--no-batching", "--token-budget", "8"], "--token-budget is an option of the scheduler, and --no-batching "
                                               "loads none"),
    (["--max-batch", "2"], "unknown option --max-batch (options: --token-budget T, --kv-tokens K, --width-policy P, "
                           "--no-batching)"),
    (["--width-policy=wide"], "--width-policy must be adaptive or profile, got 'wide'"),
    (["--width-policy"], "--width-policy needs a value"),
    (["--no-batching", "--width-policy", "profile"], "--width-policy is an option of the scheduler, and --no-batching "
                                                     "loads none"),
])
def test_a_bad_command_line_is_a_one_line_error_in_cpp(lade_host, stories_artifact, args, message):
    proc = subprocess.run([str(lade_host), str(stories_artifact), *args], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {message}\n")
