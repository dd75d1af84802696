"""The group-query-attention graph (ONNX Runtime's fused RoPE + attention over a shared,
head-major KV cache): same numbers as the standard-operator graph, exact lookahead, a cache
the step writes in place, and clear refusals where it does not apply.

A tiny random LLaMA (head width 16, GQA 4/2) gives the two formulations of one checkpoint
side by side; SmolLM2 (test_smollm2.py, test_quantize.py) is the real model on this path.
"""

import numpy as np
import pytest

from lade_export.artifact import Artifact
from lade_export.backends.onnxruntime import OrtEngine
from lade_export.errors import BuildOptionError, ProfileError
from lade_export.export.parity import PARITY_MAX_ABS
from lade_export.profile import LookaheadProfile, resolve_profile
from lade_export.runtime import Decoder

from .conftest import tiny_checkpoint
from .threads import run_in_threads

PROFILES = [resolve_profile("default"), resolve_profile("small"), LookaheadProfile(4, 3, 4, lookup=4)]


@pytest.fixture(scope="module")
def both(tmp_path_factory, stories_dir):
    """One tiny checkpoint built twice: ``auto`` (group-query-attention) and ``onnx-ops``."""
    from lade_export.export.build import build_artifact

    root = tmp_path_factory.mktemp("attention")
    ckpt = tiny_checkpoint(root / "ckpt", num_hidden_layers=2)
    profiles = [resolve_profile("default")]
    fused = build_artifact(str(ckpt), profiles, root / "fused")
    plain = build_artifact(str(ckpt), profiles, root / "plain", attention="onnx-ops")
    return root / "fused", fused, root / "plain", plain


def _decoder(path):
    art = Artifact(path)
    return Decoder(OrtEngine(art.onnx_path, art.dims), [], art.max_context)


def test_auto_picks_the_fused_op_and_records_the_layout(both):
    fused_dir, fused, _, plain = both
    assert (fused["graph"]["attention"], fused["graph"]["kv_cache"]) == ("group-query-attention", "head-major-shared")
    assert (plain["graph"]["attention"], plain["graph"]["kv_cache"]) == ("onnx-ops", "sequence-major")
    shapes = {s["name"]: s["shape"] for s in fused["graph"]["inputs"] + fused["graph"]["outputs"]}
    assert shapes["past_key_values.1.value"] == ["batch", 2, "capacity", 16]
    assert shapes["present.1.value"] == ["batch", 2, "capacity", 16]
    # The build checked the fused graph against the standard formulation, lookahead step included.
    assert [c["label"].split()[0] for c in fused["parity"]["cases"]] == ["prefill", "lookahead", "greedy"]
    assert all(c["max_abs"] <= PARITY_MAX_ABS and c["argmax_equal"] for c in fused["parity"]["cases"])
    assert all(c["argmax_equal"] for c in fused["parity"]["transformers"]["cases"])


def test_the_fused_graph_runs_one_attention_op_per_layer_with_packed_qkv(both):
    import onnx

    fused_dir, *_ = both
    graph = onnx.load(str(fused_dir / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 2
    # query, key and value arrive as one packed tensor straight from the fused projection's MatMul; the only
    # Splits left are the gate/up ones; no rotary, softmax or cache-transposing nodes remain.
    producer = {o: n for n in graph.node for o in n.output}
    assert all(list(n.input[1:3]) == ["", ""] and producer[n.input[0]].op_type == "MatMul" for n in attention)
    assert ops.count("Split") == 2 and "Sin" not in ops and "Softmax" not in ops and "Transpose" not in ops


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_fused_and_standard_graphs_decode_the_same_tokens(both, profile):
    fused_dir, _, plain_dir, _ = both
    fused, plain = _decoder(fused_dir), _decoder(plain_dir)
    rng = np.random.default_rng(3)
    for _ in range(3):
        prompt = [1] + rng.integers(3, 512, size=int(rng.integers(5, 40))).tolist()
        greedy = plain.generate(prompt, 48, None).token_ids
        assert fused.generate(prompt, 48, None).token_ids == greedy
        assert fused.generate(prompt, 48, profile).token_ids == greedy
    # (Random weights rarely accept a guess; SmolLM2's tests show the fused graph compressing real text.)


def test_the_shared_cache_is_written_in_place_and_holds_only_accepted_tokens(both, monkeypatch):
    """Every step binds the same buffers (one address, never reallocated or copied), the
    engine writes the step into them, and after decoding they hold exactly the keys and
    values the standard graph's sequence-major cache holds for the same tokens."""
    import lade_export.runtime as runtime
    from lade_export.kv_cache import KVCache

    fused_dir, _, plain_dir, _ = both
    caches = []

    class Recording(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(runtime, "KVCache", Recording)
    fused, plain = _decoder(fused_dir), _decoder(plain_dir)
    seen = []
    real_run = fused.engine.run

    def spy(feeds, with_logits=False):
        key = feeds["past_key_values.0.key"]
        before = key.copy()
        out = real_run(feeds, with_logits)
        past, step = feeds["attention_mask"].shape[-1] - feeds["input_ids"].shape[1], feeds["input_ids"].shape[1]
        changed = np.flatnonzero(np.any(key != before, axis=(0, 1, 3)))
        seen.append((key.__array_interface__["data"][0], key.shape, past, step, changed, out["present.0.key"] is key))
        return out

    fused.engine.run = spy
    prompt = [1, 45, 300, 12, 7, 88, 45, 300, 12, 9]
    look = fused.generate(prompt, 40, resolve_profile("default"))
    assert look.token_ids == plain.generate(prompt, 40, None).token_ids
    head_major, sequence_major = caches[0], caches[1]
    assert head_major.layout == "head-major-shared" and sequence_major.layout == "sequence-major"
    assert len({address for address, *_ in seen}) == 1 and len({shape for _, shape, *_ in seen}) == 1
    assert all(same for *_, same in seen)  # the present output is the past buffer itself
    for _, _, past, step, changed, _ in seen:
        assert len(changed) and changed.min() >= past and changed.max() < past + step  # only this step's slots
    # Rejected lookahead rows were dropped: the kept prefix equals greedy's cache (transposed), token for token.
    n = sequence_major.length
    assert head_major.length == n == len(prompt) + 40 - 2  # the last step's tokens are not cached
    for layer in range(2):
        for got, want in ((head_major.keys[layer], sequence_major.keys[layer]),
                          (head_major.values[layer], sequence_major.values[layer])):
            np.testing.assert_allclose(got[:, :, :n].transpose(0, 2, 1, 3), want[:, :n], atol=2e-5)


def test_a_requests_cache_is_bound_once_and_threads_share_the_engine(both):
    """The I/O binding of a request's cache buffers is made at its first step and reused
    (a step binds only its small inputs and outputs); requests on several threads, each
    with its own buffers, decode what they decode alone."""
    
    fused_dir, _, plain_dir, _ = both
    fused, plain = _decoder(fused_dir), _decoder(plain_dir)
    made = []
    real = fused.engine.session.io_binding

    class Counting:  # the session is a C++ object; count its io_binding() calls through a proxy
        def __init__(self, session):
            self._session = session

        def io_binding(self):
            made.append(1)
            return real()

        def __getattr__(self, name):
            return getattr(self._session, name)

    fused.engine.session = Counting(fused.engine.session)
    prompts = [[1, 45, 300, 12, 7, 88, 45, 300, 12, 9], [1, 7, 7, 7, 20, 21], [1, 300, 301, 302], [1, 99, 98, 97, 99]]
    alone = [fused.generate(p, 40, resolve_profile("default")) for p in prompts]
    assert [a.token_ids for a in alone] == [plain.generate(p, 40, None).token_ids for p in prompts]
    assert len(made) == len(prompts)  # one binding per request's buffers, not one per step
    assert sum(a.stats.steps for a in alone) > 4 * len(prompts)
    got = [None] * len(prompts)

    def run(i):
        got[i] = fused.generate(prompts[i], 40, resolve_profile("default")).token_ids

    run_in_threads(run, len(prompts))
    assert got == [a.token_ids for a in alone]


def test_a_profile_wider_than_the_rotary_table_is_refused(both):
    from lade_export.graph import STEP_ROOM

    fused = _decoder(both[0])
    wide = LookaheadProfile(40, 30, 0, name="very-wide")
    assert wide.max_step > STEP_ROOM
    with pytest.raises(ProfileError, match=rf"largest step \({wide.max_step} tokens\) is wider than this graph takes "
                                           rf"\({STEP_ROOM}"):
        fused.engine.check_profile(wide)


def test_a_head_width_the_kernel_refuses_falls_back_to_standard_operators(stories_artifact):
    """stories260K's heads are 8 wide; ONNX Runtime's GroupQueryAttention needs a multiple of 16."""
    from lade_export.export.build_options import choose_attention

    art = Artifact(stories_artifact)
    assert (art.attention, art.kv_layout) == ("onnx-ops", "sequence-major")
    assert choose_attention("auto", art.dims) == "onnx-ops"
    with pytest.raises(BuildOptionError, match="needs a head width that is a multiple of 16.*this model's is 8"):
        choose_attention("group-query-attention", art.dims)
