"""Interrupted and concurrent builds never leave a partial artifact directory."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lade_export.artifact import Artifact

ROOT = Path(__file__).resolve().parent.parent


def start_build(*args):
    return subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "build", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout=300.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def temp_dirs(parent: Path, name: str):
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def export_started(parent: Path, name: str) -> bool:
    return any(any(f.name.startswith("model.onnx") for f in d.iterdir()) for d in temp_dirs(parent, name))


@pytest.mark.slow
def test_sigterm_mid_export_of_smollm2_leaves_nothing_then_rebuild_succeeds(tmp_path):
    out = tmp_path / "smol"
    proc = start_build("--out", out)
    try:
        wait_for(lambda: export_started(tmp_path, "smol"), what="the ONNX export to start writing")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written"
    assert os.listdir(tmp_path) == []  # no --out, no temp dir, no lock file

    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), "build", "--out", str(out)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    art = Artifact(out)  # verifies every checksum
    assert art.manifest["model"]["dims"]["num_layers"] == 30
    assert sorted(os.listdir(tmp_path)) == ["smol"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_force_rebuild_keeps_previous_build(tmp_path, stories_dir, stories_artifact, sig):
    import shutil

    out = tmp_path / "art"
    # A stories260K build takes seconds and creates its temporary directory early, but a
    # signal can still land after the build has committed (then it completes, whole): such
    # an attempt must leave a complete artifact, and another attempt is made, up to 3.
    for attempt in range(3):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(stories_artifact, out)
        before = (out / "manifest.json").read_bytes()
        proc = start_build("--model", stories_dir, "--out", out, "--force")
        try:
            wait_for(lambda: temp_dirs(tmp_path, "art"), what="the temporary build directory")
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert sorted(os.listdir(tmp_path)) == ["art"], err  # never a temporary directory or lock left
        Artifact(out)  # verifies every checksum
        if proc.returncode == 0 and err.strip().splitlines()[-1].startswith(f"built {out}"):
            continue  # the signal came after the commit: a whole new build
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written"
        assert (out / "manifest.json").read_bytes() == before
        return
    pytest.fail("three builds finished before the signal took effect")


def test_two_concurrent_builds_one_wins_and_the_result_is_complete(tmp_path, stories_dir):
    out = tmp_path / "same"
    procs = [start_build("--model", stories_dir, "--out", out, "--profile", p) for p in ("small", "default")]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2).strip().splitlines()[-1]
    assert loser in (f"error: another build into {out} is in progress",
                     f"error: {out} already exists; pass --force to replace it")
    art = Artifact(out)
    assert art.manifest["profiles"][0]["name"] in ("small", "default")
    assert sorted(os.listdir(tmp_path)) == ["same"]
