"""What one peer generation returns, shared by the transformers peers
(:mod:`lade_export.evaluation.transformers_peer`) and the llama.cpp peers
(:mod:`lade_export.evaluation.llama_cpp`), and the timing convention they both follow.

Every peer emits its first new token from the prefill pass, so its prefill time covers
the prompt and that token, and its decode time covers the other ``new_tokens − 1``;
forward passes count the prefill's. ``compare`` counts a peer's decode tokens that way
(:func:`lade_export.evaluation.compare.summarize`).
"""

from __future__ import annotations

import dataclasses


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
