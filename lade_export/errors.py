"""Typed errors of lade-export.

Every error a user can cause derives from :class:`LadeError`; the CLI prints its
message as one line and exits with status 2 (1 for a failed check such as a parity or
exactness mismatch). The message is written for the user: it names what was wrong and,
where there is one, what to do.
"""

from __future__ import annotations


class LadeError(Exception):
    """Base class of every user-facing error. ``str(err)`` is a one-line message."""

    exit_code = 2


class ModelSourceError(LadeError):
    """The ``--model`` source cannot be resolved or loaded (missing path, not LLaMA, offline hub id, corrupt weights)."""


class ProfileError(LadeError):
    """A lookahead profile is invalid (missing file, TOML syntax, unknown key, out-of-range value)."""


class BuildOptionError(LadeError):
    """A build's options do not go together or do not fit the model (e.g. ``--engine tensorrt``
    with ``--kernels lade``, ``--block-size`` on a float32 build, a head width
    ``--attention group-query-attention`` cannot take); raised before anything is written,
    by :func:`lade_export.export.build.build_artifact` and the CLI alike."""


class ArtifactError(LadeError):
    """An artifact directory is missing, incomplete, from another schema version, or fails its checksums."""


class GenerationError(LadeError):
    """A generation request cannot be served (empty prompt without BOS, context exceeded, bad max-new-tokens)."""


class EngineError(LadeError):
    """An engine failed while running a step (the backend's own error, reworded in one line)."""

    exit_code = 1


class BackendUnavailableError(LadeError):
    """An optional backend (TensorRT, CUDA) is not installed or has no device to run on."""


class PeerError(LadeError):
    """A comparison peer cannot run: llama.cpp's binaries or GGUF missing, or a peer asked to
    sample that runs greedy only."""


class CheckFailedError(LadeError):
    """A numerical check failed: parity beyond tolerance, or lookahead output differing from greedy."""

    exit_code = 1


class ServingError(LadeError):
    """A Triton model repository cannot be written, or a served model's parameters are invalid."""


def interrupted_after_build(out) -> str:
    """The message of an interrupt that lands once ``out`` holds the complete new build (the
    CLI prints it as ``error: …`` and exits 130): said by the build's replacement of ``out``,
    by ``lade-export build``/``export`` and by the CLI's interrupt handlers alike."""
    return f"{INTERRUPTED_AFTER_BUILD} {out}"


INTERRUPTED_AFTER_BUILD = "interrupted after the new build was written to"
