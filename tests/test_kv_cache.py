"""The host KV cache's append: the kept rows of a step land at the end of the filled prefix,
whatever runs they form (one run is copied as a slice, scattered rows run by run)."""

import mmap

import numpy as np
import pytest

from lade_export.kv_cache import KVCache, StackedPresents, _runs, cache_of_feeds, owner_of
from lade_export.specs import ModelDims, past_key_name, present_key_name, present_value_name

DIMS = ModelDims(num_layers=3, heads=4, kv_heads=2, head_dim=4, hidden=16, vocab=32, max_context=64,
                 tied_embeddings=False)
# heads wide enough that 8,192 tokens make a 4 MiB buffer (kv_cache.zeros maps it)
WIDE = ModelDims(num_layers=2, heads=4, kv_heads=2, head_dim=64, hidden=256, vocab=32, max_context=1 << 14,
                 tied_embeddings=False)


def step_outputs(rng, step, dtype):
    """present.* of a step of ``step`` tokens: [1, step, kv_heads, head_dim] per layer, distinct values."""
    shape = (1, step, DIMS.kv_heads, DIMS.head_dim)
    out = {}
    for i in range(DIMS.num_layers):
        out[present_key_name(i)] = rng.standard_normal(shape).astype(dtype)
        out[present_value_name(i)] = rng.standard_normal(shape).astype(dtype)
    return out


def test_row_runs_split_increasing_rows_into_consecutive_stretches():
    assert _runs([0, 1, 2, 5, 6]) == [(0, 0, 3), (3, 5, 2)]
    assert _runs(np.array([3])) == [(0, 3, 1)]
    assert _runs([0, 3, 5]) == [(0, 0, 1), (1, 3, 1), (2, 5, 1)]
    assert _runs([]) == []


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rows", [None, [0], [0, 1, 2], [2, 3, 4, 5], [0, 3, 5], [0, 1, 4, 6, 7]])
@pytest.mark.parametrize("kind", ["separate", "stacked", "stacked, outputs one block", "stacked, one output replaced"])
def test_append_keeps_exactly_the_chosen_rows_in_order(rows, dtype, kind):
    """The decoder's append: the same rows in the same places whether the cache is one block
    (a one-copy write when the outputs are one StackedPresents block, as a bound step's are, and
    the rows one run) or separate buffers, and whatever the outputs are."""
    rng = np.random.default_rng(0)
    cache = KVCache(DIMS, capacity=32, dtype=dtype, stacked=kind != "separate")
    first = step_outputs(rng, 5, dtype)
    cache.append(first)  # a prefill of 5 tokens: every row
    step = step_outputs(rng, 8, dtype)
    outputs = step
    if kind.startswith("stacked, o"):
        presents = StackedPresents(DIMS.num_layers, 8, (DIMS.kv_heads, DIMS.head_dim), dtype)
        for name, view in presents.views.items():
            view[...] = step[name]
        outputs = dict(presents.views)
        if kind.endswith("replaced"):  # a layer's output that is not the block's view: written from that output
            outputs[present_key_name(2)] = step[present_key_name(2)].copy()
            presents.views[present_key_name(2)][...] = 0
        assert (cache._presents_block(outputs) is None) == kind.endswith("replaced")
    cache.append(outputs, None if rows is None else np.asarray(rows))
    kept = list(range(8)) if rows is None else rows
    assert cache.length == 5 + len(kept)
    for i in range(DIMS.num_layers):
        for buffers, name in ((cache.keys, present_key_name(i)), (cache.values, present_value_name(i))):
            np.testing.assert_array_equal(buffers[i][:, :5], first[name])
            np.testing.assert_array_equal(buffers[i][:, 5:cache.length], step[name][:, kept])
            assert not buffers[i][:, cache.length:].any()  # nothing written past the kept rows
    feeds = cache.feeds()
    assert feeds["past_key_values.0.key"].shape == (1, cache.length, DIMS.kv_heads, DIMS.head_dim)
    assert np.shares_memory(feeds["past_key_values.2.value"], cache.values[2])  # a view of the buffer, not a copy


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("src,dst", [(slice(2, 5), slice(7, 10)), (np.array([0, 3, 4, 7]), np.array([1, 12, 20, 30])),
                                     (np.array([5]), np.array([0]))])
def test_store_rows_writes_every_layer_alike_stacked_or_not(src, dst, dtype):
    """The scheduler pool's write (one operation when stacked) puts the same values in the same
    columns as one copy per buffer, and touches nothing else (each layer's view its own)."""
    rng = np.random.default_rng(1)
    step = step_outputs(rng, 8, dtype)
    caches = [KVCache(DIMS, capacity=32, dtype=dtype, stacked=stacked) for stacked in (False, True)]
    for cache in caches:
        for buffer in (*cache.keys, *cache.values):
            buffer[...] = -1
        cache.store_rows(step, src, dst)
    plain, stacked = caches
    assert stacked.nbytes == plain.nbytes
    for i in range(DIMS.num_layers):
        for buffers, name in ((lambda c: c.keys, present_key_name(i)), (lambda c: c.values, present_value_name(i))):
            expect = np.full((1, 32, DIMS.kv_heads, DIMS.head_dim), -1, dtype)
            expect[0, dst] = step[name][0, src]
            assert np.array_equal(buffers(plain)[i], expect)
            assert np.array_equal(buffers(stacked)[i], expect)
    assert stacked.length == 0 and stacked.revision == 0  # a raw write: the caller records it
    # outputs that are one StackedPresents block (a bound step's) are copied from it in one go: same columns
    presents = StackedPresents(DIMS.num_layers, 8, (DIMS.kv_heads, DIMS.head_dim), dtype)
    for name, view in presents.views.items():
        view[...] = step[name]
    assert all(np.shares_memory(v, presents.block) and v.ctypes.data % 64 == 0 for v in presents.views.values())
    replaced = dict(presents.views)  # one layer's output not the block's: the block is not taken as it is
    replaced[present_value_name(1)] = step[present_value_name(1)] * 2
    for outputs, doubled in ((dict(presents.views), False), (replaced, True)):
        from_block = KVCache(DIMS, capacity=32, dtype=dtype, stacked=True)
        from_block.keys[0][...] = -1
        from_block.store_rows(outputs, src, dst)
        for i in range(DIMS.num_layers):
            for buffers, name in ((from_block.keys, present_key_name(i)), (from_block.values, present_value_name(i))):
                expect = np.full((1, 32, DIMS.kv_heads, DIMS.head_dim), -1 if buffers[i] is from_block.keys[0] else 0,
                                 dtype)
                expect[0, dst] = step[name][0, src] * (2 if doubled and name == present_value_name(1) else 1)
                assert np.array_equal(buffers[i], expect), (name, doubled)
    for cache in caches:
        cache.length = 31
    plain_feeds, stacked_feeds = plain.feeds(), stacked.feeds()  # the stacked views come from one slice
    assert sorted(stacked_feeds) == sorted(plain_feeds) and len(plain_feeds) == 2 * DIMS.num_layers
    for name, feed in stacked_feeds.items():
        assert feed.shape == (1, 31, DIMS.kv_heads, DIMS.head_dim) and feed.flags.c_contiguous
        assert np.shares_memory(feed, stacked._block)  # a view, not a copy: the engine reads the cache in place
        assert np.array_equal(feed, plain_feeds[name])


def test_stacked_cache_needs_the_sequence_major_layout():
    with pytest.raises(ValueError, match="stacked KV cache needs the sequence-major layout"):
        KVCache(DIMS, capacity=8, layout="head-major-shared", stacked=True)


@pytest.mark.skipif(not hasattr(mmap, "MAP_PRIVATE"), reason="no private mappings here: kv_cache.zeros is np.zeros")
@pytest.mark.parametrize("stacked", [False, True])
def test_buffers_of_4_mib_and_more_live_in_their_own_mapping_and_behave_as_numpy_zeros(stacked):
    """Large buffers come from an anonymous mapping (no huge-page advice, see kv_cache.zeros), the
    array's base: zero, writable, contiguous; feeds are views and owner_of finds the cache;
    appends land where they do in a small cache."""
    capacity = 8192  # 8192 tokens × 2 heads × 64 × 4 bytes = 4 MiB per layer buffer
    big, small = (KVCache(WIDE, capacity=c, stacked=stacked) for c in (capacity, 64))
    buffer = big._block if stacked else big.keys[0]
    assert isinstance(buffer.base, mmap.mmap) and buffer.nbytes >= 1 << 22
    assert not isinstance(small.keys[0].base, mmap.mmap)
    assert buffer.flags.writeable and buffer.flags.c_contiguous and not buffer.any()
    rng = np.random.default_rng(2)
    shape = (1, 5, WIDE.kv_heads, WIDE.head_dim)
    step = {present_key_name(i): rng.standard_normal(shape).astype(np.float32) for i in range(2)}
    step.update({present_value_name(i): rng.standard_normal(shape).astype(np.float32) for i in range(2)})
    for cache in (big, small):
        cache.append(step)
    for name, feed in big.feeds().items():
        assert np.array_equal(feed, small.feeds()[name]) and feed.shape == (1, 5, 2, 64)
    if not stacked:
        assert owner_of(big.feeds()["past_key_values.0.key"]) is big


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dims, capacity", [(DIMS, 5), (DIMS, 63), (WIDE, 300), (WIDE, 8192)],
                         ids=["tiny", "odd", "small", "mapped"])
def test_every_cache_buffer_starts_on_a_64_byte_line_and_is_zero(stacked, dims, capacity):
    """The attention kernels ask for whole 64-byte lines of a key row: a buffer numpy would put 16
    bytes off a line (np.zeros of a few hundred KB does) starts on one, in either layout and dtype,
    zeroed, writable, and found again by owner_of."""
    layouts = ["sequence-major"] if stacked else ["sequence-major", "head-major-shared"]
    for layout in layouts:
        for dtype in (np.float16, np.float32):
            cache = KVCache(dims, capacity=capacity, layout=layout, dtype=dtype, stacked=stacked, step_room=3)
            for buffer in cache.keys + cache.values:
                assert buffer.ctypes.data % 64 == 0, (layout, dtype, buffer.ctypes.data % 64)
                assert buffer.flags.writeable and buffer.flags.c_contiguous and not buffer.any()
                assert buffer.dtype == dtype
            if not stacked:
                assert owner_of(cache.keys[0]) is cache and owner_of(cache.keys[0][:, :2]) is cache
                assert owner_of(cache.values[0]) is None


@pytest.mark.skipif(not hasattr(mmap, "MAP_PRIVATE"), reason="no private mappings here: kv_cache.zeros is np.zeros")
def test_owner_of_finds_a_mapped_cache_from_its_buffer_or_a_view_in_either_layout():
    """owner_of takes a whole buffer (head-major-shared feeds) or a view of one (sequence-major):
    the mapping under a large buffer is not mistaken for the buffer."""
    for layout in ("sequence-major", "head-major-shared"):
        cache = KVCache(WIDE, capacity=8192, layout=layout, step_room=8)
        assert isinstance(cache.keys[0].base, mmap.mmap)
        assert owner_of(cache.keys[0]) is cache
        assert owner_of(cache.keys[0][:, :3]) is cache
        assert owner_of(cache.values[0]) is None


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dims", [DIMS, WIDE], ids=["small", "mapped"])
def test_cache_of_feeds_knows_its_latest_views_and_nothing_else(stacked, dims):
    rng = np.random.default_rng(3)
    cache = KVCache(dims, capacity=8192 if dims is WIDE else 16, dtype=np.float16, stacked=stacked)
    outputs = {name: rng.standard_normal((1, 3, dims.kv_heads, dims.head_dim)).astype(np.float16)
               for i in range(dims.num_layers) for name in (present_key_name(i), present_value_name(i))}
    cache.append(outputs)
    feeds = {"input_ids": np.zeros((1, 1), np.int64), **cache.feeds()}
    assert cache_of_feeds(feeds) == (cache, 3)
    assert cache_of_feeds({**feeds, **{k: np.array(v) for k, v in cache.feeds().items()}}) is None  # copies
    older = cache.feeds()
    cache.append(outputs, rows=[0])
    assert cache_of_feeds(older) == (cache, 3)  # the length of the views, not the cache's
    latest = cache.feeds()
    assert cache_of_feeds(latest) == (cache, 4) and cache_of_feeds(older) is None  # only the latest feeds() count
    del latest[next(iter(latest))]
    assert cache_of_feeds(latest) is None and cache_of_feeds({}) is None
    other = KVCache(dims, capacity=16, dtype=np.float16, stacked=stacked)
    assert cache_of_feeds({**cache.feeds(), past_key_name(0): other.feeds()[past_key_name(0)]}) is None
    shared = KVCache(dims, capacity=16, layout="head-major-shared", dtype=np.float16)
    assert cache_of_feeds(shared.feeds()) is None
