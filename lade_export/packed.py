"""The packed step: several requests' steps as the rows of one forward pass of the
unchanged step graph, over one shared token pool.

Layout of a packed pass (computed here and nowhere else; the graph's contract is
:mod:`lade_export.specs`, batch 1):

* rows — item k (one request's decode step, or a chunk of its prompt) owns rows
  ``[o_k, o_k + w_k)`` of the step axis, in the order the scheduler chose; ``o_0 = 0``,
  ``o_{k+1} = o_k + w_k``, ``step = Σ w_k``;
* ``input_ids`` [1, step], ``position_ids`` [1, step] — item k's own ids and positions
  (a request's positions count its own tokens only: they are what it gets alone);
* the pool — the KV cache of every active request in one buffer set of the engine's
  layout (:data:`lade_export.specs.KV_LAYOUTS`); column ``c < used`` belongs to the
  request ``owner[c]``; ``past`` = ``used`` for the graph;
* ``attention_mask`` [1, 1, step, used + step] — item k's rows see the pool columns its
  request owns and, among this pass's columns ``used + o_k …``, only its own rows, with
  its step mask (block diagonal over the step); every other column is False;
* ``logits_positions`` [1, n_logits] — ``o_k + logit_rows_k`` for every item, in order;
  item k reads ``next_token_ids[:, a_k : a_k + n_k]`` (``a_k`` = logit rows before it).

After the pass, the kept rows of every item (increasing within an item, items in row
order, so increasing overall) are moved to ``[used, used + kept)``, exactly as one
request's :class:`~lade_export.kv_cache.KVCache` keeps its accepted rows; the only copy
is of accepted tokens. A request that leaves frees its columns; the pool is compacted
then (its live columns moved down in order, one copy of the live cache per leave), so a
request alone in the pool sees the columns ``0 … n−1`` it would see alone.

This needs no new graph input: any step graph built before (``onnx-ops`` and
``group-query-attention``, float32 or quantized) takes a packed pass, because the mask
already isolates rows and the positions are per token. The price is attention work on
columns a row cannot see (each row's scores span the whole pool); see
:mod:`lade_export.scheduler` for the measurement and the bound on it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import GenerationError
from .kv_cache import KVCache
from .specs import ModelDims


@dataclasses.dataclass
class PackedItem:
    """One request's rows in a packed pass.

    Attributes:
        owner: the request's pool id (``TokenPool.owner`` value of its columns).
        input_ids: int64 [w].
        position_ids: int64 [w], the request's own positions.
        step_mask: bool [w, w], lower-triangular (a lookahead layout's or causal).
        logit_rows: int64 [n], rows of the item (0-based) whose logits are read.
        rows: row offset ``o`` of the item in the pass (set by :func:`pack`).
        logits_at: offset ``a`` of its logits in ``n_logits`` (set by :func:`pack`).
    """

    owner: int
    input_ids: np.ndarray
    position_ids: np.ndarray
    step_mask: np.ndarray
    logit_rows: np.ndarray
    rows: int = 0
    logits_at: int = 0

    @property
    def width(self) -> int:
        return len(self.input_ids)


def pack(items: list[PackedItem], owner: np.ndarray) -> dict:
    """Feeds (without the pool's cache) of one packed pass; sets each item's ``rows`` and
    ``logits_at``.

    Args:
        items: at least one, in row order.
        owner: int64 [used], the pool's column owners.

    Returns:
        batch-1 feeds: int64 ``input_ids``/``position_ids`` [1, step], bool
        ``attention_mask`` [1, 1, step, used + step], int64 ``logits_positions`` [1, n_logits].
        An item without logit rows gets none; a pass where no item reads logits reads its
        last row (the graph needs n_logits ≥ 1).
    """
    used = len(owner)
    step = sum(it.width for it in items)
    mask = np.zeros((step, used + step), dtype=bool)
    o = a = 0
    logits = []
    for it in items:
        it.rows, it.logits_at = o, a
        w = it.width
        mask[o:o + w, :used] = (owner == it.owner)[None, :]
        mask[o:o + w, used + o:used + o + w] = it.step_mask
        logits.append(o + np.asarray(it.logit_rows, dtype=np.int64))
        o += w
        a += len(it.logit_rows)
    rows = np.concatenate(logits) if a else np.asarray([step - 1], dtype=np.int64)
    return {
        "input_ids": np.concatenate([it.input_ids for it in items]).astype(np.int64)[None],
        "position_ids": np.concatenate([it.position_ids for it in items]).astype(np.int64)[None],
        "attention_mask": mask[None, None],
        "logits_positions": rows[None],
    }


def item_outputs(outputs: dict, item: PackedItem) -> dict:
    """An item's view of the pass's outputs, as its own batch-1 step would return them:
    ``next_token_ids`` int64 [1, n] (and ``logits`` float [1, n, vocab] when present)."""
    a, n = item.logits_at, len(item.logit_rows)
    out = {"next_token_ids": outputs["next_token_ids"][:, a:a + n]}
    if "logits" in outputs:
        out["logits"] = outputs["logits"][:, a:a + n]
    return out


class TokenPool:
    """The KV cache of every request of a scheduler: one buffer set, columns owned per request.

    Args:
        dims: the model's shape facts.
        layout: the engine's ``kv_layout``.
        step_room: the widest pass in tokens (scratch after the live columns).
        limit: most live tokens (columns) the pool may hold; buffers grow up to it as
            requests need them (doubling from ``initial``), never allocated at the limit.
        initial: first capacity in tokens.

    Memory: ``(capacity + step_room) × dims.kv_bytes_per_token`` bytes (:attr:`nbytes`).

    Raises:
        GenerationError: :meth:`commit` beyond ``limit``.
    """

    def __init__(self, dims: ModelDims, layout: str, step_room: int, limit: int, initial: int = 1024):
        self.dims = dims
        self.layout = layout
        self.step_room = step_room
        self.limit = limit
        self.owner = np.zeros(0, dtype=np.int64)  # [used]
        self.cache = KVCache(dims, min(initial, limit), layout, step_room=step_room)

    @property
    def used(self) -> int:
        return len(self.owner)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def tokens(self, owner: int) -> int:
        """Columns ``owner`` holds (its cache length)."""
        return int(np.count_nonzero(self.owner == owner))

    def reserve(self, step: int) -> None:
        """Make room for a pass of ``step`` rows after the live columns (grows the buffers;
        a copy of the live columns, amortized by doubling). For ``sequence-major`` the step
        returns it, but what it keeps needs the same room."""
        need = self.used + step
        if need <= self.cache.capacity:
            return
        capacity = min(max(2 * self.cache.capacity, need), max(self.limit, need))
        grown = KVCache(self.dims, capacity, self.layout, step_room=self.step_room)
        n = self.used
        for old, new in zip((*self.cache.keys, *self.cache.values), (*grown.keys, *grown.values)):
            if self.layout == "sequence-major":
                new[:, :n] = old[:, :n]
            else:
                new[:, :, :n] = old[:, :, :n]
        grown.length = n
        self.cache = grown

    def feeds(self) -> dict:
        """``past_key_values.*`` of the pool (see :meth:`lade_export.kv_cache.KVCache.feeds`)."""
        self.cache.length = self.used
        return self.cache.feeds()

    def commit(self, outputs: dict, kept: list[tuple[int, np.ndarray]], step: int) -> None:
        """Keep, after a pass of ``step`` rows, the rows ``kept`` = ``[(owner, pass rows)]``
        (rows increasing over the whole list); the owners' new columns follow ``used``."""
        rows = np.concatenate([r for _, r in kept]).astype(np.int64) if kept else np.zeros(0, np.int64)
        if self.used + len(rows) > self.limit:
            raise GenerationError(f"KV pool full: {self.used} + {len(rows)} tokens exceed {self.limit}")
        self.cache.length = self.used
        self.cache.append(outputs, rows, step=step)
        self.owner = np.concatenate([self.owner, *[np.full(len(r), o, np.int64) for o, r in kept]])

    def release(self, owner: int) -> None:
        """Free ``owner``'s columns and compact the pool (live columns moved down in order)."""
        live = np.flatnonzero(self.owner != owner)
        if len(live) == self.used:
            return
        if len(live) and live[-1] >= len(live):  # something after a hole moves
            for buffer in (*self.cache.keys, *self.cache.values):
                if self.layout == "sequence-major":
                    buffer[:, :len(live)] = buffer[:, live]
                else:
                    buffer[:, :, :len(live)] = buffer[:, :, live]
        self.owner = self.owner[live]
        self.cache.length = self.used
