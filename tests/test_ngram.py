"""The step layout against hand-worked cases, the pool, and the acceptance rule."""

import numpy as np

from lade_export.ngram import LookaheadState, NGramPool, step_template
from lade_export.profile import LookaheadProfile

# W=2, N=3 (two levels), two candidates: rows are
# 0 last | 1 (l0,j0) 2 (l0,j1) | 3 (l1,j0) 4 (l1,j1) | 5,6 cand 0 | 7,8 cand 1
HAND_MASK = np.array(
    [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 0, 0, 1, 1],
    ],
    dtype=bool,
)


def test_mask_positions_and_logit_rows_match_hand_worked_case():
    offsets, mask, rows = step_template(2, 2, 2)
    assert offsets.tolist() == [0, 1, 2, 2, 3, 1, 2, 1, 2]
    assert np.array_equal(mask, HAND_MASK)
    assert rows.tolist() == [0, 3, 4, 5, 6, 7, 8]


def test_every_row_sees_a_contiguous_run_of_positions_ending_at_itself():
    offsets, mask, _ = step_template(4, 3, 3)
    for r in range(len(offsets)):
        seen = sorted(offsets[mask[r]].tolist())
        assert seen == list(range(offsets[r] + 1)), r


def test_templates_are_built_once_and_read_only():
    a = step_template(2, 2, 2)
    assert step_template(2, 2, 2) is a
    assert not a[1].flags.writeable


def test_step_layout_feeds_with_past():
    state = LookaheadState(LookaheadProfile(2, 3, 2), vocab=50, prompt_ids=[5, 6, 7, 5, 8, 9])
    layout = state.build_step(last_token=5, past_len=6)
    # the prompt's n-grams keyed by 5: (6,7) then (8,9), most recent first
    assert layout.candidates.tolist() == [[8, 9], [6, 7]]
    feeds = layout.feeds()
    assert feeds["input_ids"].shape == (1, 9)
    assert feeds["input_ids"][0, 0] == 5 and feeds["input_ids"][0, 5:].tolist() == [8, 9, 6, 7]
    assert feeds["position_ids"][0].tolist() == [6, 7, 8, 8, 9, 7, 8, 7, 8]
    m = feeds["attention_mask"]
    assert m.shape == (1, 1, 9, 15) and m.dtype == bool
    assert m[0, 0, :, :6].all()
    assert np.array_equal(m[0, 0, :, 6:], HAND_MASK)


def test_pool_keeps_most_recent_distinct_continuations():
    pool = NGramPool(vocab=10, levels=2, capacity=2)
    pool.insert(1, [2, 3])
    pool.insert(1, [4, 5])
    pool.insert(1, [2, 3])  # refresh: now most recent
    pool.insert(1, [6, 7])  # evicts (4, 5), the oldest
    assert pool.candidates(1).tolist() == [[6, 7], [2, 3]]
    assert pool.candidates(2).shape == (0, 2)
    assert len(pool) == 2


def test_pool_with_zero_capacity_is_empty():
    pool = NGramPool(vocab=10, levels=3, capacity=0)
    pool.insert_sequence([1, 2, 3, 4, 5])
    assert pool.candidates(1).shape == (0, 3)


def test_digest_accepts_longest_verified_prefix_and_keeps_its_rows():
    state = LookaheadState(LookaheadProfile(2, 3, 2), vocab=50, prompt_ids=[5, 6, 7, 5, 8, 9])
    state.build_step(last_token=5, past_len=6)  # candidates [[8, 9], [6, 7]]
    # predictions at rows [0, 3, 4, 5, 6, 7, 8]: t=6, last level -> (20, 21),
    # cand0 rows predict (1, 2), cand1 rows (6,7) predict (7, 30)
    verdict = state.digest(np.array([6, 20, 21, 1, 2, 7, 30]))
    # cand1: 6 == t, 7 == prediction after 6 -> two matched; accepted t, 7, 30
    assert verdict.accepted == [6, 7, 30]
    assert verdict.kept_rows.tolist() == [0, 7, 8]
    # the window shifted: old level 1 is level 0, predictions are the new last level
    assert state.window[1].tolist() == [20, 21]


def test_digest_without_match_accepts_one_token():
    state = LookaheadState(LookaheadProfile(2, 3, 1), vocab=50, prompt_ids=[5, 6, 7])
    state.build_step(last_token=5, past_len=3)  # candidate (6, 7)
    verdict = state.digest(np.array([9, 1, 2, 3, 4]))
    assert verdict.accepted == [9]
    assert verdict.kept_rows.tolist() == [0]
