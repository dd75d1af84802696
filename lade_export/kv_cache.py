"""The host-side KV cache one request owns.

Layout (the step graph's contract, :mod:`lade_export.specs`): per layer one float32
key buffer and one value buffer ``[1, capacity, kv_heads, head_dim]`` — sequence-major —
RoPE already applied to the keys, filled up to ``length`` tokens in sequence order.
Because the sequence axis comes first, the filled prefix ``buffer[:, :length]`` is one
contiguous block: it is handed to the engine as it is (a numpy view; ONNX Runtime reads
a contiguous input in place), so no step copies the context.
"""

from __future__ import annotations

import numpy as np

from .errors import GenerationError
from .specs import ModelDims, past_key_name, past_value_name, present_key_name, present_value_name


class KVCache:
    """Preallocated keys/values of one sequence: per layer float32
    ``[1, capacity, kv_heads, head_dim]`` for keys and for values, filled up to ``length``.

    Only accepted tokens are appended (rows picked from a step's ``present.*`` outputs),
    so rejected lookahead and candidate tokens never enter it and nothing is copied back.
    :meth:`feeds` returns views of the buffers, never copies.
    Memory: ``capacity × dims.kv_bytes_per_token`` bytes (:attr:`nbytes`).

    Args:
        dims: the model's shape facts.
        capacity: most tokens it will hold (prompt + new tokens − 1 is enough: the last
            accepted token is never cached).

    Raises:
        GenerationError: an append would exceed ``capacity``.
    """

    def __init__(self, dims: ModelDims, capacity: int):
        self.dims = dims
        self.capacity = capacity
        self.length = 0
        shape = (1, capacity, dims.kv_heads, dims.head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(dims.num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(dims.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (keys and values, all layers)."""
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def feeds(self) -> dict:
        """``past_key_values.*`` feeds: views [1, length, kv_heads, head_dim] of the buffers
        (contiguous, so engines read them without a copy)."""
        n = self.length
        out = {}
        for i in range(self.dims.num_layers):
            out[past_key_name(i)] = self.keys[i][:, :n]
            out[past_value_name(i)] = self.values[i][:, :n]
        return out

    def append(self, outputs: dict, rows: np.ndarray | None = None) -> None:
        """Append this step's ``present.*`` keys/values ([1, step, kv_heads, head_dim]) at
        ``rows`` (all rows when None)."""
        first = outputs[present_key_name(0)]
        count = first.shape[1] if rows is None else len(rows)
        if self.length + count > self.capacity:
            raise GenerationError(f"KV cache full: {self.length} + {count} tokens exceed capacity {self.capacity}")
        end = self.length + count
        for i in range(self.dims.num_layers):
            k = outputs[present_key_name(i)]
            v = outputs[present_value_name(i)]
            if rows is not None:
                k, v = k[:, rows], v[:, rows]
            self.keys[i][:, self.length:end] = k
            self.values[i][:, self.length:end] = v
        self.length = end
