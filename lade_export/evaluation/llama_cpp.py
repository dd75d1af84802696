"""The llama.cpp peers of ``lade-export compare``: llama.cpp's ``llama-completion`` (its
plain greedy CLI) as ``llama.cpp-greedy`` and its lookahead example ``llama-lookahead``
(Fu et al. 2024, arXiv 2402.02057, llama.cpp's own implementation) as
``llama.cpp-lookahead``, on a GGUF file (by default the Q4_1 file that ships SmolLM2),
built by ``bench/build_llama_cpp.sh``.

Prompts: llama.cpp tokenizes by itself, so the peer passes the prompt *text* — the chat
template rendered by our tokenizer (or the plain prompt) — through a file (``-f``, escapes
off), and llama.cpp tokenizes it with ``add_special=true, parse_special=true``: the special
tokens written by the template become their ids, and a BOS is prepended only where the
GGUF says ``add_bos_token`` (SmolLM2: false, so the ids match ours; the greedy run prints
llama.cpp's prompt ids with ``--verbose-prompt`` and the record notes whether they equal
ours). Decoding is greedy (``--temp 0 --top-k 1``), at most the same number of new tokens,
stopping at the model's end-of-generation tokens; :data:`LOOKAHEAD_CONSTANTS` are the
window W, n-gram size N and verification cap G fixed in the example's source (not patched
here).

Timings are llama.cpp's own printed figures, in the convention of
:mod:`lade_export.evaluation.peer_output` (the prefill emits the first new token, so decode
covers ``new_tokens − 1`` tokens):

* greedy: prefill = ``prompt eval time``; decode = ``eval time`` (one run per new token
  after the first) + ``sampling time`` (llama.cpp's eval timer excludes sampling, our
  decode time includes it).
* lookahead: prefill = ``encoded N tokens in S seconds``; decode = ``decoded N tokens in
  S seconds`` (wall time of the whole decode loop, sampling included); forward passes =
  ``n_predict − n_accept`` lookahead steps + 1 (the prefill, as for the other peers).

Outputs: llama.cpp prints text, not token ids, so these peers are compared as text (stdout,
special tokens rendered with ``--special``): the lookahead peer against llama.cpp's own
greedy output, the greedy peer against our greedy output decoded by our tokenizer. They run
greedy only: under sampling (temperature > 0) they are refused
(:func:`lade_export.evaluation.peers.check_peer_names`) rather than compared with a
different sampler.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

from ..errors import EngineError, PeerError
from .peer_output import PeerOutput

LLAMA_CPP_PEERS = ("llama.cpp-greedy", "llama.cpp-lookahead")
#: (W, N, G) hard-coded in llama.cpp's examples/lookahead/lookahead.cpp (b11434); each run
#: reads them back from the example's own log, and the summary reports those.
LOOKAHEAD_CONSTANTS = (15, 5, 15)
LLAMA_CPP_ENV = "LADE_LLAMA_CPP"
GREEDY_BIN = "llama-completion"
LOOKAHEAD_BIN = "llama-lookahead"

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
