"""The exported step graph: I/O contract and ONNX Runtime vs PyTorch parity on real models."""

import numpy as np
import onnx
import pytest

from lade_export.graph import PARITY_MAX_ABS, PARITY_MAX_REL, DecoderStep, check_parity
from lade_export.profile import LookaheadProfile, resolve_profile

from .conftest import mt_bench_prompts


def _dim(d):
    return d.dim_param or d.dim_value


def test_io_names_and_symbolic_shapes(stories_artifact):
    m = onnx.load(str(stories_artifact / "model.onnx"))
    ins = {i.name: [_dim(d) for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    outs = {o.name: [_dim(d) for d in o.type.tensor_type.shape.dim] for o in m.graph.output}
    assert ins["input_ids"] == ["batch", "step"]
    assert ins["attention_mask"] == ["batch", 1, "step", "past+step"]
    assert ins["past_key_values.4.value"] == ["batch", "past", 4, 8]
    assert "past_key_values.5.key" not in ins
    assert outs["logits"] == ["batch", "n_logits", 512]
    assert outs["present.0.key"] == ["batch", "step", 4, 8]
    assert m.graph.input[2].type.tensor_type.elem_type == onnx.TensorProto.BOOL


def _assert_parity(cases):
    assert [c.label.split()[0] for c in cases] == ["prefill", "lookahead", "greedy"]
    for c in cases:
        assert c.max_abs <= PARITY_MAX_ABS, c
        assert c.rel <= PARITY_MAX_REL, c
        assert c.argmax_equal, c
        assert c.kv_max_abs <= PARITY_MAX_ABS, c


def test_parity_stories260k(stories_loaded, stories_artifact, reference_greedy):
    step = DecoderStep(stories_loaded.model).eval()
    for case in reference_greedy["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"][:40]
        _assert_parity(check_parity(step, stories_artifact / "model.onnx", ids, LookaheadProfile(3, 4, 3)))


def test_step_module_matches_transformers_logits(stories_loaded, reference_greedy):
    import torch

    from lade_export.feeds import example_feeds
    from lade_export.graph import run_torch_step

    ids = reference_greedy["cases"][0]["prompt_ids"]
    step = DecoderStep(stories_loaded.model).eval()
    feeds = example_feeds(step.dims, step=len(ids), past=0)
    feeds["input_ids"] = np.asarray([ids], dtype=np.int64)
    ours = run_torch_step(step, feeds)["logits"]
    with torch.no_grad():
        ref = stories_loaded.model(torch.tensor([ids])).logits.numpy()
    assert np.max(np.abs(ours - ref)) < 1e-4


@pytest.mark.slow
def test_parity_smollm2_on_mt_bench(smollm2_loaded, smollm2_artifact):
    step = DecoderStep(smollm2_loaded.model).eval()
    tok = smollm2_loaded.tokenizer
    for text in mt_bench_prompts(2):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        _assert_parity(check_parity(step, smollm2_artifact / "model.onnx", ids, resolve_profile("default")))


@pytest.mark.slow
def test_smollm2_tied_embeddings_are_stored_once(smollm2_artifact):
    from onnx import numpy_helper  # noqa: F401

    m = onnx.load(str(smollm2_artifact / "model.onnx"), load_external_data=False)
    big = [i.name for i in m.graph.initializer if list(i.dims) in ([49152, 576], [576, 49152])]
    assert big == ["embed_tokens.weight"]
    assert (smollm2_artifact / "model.onnx.data").stat().st_size < 560_000_000
