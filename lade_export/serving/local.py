"""Run a real ``tritonserver`` on this machine, from the ``nvidia-pytriton`` wheel.

The ``tritonserver`` package on PyPI is a placeholder; the ``nvidia-pytriton`` wheel
(0.7.0: Triton 2.51, ~55 MB) bundles the server binary, the Python backend
(``backends/python/libtriton_python.so`` and ``triton_python_backend_utils.py``) and the
backend's stub executable once per Python version
(``python_backend_stubs/<major.minor>/triton_python_backend_stub``). This module
assembles a backend directory from those pieces, prepares the Python environment the
stub runs in, and starts and stops the server on free local ports. Tests, the load
benchmark and local development use it; production runs the NGC Triton container with
the same model repository (docs/serving.md).

Facts this relies on (checked with nvidia-pytriton 0.7.0):

* Install the wheel with ``pip install --no-deps nvidia-pytriton==0.7.0``: its own
  Python package pins ``numpy<2``, which we do not need (only its binaries are used).
* The stub links ``libpython3.X.so``; the dynamic loader may pick the distribution's
  copy instead of the one of the interpreter, so ``LD_LIBRARY_PATH`` starts with the
  interpreter's ``LIBDIR`` (and the wheel's ``nvidia_pytriton.libs``).
* The stub's embedded Python ignores ``PYTHONPATH``; it takes its ``site-packages`` from
  the first ``python3`` on ``PATH`` (a virtual environment's ``bin`` works).
* The stub of Triton 2.51 mis-reads BYTES tensors under NumPy 2 (it crashes on the
  first request), so the server's environment holds ``numpy<2``:
  :func:`make_server_env` makes a small virtual environment with NumPy 1.26 whose
  ``.pth`` file then adds the lade_export sources and the calling environment's
  ``site-packages`` (same onnxruntime and tokenizers, hence the same numerics).

Every server runs in its own process group with a parent-death signal, so it ends with
the Python process that started it even when that one dies, and its stubs end their
requests and exit once it is gone; :meth:`LocalTritonServer.stop` first asks the models to
end their requests (the file ``LADE_TRITON_STOP_FILE`` names, which the model watches),
then stops the server (SIGTERM, then SIGKILL to the group) and removes the shared-memory
regions the stubs left behind.

Length (just over the package's ~400 lines, a quarter of it the facts above): assembling
the backend, the stub's environment and the server's life cycle are one job — each step
exists for the next — and users run it as one module
(``python -m lade_export.serving.local REPO`` serves a repository ``lade-export triton`` wrote).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import BackendUnavailableError, ServingError

PYTRITON_PIN = "nvidia-pytriton==0.7.0"


def find_triton() -> Path:
    """The ``tritonserver`` directory inside the installed ``nvidia-pytriton`` wheel.

    Raises:
        BackendUnavailableError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("pytriton")
    root = Path(spec.origin).parent / "tritonserver" if spec and spec.origin else None
    if root is None or not (root / "bin" / "tritonserver").is_file():
        raise BackendUnavailableError(f"tritonserver not found: install it with pip install --no-deps {PYTRITON_PIN}")
    return root


def wheel_libs(triton: Path) -> Path:
    """The wheel's bundled shared libraries (``site-packages/nvidia_pytriton.libs``)."""
    return triton.parent.parent / "nvidia_pytriton.libs"


def assemble_backend_dir(triton: Path, dest: Path, python_version: str | None = None) -> Path:
    """A ``--backend-directory`` for the server: ``dest/python/`` with the Python backend
    library, its utilities module and the stub for ``python_version`` (symbolic links).

    Args:
        triton: :func:`find_triton`.
        dest: the directory to fill (created).
        python_version: ``"3.11"`` …; default: this interpreter's.

    Raises:
        BackendUnavailableError: the wheel has no stub for that Python version.
    """
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (triton / "python_backend_stubs").iterdir())
        raise BackendUnavailableError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version} "
                                      f"(it has {', '.join(have)})")
    python = Path(dest) / "python"
    python.mkdir(parents=True, exist_ok=True)
    for src in (triton / "backends" / "python" / "libtriton_python.so",
                triton / "backends" / "python" / "triton_python_backend_utils.py", stub):
        link = python / src.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return Path(dest)


def make_server_env(dest: Path, extra_paths=(), numpy_spec: str = "numpy<2") -> Path:
    """A virtual environment for the Python backend's stub: this interpreter's Python
    with ``numpy_spec`` installed, and a ``.pth`` file adding ``extra_paths`` after its own
    ``site-packages`` (so its NumPy wins). Reused when ``dest`` already holds one with the
    same paths.

    Args:
        dest: the environment's directory.
        extra_paths: directories to import from (the lade_export sources, the calling
            environment's ``site-packages`` …).
        numpy_spec: the NumPy requirement (Triton 2.51's stub needs NumPy 1.x).

    Returns:
        ``dest``.

    Raises:
        ServingError: the environment cannot be made (pip's message, one line).
    """
    dest = Path(dest)
    pth_text = "".join(f"{Path(p).resolve()}\n" for p in extra_paths)
    site = dest / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if (dest / "bin" / "python3").exists() and (site / "numpy").is_dir():
        (site / "zz_lade_export_paths.pth").write_text(pth_text)
        return dest
    base = getattr(sys, "_base_executable", sys.executable)
    try:
        subprocess.run([base, "-m", "venv", str(dest)], check=True, capture_output=True, text=True)
        subprocess.run([str(dest / "bin" / "python3"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        numpy_spec], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as err:
        last = (err.stderr or err.stdout or "").strip().splitlines()[-1:] or ["failed"]
        raise ServingError(f"cannot make the server environment in {dest}: {last[0]}") from None
    (site / "zz_lade_export_paths.pth").write_text(pth_text)
    return dest


def default_extra_paths() -> list:
    """What the stub needs from here: the directory holding this ``lade_export`` package
    and this environment's ``site-packages`` (onnxruntime, tokenizers, jinja2)."""
    source_root = Path(__file__).resolve().parent.parent.parent
    return [source_root, Path(sysconfig.get_paths()["purelib"])]


def free_ports(n: int) -> list:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (the OS picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child must not dlopen after fork
_PR_SET_PDEATHSIG = 1


def _die_with_parent():  # runs in the child between fork and exec
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _group_members(pgid: int) -> list:
    """[(pid, argv)] of live processes in process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError, PermissionError, IndexError):
            continue
        if state != "Z":
            found.append((int(entry), [a.decode(errors="replace") for a in argv if a]))
    return found


class LocalTritonServer:
    """A ``tritonserver`` process on free 127.0.0.1 ports, for tests, benchmarks and development.

    Use as a context manager, or call :meth:`start` and :meth:`stop` (``stop`` is safe to
    call twice and after a failed start)::

        with LocalTritonServer("repo", workdir="run") as server:
            print(server.grpc_url)   # 127.0.0.1:PORT

    Args:
        repository: the model repository.
        workdir: for the backend directory and the log (``server.log``); created.
        env_dir: the stub's Python environment (:func:`make_server_env`); default
            ``workdir/env``.
        exit_timeout_s: how long the server waits for in-flight requests on SIGTERM.
        log_verbose: Triton's ``--log-verbose`` level.
        remove_workdir: remove ``workdir`` (backends, log, and the stub's environment when it
            lies inside) once stopped.

    Raises:
        BackendUnavailableError: no ``nvidia-pytriton`` wheel, or libpython is not shared.
    """

    def __init__(self, repository, workdir, *, env_dir=None, exit_timeout_s: int = 10, log_verbose: int = 0,
                 remove_workdir: bool = False):
        self.repository = Path(repository).resolve()
        self.workdir = Path(workdir).resolve()
        self.env_dir = Path(env_dir).resolve() if env_dir else self.workdir / "env"
        self.exit_timeout_s = exit_timeout_s
        self.log_verbose = log_verbose
        self.remove_workdir = remove_workdir
        self.triton = find_triton()
        self.process: subprocess.Popen | None = None
        self.grpc_port = self.http_port = None
        self._stubs: dict = {}
        self._log = None
        self._ready = False  # a failed start keeps the workdir, for its log

    # -- paths and environment ----------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def stop_file(self) -> Path:
        """Created by :meth:`stop`: the models end their requests when it appears."""
        return self.workdir / "stopping"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log_text(self) -> str:
        """The server's log so far (stdout and stderr, the models' log lines included)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def environment(self) -> dict:
        """The server's environment: the stub's Python on PATH, libpython and the wheel's
        libraries on LD_LIBRARY_PATH."""
        if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
            raise BackendUnavailableError(f"{sys.executable} has no shared libpython; the Triton Python backend needs one")
        libdir = sysconfig.get_config_var("LIBDIR")
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        env["VIRTUAL_ENV"] = str(self.env_dir)
        env["LADE_TRITON_STOP_FILE"] = str(self.stop_file)
        env["PATH"] = f"{self.env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [libdir, str(wheel_libs(self.triton))] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
        return env

    # -- life cycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = 180.0, attempts: int = 3) -> "LocalTritonServer":
        """Start the server and wait until it and every model in the repository are ready.

        Raises:
            ServingError: the server exited or was not ready within ``timeout_s``; the
                message has the log's last error line (the full log is at :attr:`log_path`).
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stop_file.unlink(missing_ok=True)
        make_server_env(self.env_dir, default_extra_paths())
        backends = assemble_backend_dir(self.triton, self.workdir / "backends")
        for attempt in range(attempts):
            self.grpc_port, self.http_port = free_ports(2)
            cmd = [str(self.triton / "bin" / "tritonserver"), f"--model-repository={self.repository}",
                   f"--backend-directory={backends}", f"--grpc-port={self.grpc_port}", f"--http-port={self.http_port}",
                   "--grpc-address=127.0.0.1", "--http-address=127.0.0.1", "--allow-metrics=false",
                   "--allow-gpu-metrics=false", f"--exit-timeout-secs={self.exit_timeout_s}",
                   f"--log-verbose={self.log_verbose}"]
            self._log = open(self.log_path, "ab")
            self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.environment(), cwd=self.workdir, start_new_session=True,
                                            preexec_fn=_die_with_parent)
            try:
                self._wait_ready(timeout_s)
                self._ready = True
                return self
            except ServingError:
                log = self.log_text()
                self.stop()
                if "Address already in use" in log and attempt + 1 < attempts:
                    continue  # a port was taken between choosing and binding: choose again
                raise
        raise AssertionError("unreachable")

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

    def models(self) -> list:
        """Names of the models in the repository (the server's index)."""
        req = urllib.request.Request(self.http_url + "/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            return [m["name"] for m in json.loads(resp.read())]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServingError(f"tritonserver exited with status {self.process.returncode}: {self._last_error()}")
            if self._get("/v2/health/ready") == 200:
                self._remember_stubs()
                return
            time.sleep(0.2)
        raise ServingError(f"tritonserver was not ready after {timeout_s:.0f}s: {self._last_error()}")

    def _last_error(self) -> str:
        lines = [ln for ln in self.log_text().splitlines() if ln.startswith("E") or "rror" in ln]
        return (lines[-1].strip() if lines else "no error in the log") + f" (log: {self.log_path})"

    def _remember_stubs(self) -> None:
        """Record the stub processes (and their shared-memory regions) of the server."""
        if self.process is None:
            return
        for pid, argv in _group_members(self.process.pid):
            if argv and argv[0].endswith("triton_python_backend_stub"):
                self._stubs[pid] = argv[2] if len(argv) > 2 else None

    @property
    def stubs(self) -> dict:
        """{pid: shared-memory region name} of the stub processes seen (one per model instance)."""
        return dict(self._stubs)

    def leftover_processes(self) -> list:
        """[(pid, argv)] still alive in the server's process group (empty after :meth:`stop`)."""
        return _group_members(self.process.pid) if self.process is not None else []

    def stop(self) -> None:
        """Stop the server: the models end their requests at their next step (each client
        gets ``request stopped: the model is unloading``), SIGTERM lets the server unload
        them (it waits up to ``exit_timeout_s``), SIGKILL to its whole process group after
        that; then remove shared-memory regions its stubs left in /dev/shm, and the workdir
        with ``remove_workdir``."""
        if self.process is None:
            return
        self._remember_stubs()
        pgid = self.process.pid
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.stop_file.touch()
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.exit_timeout_s + 2)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while _group_members(pgid) and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.1)
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        for region in self._stubs.values():
            if region and "/" not in region:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{region}")
        if self._log is not None:
            self._log.close()
            self._log = None
        self.stop_file.unlink(missing_ok=True)
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        if self.remove_workdir and self._ready:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalTritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    """``python -m lade_export.serving.local REPO [WORKDIR]``: serve REPO until Ctrl-C."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m lade_export.serving.local REPO [WORKDIR]", file=sys.stderr)
        return 2
    try:
        find_triton()  # before making a workdir
    except BackendUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    workdir = Path(args[1]) if len(args) > 1 else Path(tempfile.mkdtemp(prefix="lade-triton-"))
    # a temporary workdir (backends, log, the stub's ~100 MB environment) goes when the server stops
    server = LocalTritonServer(args[0], workdir, remove_workdir=len(args) == 1)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # stop the server as Ctrl-C does, not by dying
        signal.signal(signum, lambda number, frame: sys.exit(128 + number))
    # Ctrl-C (and kill -INT) stops it even when it was started with SIGINT ignored (a script's background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.start()
        where = "" if server.remove_workdir else f"; log {server.log_path}"
        print(f"serving {args[0]}: gRPC {server.grpc_url}, HTTP {server.http_url}{where}; Ctrl-C stops", flush=True)
        while server.process.poll() is None:
            time.sleep(0.5)
        return server.process.returncode or 0
    except KeyboardInterrupt:
        return 130
    except (ServingError, BackendUnavailableError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
