"""LLaMA-family configuration fields the export honours (docs/compatibility.md): a tiny
random checkpoint with every non-rope field away from its default, built and compared
with transformers' own model."""

import onnx
import pytest
import torch

from lade_export.artifact import Artifact
from lade_export.backends.onnxruntime import OrtEngine
from lade_export.export.build import build_artifact
from lade_export.export.parity import PARITY_MAX_ABS
from lade_export.profile import LookaheadProfile, resolve_profile
from lade_export.runtime import Decoder

from .conftest import tiny_checkpoint
from .test_rope import _graph_vs_transformers, _tokens

#: Every shape/arithmetic field of LlamaConfig set away from its default.
ODD_FIELDS = dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, attention_bias=True, mlp_bias=True,
                  hidden_act="gelu_pytorch_tanh", rms_norm_eps=0.05, tie_word_embeddings=True, pretraining_tp=4,
                  attention_dropout=0.3, intermediate_size=96, num_hidden_layers=2, eos_token_id=[2, 7])


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("odd")
    ckpt = tiny_checkpoint(root / "ckpt", {"rope_type": "default", "rope_theta": 500000.0}, 256,
                           save_dtype=torch.bfloat16, **ODD_FIELDS)
    manifest = build_artifact(str(ckpt), [resolve_profile("small")], root / "art")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype="float32").eval()
    return ckpt, root / "art", manifest, model


def test_odd_fields_are_honoured_like_transformers(odd):
    ckpt, art_dir, manifest, model = odd
    assert model.config.dtype == torch.float32 and model.config.rope_parameters["rope_theta"] == 500000.0
    dims = manifest["model"]["dims"]
    assert (dims["num_layers"], dims["heads"], dims["kv_heads"], dims["head_dim"], dims["hidden"]) == (2, 4, 1, 32, 64)
    assert dims["tied_embeddings"] is True and dims["max_context"] == 256
    assert manifest["model"]["stop_token_ids"] == [2, 7] and manifest["model"]["bos_token_id"] == 1
    assert all(c["max_abs"] <= PARITY_MAX_ABS and c["argmax_equal"] for c in manifest["parity"]["transformers"]["cases"])
    art = Artifact(art_dir)
    engine = OrtEngine(art.onnx_path, art.dims)
    ids = _tokens(256)
    for n in (17, 100, 255):
        diff, same = _graph_vs_transformers(engine, art.dims, model, ids, n)
        assert diff <= PARITY_MAX_ABS and same, (n, diff)


def test_odd_fields_generate_like_transformers(odd):
    from transformers import GenerationConfig

    _, art_dir, _, model = odd
    art = Artifact(art_dir)
    decoder = Decoder(OrtEngine(art.onnx_path, art.dims), [], art.max_context)
    prompt = [1] + _tokens(30).tolist()
    plain = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), generation_config=plain,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert decoder.generate(prompt, 40, None).token_ids == ref
    assert decoder.generate(prompt, 40, LookaheadProfile(3, 4, 3)).token_ids == ref


def test_the_fields_matter(odd):
    """The odd fields change transformers' logits (so the parity above can fail): each one
    reset to its default gives other logits on the same weights."""
    ckpt, _, _, model = odd
    from transformers import AutoModelForCausalLM

    ids = torch.from_numpy(_tokens(40)[None])
    with torch.inference_mode():
        base = model(ids).logits
        for field, default in (("rms_norm_eps", 1e-6), ("hidden_act", "silu")):
            other = AutoModelForCausalLM.from_pretrained(ckpt, dtype="float32", **{field: default}).eval()
            assert float((other(ids).logits - base).abs().max()) > 1e-2, field
        for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.up_proj.bias"):
            assert float(dict(model.named_parameters())[name].abs().max()) > 0.1, name


def test_tied_embeddings_are_stored_once(odd):
    _, art_dir, _, _ = odd
    m = onnx.load(str(art_dir / "model.onnx"))
    big = [i.name for i in m.graph.initializer if sorted(i.dims) == [64, 512]]
    assert big == ["embed_tokens.weight"]


def test_gqa_and_mqa_shapes_reach_the_graph(odd, stories_artifact):
    _, art_dir, _, _ = odd
    shapes = {}
    for path in (art_dir, stories_artifact):
        g = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
        shapes[path] = [d.dim_value or d.dim_param for d in
                        next(i for i in g.input if i.name == "past_key_values.0.key").type.tensor_type.shape.dim]
    # MQA, head_dim 32 ≠ hidden / heads; a head width ONNX Runtime's GroupQueryAttention takes: head-major buffer
    assert shapes[art_dir] == ["batch", 1, "capacity", 32]
    assert shapes[stories_artifact] == ["batch", "past", 4, 8]  # GQA 8 / 4


def test_every_compatibility_row_names_existing_tests():
    """docs/compatibility.md: each table row names at least one test, and each named test
    (and parameter id) exists."""
    import importlib
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "compatibility.md").read_text(encoding="utf-8")
    rows = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| ---")
            and not line.startswith("| field")]
    assert len(rows) >= 25
    for row in rows:
        refs = re.findall(r"(test_\w+)\.py::(test_\w+)(?:\[([\w-]+)\])?", row.rsplit(" | ", 1)[1])
        assert refs, row
        for module, func, param in refs:
            mod = importlib.import_module(f"tests.{module}")
            assert callable(getattr(mod, func, None)), f"{module}.py::{func}"
            if param:
                ids = {"test_errors": lambda: [c[0] for c in mod.CASES],
                       "test_rope": lambda: list(mod.VARIANTS)}[module]()
                assert param in ids, f"{module}.py::{func}[{param}]"
