"""The transformers peers of ``lade-export compare``: transformers' own ``generate`` run on
the float32 weights of the artifact's source model, on our prompt token ids as they are.

* ``transformers-greedy``: greedy (or, under sampling, sampling with the same
  temperature / top-k / top-p).
* ``transformers-prompt-lookup``: prompt lookup decoding with :data:`PROMPT_LOOKUP_TOKENS`
  draft tokens; ``compare`` checks it against ``transformers-greedy``.

A GGUF source (SmolLM2's shipped Q4_1 file, or any ``.gguf``) is not run from the GGUF
itself: a model left by transformers' GGUF loader decodes markedly slower than the same
weights loaded from a Hugging Face directory (figures in
``bench/results/transformers-peer.md``), so the GGUF is converted once (dequantized to
float32, ``save_pretrained``) into a cache folder keyed by the GGUF's sha256
(:func:`fp32_hf_dir`) and loaded from there.

Timings follow :mod:`lade_export.evaluation.peer_output`: the prefill emits the first new
token (read from a streamer), decode covers the rest. torch and transformers are imported
only when a peer is loaded or run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from .peer_output import PeerOutput

TRANSFORMERS_PEERS = ("transformers-greedy", "transformers-prompt-lookup")
PROMPT_LOOKUP_TOKENS = 10


def cache_root() -> Path:
    """Cache folder of lade-export: ``$LADE_CACHE``, else ``$XDG_CACHE_HOME/lade-export``,
    else ``~/.cache/lade-export``."""
    if os.environ.get("LADE_CACHE"):
        return Path(os.environ["LADE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lade-export"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fp32_hf_dir(gguf: Path, cache: Path | None = None) -> Path:
    """A Hugging Face directory holding ``gguf``'s weights in float32, made once.

    The GGUF is loaded with transformers' GGUF loader (dequantized to float32, see
    :mod:`lade_export.export.model_source`) and written with ``save_pretrained`` (model, generation
    config, tokenizer) into ``cache/hf-fp32/<sha256 of the GGUF>``, through a temporary
    sibling renamed into place; later calls reuse it.

    Raises:
        ModelSourceError: the GGUF cannot be loaded.
    """
    from ..export.model_source import load_model

    gguf = Path(gguf)
    target = (cache or cache_root()) / "hf-fp32" / file_sha256(gguf)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    loaded = load_model(str(gguf))
    model = loaded.model
    # transformers marks a GGUF-loaded model as "quantized with gguf" and refuses to save it, though its
    # weights are already dequantized float32 tensors: drop the marker so it saves as a plain checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name[:12]}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf.resolve()}\n", encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            os.replace(tmp, target)
        except OSError:  # another process made it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_transformers_peer(source: str):
    """The transformers model the transformers peers run, in its fastest float32 form.

    Args:
        source: the artifact's ``source.model`` (built-in name, HF directory, GGUF path or hub id).

    Returns:
        ``(model, form)``: a float32 causal LM in eval mode, and a description of where it was
        loaded from (for the run's metadata).

    Raises:
        ModelSourceError: the source cannot be resolved or loaded.
    """
    from ..export.model_source import classify_source, load_model

    kind, location = classify_source(source)
    if kind in ("builtin", "gguf"):
        folder = fp32_hf_dir(Path(location))
        return load_model(str(folder)).model, f"float32 HF directory {folder} (made from {Path(location).name})"
    return load_model(source).model, f"{kind} {location}"


class _FirstTokenClock:
    """transformers streamer that notes when the first new token arrives (end of prefill)."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def run_transformers_peer(model, name: str, prompt_ids: list, max_new_tokens: int, stop_ids: list,
                          sampling=None) -> PeerOutput:
    """Run a transformers ``generate`` peer on our prompt ids.

    Decode time runs from the first new token to the end (the peer's prefill emits the
    first token), so decode tokens are ``new − 1``. With ``sampling`` (temperature > 0)
    the peer samples with the same temperature / top-k / top-p, seeded by ``torch.manual_seed``.

    Args:
        model: the causal LM from :func:`load_transformers_peer`.
        name: a name from :data:`TRANSFORMERS_PEERS`.
        prompt_ids: our prompt token ids (ints; fed as one int64 row of shape ``[1, len]``).
        max_new_tokens: new tokens at most.
        stop_ids: end-of-generation token ids (empty: run to ``max_new_tokens``).
        sampling: :class:`lade_export.sampling.SamplingParams`, or None for greedy.

    Returns:
        :class:`PeerOutput` with ``token_ids`` set and ``text`` None.
    """
    import torch

    ids = torch.tensor([prompt_ids])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_ids or None,
                  pad_token_id=(stop_ids or [0])[0], attention_mask=torch.ones_like(ids))
    if sampling is not None and not sampling.greedy:
        torch.manual_seed(sampling.seed or 0)
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                      top_p=sampling.top_p)
    if name == "transformers-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, streamer=clock, **kwargs)
    t1 = time.perf_counter()
    new = out[0, len(prompt_ids):].tolist()
    first = clock.first or t1
    # forward passes: the streamer gets the prompt, then one call per pass (the prefill pass emits the first token)
    return PeerOutput(new, None, len(new), max(clock.calls - 1, 1), first - t0, t1 - first)
