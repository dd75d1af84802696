"""The exported step graph: I/O contract and ONNX Runtime vs PyTorch parity on real models."""

import numpy as np
import onnx
import pytest

from lade_export.export.parity import PARITY_MAX_ABS, PARITY_MAX_REL, check_parity
from lade_export.graph import DecoderStep
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


def test_the_built_graph_runs_one_matmul_per_shared_input(stories_artifact):
    # stories260K (untied): per layer one fused q/k/v MatMul (64 -> 64 + 32 + 32), o_proj, one fused gate/up
    # (64 -> 2 x 172), down_proj; then the LM head. No two MatMuls with initializer weights read the same tensor.
    m = onnx.load(str(stories_artifact / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    weighted = [n for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert len(weighted) == 5 * 4 + 1
    assert len({n.input[0] for n in weighted}) == len(weighted)
    shapes = sorted(tuple(inits[n.input[1]].dims) for n in weighted)
    assert shapes == sorted([(64, 128), (64, 64), (64, 344), (172, 64)] * 5 + [(64, 512)])


def test_sibling_matmul_fusion_keeps_every_output():
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from lade_export.export.fusion import fuse_sibling_matmuls

    rng = np.random.default_rng(0)
    weights = {"wq": rng.standard_normal((8, 8)), "wk": rng.standard_normal((8, 4)), "wv": rng.standard_normal((8, 4)),
               "wo": rng.standard_normal((4, 8))}
    nodes = [helper.make_node("MatMul", ["x", w], [f"y_{w}"]) for w in ("wq", "wk", "wv")]
    nodes.append(helper.make_node("MatMul", ["y_wk", "wo"], ["y_wo"]))  # reads another tensor: left alone
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "step", 8])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "step", width])
         for n, width in (("y_wq", 8), ("y_wk", 4), ("y_wv", 4), ("y_wo", 8))],
        [numpy_helper.from_array(w.astype(np.float32), name) for name, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert fuse_sibling_matmuls(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Split", "MatMul"]
    assert sorted(i.name for i in model.graph.initializer) == ["wo", "wq_fused", "wq_fused_split_sizes"]
    onnx.checker.check_model(model)
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(before, after):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
