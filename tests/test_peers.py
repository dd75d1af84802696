"""Comparison peers: the transformers peers' float32 cache
(lade_export.evaluation.transformers_peer), llama.cpp's output parsers on real captured
output (lade_export.evaluation.llama_cpp), and (where the binaries are built) a real
llama.cpp comparison."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from lade_export.evaluation import llama_cpp, transformers_peer
from lade_export.cli import main
from lade_export.errors import EngineError

DATA = Path(__file__).resolve().parent / "data" / "llama_cpp"


# ---------------------------------------------------------------- transformers peers


def test_gguf_source_runs_from_a_float32_hf_cache_made_once(tmp_path, stories_dir, reference_greedy, monkeypatch):
    from lade_export.export import model_source

    monkeypatch.setenv("LADE_CACHE", str(tmp_path / "cache"))
    gguf = stories_dir / "llama2c" / "stories260K.gguf"
    model, form = transformers_peer.load_transformers_peer(str(gguf))
    folder = tmp_path / "cache" / "hf-fp32" / transformers_peer.file_sha256(gguf)
    assert form.startswith(f"float32 HF directory {folder} ")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (folder / "SOURCE").read_text().strip() == str(gguf.resolve())
    assert folder.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporary left behind
    assert next(model.parameters()).dtype.is_floating_point and str(next(model.parameters()).dtype) == "torch.float32"
    for case in reference_greedy["cases"]:  # the oracle: plain greedy on the original float32 weights, EOS ignored
        out = transformers_peer.run_transformers_peer(model, "transformers-greedy", case["prompt_ids"], 48, [])
        assert out.token_ids == case["greedy_ids"][:48]
        assert out.new_tokens == 48 and out.steps == out.new_tokens
        assert out.prefill_s > 0 and out.decode_s > 0

    def no_gguf_load(path):
        raise AssertionError("the cache should be reused, not rebuilt")

    monkeypatch.setattr(model_source, "_load_gguf", no_gguf_load)
    assert transformers_peer.fp32_hf_dir(gguf) == folder


def test_hf_directory_source_is_loaded_as_it_is(stories_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("LADE_CACHE", str(tmp_path / "cache"))
    _, form = transformers_peer.load_transformers_peer(str(stories_dir))
    assert form == f"hf-dir {stories_dir}"
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- llama.cpp output parsers (captured output)


def test_completion_timings_from_captured_stderr():
    t = llama_cpp.parse_completion_timings((DATA / "completion.stderr").read_text())
    assert t == json.loads((DATA / "completion.expected.json").read_text())["timings"]


def test_prompt_ids_from_captured_verbose_prompt():
    expected = json.loads((DATA / "completion.expected.json").read_text())
    ids, rendering = llama_cpp.parse_prompt_ids((DATA / "completion.stderr").read_text())
    assert ids == expected["prompt_ids"]
    assert rendering == (DATA / "prompt.txt").read_text()


def test_completion_text_from_captured_stdout():
    expected = json.loads((DATA / "completion.expected.json").read_text())
    assert llama_cpp.completion_text((DATA / "completion.stdout").read_text()) == expected["text"]


def test_completion_stopped_by_end_of_generation_from_captured_output():
    expected = json.loads((DATA / "eog.completion.expected.json").read_text())
    stderr = (DATA / "eog.completion.stderr").read_text()
    assert llama_cpp.parse_completion_timings(stderr) == expected["timings"]
    assert llama_cpp.completion_text((DATA / "eog.completion.stdout").read_text()) == expected["text"]
    ids, rendering = llama_cpp.parse_prompt_ids(stderr)
    assert rendering == (DATA / "eog.prompt.txt").read_text() and len(ids) == 40


def test_lookahead_timings_and_text_from_captured_output():
    expected = json.loads((DATA / "lookahead.expected.json").read_text())
    t = llama_cpp.parse_lookahead_timings((DATA / "lookahead.stderr").read_text())
    assert t == expected["timings"]
    assert (t["W"], t["N"], t["G"]) == llama_cpp.LOOKAHEAD_CONSTANTS
    prompt = (DATA / "prompt.txt").read_text()
    assert llama_cpp.lookahead_text((DATA / "lookahead.stdout").read_text(), [None, prompt]) == expected["text"]
    assert llama_cpp.lookahead_text((DATA / "lookahead.stdout").read_text(), ["something else"]) is None


def test_missing_timing_line_is_one_clear_error():
    with pytest.raises(EngineError, match=r"^llama-completion: no 'eval time' line in its output"):
        llama_cpp.parse_completion_timings("llama_perf_context_print: prompt eval time =  1.00 ms /  3 tokens\n")
    text = (DATA / "lookahead.stderr").read_text().replace("G = 15", "")
    with pytest.raises(EngineError, match=r"^llama-lookahead: no 'G = …' line"):
        llama_cpp.parse_lookahead_timings(text)


def test_end_of_text_marker_and_trailing_blank_line_are_cut():
    assert llama_cpp.completion_text("Hello there.<|im_end|> [end of text]\n\n\n") == "Hello there.<|im_end|>"
    assert llama_cpp.completion_text("two\n\nlines\n\n") == "two\n\nlines"


def test_prompt_pieces_may_hold_newlines_and_quotes():
    stderr = ("main: number of tokens in prompt = 3\n     1 -> '<|im_start|>'\n   198 -> '\n'\n"
              "    42 -> 'it's'\n\nmain: other\n")
    assert llama_cpp.parse_prompt_ids(stderr) == ([1, 198, 42], "<|im_start|>\nit's")
    assert llama_cpp.parse_prompt_ids("main: number of tokens in prompt = 2\n     1 -> 'a'\n") is None


# ---------------------------------------------------------------- real llama.cpp (only where it is built)

LLAMA_CPP = os.environ.get(llama_cpp.LLAMA_CPP_ENV)
needs_llama_cpp = pytest.mark.skipif(
    not (LLAMA_CPP and (Path(LLAMA_CPP) / llama_cpp.GREEDY_BIN).is_file() and (Path(LLAMA_CPP) / llama_cpp.LOOKAHEAD_BIN).is_file()),
    reason=f"llama.cpp binaries not built (set {llama_cpp.LLAMA_CPP_ENV} to bench/build_llama_cpp.sh's bin folder)")


@needs_llama_cpp
def test_llama_cpp_peers_in_compare_on_stories(tmp_path, stories_dir, stories_artifact):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("Once upon a time", "The little dog")))
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "small", "--dataset", str(prompts),
                                       "--limit", "2", "--max-new-tokens", "40", "--peer", "llama.cpp-lookahead",
                                       "--peer", "llama.cpp-greedy", "--llama-gguf",
                                       str(stories_dir / "llama2c" / "stories260K.gguf"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["config"] for r in records[:4]] == ["greedy", "small", "llama.cpp-greedy", "llama.cpp-lookahead"]
    for r in records:
        if r["config"].startswith("llama.cpp"):
            assert r["new_tokens"] == 40 and r["token_ids"] == [] and r["text"]
            assert r["decode_s"] > 0 and r["prefill_s"] > 0
    lookahead = [r for r in records if r["config"] == "llama.cpp-lookahead"]
    assert all(r["reference"] == "llama.cpp-greedy" for r in lookahead)
    greedy_text = {r["prompt_id"]: r["text"] for r in records if r["config"] == "llama.cpp-greedy"}
    assert all(r["exact"] == (r["text"] == greedy_text[r["prompt_id"]]) for r in lookahead)
    rows = {r["config"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert float(rows["llama.cpp-greedy"]["compression_mean"]) == 1.0
    assert float(rows["llama.cpp-lookahead"]["decode_tok_s"]) > 0
    md = (out / "summary.md").read_text()
    assert "examples/lookahead as shipped (source not patched): W=15, N=5, G=15" in md
    assert "stories260K.gguf" in md
    assert "- **llama.cpp prompt ids**: identical to ours on 2/2 prompts" in md


# ---------------------------------------------------------------- bench/gguf_to_f32.py


@pytest.mark.slow
def test_gguf_to_f32_keeps_metadata_and_dequantized_weights(tmp_path):
    import importlib.util

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from lade_export.export.model_source import builtin_smollm2_path

    spec = importlib.util.spec_from_file_location("gguf_to_f32", Path(__file__).parent.parent / "bench" / "gguf_to_f32.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    src = builtin_smollm2_path()
    out = tmp_path / "f32.gguf"
    script.convert(src, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f32.gguf"]
    a, b = GGUFReader(str(src)), GGUFReader(str(out))
    assert b.fields["general.file_type"].contents() == 0 and a.fields["general.file_type"].contents() == 3  # Q4_1
    skip = {"general.file_type", "GGUF.kv_count", "GGUF.tensor_count", "GGUF.version"}
    assert {k: f.contents() for k, f in a.fields.items() if k not in skip} == \
        {k: f.contents() for k, f in b.fields.items() if k not in skip}
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type == GGMLQuantizationType.F32 and list(tb.shape) == list(ta.shape)
        np.testing.assert_array_equal(np.asarray(tb.data), dequantize(ta.data, ta.tensor_type).reshape(tb.data.shape))
    assert any(t.tensor_type == GGMLQuantizationType.Q4_1 for t in a.tensors)
