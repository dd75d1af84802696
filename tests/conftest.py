"""Shared fixtures: the real models in ../shared, built once per test session."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
DATASETS = SHARED / "datasets"


@pytest.fixture
def prepare_calls(monkeypatch):
    """Call it to start counting ``LookaheadState.prepare`` (after any solo runs the test
    compares with): returns the list that gets each call's arguments after ``past_len`` —
    ``()`` for the profile's own step, ``(cap,)`` for a capped one."""
    from lade_export.lookahead import LookaheadState

    def start() -> list:
        calls = []
        prepare = LookaheadState.prepare

        def counted(self, *args, **kwargs):
            calls.append(args[2:] or tuple(kwargs.values()))
            return prepare(self, *args, **kwargs)

        monkeypatch.setattr(LookaheadState, "prepare", counted)
        return calls

    return start


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    assert (STORIES / "config.json").is_file(), f"missing {STORIES}"
    return STORIES


@pytest.fixture(scope="session")
def reference_greedy(stories_dir) -> dict:
    return json.loads((stories_dir / "reference_greedy.json").read_text())


@pytest.fixture(scope="session")
def stories_loaded(stories_dir):
    from lade_export.export.model_source import load_model

    return load_model(str(stories_dir))


@pytest.fixture(scope="session")
def stories_artifact(tmp_path_factory, stories_dir, stories_loaded) -> Path:
    from lade_export.export.build import build_artifact
    from lade_export.profile import resolve_profile

    out = tmp_path_factory.mktemp("stories") / "artifact"
    build_artifact(str(stories_dir), [resolve_profile("default"), resolve_profile("small")], out, loaded=stories_loaded)
    return out


@pytest.fixture(scope="session")
def stories_decoder(stories_artifact):
    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine
    from lade_export.runtime import Decoder

    art = Artifact(stories_artifact)
    return Decoder(OrtEngine(art.onnx_path, art.dims), art.stop_token_ids, art.max_context, art.tokenizer())


@pytest.fixture(scope="session")
def smollm2_loaded():
    from lade_export.export.model_source import load_model

    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory, smollm2_loaded) -> Path:
    from lade_export.export.build import build_artifact
    from lade_export.profile import resolve_profile

    out = tmp_path_factory.mktemp("smollm2") / "artifact"
    build_artifact("smollm2-135m-instruct", [resolve_profile("default")], out, loaded=smollm2_loaded)
    return out


@pytest.fixture(scope="session")
def smollm2_decoder(smollm2_artifact):
    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine
    from lade_export.runtime import Decoder

    art = Artifact(smollm2_artifact)
    return Decoder(OrtEngine(art.onnx_path, art.dims), art.stop_token_ids, art.max_context, art.tokenizer())


def mt_bench_prompts(n: int) -> list[str]:
    lines = (DATASETS / "mt_bench" / "question.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:n]]


def humaneval_prompts(n: int) -> list[str]:
    with gzip.open(DATASETS / "humaneval" / "HumanEval.jsonl.gz", "rt") as fh:
        return [json.loads(line)["prompt"] for line, _ in zip(fh, range(n))]


def tiny_checkpoint(folder: Path, rope: dict | None = None, max_position_embeddings: int = 256, legacy_rope=False,
                    seed: int = 0, save_dtype=None, **config) -> Path:
    """Save a tiny random LLaMA checkpoint (3 layers, vocab 512, head_dim 16, GQA 4/2) with
    transformers itself, beside stories260K's tokenizer files, and return its folder.

    Weights are drawn with ``initializer_range`` 0.2 (logits of a few units, so a rope
    mismatch shows as a large logit difference); biases and norm weights, which
    transformers initialises to 0 and 1, are drawn too, so a field that only they carry
    (``attention_bias``, ``mlp_bias``, ``rms_norm_eps``) changes the logits. ``config``
    overrides ``LlamaConfig`` fields; ``save_dtype`` (e.g. ``torch.bfloat16``) stores the
    weights in that dtype. ``legacy_rope`` writes the config the way transformers 4 did
    (``rope_scaling`` with ``type``, ``rope_theta`` at the top).
    """
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    settings.update(config)
    cfg = LlamaConfig(max_position_embeddings=max_position_embeddings,
                      rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}, **settings)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    if save_dtype is not None:
        model = model.to(save_dtype)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, folder / name)
    if legacy_rope:
        data = json.loads((folder / "config.json").read_text())
        params = data.pop("rope_parameters")
        data["rope_theta"] = params.pop("rope_theta")
        params["type"] = params.pop("rope_type")
        data["rope_scaling"] = params
        (folder / "config.json").write_text(json.dumps(data, indent=2))
    return folder
