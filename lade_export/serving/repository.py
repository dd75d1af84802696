"""``lade-export triton``: write a Triton Inference Server model repository entry for an artifact.

Layout written (``REPO`` may hold other models; only ``REPO/<name>`` is touched)::

    REPO/<name>/config.pbtxt       Python backend, decoupled, instance_group, inputs/outputs
                                   (lade_export.serving.protocol), parameters (settings)
    REPO/<name>/lade_export.json   provenance: artifact, settings, lade-export version
    REPO/<name>/1/model.py         the adapter (lade_export/serving/triton_model.py)
    REPO/<name>/1/artifact/        only with copy_artifact=True

The artifact is **referenced** by default: ``artifact_dir`` holds its absolute path (or
``artifact_path``, the path the server will see, e.g. a volume mounted in the
container), because an artifact is large (SmolLM2-135M: 540 MB of float32 weights), is
immutable and checksummed, and production servers mount it; each instance verifies it
on load. ``copy_artifact=True`` puts it inside the version directory (hard links where
the filesystem allows, else copies), for repositories that must be self-contained (cloud
object stores, which Triton downloads whole, or shipping one directory).

The entry is written to a temporary sibling and renamed into place, so a half-written
model never appears in the repository.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from pathlib import Path

from ..artifact import Artifact, atomic_directory
from ..errors import ServingError
from ..profile import resolve_profile
from .protocol import GREEDY, INPUTS, OUTPUTS, ServingSettings

#: The provenance file of a written model; ``--force`` replaces only directories that have one.
MARKER = "lade_export.json"
TEMPLATE = Path(__file__).with_name("triton_model.py")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def default_model_name(artifact: Artifact) -> str:
    """The model name from the artifact's source (``stories260K``, ``smollm2-135m-instruct`` …)."""
    source = str(artifact.spec.source.model or "") or artifact.root.name
    stem = Path(source.rstrip("/")).name
    stem = re.sub(r"\.(gguf|safetensors)$", "", stem)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "model"
    return name[:128]


def _quote(text: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _tensor(spec, optional: bool) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    extra = " optional: true" if optional else ""
    return f"  {{ name: {_quote(spec.name)} data_type: {spec.data_type} dims: [ {dims} ]{extra} }}"


def render_config(name: str, settings: ServingSettings, instances: int) -> str:
    """The ``config.pbtxt`` text (protobuf text format of Triton's ``ModelConfig``).

    Args:
        name: the model name (the directory name).
        settings: kept as ``parameters`` (strings).
        instances: ``instance_group`` count (per GPU for ``KIND_GPU``).
    """
    kind = "KIND_GPU" if settings.device == "cuda" else "KIND_CPU"
    lines = [
        "# Written by lade-export triton; see docs/serving.md. One request = one generation,",
        "# streamed: one response per decode step (decoupled transaction policy).",
        f"name: {_quote(name)}",
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "input [",
        ",\n".join(_tensor(s, s.optional) for s in INPUTS),
        "]",
        "output [",
        ",\n".join(_tensor(s, False) for s in OUTPUTS),
        "]",
        f"instance_group [ {{ count: {instances} kind: {kind} }} ]",
    ]
    for key, value in settings.to_parameters().items():
        lines.append(f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}")
    return "\n".join(lines) + "\n"


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_model_repository(artifact_dir, repository, *, name: str | None = None, instances: int = 1,
                           profiles=(), backend: str = "ort", device: str | None = None,
                           max_new_tokens_limit: int | None = None, default_max_new_tokens: int | None = None,
                           max_concurrent_requests: int = 8, threads: int = 0, copy_artifact: bool = False,
                           artifact_path: str | None = None, force: bool = False, batching: bool | None = None,
                           token_budget: int | None = None, kv_tokens: int | None = None,
                           width_policy: str | None = None) -> Path:
    """Write ``repository/<name>`` serving the artifact at ``artifact_dir``.

    Args:
        artifact_dir: a built artifact (``lade-export build --out``).
        repository: the model repository (created if missing; other models are kept).
        name: the model name (default: from the artifact's source, :func:`default_model_name`).
        instances: model instances (one Triton stub process each; per GPU with ``cuda``).
        profiles: profiles clients may name (shipped names, TOML paths, ``W,N,G[,K[,B]]``); the
            first is the default. Empty: the artifact's built profiles and its default.
            ``greedy`` is always served.
        backend: ``ort`` or ``tensorrt`` (each request on the artifact's engine that covers its
            profile).
        device: ``cpu`` or ``cuda`` (default: cpu for ort, cuda for tensorrt).
        max_new_tokens_limit: the most new tokens a request may ask for (default: the
            context minus one; the prompt and new tokens must fit the context anyway).
        default_max_new_tokens: for requests that give none (default: min(256, limit)).
        max_concurrent_requests: requests decoded at once per instance (with batching:
            the scheduler's ``max_batch``, the most requests that share a pass).
        threads: engine threads per instance (0: the engine's default).
        copy_artifact: put the artifact inside the repository instead of referencing it.
        artifact_path: the artifact's path as the server sees it (a mounted volume);
            default: its absolute path here. Not with ``copy_artifact``.
        force: replace an existing ``repository/<name>`` written by this command.
        batching: each instance runs its requests through one
            :class:`lade_export.scheduler.Scheduler` (default: True for ort; the tensorrt
            backend serves without it).
        token_budget: the scheduler's rows per pass that holds decode steps (default
            :data:`lade_export.scheduler.TOKEN_BUDGET`); with batching only.
        kv_tokens: the most tokens an instance's KV pool holds over its requests
            (default: the scheduler's, ``max_concurrent_requests`` × context); with
            batching only.
        width_policy: how wide the scheduler makes each request's lookahead step,
            ``adaptive`` (default) or ``profile`` (:mod:`lade_export.width_policy`); with
            batching only.

    Returns:
        The model directory.

    Raises:
        ArtifactError: the artifact is missing or damaged; ``<name>`` exists (without
            ``force``) or was not written by this command.
        ProfileError: a profile is invalid or does not fit the model's context.
        ServingError: ``repository`` is a file; a bad name, instance count, limit, backend/device combination,
            ``artifact_path`` together with ``copy_artifact``, or ``token_budget`` /
            ``kv_tokens`` / ``width_policy`` without batching, or an unknown ``width_policy``.
    """
    artifact = Artifact(artifact_dir)
    if Path(repository).exists() and not Path(repository).is_dir():
        raise ServingError(f"--out {repository} is a file; give the model repository's folder (created if missing)")
    name = name or default_model_name(artifact)
    if not _NAME.match(name):
        raise ServingError(f"model name {name!r} must be letters, digits, '.', '_' or '-' (it names a directory)")
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise ServingError(f"--instances must be ≥ 1, got {instances!r}")
    device = device or ("cuda" if backend == "tensorrt" else "cpu")
    if backend == "tensorrt" and device != "cuda":
        raise ServingError("the tensorrt backend runs on cuda; drop --device cpu or use --backend ort")
    if backend == "tensorrt" and not artifact.spec.engines:
        raise ServingError(f"{artifact.root} has no TensorRT engines; build it with --engine tensorrt, or serve "
                           "with --backend ort")
    if copy_artifact and artifact_path:
        raise ServingError("give --artifact-path or --copy-artifact, not both")
    if batching is None:
        batching = backend != "tensorrt"
    if not batching:
        for flag, value in (("--token-budget", token_budget), ("--kv-tokens", kv_tokens),
                            ("--width-policy", width_policy)):
            if value is not None:
                why = "--no-batching" if backend != "tensorrt" else "the tensorrt backend, which serves without one"
                raise ServingError(f"{flag} is an option of the scheduler, and this model has none ({why})")

    if profiles:
        resolved = [resolve_profile(p) for p in profiles]
        default = resolved[0].name
    else:
        resolved = artifact.profiles()
        built_default = artifact.default_profile()
        default = built_default.name if built_default is not None else GREEDY
    served = {}
    for prof in resolved:
        if prof.name in served:
            raise ServingError(f"profile {prof.name!r} is given twice; each --profile needs its own name")
        prof.check_fits(artifact.max_context)
        served[prof.name] = prof

    context = artifact.max_context
    limit = context - 1 if max_new_tokens_limit is None else max_new_tokens_limit
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= context - 1:
        raise ServingError(f"--max-new-tokens-limit must be between 1 and {context - 1} (the model's context is "
                           f"{context} tokens), got {limit}")
    settings = ServingSettings(
        artifact_dir="artifact" if copy_artifact else (artifact_path or str(artifact.root.resolve())),
        profiles=served,
        default_profile=default,
        backend=backend,
        device=device,
        threads=threads,
        max_new_tokens_limit=limit,
        default_max_new_tokens=min(256, limit) if default_max_new_tokens is None else default_max_new_tokens,
        max_concurrent_requests=max_concurrent_requests,
        batching=batching,
        **({} if token_budget is None else {"token_budget": token_budget}),
        kv_tokens=kv_tokens or 0,
        **({} if width_policy is None else {"width_policy": width_policy}),
    )

    from .. import __version__

    out = Path(repository) / name
    with atomic_directory(out, force=force, marker=MARKER, what="a model written by lade-export triton") as tmp:
        (tmp / "config.pbtxt").write_text(render_config(name, settings, instances), encoding="utf-8")
        version = tmp / "1"
        version.mkdir()
        shutil.copyfile(TEMPLATE, version / "model.py")
        if copy_artifact:
            shutil.copytree(artifact.root, version / "artifact", copy_function=_link_or_copy)
        provenance = {
            "written_by": f"lade-export {__version__} triton",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "artifact": {
                "path": str(artifact.root.resolve()),
                "served_as": settings.artifact_dir,
                "copied": copy_artifact,
                "source_model": artifact.spec.source.model,
            },
            "instances": instances,
            "parameters": settings.to_parameters(),
        }
        (tmp / MARKER).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    return out.resolve()


def serve_hints(repository) -> list[str]:
    """How to serve ``repository``: with ``tritonserver`` when one is on PATH; else with the
    local runner (the ``nvidia-pytriton`` wheel's server, which needs its backend directory
    and environment assembled, so it is not run directly) and in the NGC Triton container."""
    import importlib.util

    from .local import PYTRITON_PIN

    repo = Path(repository)
    if shutil.which("tritonserver"):
        return [f"serve with: tritonserver --model-repository {repo}"]
    wheel = "installed" if importlib.util.find_spec("pytriton") else f"pip install --no-deps {PYTRITON_PIN}"
    return [f"serve with: python -m lade_export.serving.local {repo}  (this machine: the tritonserver of the "
            f"nvidia-pytriton wheel, {wheel})",
            f"       or: tritonserver --model-repository {repo}  (in the NGC container "
            "nvcr.io/nvidia/tritonserver:<yy.mm>-py3 with lade-export installed; docs/serving.md)"]
