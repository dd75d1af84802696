"""This project's block-quantized weight kernels for ONNX Runtime (``build --kernels lade``).

``block_quant_ops.cc`` is an ONNX Runtime custom-op library (ONNX Runtime docs, "Custom
operators": a shared library exporting ``RegisterCustomOps``, loaded with
``SessionOptions.register_custom_ops_library``) with these operators in the domain
``lade_export``:

* ``MatMulBlockQ(X float[..., K], Q uint8[N/16, K/32, 64·bits], D float16[N/16, K/32, 16],
  M float16[N/16, K/32, 16]) -> float[..., N]`` (attribute ``N``): a MatMul whose weight is
  stored in blocks of 32 along K with ``bits`` ∈ {4, 8} per weight, ``w = D·code + M`` —
  GGML's Q4_1 blocks (``M`` the block minimum) and, for Q8_0's symmetric blocks, ``code =
  q + 128`` with ``M = −128·D``;
* ``GatherBlockQ(Q, D, M, ids int64[...]) -> float[..., K]`` (attribute ``N``): rows of the
  same table, i.e. a tied token embedding read from the LM head's own tensors.

and, for int8-compute graphs, ``AttentionRows(Q float[B, KV, G·S, D], PK, K float[B, KV, D, S],
PV, V float[B, KV, S, D], masked bool[B, 1, 1, S, P+S]) -> float[B, KV, G·S, D]`` (attributes
``scale`` and ``past_layout``): the attention of an ``onnx-ops`` step graph computed per query
row over the keys it sees, in position order, in one pass over the cache and the step
(:func:`lade_export.export.attention_rows.exact_attention` swaps it in). ``past_layout=1``
(graphs built since 2026-12-01) takes the cache as the graph's own sequence-major inputs, PK = PV =
``[B, P, KV, D]``, read in place; absent or 0 (graphs before), the graph's Transposes of it,
PK ``[B, KV, D, P]`` and PV ``[B, KV, P, D]`` — a copy of the whole cache per layer and step.
Keys are taken in blocks of 16 columns, and a block whose 16 mask entries are all masked for
a row is skipped for that row (no score, no exp): a row costs the blocks it sees, which is
what lets a packed pass over the scheduler's pool cost each request its own columns
(:mod:`lade_export.packed`, regions). Every key's score and exp are the same operations in a
vector lane or alone, so skipping changes no bit of any row. On AVX-512 CPUs the rows of a
batch entry and KV head that see the same blocks (the G query heads of a step row, and the step
rows whose seen blocks agree) are computed together (up to 8 rows; 6 for a head width of 64, 3
above 64: what the value sweep keeps in registers): each key block and value row is loaded
once for the group and feeds the group's independent FMA chains, every row's
operations being those it has alone, in the same order (so the scalar path, row by row, gives the
same bits; tests/test_kernels.py forces both). With an in-place cache, a cache block read by one
or two groups is transposed in registers straight from the cache (a one-token step, a few short
requests in a packed pass); otherwise the keys of the blocks some row sees are first copied into
``[D, 16]`` tiles, one per seen block (a buffer per calling thread of ``B × KV × seen blocks × D ×
16`` floats, kept for the next call: it follows the columns the pass's requests own, not the
pool's size). Graphs carrying ``past_layout=1`` say so in their ONNX metadata
(``attention_skips_masked = 16``, read by the ONNX Runtime engine as ``Engine.attention_skips``).
``AttentionRowsHalfCache`` (same inputs, PK and PV float16) widens a float16 cache exactly.

``RotaryAttentionRows(QKV float[B, S, (H + 2·KV)·D], cos float[B, S, 1, D], sin, PK float16[B,
P, KV, D], PV, masked) -> (float[B, S, H·D], present key float16[B, S, KV, D], present value)``
(attributes ``scale``, ``heads``, ``kv_heads``) is a whole layer's attention of an int8 graph
with a float16 cache, from the fused query/key/value projection to the output projection's
input: the rotary embedding of the query and key heads (rotate-half form; a product, a
product and a sum, each rounded, as the graph's nodes did), this step's keys and values rounded
to float16 (the ``present`` outputs) and widened back, ``AttentionRowsHalfCache`` on them, and the
heads laid back side by side. The same operations in the same order as the ~30 nodes it
replaces (:func:`lade_export.export.attention_rows.fuse_rotary_attention`), so the same bits;
ONNX Runtime dispatches those nodes one by one on one thread while the other waits, ~1.8 µs
each here, about an eighth of a one-token step of SmolLM2 (bench/results/step-costs.md).

``MatMulBlockQ`` takes two optional inputs and two attributes for the per-row work around a
projection (:mod:`lade_export.export.row_fusion` folds it in on int8 graphs): ``prologue`` 1 (RMS
norm, input 5 the weight γ [K], attribute ``epsilon``) or 2 (SwiGLU, X = [gate | up] of 2·K
columns) transforms each row of X before the product, and input 4 ``R`` is added to Y
(``Y = R + X·W``, a residual stream). The prologues are the kernels' own arithmetic, one fixed
order per row (16 lane-partial sums of squares added as a tree for the norm; σ through the
kernels' exp), the same bits on the AVX-512 and portable code.

``ArgMaxRows(X float[..., V]) -> int64[...]`` gives each row's first index of its largest value
(ONNX ``ArgMax`` over the last axis with ``keepdims=0``; a NaN counts as the largest, as
``numpy.argmax``): comparisons only, so every path gives the same index. Every lade build's
``next_token_ids`` come from it (:func:`lade_export.export.quantized_ops.lade_argmax`).

``MatMulBlockQ`` has two compute types (its attribute ``compute``; ``build --compute``):

* ``int8`` (``compute=1``, the default of ``--kernels lade`` builds): each row's activations
  are rounded per block of 32 to int8 with a float32 scale of their own (GGML's Q8_0
  activation blocks: ``d = max|x|/127``, ``q = round(x/d)``), the weight × activation sums
  are int32 (``VPDPBUSD`` on AVX512-VNNI or AVX-VNNI, ``TDPBSUD`` on AMX tiles,
  ``VPMADDUBSW``/``VPMADDWD`` on AVX2, plain C++ on other CPUs), and the scales are applied in
  float32 in one fixed order (the rounding itself 16 lanes at a time on the AVX512-VNNI and
  AMX paths, the same operations as the scalar code of the others). Integer sums are exact,
  so **every integer path gives the same bits** — an artifact decodes the same tokens on any CPU — and a row depends on nothing but
  itself (not the step's row count, not the thread split). Rounding to int8 would amplify the
  last-bit differences that ONNX Runtime's attention has between a one-token and a many-token
  step, so these graphs compute attention with ``AttentionRows`` (FMAs in a fixed order, an
  exp of the same operations on every path): every row of a step is then the bits it has
  alone, and lookahead equals greedy.
* ``float32`` (``compute=0``, an attribute absent in older graphs): float32 FMAs on the
  dequantized weights, AVX-512 or portable (the two sum in different orders), each row
  computed alone; ONNX Runtime's own attention (GroupQueryAttention where it applies). Its
  tokens stay closer to the float32 engine's.

The path is chosen once per process: ``avx512vnni`` → ``amx`` → ``avxvnni`` → ``avx2`` →
``portable`` (int8; AMX after AVX512-VNNI because, with a float epilogue per block of 32, its
tiles measured slower on this project's Xeon — bench/results/step-costs.md — and no faster after
a rewrite that kept more tiles in flight: the tile work and the vector epilogue add up instead of
overlapping, bench/results/kernel-floor.md), ``avx512`` →
``portable`` (float32). ``$LADE_KERNELS_PATH``
forces one (tests; an integer name also picks the float32 path it implies: ``amx`` and
``avx512vnni`` → ``avx512``, the others → ``portable``); ``LADE_KERNELS_PORTABLE=1`` means
``LADE_KERNELS_PATH=portable``. A forced path the CPU lacks, or an unknown name, makes every
session on the library fail to load, naming it. :func:`library_paths` and
:func:`running_path` read the library's own answer (C functions ``lade_kernels_paths`` and
``lade_kernels_path``, through ctypes: no ONNX Runtime, no torch). AMX needs the Linux tile
state, which the library asks for (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``)
before it counts AMX as available.

The packed layout puts 16 output columns in the 32-bit lanes of a 512-bit vector
(:func:`lade_export.export.weight_blocks.pack_block_lanes`): 8-bit codes are the 4-byte groups
``VPDPBUSD`` and AMX's B tiles take as they are, 4-bit codes are two such groups after one
AND and one shift.

The library is compiled at build time (g++ or ``$CXX``, C++17) against ONNX Runtime's C/C++
API headers — found in ``$LADE_ORT_INCLUDE`` or ``~/.cache/lade-export/ort-include``, where
:func:`fetch_headers` puts them (from the npm registry's ``com.github.asus4.onnxruntime``
package, checked against a pinned sha512; ``build --kernels lade`` calls it when they are
missing) — and shipped inside the artifact, so decoding needs neither a compiler nor the
headers. API version 29 (ONNX Runtime 1.29) or later is required at run time.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from ..errors import BackendUnavailableError

#: ``--kernels``: ONNX Runtime's own ``MatMulNBits``, or this project's.
KERNELS = ("onnxruntime", "lade")
#: ``--compute`` of ``--kernels lade``: int8 activations with integer sums (default), or float32.
COMPUTE = ("int8", "float32")
#: The library's paths per compute type (names of ``$LADE_KERNELS_PATH``).
PATHS = {"int8": ("amx", "avx512vnni", "avxvnni", "avx2", "portable"), "float32": ("avx512", "portable")}
#: The order in which the library takes the first path this CPU has, per compute type.
PREFERENCE = {"int8": ("avx512vnni", "amx", "avxvnni", "avx2", "portable"), "float32": ("avx512", "portable")}
#: File name of the compiled library inside an artifact (``graph.custom_ops`` in the manifest).
LIBRARY = "kernels/liblade_kernels.so"
#: The custom-op domain of the operators.
DOMAIN = "lade_export"
SOURCE = Path(__file__).with_name("block_quant_ops.cc")
HEADER = "onnxruntime_cxx_api.h"


#: Where ONNX Runtime's headers come from: the npm registry's com.github.asus4.onnxruntime
#: (MIT), which carries the official ONNX Runtime 1.29 release headers (C API version 29)
#: inside its iOS framework; PyPI's onnxruntime wheels ship none. The sha512 is the
#: registry's ``dist.integrity`` of that version.
HEADERS_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
HEADERS_URL = "https://registry.npmjs.org/com.github.asus4.onnxruntime/-/com.github.asus4.onnxruntime-0.4.9.tgz"
HEADERS_SHA512 = "BkzxduSZ9IkeDP6Q8lz2TFU2ie7hSSvS7ZIfzMooExoq0CNzJnuuGaUJ7IsojBgqO4ouD1jXah8OYyJbCN29Fg=="
HEADERS_IN_PACKAGE = "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers/"


def header_cache() -> Path:
    """``~/.cache/lade-export/ort-include``: where :func:`fetch_headers` puts the headers."""
    return Path.home() / ".cache" / "lade-export" / "ort-include"


def fetch_headers(dest: str | Path | None = None, url: str | None = None, timeout: float = 60.0) -> Path:
    """Download ONNX Runtime's C/C++ API headers (the ``*.h`` of :data:`HEADERS_PACKAGE`'s
    tarball, ~150 MB, checked against :data:`HEADERS_SHA512`) into ``dest`` (default
    :func:`header_cache`), written to a temporary folder beside it and renamed; nothing is
    fetched when ``dest`` already holds them.

    Args:
        dest: target folder.
        url: the tarball (default :data:`HEADERS_URL`; any URL urllib opens, ``file://`` too).
        timeout: seconds for the connection.

    Returns:
        ``dest``.

    Raises:
        BackendUnavailableError: the download failed (offline, HTTP error), the tarball's
            sha512 is not the pinned one, or it holds no ``onnxruntime_cxx_api.h``.
    """
    import urllib.request

    dest = Path(dest) if dest is not None else header_cache()
    if (dest / HEADER).is_file():
        return dest
    url = url or HEADERS_URL
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ort-headers-", dir=dest.parent) as work:
        tarball = Path(work) / "package.tgz"
        digest = hashlib.sha512()
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tarball, "wb") as out:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", None) or err
            raise BackendUnavailableError(
                f"--kernels lade needs ONNX Runtime's C/C++ headers and could not download them ({HEADERS_PACKAGE} "
                f"from {url}: {str(reason).splitlines()[0] if str(reason) else type(err).__name__}); connect, or set "
                f"$LADE_ORT_INCLUDE to a folder holding {HEADER}") from None
        got = base64.b64encode(digest.digest()).decode()
        if got != HEADERS_SHA512:
            raise BackendUnavailableError(f"the ONNX Runtime headers' tarball from {url} has sha512 {got}, not the "
                                          f"pinned {HEADERS_SHA512}; nothing was installed")
        staged = Path(work) / "include"
        staged.mkdir()
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar:
                name = member.name[len(HEADERS_IN_PACKAGE):] if member.name.startswith(HEADERS_IN_PACKAGE) else ""
                if member.isfile() and name.endswith(".h") and "/" not in name:
                    (staged / name).write_bytes(tar.extractfile(member).read())
        if not (staged / HEADER).is_file():
            raise BackendUnavailableError(f"the tarball from {url} holds no {HEADERS_IN_PACKAGE}{HEADER}")
        if (dest / HEADER).is_file():  # another build got there first
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        staged.replace(dest)
    return dest


def headers_to_fetch() -> bool:
    """Whether a ``--kernels lade`` build would download the headers first: neither
    ``$LADE_ORT_INCLUDE`` is set nor :func:`header_cache` holds them."""
    return not os.environ.get("LADE_ORT_INCLUDE") and not (header_cache() / HEADER).is_file()


def header_dir(fetch: bool = True) -> Path:
    """Directory holding ONNX Runtime's C/C++ API headers: ``$LADE_ORT_INCLUDE`` when set,
    else :func:`header_cache`, which :func:`fetch_headers` fills when empty and ``fetch``.

    Raises:
        BackendUnavailableError: ``$LADE_ORT_INCLUDE`` is set and lacks ``onnxruntime_cxx_api.h``;
            the cache lacks it and ``fetch`` is false; or fetching failed (:func:`fetch_headers`).
    """
    named = os.environ.get("LADE_ORT_INCLUDE")
    if named:  # a directory the user named is the only one looked at
        if (Path(named) / HEADER).is_file():
            return Path(named)
        raise BackendUnavailableError(f"$LADE_ORT_INCLUDE is {named}, which holds no {HEADER}; point it at ONNX "
                                      f"Runtime's include/ folder, or unset it to let the build download them")
    cached = header_cache()
    if (cached / HEADER).is_file():
        return cached
    if not fetch:
        raise BackendUnavailableError(
            f"--kernels lade needs ONNX Runtime's C/C++ headers ({HEADER}) in $LADE_ORT_INCLUDE or "
            f"~/.cache/lade-export/ort-include; a build downloads them ({HEADERS_PACKAGE}, ~150 MB)")
    return fetch_headers(cached)


def find_compiler() -> str:
    """``$CXX`` (a name on the PATH or a path), else g++ or c++ on the PATH.

    Raises:
        BackendUnavailableError: ``$CXX`` is not an executable, or no compiler is found.
    """
    named = os.environ.get("CXX")
    if named:
        found = shutil.which(named)
        if not found:
            raise BackendUnavailableError(f"$CXX is {named!r}, which is not an executable compiler; unset it or fix it")
        return found
    compiler = shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise BackendUnavailableError("--kernels lade compiles a C++ library at build time: no g++ (or $CXX) found")
    return compiler


#: CPU features the fast path needs (``/proc/cpuinfo`` flag names).
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c")


#: CPU features the integer path's AVX2 form needs (below it: portable C++).
AVX2_FLAGS = ("avx2", "fma", "f16c")


def _cpu_has(wanted, cpuinfo) -> bool | None:
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return None if flags is None else all(f in flags for f in wanted)


def cpu_has_avx512(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU runs the float32-compute kernels' AVX-512 path (None: unknown, no
    ``/proc/cpuinfo``). Without it they take a portable path that is much slower
    (bench/results/design-figures.md, *Kernels*)."""
    return _cpu_has(AVX512_FLAGS, cpuinfo)


def cpu_has_avx2(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU runs at least the integer path's AVX2 form (None: unknown)."""
    return _cpu_has(AVX2_FLAGS, cpuinfo)


def require_toolchain(fetch: bool = True) -> bool:
    """Check that :func:`compile_library` can run (a compiler and the headers, downloaded now
    when missing and ``fetch``), before a build starts.

    Returns:
        whether the headers are at hand (False only when ``fetch`` is false and the cache,
        the only place looked at, lacks them: a build would download them).

    Raises:
        BackendUnavailableError: as :func:`find_compiler` and :func:`header_dir` do.
    """
    find_compiler()
    if not fetch and headers_to_fetch():
        return False
    header_dir(fetch)
    return True


def _library(path: str | Path):
    import ctypes

    lib = ctypes.CDLL(str(Path(path).resolve()))
    lib.lade_kernels_path.restype = ctypes.c_char_p
    lib.lade_kernels_path.argtypes = [ctypes.c_int]
    lib.lade_kernels_paths.restype = ctypes.c_char_p
    return lib


def library_paths(path: str | Path) -> dict:
    """The paths a compiled library holds and whether this process can take each.

    Returns:
        ``{"int8": {"amx": bool, "avx512vnni": …, "avxvnni": …, "avx2": …, "portable": True},
        "float32": {"avx512": bool, "portable": True}}`` (AMX: the CPU has it and Linux granted
        the tile state).

    Raises:
        OSError: ``path`` is not a loadable library, or one without these functions (a
            library built before the integer path: AttributeError).
    """
    pairs = dict(item.split(":") for item in _library(path).lade_kernels_paths().decode().split(","))
    return {"int8": {name: pairs[name] == "1" for name in PATHS["int8"]},
            "float32": {"avx512": pairs["avx512"] == "1", "portable": True}}


def running_path(path: str | Path, compute: str) -> str:
    """The path the library at ``path`` takes in this process for ``compute`` (``"int8"`` or
    ``"float32"``): a name of :data:`PATHS`, or ``"error: …"`` when ``$LADE_KERNELS_PATH``
    cannot be honoured (then sessions on it fail to load). Chosen once per process (the
    library reads the environment on first use)."""
    try:
        return _library(path).lade_kernels_path(1 if compute == "int8" else 0).decode()
    except AttributeError:  # a library built before the paths were reported: float32 compute only
        return "not reported (a library built before the integer path: avx512 or portable)"


def _run_compiler(command: list) -> tuple[int, str]:
    """Run the compiler and return ``(exit status, stderr)``. When the wait is interrupted
    (SIGINT or SIGTERM sent to this process alone: a KeyboardInterrupt here) the processes
    the driver started (``cc1plus``, ``as``) are ended before the driver itself: ending the
    driver alone would leave them compiling. The compiler stays in this process group, so a
    signal to the whole group (a terminal's Ctrl-C) reaches it as before."""
    import signal

    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate()
    except BaseException:
        if proc.poll() is not None:  # already reaped (the interrupt came as it ended): its PID may be another's now
            raise
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    return proc.returncode, stderr


def _descendants(pid: int) -> list[int]:
    """The processes descended from ``pid``, deepest first, read from Linux's ``/proc``
    (elsewhere none)."""
    parent_of = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parent_of.items() if parent in frontier]
        found += frontier
    return found[::-1]


def compile_library(dest: str | Path) -> Path:
    """Compile ``block_quant_ops.cc`` into the shared library ``dest`` (written to a
    temporary name, then renamed). Takes ~10 s.

    Raises:
        BackendUnavailableError: no C++ compiler, no headers, or the compiler failed (its
            first error line is in the message).
    """
    dest = Path(dest)
    compiler = find_compiler()
    include = header_dir()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".compiling-", suffix=".so", dir=dest.parent)
    os.close(fd)
    # -ffp-contract=off: no FMA the source does not write, so every path's float epilogue is the same
    # -pipe: the stages pass the assembly through pipes, so an interrupted compile leaves no /tmp/cc*.s
    command = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off",
               "-Wno-maybe-uninitialized", "-pipe",
               f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        returncode, stderr = _run_compiler(command)
        if returncode:
            first = next((line for line in stderr.splitlines() if "error" in line), stderr.strip()[:200])
            raise BackendUnavailableError(f"compiling the lade kernels failed: "
                                          f"{first or f'{compiler} exited with status {returncode}, printing nothing'}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest
