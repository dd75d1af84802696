"""Every rope variant transformers supports for LLaMA: the built graph matches transformers'
own model at positions on both sides of each threshold, or the declared context is capped
below it (longer prompts refused), or the build refuses — on tiny random checkpoints.
"""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lade_export.artifact import Artifact
from lade_export.backends.onnxruntime import OrtEngine
from lade_export.export.build import build_artifact
from lade_export.errors import GenerationError, ModelSourceError
from lade_export.feeds import causal_feeds, empty_past_feeds, run_sequence_major
from lade_export.export.parity import PARITY_MAX_ABS
from lade_export.profile import LookaheadProfile, resolve_profile
from lade_export.export.rope import RopePlan, plan_rope, reference_lengths
from lade_export.runtime import Decoder
from lade_export.specs import past_key_name, past_value_name, present_key_name, present_value_name

from .conftest import tiny_checkpoint

LONG = [float(x) for x in np.geomspace(1.0, 64.0, 8)]  # head_dim 16 → 8 frequencies
SHORT = [1.0] * 8

# name: (rope parameters, max_position_embeddings, legacy config, declared context, handling, thresholds)
VARIANTS = {
    "default": ({"rope_type": "default"}, 256, False, 256, "exact", []),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 256, False, 256, "exact", []),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256, False, 256, "exact",
             [64]),
    # The optional yarn keys away from their defaults (mscale/mscale_all_dim set the attention factor).
    "yarn-tuned": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}, 256, False, 256,
                   "exact", [64]),
    "llama3": ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, 256, False, 256, "exact", [64]),
    "proportional": ({"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5}, 256, False, 256,
                     "exact", []),
    # transformers' default rope ignores partial_rotary_factor (it rotates the whole head); so does the export.
    "default-partial": ({"rope_type": "default", "partial_rotary_factor": 0.5}, 256, False, 256, "exact", []),
    # Equal factor lists: nothing switches, the whole context is exact (explicit factor and attention_factor).
    "longrope-equal-factors": ({"rope_type": "longrope", "short_factor": LONG, "long_factor": LONG, "factor": 4.0,
                                "attention_factor": 1.2, "original_max_position_embeddings": 64}, 256, False, 256,
                               "exact", [64]),
    # The case: short factors 1.0, long factors rising to 64, original 64, max 512.
    "longrope": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 64}, 512, False, 64, "capped", [64]),
    # An older config (rope_scaling with "type"), as transformers 4 wrote it.
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 128, True, 128, "capped", [128]),
}
PROBE_LENGTHS = (20, 63, 64, 65, 127, 128, 129, 200, 255, 300, 511)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build each variant once: {name: (checkpoint dir, artifact dir, manifest, transformers model)}."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name):
        if name not in cache:
            rope, mpe, legacy, *_ = VARIANTS[name]
            root = tmp_path_factory.mktemp(name)
            ckpt = tiny_checkpoint(root / "ckpt", rope, mpe, legacy_rope=legacy)
            manifest = build_artifact(str(ckpt), [resolve_profile("small")], root / "art")
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype="float32").eval()
            cache[name] = (ckpt, root / "art", manifest, model)
        return cache[name]

    return get


def _tokens(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(3, 512, size=n).astype(np.int64)


def _graph_vs_transformers(engine, dims, model, ids, n):
    """max |Δlogit| and argmax agreement of a prefill of n tokens (every row) and a decode
    step at position n, each against transformers run fresh on the same tokens."""
    out = run_sequence_major(engine, {**causal_feeds(ids[:n], 0, logit_rows=np.arange(n)), **empty_past_feeds(dims)},
                             with_logits=True)
    past = {}
    for i in range(dims.num_layers):
        past[past_key_name(i)], past[past_value_name(i)] = out[present_key_name(i)], out[present_value_name(i)]
    step = run_sequence_major(engine, {**causal_feeds(ids[n:n + 1], n), **past}, with_logits=True)
    with torch.inference_mode():
        ref = model(torch.from_numpy(ids[None, :n])).logits[0].numpy()
        ref_next = model(torch.from_numpy(ids[None, :n + 1])).logits[0, -1:].numpy()
    ours, ours_next = out["logits"][0], step["logits"][0]
    diff = max(float(np.abs(ours - ref).max()), float(np.abs(ours_next - ref_next).max()))
    same = bool(np.array_equal(ours.argmax(-1), ref.argmax(-1)) and ours_next.argmax(-1)[0] == ref_next.argmax(-1)[0])
    return diff, same


@pytest.mark.parametrize("name", list(VARIANTS))
def test_rope_variant_matches_transformers_on_both_sides_of_each_threshold(name, built):
    _, mpe, _, declared, handling, thresholds = VARIANTS[name]
    ckpt, art_dir, manifest, model = built(name)
    rope = manifest["model"]["rope"]
    assert (rope["type"], rope["handling"], rope["declared_context"], rope["thresholds"]) == (
        name.split("-")[0], handling, declared, thresholds)
    assert manifest["model"]["dims"]["max_context"] == declared
    assert rope["max_position_embeddings"] == mpe
    assert bool(rope["reason"]) == (handling == "capped")

    # The build's own check against transformers ran on both sides of every threshold below the context.
    reference = manifest["parity"]["transformers"]
    for t in thresholds:
        assert {t - 1, t, t + 1} & set(range(2, declared + 1)) <= set(reference["lengths"])
    assert declared in reference["lengths"]  # up to the last position of the declared context
    assert all(c["max_abs"] <= PARITY_MAX_ABS and c["argmax_equal"] for c in reference["cases"])

    # Independently: every accepted length, prefill and the decode step after it, against transformers.
    art = Artifact(art_dir)
    engine = OrtEngine(art.onnx_path, art.dims)
    ids = _tokens(max(PROBE_LENGTHS) + 2)
    inside = [n for n in PROBE_LENGTHS if n < declared]
    assert any(n < 64 for n in inside) and any(n >= declared - 1 or n > 64 for n in inside)
    for n in inside:
        diff, same = _graph_vs_transformers(engine, art.dims, model, ids, n)
        assert diff <= PARITY_MAX_ABS and same, (name, n, diff)


@pytest.mark.parametrize("name", ["longrope", "dynamic"])
def test_position_dependent_rope_is_capped_and_longer_prompts_are_refused(name, built):
    _, art_dir, manifest, model = built(name)
    art = Artifact(art_dir)
    declared = art.max_context
    engine = OrtEngine(art.onnx_path, art.dims)
    ids = _tokens(2 * declared)
    # Past the cap transformers switches (longrope) or rescales (dynamic) its frequencies: the graph would differ.
    diff, _ = _graph_vs_transformers(engine, art.dims, model, ids, declared + 36)
    assert diff > 0.1, diff
    decoder = Decoder(engine, art.stop_token_ids, art.max_context)
    decoder.check_request(declared - 1, 1)
    with pytest.raises(GenerationError, match=f"exceeds the model's context of {declared} tokens"):
        decoder.check_request(declared + 1, 1)
    with pytest.raises(GenerationError, match=f"exceeds the model's context of {declared} tokens"):
        decoder.check_request(declared - 8, 9)


def test_longrope_generate_refuses_a_prompt_past_the_cap(built, tmp_path):
    from lade_export.cli import main

    _, art_dir, _, _ = built("longrope")
    prompt = tmp_path / "long.txt"
    prompt.write_text("Once upon a time there was a little dog. " * 12)  # > 64 tokens with stories' tokenizer
    result = CliRunner().invoke(main, ["generate", str(art_dir), "--prompt-file", str(prompt), "--max-new-tokens", "4"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: prompt (") and lines[0].endswith(
        "exceeds the model's context of 64 tokens"), result.stderr


@pytest.mark.parametrize("name", ["longrope", "dynamic", "yarn"])
def test_lookahead_and_greedy_equal_transformers_generate_up_to_the_context(name, built):
    """End to end through the runtime: a 40-token prompt generated to min(context, 100)
    tokens — the edge of longrope's capped context, across yarn's threshold — lookahead and
    greedy alike, token for token what transformers' own generate gives."""
    from transformers import GenerationConfig

    ckpt, art_dir, _, model = built(name)
    art = Artifact(art_dir)
    decoder = Decoder(OrtEngine(art.onnx_path, art.dims), [], art.max_context)  # no stop id: run to the edge
    prompt = [1] + _tokens(39).tolist()
    new = min(art.max_context, 100) - len(prompt)
    plain = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), generation_config=plain,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = ref[0, len(prompt):].tolist()
    assert len(expected) == new
    assert decoder.generate(prompt, new, None).token_ids == expected
    assert decoder.generate(prompt, new, LookaheadProfile(3, 4, 3)).token_ids == expected


def test_build_fails_when_the_graph_differs_from_transformers(tmp_path, monkeypatch):
    """Without the cap, the issue's longrope checkpoint passes the ONNX-vs-PyTorch check but
    not the check against transformers: the build stops in one line and writes nothing."""
    from lade_export import graph
    from lade_export.cli import main

    ckpt = tiny_checkpoint(tmp_path / "ckpt", VARIANTS["longrope"][0], 512)
    real = graph.plan_rope

    def uncapped(config):
        plan = real(config)
        return RopePlan(plan.rope_type, plan.max_position_embeddings, plan.max_position_embeddings, "exact",
                        plan.thresholds)

    monkeypatch.setattr(graph, "plan_rope", uncapped)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", "--model", str(ckpt), "--out", str(out), "--profile", "small"])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert errors[0].startswith("error: parity check (ONNX graph vs transformers) failed at prefill of 65 tokens with "
                                "rope type 'longrope' (declared context 512): max |Δlogit| ")
    assert not out.exists()


def test_build_says_when_it_caps_the_context(built, tmp_path):
    from lade_export.cli import main

    ckpt, _, manifest, _ = built("longrope")
    result = CliRunner().invoke(main, ["build", "--model", str(ckpt), "--out", str(tmp_path / "a"), "--profile", "small"])
    assert result.exit_code == 0, result.output
    notes = [line.split("] ", 1)[1] for line in result.stderr.splitlines() if "] note: " in line]
    assert notes == [f"note: {manifest['model']['rope']['reason']}"]  # one stage line (no terminal here)
    assert notes[0].startswith("note: rope type 'longrope': ")
    assert "the artifact declares 64 tokens of context instead of 512" in notes[0]
    inspect = CliRunner().invoke(main, ["inspect", str(tmp_path / "a")])
    assert "rope longrope: capped, context 64 of 512" in inspect.stdout


def test_plan_refuses_partial_rotation_it_cannot_reference():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                      rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5,
                                       "rope_theta": 10000.0})
    with pytest.raises(ModelSourceError, match="rope type 'linear' with partial_rotary_factor 0.5: transformers' "
                                               "LLaMA rotates the whole head"):
        plan_rope(cfg)
    # transformers' default rope ignores partial_rotary_factor, and so does the export (exact against it).
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5, "rope_theta": 10000.0})
    assert plan_rope(cfg).handling == "exact"


def test_reference_lengths_straddle_thresholds_and_stay_modest():
    plan = RopePlan("yarn", 512, 512, "exact", (64,))
    assert reference_lengths(plan, 40) == [40, 63, 64, 65, 512]
    capped = RopePlan("longrope", 512, 64, "capped", (64,))
    assert reference_lengths(capped, 40) == [40, 63, 64]
    big = RopePlan("default", 8192, 8192, "exact", ())
    assert reference_lengths(big, 45) == [45, 128]  # SmolLM2: no 8k-token prompts in a build
    far = RopePlan("llama3", 131072, 131072, "exact", (8192,))
    assert reference_lengths(far, 45) == [45, 128]  # thresholds past the 1024-token limit are not run


def test_legacy_rope_scaling_config_is_read(built):
    ckpt, _, manifest, model = built("dynamic")
    assert "rope_scaling" in json.loads((ckpt / "config.json").read_text())
    assert manifest["model"]["rope"]["type"] == "dynamic"
