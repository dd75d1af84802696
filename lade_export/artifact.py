"""Artifact directories: what ``lade-export build`` writes, and how it is read back.

Layout of ``DIR``::

    manifest.json         the contract (schema in docs/manifest.md)
    model.onnx            the decoder-step graph
    model.onnx.data       its weights, when large (external data)
    tokenizer/            tokenizer files (tokenizer.json, tokenizer_config.json, chat template)
    engines/NAME.plan     TensorRT engines, one per profile (optional)

Writes are atomic: a build fills a hidden temporary sibling of ``DIR`` and renames it
into place only when everything succeeded; an interrupted build (exception, SIGINT,
SIGTERM) removes the temporary directory, so ``DIR`` is either the previous complete
build or absent. A lock file beside ``DIR`` makes a second concurrent build into the
same ``DIR`` fail at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path, PurePosixPath

from .errors import ArtifactError, interrupted_after_build
from .manifest import REQUIRED_KEYS, SCHEMA_VERSION, Manifest  # noqa: F401 (REQUIRED_KEYS: re-exported)

#: Files up to this size are hashed on every open; larger ones (the weights) only when asked.
QUICK_HASH_LIMIT = 16 << 20
MANIFEST = "manifest.json"


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entries(root: Path, names) -> dict:
    """{relative name: {"sha256", "bytes"}} for files under ``root``."""
    return {n: {"sha256": sha256_file(root / n), "bytes": (root / n).stat().st_size} for n in names}


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to ``path`` via a temporary file in the same directory and a rename."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def stage_text(path: Path, text: str) -> str:
    """Write text (UTF-8) to a new hidden temporary file beside ``path``, flushed to disk and
    readable by all (0644), and return its path, for the caller to rename onto ``path``
    (``os.replace``) or to remove; on failure nothing is left."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to ``path`` via a temporary file in the same directory and a rename."""
    tmp = stage_text(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def check_out(out: str | Path, force: bool = False, *, marker: str = MANIFEST,
              what: str = "a lade-export build") -> Path:
    """Whether ``out`` may become a new build (what :func:`atomic_directory` checks before
    it starts, and a dry run reports); returns it resolved. Writes nothing.

    Args:
        out: the directory to create or replace.
        force: replace an existing ``out`` written by lade-export.
        marker: the file that proves an existing ``out`` was written by lade-export.
        what: how the errors name such a directory.

    Raises:
        ArtifactError: ``out`` is empty, a dangling symbolic link, the working or home
            directory or the root; it exists but is not ``what`` (no ``marker``: nothing
            replaces it, ``force`` or not); it is ``what`` and ``force`` is false; its
            parent is a file.
    """
    if not str(out).strip():
        raise ArtifactError("--out is empty; give the artifact directory to create")
    if Path(out).is_symlink() and not Path(out).exists():  # resolving it would build at its target, parents made
        raise ArtifactError(f"--out {out} is a symbolic link to {os.readlink(out)}, which does not exist; give a new "
                            "directory (or the link's target)")
    out = Path(out).resolve()
    if out == Path.cwd().resolve() or out == Path.home().resolve() or out.parent == out:
        raise ArtifactError(f"refusing to build into {out}: give a new directory for --out")
    if out.exists():
        if not (out.is_dir() and (out / marker).is_file()):  # --force would not help: say so at once
            raise ArtifactError(f"refusing to replace {out}: it is not {what} (no {marker}); give a new directory "
                                "for --out")
        if not force:
            raise ArtifactError(f"{out} already exists; pass --force to replace it")
    if out.parent.exists() and not out.parent.is_dir():
        raise ArtifactError(f"parent of --out is not a directory: {out.parent}")
    return out


@contextlib.contextmanager
def atomic_directory(out: str | Path, force: bool = False, *, marker: str = MANIFEST,
                     what: str = "a lade-export build"):
    """Yield a temporary directory that becomes ``out`` when the block succeeds.

    Args:
        out: final directory path.
        force: replace an existing ``out`` (only after the new build completed).
        marker: the file that proves an existing ``out`` was written by lade-export
            (``--force`` replaces nothing without it).
        what: how the error names such a directory.

    Interrupts (in the main thread, SIGINT and SIGTERM get a handler of their own for the
    duration): one inside the block raises KeyboardInterrupt there at once; and since
    Python runs a signal handler between any two bytecodes, also inside a ``__del__`` or
    a library's ``except BaseException`` that discard the exception, every signal is
    recorded too and checked again before the commit, so a build whose interrupt was lost
    still ends with KeyboardInterrupt and leaves ``out`` as it was. While the lock and
    temporary directory are created, while they are removed and while ``out`` is being
    replaced, a signal is only recorded (the handler is Python's, whatever thread the
    kernel gives the signal to): one recorded before the replacement raises
    KeyboardInterrupt after the cleanup (``out`` as it was); one that arrives during it
    raises KeyboardInterrupt afterwards, with ``out`` the new complete directory.

    Raises:
        ArtifactError: what :func:`check_out` raises (``force`` never deletes anything but
            a lade-export build); or another build holds the lock on ``out``. On any failure, SIGINT or SIGTERM inside the block, the
            temporary directory is removed and ``out`` is left as it was.
        KeyboardInterrupt: SIGINT or SIGTERM (above).
    """
    out = check_out(out, force, marker=marker, what=what)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"

    caught = []  # signals received while the context runs
    building = [False]  # inside the block: raise at once

    def on_signal(signum, frame):
        caught.append(signum)
        if building[0]:
            raise KeyboardInterrupt("terminated" if signum == signal.SIGTERM else "interrupted")

    def stop_if_caught():
        if caught:
            raise KeyboardInterrupt("terminated" if caught[0] == signal.SIGTERM else "interrupted")

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    lock_fd = tmp = None
    replacing = False
    try:
        lock_fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            lock_fd = None
            raise ArtifactError(f"another build into {out} is in progress") from None
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        os.chmod(tmp, 0o755)
        stop_if_caught()
        building[0] = True
        try:
            yield tmp
        finally:
            building[0] = False
        stop_if_caught()  # an interrupt whose KeyboardInterrupt the block lost: nothing is replaced
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if out.exists() and not force:
            raise ArtifactError(f"{out} appeared during the build; pass --force to replace it")
        stop_if_caught()
        replacing = True
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "prev")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        building[0] = False
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
            os.close(lock_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if replacing and caught:  # it arrived while out was being replaced: out is the new build
        raise KeyboardInterrupt(interrupted_after_build(out))


class Artifact:
    """A built artifact directory, validated on open.

    Args:
        root: the directory.
        verify: ``"quick"`` (default): every listed file exists with its recorded size,
            and files up to :data:`QUICK_HASH_LIMIT` bytes (graph, tokenizer, engines'
            small files) match their sha256 — milliseconds; ``"full"`` (or True): every
            file's sha256, the weights included (~1 s per GB); ``"none"`` (or False):
            only the manifest is read — but a ``--kernels lade`` build's kernel library,
            native code the process loads (a few hundred KB), is checked in every mode when
            :attr:`custom_ops_path` is first asked for (a damaged one would crash the
            process that maps it instead of raising).

    Attributes:
        root: the directory.
        spec: the manifest, typed (:class:`lade_export.manifest.Manifest`; what the
            package reads).
        manifest: the manifest's JSON object as it is on disk (for tools and tests that
            want the raw keys; ``lade-export inspect --json`` prints it).

    Raises:
        ArtifactError: directory or ``manifest.json`` missing, unreadable JSON, or a
            manifest that :meth:`lade_export.manifest.Manifest.from_dict` refuses (a
            ``schema_version`` other than :data:`SCHEMA_VERSION`, a required section or
            key missing, a wrong ``model.dims`` value), a file the manifest names (graph,
            weights, tokenizer, TensorRT plans) that its ``files`` does not list (checked
            unless ``verify="none"``: :func:`unlisted_files`), a listed file missing or of
            another size, or a checksum mismatch naming the file.
    """

    def __init__(self, root: str | Path, verify: str | bool = "quick"):
        self.root = Path(root)
        if self.root.is_file():
            raise ArtifactError(f"{self.root} is a file, not an artifact folder; give the folder that holds "
                                f"{MANIFEST} ({self.root.parent})")
        if not self.root.is_dir():
            raise ArtifactError(f"artifact directory not found: {self.root}")
        path = self.root / MANIFEST
        if not path.is_file():
            raise ArtifactError(f"{self.root} has no {MANIFEST}: not a lade-export build (run lade-export build)")
        try:
            self.manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # ValueError: JSON syntax, huge ints
            raise ArtifactError(f"{path}: unreadable manifest: {err}") from None
        self.spec = Manifest.from_dict(self.manifest, where=path)
        mode = {True: "full", False: "none"}.get(verify, verify)
        if mode not in ("quick", "full", "none"):
            raise ArtifactError(f"verify must be quick, full or none, got {verify!r}")
        self._library_checked = mode != "none"
        if mode != "none":
            self.verify_files(full=mode == "full")

    def verify_files(self, full: bool = False, hashes: bool = True) -> None:
        """Check every listed file: present, of the recorded size, and (with ``hashes``; all
        files when ``full``, else those up to :data:`QUICK_HASH_LIMIT` bytes) of the recorded sha256.

        Raises:
            ArtifactError: naming the first missing, resized or mismatching file.
        """
        self.check_listed()
        for name, entry in self.spec.files.items():
            self._verify_file(name, entry, hashes and (full or entry.bytes <= QUICK_HASH_LIMIT))

    def check_listed(self) -> None:
        """Raise on the first of :func:`unlisted_files`: a file the manifest names that its
        ``files`` lacks would go unchecked (every mode but ``verify="none"`` calls it;
        ``lade-export inspect`` too).

        Raises:
            ArtifactError: ``DIR/manifest.json: graph.file 'model.onnx' is not among the
                manifest's files, …``, or a name that is not a string.
        """
        problems = unlisted_files(self.spec)
        if problems:
            raise ArtifactError(f"{self.root / MANIFEST}: {problems[0]}; rebuild with lade-export build")

    def _verify_file(self, name: str, entry, digest: bool) -> None:
        """One listed file: present, of its recorded size and (``digest``) its recorded sha256."""
        f = self.root / name
        if not f.is_file():
            raise ArtifactError(f"{f} is listed in the manifest but missing")
        size = f.stat().st_size
        if size != entry.bytes:
            raise ArtifactError(f"size mismatch for {name}: {size:,} bytes, the manifest says {entry.bytes:,}; "
                                "rebuild the artifact")
        if digest and sha256_file(f) != entry.sha256:
            raise ArtifactError(f"checksum mismatch for {name}: the file differs from the manifest; rebuild the artifact")

    def verify_checksums(self) -> None:
        """Every file's full sha256 (see :meth:`verify_files`)."""
        self.verify_files(full=True)

    @property
    def onnx_path(self) -> Path:
        return self.root / self.spec.graph.file

    @property
    def custom_ops_path(self) -> Path | None:
        """The custom-op library the graph computes with (``graph.custom_ops``, built with
        ``--kernels lade``; :mod:`lade_export.kernels`), or None.

        Raises:
            ArtifactError: the name is absolute, leaves the artifact, or is not in ``files``;
                or (opened with ``verify="none"``) the file is missing or not of its
                recorded size and sha256 (``verify_files`` checks it in the other modes)."""
        name = self.spec.graph.custom_ops
        if not name:
            return None
        # Native code is loaded from it: only a file inside the artifact whose sha256 the manifest records.
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts \
                or name not in self.spec.files:
            raise ArtifactError(f"{self.root / 'manifest.json'}: graph.custom_ops {name!r} is not a file of the "
                                "artifact listed in its files; rebuild with lade-export build")
        if not self._library_checked:
            self._verify_file(name, self.spec.files[name], True)
            self._library_checked = True
        return self.root / name

    @property
    def dims(self):
        """:class:`lade_export.specs.ModelDims` of the model."""
        return self.spec.model.dims

    @property
    def attention(self) -> str:
        """How the graph computes attention (``graph.attention``): ``onnx-ops`` (standard
        operators, every engine) or ``group-query-attention`` (ONNX Runtime's fused op)."""
        return self.spec.graph.attention

    @property
    def kv_layout(self) -> str:
        """The graph's KV cache layout (``graph.kv_cache``, :data:`lade_export.specs.KV_LAYOUTS`);
        artifacts built before it existed are ``sequence-major``."""
        return self.spec.graph.kv_cache

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.spec.model.stop_token_ids)

    @property
    def max_context(self) -> int:
        return int(self.spec.model.dims.max_context)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.spec.tokenizer.chat_template)

    def tokenizer(self):
        """The runtime tokenizer (:class:`lade_export.tokenizer.Tokenizer`; no transformers)."""
        from .tokenizer import Tokenizer

        return Tokenizer.from_manifest(self.root, self.spec)

    def profiles(self):
        """Profiles recorded at build time, as :class:`LookaheadProfile` values."""
        return list(self.spec.profiles)

    def default_profile(self):
        """The profile a request gets when it names none: the manifest's
        ``default_profile``, else the first built profile (None: plain greedy).

        Raises:
            ArtifactError: ``default_profile`` names none of the manifest's profiles.
        """
        profiles = self.profiles()
        name = self.spec.default_profile
        for p in profiles:
            if p.name == name:
                return p
        if name is not None:
            raise ArtifactError(f"{self.root / 'manifest.json'}: default_profile {name!r} is not one of its profiles "
                                f"({', '.join(p.name for p in profiles) or 'none'}); fix the manifest or rebuild")
        return profiles[0] if profiles else None


def unlisted_files(spec) -> list[str]:
    """What keeps the files a manifest names from being checked, one phrase each: the graph,
    its weights, the tokenizer's files and the TensorRT plans must be among ``files`` (a
    hand-edited ``"files": {}`` would otherwise turn every check off), by name (a string).
    ``spec`` is a :class:`lade_export.manifest.Manifest`; an empty list when all is well."""
    named = [("graph.file", spec.graph.file), ("graph.external_data", spec.graph.external_data),
             ("tokenizer.file", spec.tokenizer.file)]
    named += [(f"tokenizer.files[{i}]", name) for i, name in enumerate(spec.tokenizer.files)]
    named += [(f"engines[{i}].file", e.file) for i, e in enumerate(spec.engines)]
    problems = [f"files names {name!r}, which is not a path inside the artifact" for name in spec.files
                if isinstance(name, str) and not _inside(name)]
    for key, name in named:
        if name is None:
            continue
        if not isinstance(name, str):
            problems.append(f"{key} is {name!r}, not a file name")
        elif not _inside(name):
            problems.append(f"{key} {name!r} is not a path inside the artifact")
        elif name not in spec.files:
            problems.append(f"{key} {name!r} is not among the manifest's files, so it could not be checked")
    return problems


def _inside(name: str) -> bool:
    """Whether a manifest's file name stays inside the artifact: relative, without ``..``
    (what a build writes; a hand edit must not make decoding read or hash other files)."""
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


def checksum_errors(artifact: Artifact) -> list[str]:
    """One message per file that is missing, of another size than the manifest records
    (``"NAME: 1,000,000 bytes on disk, the manifest says 115,635,456"``; no hash is computed
    then) or whose sha256 differs from the manifest."""
    errors = []
    for name, entry in artifact.spec.files.items():
        path = artifact.root / name
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            errors.append(f"{name}: missing")
        elif size != entry.bytes:
            errors.append(f"{name}: {size:,} bytes on disk, the manifest says {entry.bytes:,}")
        elif sha256_file(path) != entry.sha256:
            errors.append(f"{name}: sha256 does not match the manifest")
    return errors
