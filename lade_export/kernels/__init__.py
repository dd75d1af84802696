"""This project's block-quantized weight kernels for ONNX Runtime (``build --kernels lade``).

``block_quant_ops.cc`` is an ONNX Runtime custom-op library (ONNX Runtime docs, "Custom
operators": a shared library exporting ``RegisterCustomOps``, loaded with
``SessionOptions.register_custom_ops_library``) with two operators in the domain
``lade_export``:

* ``MatMulBlockQ(X float[..., K], Q uint8[N/16, K/32, 64·bits], D float16[N/16, K/32, 16],
  M float16[N/16, K/32, 16]) -> float[..., N]`` (attribute ``N``): a MatMul whose weight is
  stored in blocks of 32 along K with ``bits`` ∈ {4, 8} per weight, ``w = D·code + M`` —
  GGML's Q4_1 blocks (``M`` the block minimum) and, for Q8_0's symmetric blocks, ``code =
  q + 128`` with ``M = −128·D``;
* ``GatherBlockQ(Q, D, M, ids int64[...]) -> float[..., K]`` (attribute ``N``): rows of the
  same table, i.e. a tied token embedding read from the LM head's own tensors.

They compute in float32, and each output row only from its own input row in a fixed order,
so a token's logits are bit for bit the same in a one-token step and in a many-token step:
lookahead stays exact (ONNX Runtime's ``MatMulNBits`` either computes in float32 slowly or
rounds activations to int8 differently for one row and for several; see
:mod:`lade_export.quantize`). The packed layout puts 16 output columns in the 32-bit lanes of
a 512-bit vector (:func:`lade_export.quantize.pack_block_lanes`), so the AVX-512 path
dequantizes with one AND and one conversion per 16 weights; other CPUs take a portable path.

The library is compiled at build time (g++ or ``$CXX``, C++17) against ONNX Runtime's C/C++
API headers — found in ``$LADE_ORT_INCLUDE`` or ``~/.cache/lade-export/ort-include``
(``bash scripts/fetch_ort_headers.sh`` puts them there) — and shipped inside the artifact,
so decoding needs neither a compiler nor the headers. API version 29 (ONNX Runtime 1.29) or
later is required at run time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import BackendUnavailableError

#: ``--kernels``: ONNX Runtime's own ``MatMulNBits``, or this project's.
KERNELS = ("onnxruntime", "lade")
#: File name of the compiled library inside an artifact (``graph.custom_ops`` in the manifest).
LIBRARY = "kernels/liblade_kernels.so"
#: The custom-op domain of the operators.
DOMAIN = "lade_export"
SOURCE = Path(__file__).with_name("block_quant_ops.cc")
HEADER = "onnxruntime_cxx_api.h"


def header_dir() -> Path:
    """Directory holding ONNX Runtime's C/C++ API headers.

    Raises:
        BackendUnavailableError: ``$LADE_ORT_INCLUDE`` is set and lacks ``onnxruntime_cxx_api.h``,
            or it is unset and ``~/.cache/lade-export/ort-include`` lacks it.
    """
    named = os.environ.get("LADE_ORT_INCLUDE")
    if named:  # a directory the user named is the only one looked at
        if (Path(named) / HEADER).is_file():
            return Path(named)
        raise BackendUnavailableError(f"$LADE_ORT_INCLUDE is {named}, which holds no {HEADER}; point it at ONNX "
                                      f"Runtime's include/ folder, or unset it and run `bash scripts/fetch_ort_headers.sh`")
    cached = Path.home() / ".cache" / "lade-export" / "ort-include"
    if (cached / HEADER).is_file():
        return cached
    raise BackendUnavailableError(
        f"--kernels lade needs ONNX Runtime's C/C++ headers ({HEADER}) in $LADE_ORT_INCLUDE or "
        f"~/.cache/lade-export/ort-include; run `bash scripts/fetch_ort_headers.sh`")


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


def cpu_has_avx512(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU runs the kernels' AVX-512 path (None: unknown, no ``/proc/cpuinfo``).
    Without it they take a portable path that is about 12× slower (measured on SmolLM2)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return None if flags is None else all(f in flags for f in AVX512_FLAGS)


def require_toolchain() -> None:
    """Check that :func:`compile_library` can run (a compiler and the headers), before a build
    starts. Raises BackendUnavailableError as they do."""
    find_compiler()
    header_dir()


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
    command = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wno-maybe-uninitialized",
               f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
            raise BackendUnavailableError(f"compiling the lade kernels failed: "
                                          f"{first or f'{compiler} exited with status {done.returncode}, printing nothing'}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest
