"""Numpy feeds of the step graph that do not depend on a lookahead layout: prefill and
plain greedy steps (a causal block), an empty KV cache, and random feeds of a given
shape (export examples, step-cost measurements).

Names, shapes and dtypes follow :mod:`lade_export.specs`.
"""

from __future__ import annotations

import numpy as np

from .kv_cache import zeros
from .specs import ModelDims, past_key_name, past_value_name, present_key_name, present_value_name


def causal_feeds(token_ids, past_len: int, logit_rows=None) -> dict:
    """Feeds (without the KV cache) of a plain causal step: prefill or a greedy step.

    Args:
        token_ids: the step's tokens, in order (positions ``past_len`` onward).
        past_len: tokens already in the cache (all visible to every row).
        logit_rows: rows whose logits to compute (default: the last row only).

    Returns:
        batch-1 numpy feeds: int64 ids/positions [1, step], bool mask [1, 1, step, past+step]
        (lower-triangular over this step), int64 logits_positions [1, n_logits].
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    step = len(ids)
    rows = np.asarray([step - 1] if logit_rows is None else logit_rows, dtype=np.int64)
    return {
        "input_ids": ids[None],
        "position_ids": np.arange(past_len, past_len + step, dtype=np.int64)[None],
        "attention_mask": np.tril(np.ones((step, past_len + step), dtype=bool), k=past_len)[None, None],
        "logits_positions": rows[None],
    }


def empty_past_feeds(dims: ModelDims) -> dict:
    """``past_key_values.*`` feeds of an empty sequence-major cache: float32 [1, 0, kv_heads, head_dim] each."""
    empty = np.zeros((1, 0, dims.kv_heads, dims.head_dim), np.float32)
    return {n: empty for i in range(dims.num_layers) for n in (past_key_name(i), past_value_name(i))}


def to_kv_layout(feeds: dict, dims: ModelDims, kv_layout: str, capacity: int | None = None) -> dict:
    """``feeds`` with a sequence-major cache ([b, past, kv_heads, head_dim]) rewritten for
    ``kv_layout``: unchanged for ``sequence-major``; for ``head-major-shared`` each past
    tensor becomes a new buffer [b, kv_heads, capacity, head_dim] (default capacity: past +
    step) holding the cache in its first ``past`` positions. Copies; for checks and benchmarks."""
    if kv_layout == "sequence-major":
        return dict(feeds)
    out = dict(feeds)
    step = feeds["input_ids"].shape[1]
    for i in range(dims.num_layers):
        for name in (past_key_name(i), past_value_name(i)):
            past = feeds[name]
            b, n = past.shape[0], past.shape[1]
            buffer = np.zeros((b, dims.kv_heads, capacity or n + step, dims.head_dim), past.dtype)
            buffer[:, :, :n] = past.transpose(0, 2, 1, 3)
            out[name] = buffer
    return out


def example_feeds(dims: ModelDims, step: int, past: int, batch: int = 1, seed: int = 0, dtype=np.float32,
                  kv_layout: str = "sequence-major") -> dict:
    """Feeds of a given (step, past) shape: random token ids over contiguous positions with
    a causal mask, logits at every row, and a random float cache (fixed ``seed``).

    Returns:
        numpy arrays keyed by input name; the cache is ``dtype`` [batch, past, kv_heads, head_dim]
        (``sequence-major``) or [batch, kv_heads, past+step, head_dim] (``head-major-shared``).
    """
    rng = np.random.default_rng(seed)
    one = causal_feeds(rng.integers(0, dims.vocab, size=step), past, logit_rows=np.arange(step))
    feeds = {name: np.repeat(value, batch, axis=0) for name, value in one.items()}
    for i in range(dims.num_layers):
        for name in (past_key_name(i), past_value_name(i)):  # on a cache line, as a runtime cache's buffers
            feeds[name] = zeros((batch, past, dims.kv_heads, dims.head_dim), dtype)
            feeds[name][...] = rng.standard_normal(feeds[name].shape)
    return to_kv_layout(feeds, dims, kv_layout)


def run_sequence_major(engine, feeds: dict, with_logits: bool = False) -> dict:
    """Run ``engine`` on feeds with a sequence-major cache whatever the engine's layout.

    For an engine whose ``kv_layout`` is ``head-major-shared`` the cache is copied into
    fresh buffers (:func:`to_kv_layout`) and the ``present.*`` outputs are returned as
    this step's keys/values only, sequence-major [b, step, kv_heads, head_dim] — the
    contract of a ``sequence-major`` engine. For checks, tools and tests, not the decoding
    loop (which owns its buffers, :class:`lade_export.kv_cache.KVCache`).

    Raises:
        EngineError: the engine failed to run the feeds.
    """
    layout = engine.kv_layout
    if layout == "sequence-major":
        return engine.run(feeds, with_logits=with_logits)
    past = feeds[past_key_name(0)].shape[1]
    step = feeds["input_ids"].shape[1]
    out = dict(engine.run(to_kv_layout(feeds, engine.dims, layout), with_logits=with_logits))
    for i in range(engine.dims.num_layers):
        for name in (present_key_name(i), present_value_name(i)):  # [b, kv, capacity, hd] -> this step's rows
            out[name] = np.ascontiguousarray(out[name][:, :, past:past + step].transpose(0, 2, 1, 3))
    return out
