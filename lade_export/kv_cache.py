"""The host-side KV cache one request owns.

Two layouts, the step graph's contract (:mod:`lade_export.specs`, ``KV_LAYOUTS``); in
both, per layer one key buffer and one value buffer (float32, or float16 where the engine
keeps a half-precision cache: its ``kv_dtype``), RoPE already applied to the
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

Engines that keep a copy of the cache in device memory (TensorRT, ONNX Runtime with I/O
binding, :mod:`lade_export.backends.cuda`) read the cache's write log instead of the
buffers: every write has a :attr:`KVCache.revision`, and :meth:`KVCache.writes_since`
says which rows changed since the revision an engine last saw and, for an append, which
rows of which step output they came from, so the engine moves those rows on the device
and uploads nothing else. Code that writes the buffers other than through
:meth:`KVCache.append` must call :meth:`KVCache.rewrote` (setting :attr:`length` by hand
counts as such a write).
"""

from __future__ import annotations

import collections
import mmap
import operator
import weakref

import numpy as np

from .errors import GenerationError
from .specs import KV_LAYOUTS, ModelDims, past_key_name, past_value_name, present_key_name, present_value_name


#: Writes a cache remembers for :meth:`KVCache.writes_since` (an engine that saw the cache
#: more writes ago than this re-reads all of it).
WRITE_LOG = 8


#: id(first key buffer) -> the cache that owns it (see :func:`owner_of`).
_OWNERS: "weakref.WeakValueDictionary[int, KVCache]" = weakref.WeakValueDictionary()
#: id of the array a sequence-major cache's feeds are views of (its layer-0 key buffer, or a
#: stacked cache's block) -> the cache (:func:`cache_of_feeds`)
_VIEW_OWNERS: "weakref.WeakValueDictionary[int, KVCache]" = weakref.WeakValueDictionary()


def _block_present_names(num_layers: int) -> list[str]:
    """``present.*`` output names in a stacked block's order: every layer's key, then every
    layer's value."""
    return [present_key_name(i) for i in range(num_layers)] + [present_value_name(i) for i in range(num_layers)]


#: id of a :class:`StackedPresents` block -> that object (:meth:`KVCache.store_rows`).
_PRESENT_BLOCKS: "weakref.WeakValueDictionary[int, StackedPresents]" = weakref.WeakValueDictionary()


class StackedPresents:
    """Output arrays for a step's ``present.*`` ([1, step, kv_heads, head_dim] each) that are
    views of one block [2·layers, 1, step, kv_heads, head_dim]: the keys of layers 0 … L−1,
    then their values, a stacked cache's order. An engine that binds its outputs to these
    (:class:`lade_export.backends.onnxruntime.OrtEngine`'s bound steps) lets a stacked
    :class:`KVCache` store a pass's kept rows in one copy from the block, where separate
    outputs are first joined (:meth:`KVCache.store_rows`). The registration lives as long as
    this object.

    Args:
        num_layers: decoder layers L.
        step: rows of the step.
        row_shape: ``(kv_heads, head_dim)``.
        dtype: the cache's element type (float32 or float16).
    """

    def __init__(self, num_layers: int, step: int, row_shape: tuple, dtype):
        self.block = zeros((2 * num_layers, 1, step, *row_shape), dtype)  # on a line, as the cache
        #: the outputs' names, in the block's order
        self.names = _block_present_names(num_layers)
        #: the outputs by name, each a view of :attr:`block`
        self.views = dict(zip(self.names, self.block))
        _PRESENT_BLOCKS[id(self.block)] = self


#: numpy asks Linux for transparent huge pages on every array of this many bytes or more
#: (``madvise(MADV_HUGEPAGE)``, numpy's ``hugepage`` allocator policy).
_HUGEPAGE_ADVICE_BYTES = 1 << 22


#: Every cache buffer starts on a 64-byte line (a cache line of x86-64 and most ARM cores), so a
#: head's 128-byte key row of a float16 cache spans two lines, not three, and the attention kernels'
#: prefetches cover it (a one-token step at 1,024 cached tokens, SmolLM2 int4: 0.88× with the rows
#: 16 bytes off the lines, 0.79× on them, against before either; ``bench/results/step-costs.md``).
CACHE_ALIGNMENT = 64


def zeros(shape: tuple, dtype) -> np.ndarray:
    """A zeroed buffer for a cache, its first byte on a :data:`CACHE_ALIGNMENT` boundary:
    ``np.zeros`` (numpy promises 16 bytes), except that on POSIX systems one of 4 MiB or
    more lies in a private anonymous memory mapping of its own (page-aligned; the OS zeroes its
    pages on first touch; numpy's huge-page advice is not given). On virtual machines whose balloon device
    reports free memory to the host (virtio-balloon free page reporting, as on Firecracker
    hosts), free blocks of 2 MiB and more are handed back to the host, so the first touch of a
    transparent huge page, which takes such a block, waits for the host to back it again: ~9 ms
    per 2 MiB on the machine of ``bench/results``, ~10× a plain page's first touch, while one
    freed and taken again soon after is fast (no compaction: ``compact_stall`` stayed 0).
    A scheduler's pool growing while requests ran stalled every stream for that long
    (``bench/results/serving.md``).

    Such an array does not own its data (``flags.owndata`` is False, ``resize`` refuses): its
    ``base`` is the ``mmap.mmap`` (or, below 4 MiB, a ``bytearray`` a line longer than the
    buffer), kept alive by the array and its views and unmapped after them (closing a mapping by
    hand while they live would leave them pointing at unmapped memory; nothing here does). Views
    of the array have the array as their base, as with ``np.zeros``. A forked process gets a
    copy-on-write copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _HUGEPAGE_ADVICE_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        raw = bytearray(nbytes + CACHE_ALIGNMENT)  # zeroed (calloc); not resizable while the array lives
        start = -np.frombuffer(raw, np.uint8).ctypes.data % CACHE_ALIGNMENT
        return np.ndarray(shape, dtype=dtype, buffer=raw, offset=start)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))  # fd −1: anonymous
    return np.ndarray(shape, dtype=dtype, buffer=mapping)


def _stacked_zeros(count: int, shape: tuple, dtype) -> np.ndarray:
    """``count`` zeroed buffers of ``shape`` in one block [count, *shape] (:func:`zeros`), each
    starting on a :data:`CACHE_ALIGNMENT` line: a buffer whose bytes are not a multiple of the
    line (a tiny model's) is followed by padding, and the block is then a strided view."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes % CACHE_ALIGNMENT == 0:
        return zeros((count, *shape), dtype)
    stride = -(-nbytes // CACHE_ALIGNMENT) * CACHE_ALIGNMENT
    flat = zeros((count * stride,), np.uint8)
    inner = np.empty(shape, dtype).strides
    return np.lib.stride_tricks.as_strided(flat.view(dtype), shape=(count, *shape), strides=(stride, *inner))


def cache_of_feeds(feeds: dict) -> tuple[KVCache, int] | None:
    """The ``sequence-major`` :class:`KVCache` (stacked or not) whose latest
    :meth:`KVCache.feeds` views ``feeds`` holds, every ``past_key_values.*`` feed being that
    very view object, and the views' length in tokens (the cache's length when they were
    made; an append since does not change what they show); None for any other feeds (the
    caller's own arrays, views of an earlier :meth:`KVCache.feeds` call, a
    ``head-major-shared`` cache). An engine that binds a cache's buffers
    [1, capacity, kv_heads, head_dim] once and widens the mask reads the cache through this
    (:meth:`lade_export.backends.onnxruntime.OrtEngine.run`)."""
    feed = feeds.get(past_key_name(0))
    base = getattr(feed, "base", None)
    cache = _VIEW_OWNERS.get(id(base)) if isinstance(base, np.ndarray) else None
    if cache is None or cache._views is None:
        return None
    length, views = cache._views
    for name, view in views.items():
        if feeds.get(name) is not view:
            return None
    return cache, length


def owner_of(feed) -> KVCache | None:
    """The :class:`KVCache` whose layer-0 key buffer ``feed`` is or is a view of (a
    ``past_key_values.0.key`` feed from :meth:`KVCache.feeds`), else None."""
    base = feed.base if isinstance(getattr(feed, "base", None), np.ndarray) else feed
    cache = _OWNERS.get(id(base))
    return cache if cache is not None and cache.keys[0] is base else None


def _runs(rows) -> list[tuple[int, int, int]]:
    """Increasing step rows as runs of consecutive rows: (offset among the kept rows, first step
    row, length) — [0, 1, 2, 5, 6] gives [(0, 0, 3), (3, 5, 2)]."""
    runs = []
    for at, row in enumerate(int(r) for r in rows):
        if runs and runs[-1][1] + runs[-1][2] == row:
            runs[-1][2] += 1
        else:
            runs.append([at, row, 1])
    return [tuple(r) for r in runs]


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
        dtype: the buffers' dtype, the engine's ``kv_dtype`` (float32; float16 for the
            integer path's half-precision cache).
        stacked: ``sequence-major`` only: every layer's key and value buffer is a view of
            one array ``[2·num_layers, 1, capacity, kv_heads, head_dim]`` (keys, then
            values), so :meth:`store_rows` copies a pass's rows for all layers in one
            operation (the scheduler's pool: many requests' rows scattered per pass). A
            stacked cache's feeds are views of that array, which device mirrors do not
            recognise (:func:`owner_of` returns None): for CPU engines.

    Raises:
        ValueError: an unknown ``layout``; ``stacked`` with another layout.
        GenerationError: an append would exceed ``capacity``.
    """

    def __init__(self, dims: ModelDims, capacity: int, layout: str = "sequence-major", step_room: int = 0,
                 dtype=np.float32, stacked: bool = False):
        if layout not in KV_LAYOUTS:
            raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
        if stacked and layout != "sequence-major":
            raise ValueError(f"a stacked KV cache needs the sequence-major layout, not {layout!r}")
        self.dims = dims
        self.capacity = capacity
        self.layout = layout
        self._length = 0
        self.revision = 0
        #: (revision, first row written, source output or None, rows of the source, rows written)
        self._writes: collections.deque = collections.deque(maxlen=WRITE_LOG)
        if layout == "sequence-major":
            shape = (1, capacity, dims.kv_heads, dims.head_dim)
        else:
            shape = (1, dims.kv_heads, capacity + step_room, dims.head_dim)
        self.dtype = np.dtype(dtype)
        self.stacked = stacked
        if stacked:
            self._block = _stacked_zeros(2 * dims.num_layers, shape, self.dtype)
            self.keys = list(self._block[:dims.num_layers])
            self.values = list(self._block[dims.num_layers:])
        else:
            self.keys = [zeros(shape, self.dtype) for _ in range(dims.num_layers)]
            self.values = [zeros(shape, self.dtype) for _ in range(dims.num_layers)]
        self._present = _block_present_names(dims.num_layers)
        self._shared_feeds = None  # feeds() of a head-major-shared cache, built once
        # (past key name, past value name, present key name, present value name) per layer
        self._names = [(past_key_name(i), past_value_name(i), present_key_name(i), present_value_name(i))
                       for i in range(dims.num_layers)]
        self._past = [k for k, _, _, _ in self._names] + [v for _, v, _, _ in self._names]  # block order
        _OWNERS[id(self.keys[0])] = self
        self._views = None  # (length, the feeds() of that length), for cache_of_feeds
        if layout == "sequence-major":
            _VIEW_OWNERS[id(self._block if stacked else self.keys[0])] = self

    @property
    def length(self) -> int:
        """Tokens held (the filled prefix of the buffers)."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        # Set by hand, the length follows writes made outside append (a pool moving its
        # columns, a copy into new buffers): rows from the old length on when it grows,
        # any row when it shrinks.
        value = int(value)
        if value != self._length:
            self.rewrote(self._length if value > self._length else 0)
            self._length = value

    def rewrote(self, start: int) -> None:
        """Record that rows from ``start`` on were written other than by :meth:`append`."""
        self.revision += 1
        self._writes.append((self.revision, int(start), None, None, None))

    def writes_since(self, revision: int) -> list | None:
        """The writes after ``revision``, oldest first: ``(revision, first row, source,
        rows, count)``. For an append of a ``sequence-major`` cache ``source`` is the
        ``present.0.key`` output it copied from (None once that output no longer exists),
        ``rows`` the step rows it kept (None: the first ``count``) and ``count`` the rows
        written; for any other write ``source`` is None and the rows from ``first row`` on
        may have changed. None when the log no longer reaches back to ``revision`` (every
        row may have changed). An output that still exists may have been overwritten by a
        later step on an engine that returns bound arrays (the ONNX Runtime CPU engine's
        bound-buffer path); the log's readers, device mirrors, never run on such engines."""
        if revision == self.revision:
            return []
        if revision > self.revision or not self._writes or self._writes[0][0] > revision + 1:
            return None
        return [(r, start, source() if source is not None else None, rows, count)
                for r, start, source, rows, count in self._writes if r > revision]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (keys and values, all layers)."""
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def feeds(self) -> dict:
        """``past_key_values.*`` feeds: views [1, length, kv_heads, head_dim] of the buffers
        (``sequence-major``; contiguous, so engines read them without a copy; the latest
        call's views are remembered, for :func:`cache_of_feeds`), or the buffers themselves
        [1, kv_heads, capacity + step_room, head_dim] (``head-major-shared``; the engine
        writes the step into them). A new dict each call (``sequence-major``)."""
        shared = self.layout == "head-major-shared"
        if shared and self._shared_feeds is not None:
            return self._shared_feeds  # the same buffers every step
        if shared:
            self._shared_feeds = {name: buffer for (k, v, _, _), key, value in zip(self._names, self.keys, self.values)
                                  for name, buffer in ((k, key), (v, value))}
            return self._shared_feeds
        n = self.length
        if self.stacked:  # every buffer's view from one slice of the block: [2·layers, 1, n, kv_heads, head_dim]
            out = dict(zip(self._past, self._block[:, :, :n]))
        else:
            out = {}
            for (k, v, _, _), key, value in zip(self._names, self.keys, self.values):
                out[k] = key[:, :n]
                out[v] = value[:, :n]
        self._views = (n, out)
        return dict(out)

    def store_rows(self, outputs: dict, src, dst) -> None:
        """Copy rows ``src`` of every ``present.*`` output ([1, step, kv_heads, head_dim]) to
        columns ``dst`` of the matching buffers (``sequence-major``), every layer alike. A raw
        write: it changes neither :attr:`length` nor the write log (the caller records it,
        :meth:`rewrote`). Stacked, the outputs are joined once and written in one operation
        (outputs that are the views of one :class:`StackedPresents` block are written from the
        block, without the join); otherwise one copy per buffer. Same values either way (a
        copy; a float32 output into a float16 cache is rounded to nearest even, as any numpy
        assignment).

        Args:
            outputs: the step's outputs by name.
            src: step rows, a slice or int [n].
            dst: columns, a slice or int [n] (as many as ``src``).
        """
        if self.stacked:
            block = self._presents_block(outputs)
            if block is not None:
                self._block[:, 0, dst] = block[:, 0, src]  # the outputs are already one block
            else:
                self._block[:, 0, dst] = np.concatenate([outputs[n] for n in self._present])[:, src]
            return
        for name, buffer in zip(self._present, (*self.keys, *self.values)):
            buffer[0, dst] = outputs[name][0, src]

    def _presents_block(self, outputs: dict) -> np.ndarray | None:
        """The :class:`StackedPresents` block [2·layers, 1, step, kv_heads, head_dim] whose views
        are this stacked cache's ``present.*`` outputs, each in its place in the cache's order;
        None when any output is not (a replaced output, another engine's arrays)."""
        first = outputs[self._present[0]]
        presents = _PRESENT_BLOCKS.get(id(first.base)) if isinstance(first.base, np.ndarray) else None
        # (found by the block's id, which is unique while the block is alive: it is that block)
        if presents is not None and presents.names == self._present \
                and all(map(operator.is_, map(outputs.__getitem__, self._present), presents.views.values())):
            return presents.block
        return None

    def append(self, outputs: dict, rows: np.ndarray | None = None, step: int | None = None) -> None:
        """Keep this step's keys/values at ``rows`` of the step (all rows when None). Stacked,
        with outputs that are one :class:`StackedPresents` block (an ONNX Runtime step bound to
        this cache) and rows that are one run of consecutive rows (a greedy step, an accepted
        prefix of a chain), in one copy; otherwise one copy per buffer (and run). Same values.

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
        if self._length + count > self.capacity:
            raise GenerationError(f"KV cache full: {self._length} + {count} tokens exceed capacity {self.capacity}")
        start, end = self._length, self._length + count
        self.revision += 1
        source = outputs.get(present_key_name(0)) if self.layout == "sequence-major" else None
        source = weakref.ref(source) if isinstance(source, np.ndarray) else None  # the log keeps no output alive
        self._writes.append((self.revision, start, source, None if rows is None else np.asarray(rows), count))
        if self.layout == "head-major-shared":
            if rows is not None and not np.array_equal(rows, np.arange(count)):
                source = start + np.asarray(rows)
                for buffer in (*self.keys, *self.values):
                    buffer[:, :, start:end] = buffer[:, :, source]  # rows[j] ≥ j: reads before writes
            self._length = end
            return
        # the kept rows as runs of consecutive step rows, each copied as a slice (a greedy step or the
        # accepted prefix of a chain: one run), or by its index for a single row: no gathered temporaries
        runs = None if rows is None else _runs(rows)
        if self.stacked and (runs is None or len(runs) == 1):  # one copy when the outputs are one block
            block = self._presents_block(outputs)
            if block is not None:
                first = 0 if runs is None else runs[0][1]
                self._block[:, 0, start:end] = block[:, 0, first:first + count]
                self._length = end
                return
        for (_, _, kname, vname), keys, values in zip(self._names, self.keys, self.values):
            k, v = outputs[kname], outputs[vname]
            if runs is None:
                keys[:, start:end] = k
                values[:, start:end] = v
                continue
            if len(runs) == 1:
                first = runs[0][1]
                keys[:, start:end] = k[:, first:first + count]
                values[:, start:end] = v[:, first:first + count]
                continue
            k, v, keys, values = k[0], v[0], keys[0], values[0]
            for at, first, n in runs:
                if n == 1:
                    keys[start + at] = k[first]
                    values[start + at] = v[first]
                else:
                    keys[start + at:start + at + n] = k[first:first + n]
                    values[start + at:start + at + n] = v[first:first + n]
        self._length = end
