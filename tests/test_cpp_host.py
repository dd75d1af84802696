"""The C++ host in examples/cpp, built with CMake against pybind11's embed API and run on
stories260K: four concurrent requests from C++ threads (one cancelled midway) share the
scheduler's passes and each gives its solo run's text (the Python API without a
scheduler), and a Python error reaches C++ as an exception with its message."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lade_export

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


def test_cpp_threads_stream_the_python_api_text_and_cancel_one(lade_host, stories_artifact):
    proc = subprocess.run([str(lade_host), str(stories_artifact), "64"], capture_output=True, text=True, timeout=300)
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
    # the scheduler packed them: alone each decode step is a pass (and each prompt at least
    # one more); the four took fewer passes than their decode steps
    steps = sum(r["steps"] for r in rows[:4])
    assert scheduler["passes"] < steps, (scheduler, steps)
    assert scheduler["shared_passes"] > 0 and scheduler["most_requests_per_pass"] >= 2


def test_a_missing_artifact_is_a_one_line_error_in_cpp(lade_host, tmp_path):
    proc = subprocess.run([str(lade_host), str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: artifact directory not found: {tmp_path / 'none'}"
