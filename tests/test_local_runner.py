"""The local Triton runner stops promptly and leaves nothing behind: ``stop()`` ends the
requests in flight at their next step instead of waiting out the server's exit timeout,
and ``python -m lade_export.serving.local REPO`` stops the server on SIGTERM as on Ctrl-C
and removes its temporary folder (backends, log, the stub's ~100 MB environment)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lade_export.serving.repository import write_model_repository

from .test_serving import _gather, _require_triton, triton_env  # noqa: F401  (triton_env: a fixture)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("batching", [True, False], ids=["scheduler", "no-batching"])
def test_stop_ends_the_requests_in_flight_instead_of_waiting_out_the_exit_timeout(tmp_path, stories_artifact,
                                                                                 triton_env, batching):  # noqa: F811
    from lade_export.serving.local import LocalTritonServer

    # sixteen requests in flight: in one scheduler's passes, or (--no-batching) each on its own
    write_model_repository(stories_artifact, tmp_path / "repo", name="busy", threads=1, max_concurrent_requests=16,
                           max_new_tokens_limit=480, batching=batching)
    server = LocalTritonServer(tmp_path / "repo", tmp_path / "run", env_dir=triton_env, exit_timeout_s=20)
    server.start()
    requests = [dict(prompt=f"Once upon a time, {i}", max_new_tokens=480, profile="greedy") for i in range(16)]

    async def stop_while_decoding():
        task = asyncio.ensure_future(_gather(server.grpc_url, requests, model="busy"))
        await asyncio.sleep(1.0)  # sixteen 480-token requests on one thread: seconds of decoding left
        started = time.monotonic()
        await asyncio.to_thread(server.stop)
        stopped_s = time.monotonic() - started
        return stopped_s, await task

    try:
        stopped_s, results = asyncio.run(stop_while_decoding())
    finally:
        server.stop()
    log = server.log_text()
    assert ("scheduler: max_batch 16, token_budget 64, kv_tokens 8192, width_policy adaptive" if batching
            else "no scheduler: up to 16 requests on their own passes") in log
    assert "stopped: the model is unloading after" in log
    assert "Exit timeout expired" not in log and server.process.returncode == 0, log[-2000:]
    assert stopped_s < 10, stopped_s  # was the exit timeout (20 s here) and a SIGKILL
    assert server.leftover_processes() == []
    assert any(r.error == "request stopped: the model is unloading" for r in results)


def test_the_runner_stops_on_sigterm_and_removes_its_temporary_folder(tmp_path, stories_artifact):
    _require_triton()
    write_model_repository(stories_artifact, tmp_path / "repo", name="runner")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    runner = subprocess.Popen([sys.executable, "-m", "lade_export.serving.local", str(tmp_path / "repo")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = runner.stdout.readline()
        assert line.startswith(f"serving {tmp_path / 'repo'}: gRPC 127.0.0.1:"), runner.stderr.read()
        [workdir] = tmp.glob("lade-triton-*")
        assert (workdir / "env").is_dir()  # the stub's environment lives in it
        server = next(int(p.name) for p in Path("/proc").iterdir()
                      if p.name.isdigit() and _ppid(p) == runner.pid)
        started = time.monotonic()
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM  # it stopped the server (it used to just die)
        assert time.monotonic() - started < 15
    finally:
        if runner.poll() is None:
            runner.kill()
    assert list(tmp.glob("lade-triton-*")) == []  # was ~104 MB left in /tmp after every stop
    assert [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(int(p.name)) == server] == []


def _ppid(proc: Path):
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _pgid(pid: int):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_triton_says_how_to_serve_where_no_tritonserver_is_on_path(tmp_path, stories_artifact, monkeypatch):
    import importlib.util

    from click.testing import CliRunner

    from lade_export.cli import main

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no tritonserver here
    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["triton", str(stories_artifact), "--out", str(repo)])
    assert result.exit_code == 0, result.output
    wheel = "installed" if importlib.util.find_spec("pytriton") else "pip install --no-deps nvidia-pytriton==0.7.0"
    assert result.stdout.splitlines() == [
        f"wrote {repo / 'stories260K'} (model 'stories260K')",
        f"serve with: python -m lade_export.serving.local {repo}  (this machine: the tritonserver of the "
        f"nvidia-pytriton wheel, {wheel})",
        f"       or: tritonserver --model-repository {repo}  (in the NGC container "
        "nvcr.io/nvidia/tritonserver:<yy.mm>-py3 with lade-export installed; docs/serving.md)"]
    (bin_dir / "tritonserver").write_text("#!/bin/sh\n")
    (bin_dir / "tritonserver").chmod(0o755)
    again = CliRunner().invoke(main, ["triton", str(stories_artifact), "--out", str(repo), "--force"])
    assert again.stdout.splitlines()[1:] == [f"serve with: tritonserver --model-repository {repo}"]


def test_the_runner_takes_sigint_even_when_started_with_it_ignored(tmp_path, monkeypatch):
    """A script's background job (``python -m lade_export.serving.local REPO &``) starts
    with SIGINT ignored; the runner installs its handler itself, so ``kill -INT`` stops it."""
    from lade_export.errors import ServingError
    from lade_export.serving import local

    seen = []

    class Server:
        remove_workdir = False

        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            seen.append(signal.getsignal(signal.SIGINT))
            raise ServingError("stop here")

        def stop(self):
            pass

    monkeypatch.setattr(local, "find_triton", lambda: None)
    monkeypatch.setattr(local, "LocalTritonServer", Server)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert local.main([str(tmp_path / "repo"), str(tmp_path / "run")]) == 2
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert seen == [signal.default_int_handler]
