"""SmolLM2-135M-Instruct (30 layers, GQA 9/3, 49,152 vocab, ChatML) on the paper's
workloads: lookahead output equals plain greedy output on the same ONNX Runtime engine."""

import pytest

from lade_export.profile import resolve_profile

from .conftest import humaneval_prompts, mt_bench_prompts

pytestmark = pytest.mark.slow

IM_END = 2  # <|im_end|>


def _chat_ids(decoder, text):
    return decoder.tokenizer.encode_prompt(text, chat=True)


@pytest.mark.parametrize("source", ["mt_bench", "humaneval"])
def test_lookahead_equals_greedy_on_real_prompts(smollm2_decoder, source):
    profile = resolve_profile("default")
    prompts = mt_bench_prompts(4) if source == "mt_bench" else [
        f"Complete this Python function.\n\n{p}" for p in humaneval_prompts(2)
    ]
    tokens = steps = 0
    for text in prompts:
        ids = _chat_ids(smollm2_decoder, text)
        greedy = smollm2_decoder.generate(ids, 64, None)
        look = smollm2_decoder.generate(ids, 64, profile)
        assert look.token_ids == greedy.token_ids, text[:60]
        assert greedy.stats.steps == len(greedy.token_ids)
        tokens += look.stats.new_tokens
        steps += look.stats.steps
    assert tokens / steps > 1.0


def test_chat_answer_ends_on_end_of_turn_token(smollm2_decoder):
    ids = _chat_ids(smollm2_decoder, "What is the capital of France? Answer in one short sentence.")
    greedy = smollm2_decoder.generate(ids, 64, None)
    look = smollm2_decoder.generate(ids, 64, resolve_profile("default"))
    assert greedy.stop_reason == "stop_token" and greedy.token_ids[-1] == IM_END
    assert look.token_ids == greedy.token_ids
    assert "Paris" in look.text
    assert "<|im_end|>" not in look.text


def test_manifest_records_smollm2_facts(smollm2_artifact):
    from lade_export.artifact import Artifact

    m = Artifact(smollm2_artifact).manifest
    dims = m["model"]["dims"]
    assert (dims["num_layers"], dims["heads"], dims["kv_heads"], dims["head_dim"], dims["vocab"]) == (30, 9, 3, 64, 49152)
    assert dims["tied_embeddings"] is True
    # The exactness tests above run on the fused-attention graph (head width 64: ONNX Runtime's GroupQueryAttention).
    assert (m["graph"]["attention"], m["graph"]["kv_cache"]) == ("group-query-attention", "head-major-shared")
    assert IM_END in m["model"]["stop_token_ids"]
    assert m["tokenizer"]["chat_template"].startswith("{% for message in messages %}")
    assert all(c["max_abs"] <= 1e-3 and c["rel"] <= 1e-5 and c["argmax_equal"] for c in m["parity"]["cases"])
