"""Numpy feeds of the step graph that do not depend on a lookahead layout: prefill and
plain greedy steps (a causal block), an empty KV cache, and random feeds of a given
shape (export examples, step-cost measurements).

Names, shapes and dtypes follow :mod:`lade_export.specs`.
"""

from __future__ import annotations

import numpy as np

from .specs import ModelDims, past_key_name, past_value_name


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
    """``past_key_values.*`` feeds of an empty cache: float32 [1, 0, kv_heads, head_dim] each."""
    empty = np.zeros((1, 0, dims.kv_heads, dims.head_dim), np.float32)
    return {n: empty for i in range(dims.num_layers) for n in (past_key_name(i), past_value_name(i))}


def example_feeds(dims: ModelDims, step: int, past: int, batch: int = 1, seed: int = 0, dtype=np.float32) -> dict:
    """Feeds of a given (step, past) shape: random token ids over contiguous positions with
    a causal mask, logits at every row, and a random float cache (fixed ``seed``).

    Returns:
        numpy arrays keyed by input name; the cache is ``dtype`` [batch, past, kv_heads, head_dim].
    """
    rng = np.random.default_rng(seed)
    one = causal_feeds(rng.integers(0, dims.vocab, size=step), past, logit_rows=np.arange(step))
    feeds = {name: np.repeat(value, batch, axis=0) for name, value in one.items()}
    for i in range(dims.num_layers):
        for name in (past_key_name(i), past_value_name(i)):
            feeds[name] = rng.standard_normal((batch, past, dims.kv_heads, dims.head_dim)).astype(dtype)
    return feeds
