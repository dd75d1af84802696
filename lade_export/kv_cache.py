"""The host-side KV cache one request owns.

Two layouts, the step graph's contract (:mod:`lade_export.specs`, ``KV_LAYOUTS``); in
both, per layer one float32 key buffer and one value buffer, RoPE already applied to the
keys, filled up to ``length`` tokens in sequence order, and no step copies the context:

* ``sequence-major`` — buffers ``[1, capacity, kv_heads, head_dim]``. The filled prefix
  ``buffer[:, :length]`` is one contiguous block, handed to the engine as it is (a numpy
  view; engines read a contiguous input in place). The step returns its own keys/values
  (``present.*``, this step only) and the accepted rows are copied in after it.
* ``head-major-shared`` — buffers ``[1, kv_heads, capacity, head_dim]`` handed to the
  engine whole; the engine writes the step's keys/values at ``[length, length+step)`` of
  the same buffers (ONNX Runtime's ``GroupQueryAttention`` with past and present bound to
  one buffer). Accepting moves the kept rows down to ``[length, length+kept)``: the only
  copy is of the accepted tokens, and none when they are the first rows of the step (a
  greedy step, a prefill). The buffers need room for the widest step beyond the tokens
  kept (``step_room``).
"""

from __future__ import annotations

import numpy as np

from .errors import GenerationError
from .specs import KV_LAYOUTS, ModelDims, past_key_name, past_value_name, present_key_name, present_value_name


class KVCache:
    """Preallocated keys/values of one sequence, filled up to ``length`` (see the module
    docstring for the two layouts).

    Only accepted tokens stay in it (rows picked from a step's keys/values), so rejected
    lookahead and candidate tokens never count and nothing is copied back to the engine.
    :meth:`feeds` returns the buffers or views of them, never copies.
    Memory: ``(capacity + step_room) × dims.kv_bytes_per_token`` bytes (:attr:`nbytes`).

    Args:
        dims: the model's shape facts.
        capacity: most tokens it will keep (prompt + new tokens − 1 is enough: the last
            accepted token is never cached).
        layout: one of :data:`lade_export.specs.KV_LAYOUTS` (the engine's ``kv_layout``).
        step_room: tokens of scratch space after ``capacity`` for the widest step
            (``head-major-shared`` only: the engine writes a whole step before any is kept).

    Raises:
        ValueError: an unknown ``layout``.
        GenerationError: an append would exceed ``capacity``.
    """

    def __init__(self, dims: ModelDims, capacity: int, layout: str = "sequence-major", step_room: int = 0):
        if layout not in KV_LAYOUTS:
            raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
        self.dims = dims
        self.capacity = capacity
        self.layout = layout
        self.length = 0
        if layout == "sequence-major":
            shape = (1, capacity, dims.kv_heads, dims.head_dim)
        else:
            shape = (1, dims.kv_heads, capacity + step_room, dims.head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(dims.num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(dims.num_layers)]
        self._shared_feeds = None  # feeds() of a head-major-shared cache, built once

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (keys and values, all layers)."""
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def feeds(self) -> dict:
        """``past_key_values.*`` feeds: views [1, length, kv_heads, head_dim] of the buffers
        (``sequence-major``; contiguous, so engines read them without a copy), or the
        buffers themselves [1, kv_heads, capacity + step_room, head_dim] (``head-major-shared``;
        the engine writes the step into them)."""
        shared = self.layout == "head-major-shared"
        if shared and self._shared_feeds is not None:
            return self._shared_feeds  # the same buffers every step
        out = {}
        n = self.length
        for i in range(self.dims.num_layers):
            out[past_key_name(i)] = self.keys[i] if shared else self.keys[i][:, :n]
            out[past_value_name(i)] = self.values[i] if shared else self.values[i][:, :n]
        if shared:
            self._shared_feeds = out
        return out

    def append(self, outputs: dict, rows: np.ndarray | None = None, step: int | None = None) -> None:
        """Keep this step's keys/values at ``rows`` of the step (all rows when None).

        Args:
            outputs: the step's outputs; ``sequence-major`` reads its ``present.*``
                ([1, step, kv_heads, head_dim]), ``head-major-shared`` reads nothing (the
                engine already wrote the step into the buffers).
            rows: increasing row indices of the step to keep.
            step: the step's width in tokens (``head-major-shared``, when ``rows`` is None).
        """
        if self.layout == "head-major-shared":
            count = step if rows is None else len(rows)
        else:
            count = outputs[present_key_name(0)].shape[1] if rows is None else len(rows)
        if self.length + count > self.capacity:
            raise GenerationError(f"KV cache full: {self.length} + {count} tokens exceed capacity {self.capacity}")
        start, end = self.length, self.length + count
        if self.layout == "head-major-shared":
            if rows is not None and not np.array_equal(rows, np.arange(count)):
                source = start + np.asarray(rows)
                for buffer in (*self.keys, *self.values):
                    buffer[:, :, start:end] = buffer[:, :, source]  # rows[j] ≥ j: reads before writes
            self.length = end
            return
        for i in range(self.dims.num_layers):
            k = outputs[present_key_name(i)]
            v = outputs[present_value_name(i)]
            if rows is not None:
                k, v = k[:, rows], v[:, rows]
            self.keys[i][:, start:end] = k
            self.values[i][:, start:end] = v
        self.length = end
