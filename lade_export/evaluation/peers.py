"""Comparison peers for ``lade-export compare``: other implementations run on the same
model and prompts, inside the same interleaved loop as our configurations.

==============================  ==========================================  ==================================
peer (``--peer``)               what runs                                   exact against (fails compare?)
==============================  ==========================================  ==================================
``transformers-greedy``         transformers ``generate``, float32 weights  our greedy, token ids (no)
``transformers-prompt-lookup``  the same with prompt lookup decoding        ``transformers-greedy`` (yes)
``llama.cpp-greedy``            ``llama-completion`` on a GGUF              our greedy, as text (no)
``llama.cpp-lookahead``         llama.cpp's lookahead example, same GGUF    ``llama.cpp-greedy``, as text (no)
==============================  ==========================================  ==================================

A reference that did not run (``--peer transformers-prompt-lookup`` alone) is replaced by
our baseline. Under sampling nothing is compared (exact reads n/a) and the llama.cpp peers
are refused (:func:`check_peer_names`): they run greedy only.

How each kind is loaded, run and timed is in :mod:`lade_export.evaluation.transformers_peer`
and :mod:`lade_export.evaluation.llama_cpp`; what a run returns is
:class:`~lade_export.evaluation.peer_output.PeerOutput`. This module holds the peer names,
the check that refuses the llama.cpp peers under sampling, and :class:`Peers`, which sets
every requested peer up once and runs them on each prompt (references first). The names
the CLI uses from the two peer modules are importable from here as well.
"""

from __future__ import annotations

import os

from ..errors import PeerError
from .llama_cpp import LLAMA_CPP_PEERS, LOOKAHEAD_CONSTANTS, LlamaCpp, check_gguf, find_llama_cpp
from .peer_output import PeerOutput
from .transformers_peer import TRANSFORMERS_PEERS, load_transformers_peer, run_transformers_peer

__all__ = ["LLAMA_CPP_PEERS", "PEERS", "TRANSFORMERS_PEERS", "UNCHECKED_PEERS", "PeerOutput", "Peers",
           "check_gguf", "check_peer_names", "find_llama_cpp"]

PEERS = TRANSFORMERS_PEERS + LLAMA_CPP_PEERS
#: Peers whose mismatch against their reference is reported but does not fail ``compare``:
#: other engines (or other weights: a 4-bit GGUF) legitimately differ from ours.
UNCHECKED_PEERS = ("transformers-greedy", "llama.cpp-greedy", "llama.cpp-lookahead")


def check_peer_names(peers, sampled: bool) -> None:
    """Refuse llama.cpp peers under sampling (they run greedy only).

    Raises:
        PeerError: a llama.cpp peer with ``sampled`` true.
    """
    llama = [p for p in peers if p in LLAMA_CPP_PEERS]
    if llama and sampled:
        raise PeerError(f"--peer {llama[0]} runs greedy only; drop --temperature or the llama.cpp peers")


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
