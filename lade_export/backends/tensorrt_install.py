"""Which TensorRT is installed here: its importable modules, their versions, and what is
missing to run (or, for :mod:`lade_export.export.tensorrt_build`, to build) engines.

Both halves of the TensorRT path need these answers (the run-time engine also asks
whether an engine built elsewhere runs here, :func:`check_engine_entry`) — the run-time engine
(:mod:`lade_export.backends.tensorrt`) and the builder on the export side, which imports
this module (never the other way round) — so they live apart from either.

Versions: the TensorRT 10 and 11 Python APIs (:data:`SUPPORTED_MAJORS`); any other major
is refused with one line. Runtimes: the full ``tensorrt`` module (builder, ONNX parser and
runtime), or the lean runtime (``tensorrt_lean``, from PyPI's ``tensorrt-lean`` wheels)
or the dispatch runtime (``tensorrt_dispatch``), which deserialize only engines built
with ``--version-compatible`` and have no builder (:data:`RUNTIME_MODULES`). TensorRT is
optional: it is imported only inside functions.
"""

from __future__ import annotations

import importlib

from ..errors import ArtifactError, BackendUnavailableError

SUPPORTED_MAJORS = (10, 11)
#: Importable module names of a TensorRT runtime, in order of preference, and their kind.
RUNTIME_MODULES = (("tensorrt", "full"), ("tensorrt_lean", "lean"), ("tensorrt_lean_bindings", "lean"),
                   ("tensorrt_dispatch", "dispatch"), ("tensorrt_dispatch_bindings", "dispatch"))
FULL_HINT = ("the full TensorRT builds and runs engines: pip install 'lade-export[tensorrt]' "
             "(tensorrt from NVIDIA's index pypi.nvidia.com, on a machine with an NVIDIA GPU)")
LEAN_HINT = ("the lean runtime only runs engines built with --version-compatible: "
             "pip install 'lade-export[tensorrt-lean]' (tensorrt-lean and cuda-bindings, from PyPI)")


def import_module(name: str):
    """The TensorRT module ``name`` (one of :data:`RUNTIME_MODULES`), None when it is not
    installed.

    Raises:
        BackendUnavailableError: it is installed but cannot be imported (a placeholder
            wheel, a missing libnvinfer), naming the package to install.
    """
    hint = FULL_HINT if name == "tensorrt" else LEAN_HINT
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.startswith(err.name.split(".")[0]):
            return None
        raise BackendUnavailableError(f"{name} cannot be imported (missing {err.name}); {hint}") from None
    except Exception as err:  # noqa: BLE001 - placeholder wheels raise anything on import
        first = str(err).splitlines()[0] if str(err) else ""
        raise BackendUnavailableError(f"{name} cannot be imported ({type(err).__name__}: {first}); {hint}") from None


def version_of(module) -> tuple[int, int]:
    """(major, minor) of a TensorRT module's ``__version__``."""
    parts = str(module.__version__).split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def check_version(module) -> int:
    """The module's major version, when lade-export supports it.

    Raises:
        BackendUnavailableError: a TensorRT other than 10.x or 11.x.
    """
    major = version_of(module)[0]
    if major not in SUPPORTED_MAJORS:
        raise BackendUnavailableError(
            f"TensorRT {module.__version__} is not supported: lade-export builds and runs engines with TensorRT 10 or 11 "
            "(pip install 'tensorrt>=10,<12')")
    return major


def import_runtime(kind: str | None = None):
    """``(module, kind)`` of the first installed TensorRT runtime (full, lean, dispatch),
    or of the given ``kind``.

    Raises:
        BackendUnavailableError: none installed (naming the full and lean packages), or
            an unsupported version.
    """
    for name, k in RUNTIME_MODULES:
        if kind not in (None, k):
            continue
        module = import_module(name)
        if module is not None:
            check_version(module)
            return module, k
    wanted = f"the TensorRT {kind} runtime is" if kind else "TensorRT is"
    raise BackendUnavailableError(f"{wanted} not installed; {LEAN_HINT}; {FULL_HINT}")


def installed_runtimes(kinds=("full", "lean", "dispatch")) -> list[str]:
    """Names of the importable TensorRT modules of ``kinds`` (broken installs left out)."""
    found = []
    for name, kind in RUNTIME_MODULES:
        try:
            if kind in kinds and import_module(name) is not None:
                found.append(name)
        except BackendUnavailableError:
            pass
    return found


def installed_tensorrt_major() -> int | None:
    """Major version of the installed TensorRT (the full module, else a runtime), None if none."""
    names = installed_runtimes()
    return version_of(importlib.import_module(names[0]))[0] if names else None


def tensorrt_unavailable_reason(importer=None) -> str | None:
    """None when TensorRT can run engines here with a CUDA GPU, else a one-line reason
    with the fix.

    Args:
        importer: what must import, a callable raising BackendUnavailableError; None:
            :func:`import_runtime` (any runtime). The builder passes its own
            (:func:`lade_export.export.tensorrt_build.builder_unavailable_reason`).
    """
    from .cuda import cuda_unavailable_reason

    try:
        (importer or import_runtime)()
    except BackendUnavailableError as err:
        return str(err)
    reason = cuda_unavailable_reason()
    return f"TensorRT is installed but {reason}" if reason else None


def check_engine_entry(entry, module, kind: str, capability: str) -> None:
    """Refuse an engine the installed runtime cannot run.

    Args:
        entry: its :class:`lade_export.manifest.EngineEntry`.
        module: the TensorRT runtime module (:func:`import_runtime`), ``kind`` its kind.
        capability: the GPU's compute capability (``"9.0"``).

    Raises:
        ArtifactError: the entry lacks its lookahead profile or optimization profiles, or
            the engine was built for another GPU (and not ``--hardware-compatible``) or
            with another TensorRT (an earlier or different one for a
            ``--version-compatible`` engine, any other for the rest).
        BackendUnavailableError: a lean or dispatch runtime and an engine built without
            ``--version-compatible``.
    """
    file, version = entry.file, str(module.__version__)
    if entry.lookahead_profile is None or entry.optimization_profiles is None:
        raise ArtifactError(f"engine {file}: its manifest entry lacks its lookahead profile or optimization "
                            "profiles; rebuild with lade-export build --engine tensorrt")
    built = entry.tensorrt_version or "?"
    vc = bool(entry.version_compatible)
    if kind != "full" and not vc:
        raise BackendUnavailableError(
            f"{file} was built without --version-compatible, which the {kind} runtime "
            f"({module.__name__}) needs; rebuild with --version-compatible, or install the full TensorRT "
            "(pip install 'lade-export[tensorrt]')")
    if entry.compute_capability != capability and not entry.hardware_compatible:
        raise ArtifactError(
            f"engine {file} was built for compute capability {entry.compute_capability}, this GPU is "
            f"{capability}; rebuild it here or with --hardware-compatible")
    same = built.split(".")[:3] == version.split(".")[:3]
    later = version_of(module) >= tuple(int(x) for x in built.split(".")[:2]) if built != "?" else False
    if not (same or (vc and later)):
        need = "this exact version" if not vc else "this version or a later one"
        raise ArtifactError(
            f"engine {file} was built with TensorRT {built} and needs {need}; this runtime is {version}: "
            "rebuild it here" + ("" if vc else " (or build with --version-compatible)"))
