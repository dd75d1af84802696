"""The step layout against hand-worked cases, the pool, and the acceptance rule."""

import numpy as np

from lade_export.lookahead import LookaheadState
from lade_export.ngram import NGramPool, build_trie, chain_parents, step_template
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


def _outputs(next_ids):
    """Engine outputs of a step as the state reads them: next_token_ids int64 [1, n_logits]."""
    return {"next_token_ids": np.asarray(next_ids, dtype=np.int64)[None]}


def test_mask_positions_and_logit_rows_match_hand_worked_case():
    offsets, mask, rows = step_template(2, 2, chain_parents(2, 2))
    assert offsets.tolist() == [0, 1, 2, 2, 3, 1, 2, 1, 2]
    assert np.array_equal(mask, HAND_MASK)
    assert rows.tolist() == [0, 3, 4, 5, 6, 7, 8]


def test_every_row_sees_a_contiguous_run_of_positions_ending_at_itself():
    offsets, mask, _ = step_template(4, 3, chain_parents(3, 3))
    for r in range(len(offsets)):
        seen = sorted(offsets[mask[r]].tolist())
        assert seen == list(range(offsets[r] + 1)), r


def test_templates_are_built_once_and_read_only():
    a = step_template(2, 2, chain_parents(2, 2))
    assert step_template(2, 2, (-1, 0, -1, 2)) is a
    assert not a[1].flags.writeable


def test_step_layout_feeds_with_past():
    state = LookaheadState(LookaheadProfile(2, 3, 2), vocab=50, prompt_ids=[5, 6, 7, 5, 8, 9])
    layout = state.prepare(5, 6)
    # the prompt's n-grams keyed by 5: (6,7) then (8,9), most recent first
    assert layout.trie_tokens == [8, 9, 6, 7] and layout.trie_parents == (-1, 0, -1, 2)
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


def test_update_accepts_longest_verified_prefix_and_keeps_its_rows():
    state = LookaheadState(LookaheadProfile(2, 3, 2), vocab=50, prompt_ids=[5, 6, 7, 5, 8, 9])
    layout = state.prepare(5, 6)  # candidates [[8, 9], [6, 7]]
    # predictions at rows [0, 3, 4, 5, 6, 7, 8]: t=6, last level -> (20, 21),
    # cand0 rows predict (1, 2), cand1 rows (6,7) predict (7, 30)
    verdict = state.update(layout, _outputs([6, 20, 21, 1, 2, 7, 30]))
    # cand1: 6 == t, 7 == prediction after 6 -> two matched; accepted t, 7, 30
    assert verdict.accepted == [6, 7, 30]
    assert verdict.kept_rows.tolist() == [0, 7, 8]
    # the window shifted: old level 1 is level 0, predictions are the new last level
    assert state.window[1].tolist() == [20, 21]


def test_update_without_match_accepts_one_token():
    state = LookaheadState(LookaheadProfile(2, 3, 1), vocab=50, prompt_ids=[5, 6, 7])
    layout = state.prepare(5, 3)  # candidate (6, 7)
    verdict = state.update(layout, _outputs([9, 1, 2, 3, 4]))
    assert verdict.accepted == [9]
    assert verdict.kept_rows.tolist() == [0]


def test_candidates_sharing_a_prefix_share_trie_nodes_and_masks():
    tokens, parents, children = build_trie([[4, 5, 6], [4, 5, 7], [4, 8, 9], [3, 1, 2]])
    assert children[(0, 5)] == 1 and children[(1, 7)] == 3 and (0, 7) not in children
    assert tokens == [4, 5, 6, 7, 8, 9, 3, 1, 2]
    assert parents == (-1, 0, 1, 1, 0, 4, -1, 6, 7)
    offsets, mask, rows = step_template(1, 1, parents)  # W=1, N=2: one window token at row 1
    base = 2
    assert offsets[base:].tolist() == [1, 2, 3, 3, 2, 3, 1, 2, 3]
    # node 3 (token 7) sees row 0, nodes 0, 1 and itself, not its sibling node 2
    assert np.flatnonzero(mask[base + 3]).tolist() == [0, base + 0, base + 1, base + 3]
    assert np.flatnonzero(mask[base + 5]).tolist() == [0, base + 0, base + 4, base + 5]
    assert rows.tolist() == [0, 1] + list(range(base, base + 9))


def test_update_walks_the_trie_to_the_longest_verified_branch():
    state = LookaheadState(LookaheadProfile(1, 4, 3), vocab=50, prompt_ids=[1])
    for cand in ([4, 5, 6], [4, 5, 7], [4, 8, 9]):
        state.pool.insert(3, cand)
    layout = state.prepare(3, 1)
    assert layout.trie_tokens == [4, 8, 9, 5, 7, 6]  # most recent first: (4,8,9), (4,5,7), (4,5,6)
    # rows: 0 last, 1..3 window (W=1, three levels), 4.. trie; logits at [0, 3, trie...]
    preds = {0: 4, 4: 5, 5: 0, 6: 0, 7: 7, 8: 11, 9: 0}  # 3 -> 4 -> 5 -> 7 -> 11
    next_ids = np.array([preds[0], 0] + [preds[r] for r in range(4, 10)])
    verdict = state.update(layout, _outputs(next_ids))
    assert verdict.accepted == [4, 5, 7, 11]
    assert verdict.kept_rows.tolist() == [0, 4, 7, 8]


def test_history_lookup_proposes_what_followed_the_latest_suffix_match():
    profile = LookaheadProfile(1, 2, 0, lookup=4)
    state = LookaheadState(profile, vocab=50, prompt_ids=[1, 7, 8, 9, 10, 11, 2, 7, 8])
    assert state.candidates(8) == [[9, 10]]  # a 2-token match (7, 8): half of K
    state.observe([9])
    assert state.candidates(9) == [[10, 11, 2, 7]]  # a 3-token match (7, 8, 9): all of K
    assert profile.max_step == 1 + 1 + 4


def test_history_lookup_branches_come_from_distinct_earlier_occurrences():
    profile = LookaheadProfile(1, 2, 0, lookup=4, lookup_branches=3)
    #                    5 6 | 20 21      5 6 | 30 31      5 6 | 20 22     ... 5 6
    prompt = [1, 5, 6, 20, 21, 9, 5, 6, 30, 31, 9, 5, 6, 20, 22, 9, 4, 5, 6]
    state = LookaheadState(profile, vocab=50, prompt_ids=prompt)
    # (5, 6) matched at three places, latest first; (20, 22) and (20, 21) share a first token
    assert state.candidates(6) == [[20, 22], [30, 31]]
    assert profile.max_step == 1 + 1 + 4 * 3
    tokens, parents, _ = build_trie(state.candidates(6))
    assert tokens == [20, 22, 30, 31] and parents == (-1, 0, -1, 2)


def test_history_lookup_span_follows_match_strength():
    from lade_export.ngram import HistoryIndex

    assert [HistoryIndex.span(m, 10) for m in (3, 2, 1)] == [10, 5, 2]
    assert [HistoryIndex.span(m, 1) for m in (3, 2, 1)] == [1, 1, 1]


def test_history_index_grown_in_pieces_keeps_each_ngrams_latest_ends():
    """Indexed a few tokens at a time, as decoding grows the sequence, the index holds, for
    every 1- to 3-token n-gram, its ENDS_KEPT latest end positions (the last token excluded),
    and lookups propose what followed them."""
    from lade_export.ngram import HistoryIndex

    rng = np.random.default_rng(5)
    seq = [int(t) for t in rng.integers(0, 6, size=400)]  # a small vocabulary: many repeats
    index, length, lookups = HistoryIndex(), 0, 0
    while length < len(seq):
        length = min(len(seq), length + int(rng.integers(1, 12)))
        got = index.lookup(seq[:length], 6, branches=3)
        want = {}
        for end in range(length - 1):
            for m in (1, 2, 3):
                if end - m + 1 >= 0:
                    want.setdefault(tuple(seq[end - m + 1:end + 1]), []).append(end)
        assert index.ends == {k: v[-HistoryIndex.ENDS_KEPT:] for k, v in want.items()}
        assert index.indexed == length - 1
        if length >= 4:
            last3 = tuple(seq[length - 3:length])
            end = want[last3][-1] if last3 in want else None
            if end is not None:  # the latest earlier occurrence of the 3-token suffix comes first
                assert got[0] == seq[end + 1:min(end + 7, length)]
                lookups += 1
    assert lookups > 20


def test_history_lookup_min_match_drops_weaker_suffix_matches():
    prompt = [1, 7, 8, 9, 10, 11, 2, 5, 8]  # (5, 8) never occurred before; 8 alone did, followed by 9, 10
    weak = LookaheadState(LookaheadProfile(0, 2, 0, lookup=4), vocab=50, prompt_ids=prompt)
    assert weak.candidates(8) == [[9, 10]]  # a 1-token match: at most 2 tokens
    strict = LookaheadState(LookaheadProfile(0, 2, 0, lookup=4, lookup_min_match=2), vocab=50, prompt_ids=prompt)
    assert strict.candidates(8) == []  # a one-token step
    strict.observe([9])  # the sequence now ends (8, 9): a 2-token match
    assert strict.candidates(9) == [[10, 11]]
