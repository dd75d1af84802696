"""Comparison peers for ``lade-export compare``: other implementations run on the same
model and prompts, inside the same interleaved loop as our configurations.

Peers (names as given to ``--peer``):

* ``transformers-greedy`` and ``transformers-prompt-lookup`` — transformers' own
  ``generate`` (greedy; prompt lookup decoding with :data:`PROMPT_LOOKUP_TOKENS` draft
  tokens) on the float32 weights of the artifact's source model. A GGUF source is not run
  from the GGUF itself: transformers' GGUF loader leaves a model that runs about 20% slower
  than the same weights loaded from a Hugging Face directory (measured 16.8 vs 20.6 tok/s
  on SmolLM2-135M), so the GGUF is converted once (dequantized to float32, ``save_pretrained``)
  into a cache folder keyed by the GGUF's sha256 (:func:`fp32_hf_dir`) and loaded from there.
  Prompts are our token ids, passed as they are.
* ``llama.cpp-greedy`` and ``llama.cpp-lookahead`` — llama.cpp's ``llama-completion`` (its
  plain greedy CLI) and its lookahead example ``llama-lookahead`` (Fu et al. 2024, arXiv
  2402.02057, llama.cpp's own implementation) on a GGUF file (by default the Q4_1 file that
  ships SmolLM2), built by ``bench/build_llama_cpp.sh``. llama.cpp tokenizes by itself: the
  peer passes the prompt *text* — the chat template rendered by our tokenizer (or the plain
  prompt) — through a file (``-f``, escapes off), and llama.cpp tokenizes it with
  ``add_special=true, parse_special=true``: the special tokens written by the template become
  their ids, and a BOS is prepended only where the GGUF says ``add_bos_token`` (SmolLM2:
  false, so the ids match ours; the greedy run prints llama.cpp's prompt ids with
  ``--verbose-prompt`` and the record notes whether they equal ours). Decoding is greedy
  (``--temp 0 --top-k 1``), at most the same number of new tokens, stopping at the model's
  end-of-generation tokens; :data:`LOOKAHEAD_CONSTANTS` are the window W, n-gram size N and
  verification cap G fixed in the example's source (not patched here).

Timings of the llama.cpp peers are llama.cpp's own printed figures, in the same convention
as the transformers peers (the prefill emits the first new token, so decode covers
``new_tokens − 1`` tokens):

* greedy: prefill = ``prompt eval time``; decode = ``eval time`` (one run per new token
  after the first) + ``sampling time`` (llama.cpp's eval timer excludes sampling, our
  decode time includes it).
* lookahead: prefill = ``encoded N tokens in S seconds``; decode = ``decoded N tokens in
  S seconds`` (wall time of the whole decode loop, sampling included); forward passes =
  ``n_predict − n_accept`` lookahead steps + 1 (the prefill, as for the other peers).

Outputs: llama.cpp prints text, not token ids, so the llama.cpp peers are compared as text
(stdout, special tokens rendered with ``--special``): the lookahead peer against llama.cpp's
own greedy output, the greedy peer against our greedy output decoded by our tokenizer.

llama.cpp peers run greedy only: under sampling (temperature > 0) they are refused
(:class:`PeerError`) rather than compared with a different sampler.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import EngineError, PeerError

TRANSFORMERS_PEERS = ("transformers-greedy", "transformers-prompt-lookup")
LLAMA_CPP_PEERS = ("llama.cpp-greedy", "llama.cpp-lookahead")
PEERS = TRANSFORMERS_PEERS + LLAMA_CPP_PEERS
#: Peers whose mismatch against their reference is reported but does not fail ``compare``:
#: other engines (or other weights: a 4-bit GGUF) legitimately differ from ours.
UNCHECKED_PEERS = ("transformers-greedy", "llama.cpp-greedy", "llama.cpp-lookahead")
PROMPT_LOOKUP_TOKENS = 10
#: (W, N, G) hard-coded in llama.cpp's examples/lookahead/lookahead.cpp (b11434); each run
#: reads them back from the example's own log, and the summary reports those.
LOOKAHEAD_CONSTANTS = (15, 5, 15)
LLAMA_CPP_ENV = "LADE_LLAMA_CPP"
GREEDY_BIN = "llama-completion"
LOOKAHEAD_BIN = "llama-lookahead"


@dataclasses.dataclass
class PeerOutput:
    """One peer generation.

    Attributes:
        token_ids: new token ids, or None where the peer prints text only (llama.cpp).
        text: generated text where the peer prints text (llama.cpp), else None.
        new_tokens: tokens generated (the first comes from the prefill).
        steps: forward passes that emitted tokens, the prefill's included (greedy: ``new_tokens``).
        prefill_s: prompt processing time, seconds.
        decode_s: decode time for ``new_tokens − 1`` tokens, seconds.
        prompt_ids_match: llama.cpp greedy only: its prompt token ids equal ours (None: unknown).
    """

    token_ids: list | None
    text: str | None
    new_tokens: int
    steps: int
    prefill_s: float
    decode_s: float
    prompt_ids_match: bool | None = None


def check_peer_names(peers, sampled: bool) -> None:
    """Refuse llama.cpp peers under sampling (they run greedy only).

    Raises:
        PeerError: a llama.cpp peer with ``sampled`` true.
    """
    llama = [p for p in peers if p in LLAMA_CPP_PEERS]
    if llama and sampled:
        raise PeerError(f"--peer {llama[0]} runs greedy only; drop --temperature or the llama.cpp peers")


# ---------------------------------------------------------------- transformers peers


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


# ---------------------------------------------------------------- llama.cpp peers

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_SAMPLING = re.compile(r"sampling time =\s*([\d.]+) ms")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_CONSTANT = re.compile(r"^\s*(?:\S+:\s*)?([WNG]) =\s*(\d+)\s*$", re.M)
_COUNTER = re.compile(r"^\s*(?:\S+:\s*)?(n_predict|n_accept)\s*=\s*(\d+)\s*$", re.M)
_N_PROMPT = re.compile(r"number of tokens in prompt = (\d+)\n")
_PROMPT_TOKEN = re.compile(r"(?:\d+\.\d+\.\d+\.\d+ [A-Z] )?\s*(\d+) -> '")  # optional log timestamp/level
_VERSION = re.compile(r"version: (\S+) \(([^)]*)\)")
_END_OF_TEXT = " [end of text]\n"
_LOG_COMPLETE = re.compile(r"graphs reused\s*=\s*\d+")
LOG_ATTEMPTS = 3


def _need(pattern: re.Pattern, text: str, what: str, tool: str):
    m = pattern.search(text)
    if m is None:
        raise EngineError(f"{tool}: no '{what}' line in its output (a llama.cpp version this peer does not read?)")
    return m


def parse_completion_timings(stderr: str) -> dict:
    """llama.cpp's timing block (``common_perf_print``) from ``llama-completion``'s stderr.

    Returns:
        dict with ``prompt_ms`` (prompt processing, ms), ``prompt_tokens``, ``eval_ms``
        (single-token decodes, ms, sampling excluded), ``eval_runs`` (their count) and
        ``sampling_ms`` (all sampling, ms; 0.0 when not printed).

    Raises:
        EngineError: a timing line is missing.
    """
    p = _need(_PROMPT_EVAL, stderr, "prompt eval time", GREEDY_BIN)
    e = _need(_EVAL, stderr, "eval time", GREEDY_BIN)
    s = _SAMPLING.search(stderr)
    return {"prompt_ms": float(p.group(1)), "prompt_tokens": int(p.group(2)), "eval_ms": float(e.group(1)),
            "eval_runs": int(e.group(2)), "sampling_ms": float(s.group(1)) if s else 0.0}


def parse_lookahead_timings(stderr: str) -> dict:
    """The summary ``llama-lookahead`` prints at exit.

    Returns:
        dict with ``encoded_tokens``, ``encode_s`` (prompt, seconds), ``decoded_tokens``,
        ``decode_s`` (decode loop wall time, seconds, for ``decoded_tokens`` tokens after
        the first), ``W``, ``N``, ``G`` (the example's constants), ``n_predict`` and
        ``n_accept`` (tokens accepted from verified n-grams beyond one per step).

    Raises:
        EngineError: a line is missing.
    """
    enc = _need(_ENCODED, stderr, "encoded N tokens", LOOKAHEAD_BIN)
    dec = _need(_DECODED, stderr, "decoded N tokens", LOOKAHEAD_BIN)
    out = {"encoded_tokens": int(enc.group(1)), "encode_s": float(enc.group(2)),
           "decoded_tokens": int(dec.group(1)), "decode_s": float(dec.group(2))}
    out.update({k: int(v) for k, v in _CONSTANT.findall(stderr)})
    out.update({k: int(v) for k, v in _COUNTER.findall(stderr)})
    for key in ("W", "N", "G", "n_predict", "n_accept"):
        if key not in out:
            raise EngineError(f"{LOOKAHEAD_BIN}: no '{key} = …' line in its output")
    return out


def parse_prompt_ids(stderr: str) -> tuple[list[int], str] | None:
    """Prompt token ids and their rendered pieces from ``--verbose-prompt`` output.

    The block is ``number of tokens in prompt = K`` followed by K lines ``<id> -> '<piece>'``
    (a piece may itself hold newlines). Returns ``(ids, concatenated pieces)``, or None when
    the block is absent or does not hold K entries.
    """
    m = _N_PROMPT.search(stderr)
    if m is None:
        return None
    count, pos = int(m.group(1)), m.end()
    ids, pieces = [], []
    for i in range(count):
        t = _PROMPT_TOKEN.match(stderr, pos)
        if t is None:
            return None
        start = t.end()
        end = start
        while True:  # the piece ends at "'\n" followed by the next entry (or anything, for the last)
            end = stderr.find("'\n", end)
            if end < 0:
                return None
            if i == count - 1 or _PROMPT_TOKEN.match(stderr, end + 2):
                break
            end += 1
        ids.append(int(t.group(1)))
        pieces.append(stderr[start:end])
        pos = end + 2
    return ids, "".join(pieces)


def completion_text(stdout: str) -> str:
    """Generated text from ``llama-completion --no-display-prompt`` stdout: drops the
    ``" [end of text]\\n"`` marker printed at an end-of-generation token and the final blank line."""
    text = stdout[:-2] if stdout.endswith("\n\n") else stdout
    if text.endswith(_END_OF_TEXT):
        text = text[: -len(_END_OF_TEXT)]
    return text


def lookahead_text(stdout: str, prompt_renderings: list[str]) -> str | None:
    """Generated text from ``llama-lookahead`` stdout (``\\n\\n`` + prompt pieces + generated
    pieces, accepted ones wrapped in colour codes, then blank lines): colour codes removed,
    the prompt (the first of ``prompt_renderings`` that prefixes it) and the trailing blank
    lines cut. None when no rendering matches."""
    plain = _ANSI.sub("", stdout)
    if plain.startswith("\n\n"):
        plain = plain[2:]
    for prompt in prompt_renderings:
        if prompt is not None and plain.startswith(prompt):
            body = plain[len(prompt):]
            for tail in ("\n\n\n\n", "\n\n"):  # before the summary, and at exit (may be lost, see LlamaCpp._run)
                if body.endswith(tail):
                    return body[: -len(tail)]
            return body
    return None


def find_llama_cpp(option: str | os.PathLike | None) -> Path:
    """Folder holding ``llama-completion`` and ``llama-lookahead``: ``--llama-cpp DIR``, else
    ``$LADE_LLAMA_CPP``.

    Raises:
        PeerError: neither is given, the folder does not exist, or a binary is missing.
    """
    value = option if option not in (None, "") else os.environ.get(LLAMA_CPP_ENV) or None
    if value is None:
        raise PeerError(f"the llama.cpp peers need llama.cpp's binaries: give --llama-cpp DIR or set {LLAMA_CPP_ENV} "
                        f"(build them with bench/build_llama_cpp.sh)")
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise PeerError(f"llama.cpp folder not found: {folder} (build it with bench/build_llama_cpp.sh)")
    for tool in (GREEDY_BIN, LOOKAHEAD_BIN):
        exe = folder / tool
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise PeerError(f"{folder} has no executable {tool} (build it with bench/build_llama_cpp.sh)")
    return folder


def check_gguf(path: str | os.PathLike) -> Path:
    """``path`` if it is a GGUF file.

    Raises:
        PeerError: missing, or not starting with the GGUF magic.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise PeerError(f"--llama-gguf {p}: file not found")
    with open(p, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise PeerError(f"--llama-gguf {p}: not a GGUF file")
    return p


def _signal_name(code: int) -> str:
    import signal

    try:
        return f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        return ""


class LlamaCpp:
    """Runs llama.cpp's greedy CLI and lookahead example as peers.

    Args:
        folder: binaries folder (see :func:`find_llama_cpp`).
        gguf: the GGUF file llama.cpp runs (see :func:`check_gguf`).
        threads: CPU threads for generation and prompt processing (``-t``, ``-tb``).
    """

    def __init__(self, folder: Path, gguf: Path, threads: int):
        self.folder, self.gguf, self.threads = Path(folder), Path(gguf), int(threads)
        self.constants: tuple | None = None
        self.last_command: dict = {}

    def version(self) -> str:
        """``<build number> (<commit>)`` as ``llama-completion --version`` prints it."""
        proc = subprocess.run([str(self.folder / GREEDY_BIN), "--version"], capture_output=True, text=True,
                              timeout=60, errors="replace")
        m = _VERSION.search(proc.stdout + proc.stderr)
        return f"{m.group(1)} ({m.group(2)})" if m else "unknown"

    def _args(self, prompt_file: str, n_predict: int, context: int) -> list[str]:
        t = str(self.threads)
        return ["-m", str(self.gguf), "-f", prompt_file, "-n", str(n_predict), "-c", str(context), "-t", t, "-tb", t,
                "--temp", "0", "--top-k", "1", "--repeat-penalty", "1", "--seed", "0", "--no-escape",
                "--no-log-prefix", "--no-log-timestamps", "--log-colors", "off"]

    def _run(self, tool: str, args: list[str], name: str) -> tuple[str, str]:
        """Run ``tool``; returns (stdout, stderr) of a run whose log reached its last line.

        llama.cpp's logger writes from a background thread that the tools do not join at exit
        (upstream notes the logger "may lose logs if not flushed before the program exits"),
        so a fast run sometimes ends before its timing block is printed. The last line of that
        block (``graphs reused``) marks a complete log; a run without it is repeated, up to
        :data:`LOG_ATTEMPTS` times in all.
        """
        cmd = [str(self.folder / tool), *args]
        self.last_command[name] = " ".join(c if c.startswith("-") or "/" not in c else Path(c).name for c in cmd)
        for _ in range(LOG_ATTEMPTS):
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=3600)
            out, err = (proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace"))
            if proc.returncode != 0:
                last = next((line for line in reversed(err.splitlines()) if line.strip()), "no output")
                raise EngineError(f"{tool} failed with exit status {proc.returncode}{_signal_name(proc.returncode)}: "
                                  f"{last.strip()[:200]}")
            if _LOG_COMPLETE.search(err):
                return out, err
        raise EngineError(f"{tool}: its log ended before the timings {LOG_ATTEMPTS} times (llama.cpp's logger "
                          f"thread lost its last lines); cannot read the run")

    def run(self, name: str, prompt_text: str, prompt_ids: list, max_new_tokens: int,
            prompt_rendering: str | None = None) -> tuple[PeerOutput, dict]:
        """Generate with peer ``name`` on ``prompt_text``.

        Args:
            name: ``llama.cpp-greedy`` or ``llama.cpp-lookahead``.
            prompt_text: the exact prompt text (chat template already applied).
            prompt_ids: our token ids of it (compared with llama.cpp's, context size).
            max_new_tokens: new tokens at most. The lookahead example stops once its counter
                (which does not count the first token) exceeds ``-n``, so it gets
                ``-n max_new_tokens − 2``; a longer output is cut to ``max_new_tokens`` (only
                possible for ``max_new_tokens`` < 2).
            prompt_rendering: the prompt as llama.cpp renders its tokens (from the greedy run),
                used to split the lookahead example's echo of the prompt from its output.

        Returns:
            ``(PeerOutput, extra)``; ``extra`` holds ``prompt_rendering`` (greedy) and the
            parsed figures.

        Raises:
            EngineError: the tool failed or printed no timings.
        """
        context = -(-(len(prompt_ids) + max_new_tokens + 256) // 256) * 256
        with tempfile.TemporaryDirectory(prefix="lade-llama-") as tmp:
            prompt_file = os.path.join(tmp, "prompt.txt")
            with open(prompt_file, "w", encoding="utf-8", newline="") as fh:
                fh.write(prompt_text + "\n")  # llama.cpp's -f drops one trailing newline: this one
            if name == "llama.cpp-greedy":
                out, err = self._run(GREEDY_BIN, self._args(prompt_file, max_new_tokens, context)
                                     + ["-no-cnv", "--no-display-prompt", "--special", "--verbose-prompt"], name)
            elif name == "llama.cpp-lookahead":
                out, err = self._run(LOOKAHEAD_BIN, self._args(prompt_file, max(max_new_tokens - 2, 0), context), name)
            else:
                raise ValueError(name)
        if name == "llama.cpp-greedy":
            t = parse_completion_timings(err)
            new = min(t["eval_runs"] + 1, max_new_tokens)
            parsed = parse_prompt_ids(err)
            match = None if parsed is None else parsed[0] == list(prompt_ids)
            rendering = parsed[1] if parsed is not None else None
            output = PeerOutput(None, completion_text(out), new, new, t["prompt_ms"] / 1000,
                                (t["eval_ms"] + t["sampling_ms"]) / 1000, match)
            return output, {"prompt_rendering": rendering, **t}
        t = parse_lookahead_timings(err)
        self.constants = (t["W"], t["N"], t["G"])
        text = lookahead_text(out, [prompt_rendering, prompt_text])
        if text is None:
            raise EngineError(f"{LOOKAHEAD_BIN}: its output does not start with the prompt; cannot read the generated text")
        new = min(t["n_predict"] + 1, max_new_tokens)
        steps = t["n_predict"] - t["n_accept"] + 1  # lookahead steps + the prefill pass
        return PeerOutput(None, text, new, steps, t["encode_s"], t["decode_s"]), t


# ---------------------------------------------------------------- all peers


class Peers:
    """Every peer of one ``compare`` run, set up before the first prompt.

    Args:
        names: peer names from :data:`PEERS` (run in that order, duplicates dropped, so each
            reference runs before the peers compared with it).
        source: the artifact's ``source.model``, for the transformers peers.
        llama_cpp: ``--llama-cpp`` value (None: ``$LADE_LLAMA_CPP``).
        llama_gguf: ``--llama-gguf`` value (None: the Q4_1 GGUF shipped for SmolLM2).
        threads: llama.cpp threads (None: the CPUs this process may use).
        sampled: the run samples (temperature > 0).

    Raises:
        PeerError: llama.cpp peers under sampling, or their binaries / GGUF missing.
        ModelSourceError: the transformers peers' model cannot be loaded.
    """

    def __init__(self, names, source: str | None = None, llama_cpp=None, llama_gguf=None, threads: int | None = None,
                 sampled: bool = False):
        self.names = sorted(set(names), key=PEERS.index)  # references (the greedy peers) run first
        check_peer_names(self.names, sampled)
        self.model = None
        self.llama = None
        self.info: dict = {}
        self.prompt_ids_match: list = []  # llama.cpp-greedy, per prompt: its prompt ids equal ours (None: unread)
        if any(n in LLAMA_CPP_PEERS for n in self.names):
            folder = find_llama_cpp(llama_cpp)
            if llama_gguf is None:
                from ..export.model_source import builtin_smollm2_path

                try:
                    llama_gguf = builtin_smollm2_path()
                except Exception as err:
                    raise PeerError(f"no --llama-gguf given and the default GGUF is unavailable: {err}") from None
            gguf = check_gguf(llama_gguf)
            threads = threads or len(os.sched_getaffinity(0))
            self.llama = LlamaCpp(folder, gguf, threads)
        if any(n in TRANSFORMERS_PEERS for n in self.names):
            self.model, form = load_transformers_peer(source)
            self.info["transformers peers"] = form
        if self.llama is not None:
            self.info["llama.cpp"] = (f"{self.llama.version()} in {folder}, GGUF {gguf.name}, "
                                      f"{self.llama.threads} threads, greedy (--temp 0 --top-k 1)")

    def describe(self) -> dict:
        """Metadata for the run's summary: where each peer's model came from, llama.cpp's
        version, GGUF, threads, and the lookahead example's W, N, G (once it ran)."""
        info = dict(self.info)
        if self.llama is not None and "llama.cpp-lookahead" in self.names:
            W, N, G = self.llama.constants or LOOKAHEAD_CONSTANTS
            info["llama.cpp lookahead"] = (f"examples/lookahead as shipped (source not patched): W={W}, N={N}, G={G}"
                                           + ("" if self.llama.constants else " (from the source; not yet run)"))
        if self.prompt_ids_match:
            same = sum(1 for m in self.prompt_ids_match if m)
            info["llama.cpp prompt ids"] = (f"identical to ours on {same}/{len(self.prompt_ids_match)} prompts "
                                            "(llama.cpp tokenizes the prompt text itself; read from --verbose-prompt)")
        if self.llama is not None and self.llama.last_command:
            info["llama.cpp commands"] = "; ".join(self.llama.last_command.values())
        return info

    def run_prompt(self, prompt_text: str, prompt_ids: list, budget: int, stop_ids: list, baseline: str,
                   base_ids: list, base_text_fn, sampling=None):
        """Run every peer on one prompt, in :data:`PEERS` order (references first).

        Args:
            prompt_text: the prompt as text (chat template applied); prompt_ids: our ids of it.
            budget: max new tokens; stop_ids: our stop token ids (for transformers).
            baseline: our baseline's configuration name (``greedy`` or ``sampling``);
                base_ids: its new token ids; base_text_fn: ``callable() -> str``, its text
                with special tokens rendered (asked only when a llama.cpp peer compares with it).
            sampling: :class:`lade_export.sampling.SamplingParams` under sampling, else None.

        Yields:
            ``(name, PeerOutput, reference, exact)``: ``reference`` names what ``exact``
            compared against — ``transformers-greedy`` for prompt lookup and
            ``llama.cpp-greedy`` for the lookahead example when those ran first, else the
            baseline; token ids for transformers, text for llama.cpp. ``exact`` is None under
            sampling.
        """
        sampled = sampling is not None and not sampling.greedy
        refs: dict = {}
        rendering = None
        for name in self.names:
            if name in TRANSFORMERS_PEERS:
                out = run_transformers_peer(self.model, name, prompt_ids, budget, stop_ids, sampling)
                if name == "transformers-greedy":
                    refs[name] = out.token_ids
                reference = ("transformers-greedy" if name == "transformers-prompt-lookup" and "transformers-greedy" in refs
                             else baseline)
                expected = refs["transformers-greedy"] if reference == "transformers-greedy" else base_ids
                got = out.token_ids
            else:
                out, extra = self.llama.run(name, prompt_text, prompt_ids, budget, prompt_rendering=rendering)
                if name == "llama.cpp-greedy":
                    refs[name], rendering = out.text, extra.get("prompt_rendering")
                    self.prompt_ids_match.append(out.prompt_ids_match)
                reference = "llama.cpp-greedy" if name == "llama.cpp-lookahead" and "llama.cpp-greedy" in refs \
                    else baseline
                expected = refs["llama.cpp-greedy"] if reference == "llama.cpp-greedy" else None
                got = out.text
                if expected is None and not sampled:
                    expected = base_text_fn()
            yield name, out, reference, (None if sampled else got == expected)
