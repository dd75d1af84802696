"""The decoding loop around a compiled step engine: plain greedy and lookahead decoding.

Both modes run on the same engine, so their outputs can be compared token for token.
Lookahead decoding (Fu et al. 2023, arXiv 2402.02057) is exact for greedy decoding:
every accepted token is the argmax the model gives after exactly the accepted prefix,
so the output equals plain greedy output (up to float ties).

Cache invariant: after every step, the KV cache holds all tokens of the sequence except
the last accepted one, which is the first token fed at the next step.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Callable, Protocol

import numpy as np

from .errors import GenerationError
from .graph import ModelDims, empty_past_feeds
from .ngram import LookaheadState, causal_feeds
from .profile import LookaheadProfile
from .specs import past_key_name, past_value_name, present_key_name, present_value_name


class Engine(Protocol):
    """What the decoding loop needs from a backend (ONNX Runtime, PyTorch, TensorRT)."""

    name: str
    dims: ModelDims

    def run(self, feeds: dict, with_logits: bool = False) -> dict:
        """One forward pass on numpy feeds named as in :mod:`lade_export.specs`."""

    def close(self) -> None:
        """Release the engine's resources."""


class KVCache:
    """Host-side KV cache owned by the runtime: per layer a preallocated float32 buffer
    [1, kv_heads, capacity, head_dim] for keys and one for values, filled up to ``length``.

    Only accepted tokens are appended (rows picked from a step's ``present.*`` outputs),
    so rejected lookahead and candidate tokens never enter it and nothing is copied back.

    Raises:
        GenerationError: an append would exceed ``capacity``.
    """

    def __init__(self, dims: ModelDims, capacity: int):
        self.dims = dims
        self.capacity = capacity
        self.length = 0
        shape = (1, dims.kv_heads, capacity, dims.head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(dims.num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(dims.num_layers)]

    def feeds(self) -> dict:
        """``past_key_values.*`` feeds: contiguous [1, kv_heads, length, head_dim] arrays."""
        n = self.length
        out = {}
        for i in range(self.dims.num_layers):
            out[past_key_name(i)] = np.ascontiguousarray(self.keys[i][:, :, :n])
            out[past_value_name(i)] = np.ascontiguousarray(self.values[i][:, :, :n])
        return out

    def append(self, outputs: dict, rows: np.ndarray | None = None) -> None:
        """Append this step's ``present.*`` keys/values at ``rows`` (all rows when None)."""
        first = outputs[present_key_name(0)]
        count = first.shape[2] if rows is None else len(rows)
        if self.length + count > self.capacity:
            raise GenerationError(f"KV cache full: {self.length} + {count} tokens exceed capacity {self.capacity}")
        end = self.length + count
        for i in range(self.dims.num_layers):
            k = outputs[present_key_name(i)]
            v = outputs[present_value_name(i)]
            if rows is not None:
                k, v = k[:, :, rows], v[:, :, rows]
            self.keys[i][:, :, self.length:end] = k
            self.values[i][:, :, self.length:end] = v
        self.length = end


@dataclasses.dataclass
class GenerationStats:
    """Statistics of one generation.

    Attributes:
        prompt_tokens: prompt length in tokens.
        new_tokens: generated tokens (including a final stop token).
        steps: decode forward passes (prefill not counted).
        prefill_s: prefill wall time, seconds.
        decode_s: decode wall time, seconds.
        acceptance_histogram: {tokens accepted in a step: number of steps}.
        host_s: time spent outside the engine during decode, seconds.
        cache_tokens: tokens in the KV cache at the end (never above the context).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    acceptance_histogram: dict = dataclasses.field(default_factory=dict)
    host_s: float = 0.0
    cache_tokens: int = 0

    @property
    def compression_ratio(self) -> float:
        """Tokens per decode forward pass: new_tokens / steps (1.0 for greedy)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput, new tokens per second of decode time."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["acceptance_histogram"] = {str(k): v for k, v in sorted(self.acceptance_histogram.items())}
        d["compression_ratio"] = self.compression_ratio
        d["tokens_per_s"] = self.tokens_per_s
        return d

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        return (f"steps {self.steps} · tokens {self.new_tokens} · compression {self.compression_ratio:.2f} · "
                f"{self.tokens_per_s:.1f} tok/s (prefill {self.prompt_tokens} token{'' if self.prompt_tokens == 1 else 's'} "
                f"in {self.prefill_s:.2f}s)")


@dataclasses.dataclass
class GenerationResult:
    """Output of :meth:`Decoder.generate`: new token ids (int list), their text (when a
    tokenizer was given), the stop reason (``"stop_token" | "max_new_tokens"``) and stats."""

    token_ids: list
    text: str
    stop_reason: str
    stats: GenerationStats


class Decoder:
    """Greedy and lookahead decoding on one engine.

    Args:
        engine: a backend engine (see :class:`Engine`).
        stop_token_ids: every id that ends generation (the stop token is emitted, nothing after it).
        max_context: the model's context length in tokens (prompt + new tokens may not exceed it).
        tokenizer: optional, to return text.

    State (window, pool, KV cache) is created per :meth:`generate` call, so consecutive
    calls on one object are independent.
    """

    def __init__(self, engine: Engine, stop_token_ids=(), max_context: int | None = None, tokenizer=None):
        self.engine = engine
        self.dims = engine.dims
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_context = max_context or self.dims.max_context
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, max_new_tokens: int, profile: LookaheadProfile | None = None,
                 on_tokens: Callable[[list], None] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

        Args:
            prompt_ids: int token ids, at least one (the BOS token counts).
            max_new_tokens: ≥ 1.
            profile: a lookahead profile, or None for plain greedy decoding.
            on_tokens: called with each step's newly emitted token ids (streaming).

        Raises:
            GenerationError: empty prompt, ``max_new_tokens`` < 1, or prompt + new tokens
                beyond the model's context (checked before any work).
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise GenerationError("empty prompt: give at least one token (the tokenizer's BOS counts)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer ≥ 1, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_context:
            raise GenerationError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {len(prompt) + max_new_tokens} "
                f"exceeds the model's context of {self.max_context} tokens"
            )
        if profile is not None and not profile.enabled:
            profile = None  # the greedy setting
        stats = GenerationStats(prompt_tokens=len(prompt))
        cache = KVCache(self.dims, capacity=len(prompt) + max_new_tokens)
        t0 = time.perf_counter()
        if len(prompt) > 1:
            cache.append(self.engine.run({**causal_feeds(prompt[:-1], 0), **empty_past_feeds(self.dims)}))
        stats.prefill_s = time.perf_counter() - t0

        state = LookaheadState(profile, self.dims.vocab, prompt) if profile else None
        sequence = list(prompt)
        new: list[int] = []
        histogram: Counter = Counter()
        stop_reason = "max_new_tokens"
        engine_s = 0.0
        t1 = time.perf_counter()
        while True:
            last = sequence[-1]
            past = cache.length
            if state is None:
                feeds = causal_feeds([last], past)
            else:
                feeds = state.build_step(last, past).feeds()
            feeds.update(cache.feeds())
            te = time.perf_counter()
            outputs = self.engine.run(feeds)
            engine_s += time.perf_counter() - te
            stats.steps += 1
            next_ids = outputs["next_token_ids"][0]
            if state is None:
                accepted, kept = [int(next_ids[0])], None
            else:
                verdict = state.digest(next_ids)
                accepted, kept = verdict.accepted, verdict.kept_rows
            emitted = []
            for token in accepted:
                emitted.append(token)
                if token in self.stop_token_ids:
                    stop_reason = "stop_token"
                    break
                if len(new) + len(emitted) >= max_new_tokens:
                    break
            new += emitted
            histogram[len(emitted)] += 1
            if on_tokens:
                on_tokens(emitted)
            if stop_reason == "stop_token" or len(new) >= max_new_tokens:
                break
            cache.append(outputs, kept)
            sequence += accepted
            if state is not None:
                state.observe_output(accepted)
        stats.decode_s = time.perf_counter() - t1
        stats.host_s = max(stats.decode_s - engine_s, 0.0)
        stats.new_tokens = len(new)
        stats.cache_tokens = cache.length
        stats.acceptance_histogram = dict(histogram)
        text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerationResult(new, text, stop_reason, stats)
