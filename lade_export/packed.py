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
  request ``owner[c]`` (−1: no request's); ``past`` = ``used`` for the graph;
* ``attention_mask`` [1, 1, step, used + step] — item k's rows see the pool columns its
  request owns and, among this pass's columns ``used + o_k …``, only its own rows, with
  its step mask (block diagonal over the step); every other column is False;
* ``logits_positions`` [1, n_logits] — ``o_k + logit_rows_k`` for every item, in order;
  item k reads ``next_token_ids[:, a_k : a_k + n_k]`` (``a_k`` = logit rows before it).

This needs no new graph input: any step graph built before (``onnx-ops`` and
``group-query-attention``, float32 or quantized) takes a packed pass, because the mask
already isolates rows and the positions are per token.

Where a request's columns go (:class:`TokenPool`) depends on what the engine's attention
costs:

* **regions** — int8-compute lade builds (``AttentionRows`` reading the cache in place and
  skipping every 16-key block a row cannot see; ``Engine.attention_skips``): each request
  gets at admission one contiguous region of prompt + max_new_tokens columns (first fit),
  fills it in order and frees it whole when it leaves (nothing moves). The mask over the
  pool has one run of True per request, so each row's attention costs the blocks of its
  own request (plus one partly seen block at each end of its run); other requests'
  regions and unused room cost a scan of the mask, not arithmetic. A row's bits are the
  same wherever its region lies and whatever else the pool holds (masked keys add
  nothing; ``tests/test_kernels.py``).
* **compact** — every other engine (ONNX Runtime's ``GroupQueryAttention``, the standard
  operators, int8 builds made before the kernels skipped): their attention spans every
  column up to ``past``, so a gap would cost as much as a live token. After each pass the
  kept rows of every item (increasing within an item, items in row order) are appended
  at ``[used, used + kept)``, exactly as one request's :class:`~lade_export.kv_cache.KVCache`
  keeps its accepted rows, so requests' columns interleave; a leave compacts the pool
  (its live columns moved down in order, one copy of the live cache per leave), so a
  request alone sees the columns ``0 … n−1`` it would see alone.

Either way the only copy a pass makes is of accepted tokens. Measured with
``bench/batched_step_options.py``: on the int8 lade build, regions bring a packed pass
close to the per-request bound where the compact pool was well above it (the compact pool
on that engine leaves no block to skip); on the float32 builds a pool with room costs the
room's share of attention and can save nothing, and on ``group-query-attention`` graphs
reserved room would count against the ``max_context`` columns their pool may hold: they
keep the compact pool. The figures: ``bench/results/design-figures.md`` (*Packed passes*)
and ``bench/results/serving-batched.md``. See :mod:`lade_export.scheduler`.
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

    Two ways to place a request's columns (``regions``):

    * compact (``regions=False``): every pass's kept rows are appended after ``used``, so the
      requests' columns interleave pass by pass and the pool holds nothing but live tokens;
      a leave compacts it. For engines whose attention spans every column (the graph's
      ``past``): a hole would cost as much as a live token.
    * regions (``regions=True``, ``sequence-major`` only): :meth:`admit` gives a request one
      contiguous region of ``need`` columns (prompt + max_new_tokens, what it can keep),
      first fit among the free ranges, else after the last region; its tokens fill the
      region in order and :meth:`release` frees it without moving anything. The mask over
      the pool then has one run of True per request, so an attention that skips fully
      masked key blocks (``Engine.attention_skips``) costs each row its own request's blocks
      only: other requests' regions and the unused tail of regions cost nothing. When no
      free range fits below ``limit``, the live regions are moved down (one copy of the live
      columns) and the request goes after them.

    Args:
        dims: the model's shape facts.
        layout: the engine's ``kv_layout``.
        step_room: the widest pass in tokens (scratch after the live columns).
        limit: most columns the pool may hold (live tokens; with regions, reserved
            columns); buffers grow up to it as requests need them (doubling from
            ``initial``), never allocated at the limit.
        initial: first capacity in tokens.
        regions: place each request in a contiguous region (above).
        dtype: the buffers' dtype, the engine's ``kv_dtype``.

    ``used`` is the graph's ``past``: the pool columns a pass feeds, ``[0, used)``; column
    ``c`` belongs to request ``owner[c]`` (−1: free or not yet filled).
    Memory: ``(capacity + step_room) × dims.kv_bytes_per_token`` bytes (:attr:`nbytes`; half
    that in float16).

    Raises:
        ValueError: ``regions`` on a layout other than ``sequence-major``.
        GenerationError: :meth:`commit` beyond ``limit`` (compact) or beyond the request's
            region; :meth:`admit` of a region larger than ``limit`` or of an owner already in.
    """

    def __init__(self, dims: ModelDims, layout: str, step_room: int, limit: int, initial: int = 1024,
                 regions: bool = False, dtype=np.float32):
        if regions and layout != "sequence-major":
            raise ValueError(f"KV regions need the sequence-major cache layout, not {layout!r}")
        self.dims = dims
        self.layout = layout
        self.step_room = step_room
        self.limit = limit
        self.regions = regions
        self.owner = np.zeros(0, dtype=np.int64)  # [used]
        # regions: a pass's kept rows scatter over several requests' regions, written for every
        # layer at once (a stacked cache; KVCache.store_rows)
        self.cache = KVCache(dims, min(initial, limit), layout, step_room=step_room, dtype=dtype, stacked=regions)
        self._region: dict[int, list[int]] = {}  # owner -> [start, size, filled] (regions)

    @property
    def used(self) -> int:
        return len(self.owner)

    @property
    def live(self) -> int:
        """Tokens held over all requests (``used`` less free and unfilled columns)."""
        return int(np.count_nonzero(self.owner >= 0))

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def tokens(self, owner: int) -> int:
        """Columns ``owner`` holds (its cache length)."""
        if self.regions:
            return self._region[owner][2] if owner in self._region else 0
        return int(np.count_nonzero(self.owner == owner))

    def region(self, owner: int) -> tuple[int, int] | None:
        """``(first column, columns)`` of ``owner``'s region (regions), or None."""
        r = self._region.get(owner)
        return (r[0], r[1]) if r is not None else None

    def _grow(self, capacity: int) -> None:
        grown = KVCache(self.dims, capacity, self.layout, step_room=self.step_room, dtype=self.cache.dtype,
                        stacked=self.regions)
        n = self.used
        for old, new in zip((*self.cache.keys, *self.cache.values), (*grown.keys, *grown.values)):
            if self.layout == "sequence-major":
                new[:, :n] = old[:, :n]
            else:
                new[:, :, :n] = old[:, :, :n]
        grown.length = n
        self.cache = grown

    def admit(self, owner: int, need: int) -> None:
        """Give ``owner`` a region of ``need`` columns (regions; a no-op when compact): first
        fit among the free ranges below the last region, else after it (compacting the live
        regions first when that would pass ``limit``); grows the buffers as needed."""
        if not self.regions:
            return
        if owner in self._region:
            raise GenerationError(f"KV pool: request {owner} already holds a region")
        if need > self.limit:
            raise GenerationError(f"KV pool full: a region of {need} tokens exceeds {self.limit}")
        at, end = None, 0
        for start, size, _ in sorted(self._region.values()):
            if at is None and start - end >= need:
                at = end
            end = start + size
        if at is None:
            if end + need > self.limit:
                self._compact()
                end = sum(r[1] for r in self._region.values())
                if end + need > self.limit:
                    raise GenerationError(f"KV pool full: {end} reserved + {need} tokens exceed {self.limit}")
            at = end
        if at + need > self.cache.capacity:
            self._grow(min(max(2 * self.cache.capacity, at + need), self.limit))
        self._region[owner] = [at, need, 0]

    def _compact(self) -> None:
        """Move the live regions down in order, no gap between them (one copy of their filled columns)."""
        end = 0
        for owner, r in sorted(self._region.items(), key=lambda kv: kv[1][0]):
            start, size, filled = r
            if start != end and filled:
                for buffer in (*self.cache.keys, *self.cache.values):
                    buffer[:, end:end + filled] = buffer[:, start:start + filled]  # end < start: reads before writes
                self.cache.rewrote(end)  # for engines that keep a copy of the pool on a device
            r[0] = end
            end += size
        self._reshape()

    def _reshape(self) -> None:
        """``owner`` from the regions: up to the last filled column, −1 where free or unfilled."""
        used = max((start + filled for start, _, filled in self._region.values()), default=0)
        owner = np.full(used, -1, dtype=np.int64)
        for o, (start, _, filled) in self._region.items():
            owner[start:start + filled] = o
        self.owner = owner
        self.cache.length = used

    def reserve(self, step: int) -> None:
        """Make room for a pass of ``step`` rows after the live columns (grows the buffers;
        a copy of the live columns, amortized by doubling). For ``sequence-major`` the step
        returns it, but what it keeps needs the same room. With regions there is nothing to
        do: what a pass keeps goes into its requests' regions."""
        if self.regions:
            return
        need = self.used + step
        if need <= self.cache.capacity:
            return
        self._grow(min(max(2 * self.cache.capacity, need), max(self.limit, need)))

    def feeds(self) -> dict:
        """``past_key_values.*`` of the pool (see :meth:`lade_export.kv_cache.KVCache.feeds`)."""
        self.cache.length = self.used
        return self.cache.feeds()

    def commit(self, outputs: dict, kept: list[tuple[int, np.ndarray]], step: int) -> None:
        """Keep, after a pass of ``step`` rows, the rows ``kept`` = ``[(owner, pass rows)]``
        (rows increasing over the whole list); compact: the owners' new columns follow
        ``used``; regions: each owner's follow its filled columns in its region."""
        if self.regions:
            for o, rows in kept:
                start, size, filled = self._region[o]
                if filled + len(rows) > size:
                    raise GenerationError(f"KV region of request {o} full: {filled} + {len(rows)} tokens exceed "
                                          f"its {size}")
            kept = [(o, rows) for o, rows in kept if len(rows)]
            if len(kept) == 1:  # one owner: its rows go to one run of its region
                o, rows = kept[0]
                at = self._region[o][0] + self._region[o][2]
                # increasing rows without a gap (a greedy step, a prompt chunk): a slice, not a gather
                src = slice(int(rows[0]), int(rows[-1]) + 1) if rows[-1] - rows[0] == len(rows) - 1 else rows
                dst = slice(at, at + len(rows))
            elif kept:  # several: one gather and one scatter per tensor for all of them (not one per owner)
                src = np.concatenate([rows for _, rows in kept]).astype(np.intp)
                dst = np.concatenate([np.arange(len(rows)) + (self._region[o][0] + self._region[o][2])
                                      for o, rows in kept])
            if kept:
                self.cache.store_rows(outputs, src, dst)
            for o, rows in kept:
                r = self._region[o]
                self.cache.rewrote(r[0] + r[2])  # for engines that keep a copy of the pool on a device
                r[2] += len(rows)
            self._reshape()
            return
        rows = np.concatenate([r for _, r in kept]).astype(np.int64) if kept else np.zeros(0, np.int64)
        if self.used + len(rows) > self.limit:
            raise GenerationError(f"KV pool full: {self.used} + {len(rows)} tokens exceed {self.limit}")
        self.cache.length = self.used
        # every row kept (a greedy step, a prompt chunk): slices, not a gather of each present tensor
        self.cache.append(outputs, None if len(rows) == step else rows, step=step)
        self.owner = np.concatenate([self.owner, *[np.full(len(r), o, np.int64) for o, r in kept]])

    def release(self, owner: int) -> None:
        """Free ``owner``'s columns: regions: its region, nothing moves; compact: the pool is
        compacted (live columns moved down in order)."""
        if self.regions:
            if self._region.pop(owner, None) is not None:
                self._reshape()
            return
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
