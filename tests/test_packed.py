"""The scheduler's KV pool (lade_export.packed.TokenPool): compact columns and per-request
regions — allocation, release, reuse, growth, bytes, and what a packed pass's mask sees."""

import numpy as np
import pytest

from lade_export.errors import GenerationError
from lade_export.packed import PackedItem, TokenPool, pack
from lade_export.specs import ModelDims, present_key_name, present_value_name

DIMS = ModelDims(num_layers=2, heads=2, kv_heads=1, head_dim=4, hidden=8, vocab=11, max_context=64,
                 tied_embeddings=False)


def _outputs(step, tag):
    """A pass's present.* whose row r of layer i holds tag·1000 + i·100 + r (key) and its negative (value)."""
    out = {}
    for i in range(DIMS.num_layers):
        rows = (tag * 1000 + i * 100 + np.arange(step, dtype=np.float32))[None, :, None, None]
        out[present_key_name(i)] = np.broadcast_to(rows, (1, step, 1, 4)).copy()
        out[present_value_name(i)] = -out[present_key_name(i)]
    return out


def _columns(pool, layer=0):
    return pool.cache.keys[layer][0, :pool.used, 0, 0].tolist()


def test_regions_first_fit_release_reuse_and_one_mask_run_per_request():
    pool = TokenPool(DIMS, "sequence-major", 0, limit=40, initial=8, regions=True)
    assert pool.nbytes == 8 * DIMS.kv_bytes_per_token
    pool.admit(1, 6)
    pool.admit(2, 10)  # past the 8 columns: the buffers double to 16
    assert (pool.region(1), pool.region(2), pool.cache.capacity) == ((0, 6), (6, 10), 16)
    assert pool.nbytes == 16 * DIMS.kv_bytes_per_token and pool.used == 0
    # one pass: request 1 keeps rows 0, 1 and request 2 rows 2, 4 of a 5-row step
    pool.commit(_outputs(5, 1), [(1, np.array([0, 1])), (2, np.array([2, 4]))], 5)
    assert pool.used == 8 and pool.owner.tolist() == [1, 1, -1, -1, -1, -1, 2, 2]
    assert _columns(pool) == [1000, 1001, 0, 0, 0, 0, 1002, 1004]
    assert pool.cache.values[1][0, 7, 0, 0] == -1104 and (pool.tokens(1), pool.tokens(2)) == (2, 2)
    pool.commit(_outputs(2, 2), [(1, np.array([0])), (2, np.array([1]))], 2)
    assert pool.owner.tolist() == [1, 1, 1, -1, -1, -1, 2, 2, 2] and pool.live == 6
    # the packed mask: each request's rows see one run of its own columns, then their own step rows
    items = [PackedItem(1, np.array([3]), np.array([3]), np.ones((1, 1), bool), np.array([0])),
             PackedItem(2, np.array([4]), np.array([3]), np.ones((1, 1), bool), np.array([0]))]
    mask = pack(items, pool.owner)["attention_mask"][0, 0]
    assert mask.tolist() == [[True] * 3 + [False] * 6 + [True, False], [False] * 6 + [True] * 3 + [False, True]]
    # release: nothing moves; the hole is reused first fit by a request that fits in it
    pool.release(1)
    assert pool.region(1) is None and pool.owner.tolist() == [-1] * 6 + [2, 2, 2] and pool.tokens(1) == 0
    assert _columns(pool)[6:] == [1002, 1004, 2001]
    pool.admit(3, 5)
    pool.admit(4, 4)  # does not fit in the 1 column left before request 2: after it
    assert (pool.region(3), pool.region(4)) == ((0, 5), (16, 4))
    assert pool.cache.capacity == 32 and _columns(pool)[6:9] == [1002, 1004, 2001]  # grown, columns kept
    pool.release(2)
    pool.release(3)
    pool.release(4)
    assert pool.used == 0 and pool.owner.tolist() == []


def test_regions_compact_when_fragmented_and_refuse_what_cannot_fit():
    pool = TokenPool(DIMS, "sequence-major", 0, limit=20, initial=20, regions=True)
    for owner, need in ((1, 6), (2, 6), (3, 6)):
        pool.admit(owner, need)
    pool.commit(_outputs(3, 1), [(1, np.array([0])), (2, np.array([1])), (3, np.array([2]))], 3)
    pool.release(2)  # a 6-column hole in the middle, 2 free at the end
    pool.admit(4, 8)  # fits in neither: regions 1 and 3 move down, 4 goes after them
    assert (pool.region(1), pool.region(3), pool.region(4)) == ((0, 6), (6, 6), (12, 8))
    assert pool.owner.tolist() == [1, -1, -1, -1, -1, -1, 3] and _columns(pool) == [1000, 0, 0, 0, 0, 0, 1002]
    assert pool.cache.capacity == 20
    with pytest.raises(GenerationError, match=r"^KV pool full: 20 reserved \+ 1 tokens exceed 20$"):
        pool.admit(5, 1)
    with pytest.raises(GenerationError, match=r"^KV pool full: a region of 21 tokens exceeds 20$"):
        TokenPool(DIMS, "sequence-major", 0, limit=20, regions=True).admit(1, 21)
    with pytest.raises(GenerationError, match=r"^KV pool: request 4 already holds a region$"):
        pool.admit(4, 1)
    with pytest.raises(GenerationError, match=r"^KV region of request 1 full: 1 \+ 6 tokens exceed its 6$"):
        pool.commit(_outputs(6, 5), [(1, np.arange(6))], 6)
    assert pool.tokens(1) == 1  # the refused commit kept nothing
    with pytest.raises(ValueError, match="KV regions need the sequence-major cache layout, not 'head-major-shared'"):
        TokenPool(DIMS, "head-major-shared", 4, limit=20, regions=True)


def test_compact_pool_appends_interleaved_and_compacts_on_release():
    pool = TokenPool(DIMS, "sequence-major", 0, limit=10, initial=4)
    pool.admit(1, 100)  # a no-op without regions
    pool.reserve(3)
    pool.commit(_outputs(3, 1), [(1, np.array([0])), (2, np.array([1, 2]))], 3)
    pool.reserve(2)
    pool.commit(_outputs(2, 2), [(1, np.array([0])), (2, np.array([1]))], 2)
    assert pool.owner.tolist() == [1, 2, 2, 1, 2] and pool.cache.capacity == 8
    assert pool.nbytes == 8 * DIMS.kv_bytes_per_token
    pool.release(1)
    assert pool.owner.tolist() == [2, 2, 2] and _columns(pool) == [1001, 1002, 2001]
    with pytest.raises(GenerationError, match=r"^KV pool full: 3 \+ 8 tokens exceed 10$"):
        pool.commit(_outputs(8, 3), [(2, np.arange(8))], 8)


def test_attention_skips_is_what_the_engines_graph_says(stories_artifact):
    """``Engine.attention_skips``: 0 for a graph whose attention spans every pool column
    (stories260K float32: the standard operators) and for TensorRT engines; the int8 lade
    graph's 16 is asserted in tests/test_kernels.py."""
    import lade_export
    from lade_export.backends.tensorrt import TensorRTEngine

    with lade_export.load(stories_artifact) as model:
        assert model.engine.attention_skips == 0
        assert model.engine.session.get_modelmeta().custom_metadata_map.get("attention_skips_masked") is None
    assert TensorRTEngine.attention_skips == 0


def test_regions_commit_of_several_owners_at_once_keeps_each_row_in_its_own_region():
    """One pass's kept rows of several requests (a run, none, a gather) land in their
    regions in order, exactly as one request at a time would put them."""
    pool = TokenPool(DIMS, "sequence-major", 0, limit=64, initial=32, regions=True)
    for owner, need in ((1, 8), (2, 8), (3, 8)):
        pool.admit(owner, need)
    pool.commit(_outputs(7, 3), [(1, np.array([0, 1, 2])), (2, np.zeros(0, np.int64)), (3, np.array([3, 5]))], 7)
    pool.commit(_outputs(3, 4), [(3, np.array([0, 2]))], 3)  # one owner, rows with a gap
    pool.commit(_outputs(2, 5), [(2, np.array([1]))], 2)
    assert pool.owner.tolist() == [1] * 3 + [-1] * 5 + [2] + [-1] * 7 + [3] * 4
    assert _columns(pool, 1) == [3100, 3101, 3102] + [0] * 5 + [5101] + [0] * 7 + [3103, 3105, 4100, 4102]
    assert pool.cache.values[0][0, 16:20, 0, 0].tolist() == [-3003, -3005, -4000, -4002]
    assert (pool.tokens(1), pool.tokens(2), pool.tokens(3)) == (3, 1, 4)
