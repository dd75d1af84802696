"""Interrupted and concurrent builds never leave a partial artifact directory."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lade_export.artifact import Artifact, atomic_directory

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


def process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_force_rebuild_keeps_previous_build(tmp_path, stories_dir, stories_artifact, sig):
    out = tmp_path / "art"
    shutil.copytree(stories_artifact, out)
    before = (out / "manifest.json").read_bytes()
    proc = start_build("--model", stories_dir, "--out", out, "--force")
    try:
        wait_for(lambda: temp_dirs(tmp_path, "art"), what="the temporary build directory")
        # The build is stopped while its temporary directory exists, so it has not begun
        # to replace --out (that renames the directory away), however loaded the machine
        # is; the signal is delivered when it continues.
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(proc.pid) == "T", timeout=30, what="the build to stop")
        assert temp_dirs(tmp_path, "art"), "the build finished before it could be stopped"
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written"
    assert sorted(os.listdir(tmp_path)) == ["art"], err  # never a temporary directory or lock left
    Artifact(out)  # verifies every checksum
    assert (out / "manifest.json").read_bytes() == before


class _InterruptsInFinalizer:
    """An object whose finalizer sends SIGINT to this process and runs Python code, so the
    handler runs inside ``__del__``, where Python prints and drops what it raises."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass


def test_an_interrupt_lost_inside_a_finalizer_still_keeps_the_previous_build(tmp_path, monkeypatch):
    # The cause of a build that got SIGINT and exited 0 with a new artifact: the handler
    # ran inside a garbage-collected object's __del__ (regex's, while transformers was
    # imported), Python dropped its KeyboardInterrupt, and the build went on to commit.
    out = tmp_path / "art"
    out.mkdir()
    (out / "manifest.json").write_text("previous\n")
    before = signal.getsignal(signal.SIGINT)  # Python's default handler, or SIG_IGN in a shell's background job
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lost.append)  # where Python puts what a __del__ raises
    with pytest.raises(KeyboardInterrupt, match="^interrupted$"):
        with atomic_directory(out, force=True) as tmp:
            _InterruptsInFinalizer()  # made and finalized at once: the KeyboardInterrupt raised in it is lost
            assert [u.exc_type for u in lost] == [KeyboardInterrupt]
            (tmp / "manifest.json").write_text("new\n")
    assert (out / "manifest.json").read_text() == "previous\n"
    assert sorted(os.listdir(tmp_path)) == ["art"]
    assert signal.getsignal(signal.SIGINT) is before  # the handler the build found is back


def test_an_interrupt_while_out_is_replaced_lets_the_new_build_land_and_says_so(tmp_path, monkeypatch):
    out = tmp_path / "art"
    out.mkdir()
    (out / "manifest.json").write_text("previous\n")
    replace = os.replace

    def interrupted_replace(src, dst):
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs in the loop below: only recorded here
        for _ in range(1000):
            pass
        replace(src, dst)

    with pytest.raises(KeyboardInterrupt, match=f"^interrupted after the new build was written to {out}$"):
        with atomic_directory(out, force=True) as tmp:
            (tmp / "manifest.json").write_text("new\n")
            monkeypatch.setattr(os, "replace", interrupted_replace)
    monkeypatch.undo()
    assert (out / "manifest.json").read_text() == "new\n"
    assert sorted(os.listdir(tmp_path)) == ["art"]  # neither the temporary nor the previous directory left


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


def _compilers_for(path_part: str) -> list[int]:
    """PIDs of processes whose command line mentions ``path_part`` and that run a compiler."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if path_part in cmd and any(name in cmd for name in ("cc1plus", "g++", "c++", " as ")):
                found.append(int(entry))
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_build_alone_during_the_kernels_compile_ends_the_compiler_too(tmp_path, stories_dir, sig):
    """SIGINT or SIGTERM sent to the build's process alone (not its group) while it compiles the
    lade kernels: the build exits 130 with its one line and nothing written, and no compiler
    process it started keeps running (the driver's cc1plus was left compiling)."""
    from lade_export.kernels import find_compiler

    try:
        find_compiler()
    except Exception as err:
        pytest.skip(f"no compiler: {err}")
    out = tmp_path / "art"
    proc = start_build("--model", stories_dir, "--precision", "int8", "--kernels", "lade", "--out", out)
    try:
        wait_for(lambda: any("cc1plus" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                             for pid in _compilers_for(str(tmp_path))), what="the kernels' compiler to start")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written"
    wait_for(lambda: not _compilers_for(str(tmp_path)), timeout=2, what="the compiler processes to end")
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_once_the_build_has_said_built_is_ignored(tmp_path, stories_dir):
    """The artifact is complete when ``built …`` is printed; a SIGINT during the interpreter's
    teardown that follows (torch's exit handlers take ~0.5 s) used to end the process by
    SIGINT with no message, or with a traceback from an exit handler."""
    out = tmp_path / "art"
    proc = start_build("--model", stories_dir, "--out", out)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("built "):
                proc.send_signal(signal.SIGINT)
                break
        _, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = "".join(lines) + rest
    assert lines and lines[-1].startswith(f"built {out}: "), err
    assert "Traceback" not in err, err
    if proc.returncode == 130:  # it landed before the command returned: the build says it is complete
        assert err.strip().splitlines()[-1] == f"error: interrupted after the new build was written to {out}", err
    else:  # during the teardown: ignored
        assert proc.returncode == 0 and "error:" not in err, (proc.returncode, err)
    Artifact(out)  # complete: every checksum
