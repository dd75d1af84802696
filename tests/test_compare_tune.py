"""``compare`` and ``tune`` on stories260K: files, exactness column, chosen profile."""

import csv
import json

from click.testing import CliRunner

from lade_export.cli import main
from lade_export.profile import load_profile


def _prompts(tmp_path):
    f = tmp_path / "stories.jsonl"
    texts = ["Once upon a time", "Tom and Sue went to the beach.", "The little dog", "One day, a girl named Lily",
             "The sun was shining", "Ben had a red ball"]
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return f


def test_compare_writes_results_and_every_output_is_exact(tmp_path, stories_artifact):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "default", "--profile", "small",
                                       "--dataset", str(_prompts(tmp_path)), "--limit", "4", "--max-new-tokens", "48",
                                       "--peer", "transformers-greedy", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl", "speedup.png", "summary.csv", "summary.md"]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 4  # prompts × (greedy, default, small, transformers-greedy)
    assert [r["config"] for r in records[:4]] == ["greedy", "default", "small", "transformers-greedy"]
    assert all(r["exact"] for r in records)
    greedy = {r["prompt_id"]: r["token_ids"] for r in records if r["config"] == "greedy"}
    assert all(r["token_ids"] == greedy[r["prompt_id"]] for r in records)
    assert all(r["new_tokens"] == 48 for r in records)
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["config"] for r in rows] == ["greedy", "default", "small", "transformers-greedy"]
    assert [r["exact"] for r in rows] == ["4", "4", "4", "4"]
    assert float(rows[0]["speedup_vs_baseline"]) == 1.0 and float(rows[0]["compression_mean"]) == 1.0
    assert float(rows[1]["compression_mean"]) > 1.0
    md = (out / "summary.md").read_text()
    assert "| stories | default | 4 |" in md and "4/4 |" in md
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_replaces_its_files_as_a_set_or_not_at_all(tmp_path, stories_artifact, monkeypatch):
    """An interrupt while the files are made (the plot comes last and takes a while) leaves
    an earlier run's four files as they were, with no temporary file beside them; a run
    without matplotlib removes the earlier plot instead of leaving it beside new results."""
    import importlib.util

    from lade_export.evaluation import report

    out, prompts = tmp_path / "cmp", _prompts(tmp_path)

    def run(limit):
        return CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "small", "--dataset",
                                         str(prompts), "--limit", str(limit), "--max-new-tokens", "8", "--out", str(out)])

    assert run(2).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["results.jsonl", "speedup.png", "summary.csv", "summary.md"]

    def interrupted(rows, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "plot_summary", interrupted)
    result = run(3)
    assert result.exit_code == 130, result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier set, nothing else
    monkeypatch.undo()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert run(3).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl", "summary.csv", "summary.md"]
    assert len((out / "results.jsonl").read_text().splitlines()) == 3 * 2  # the new run's: 3 prompts × 2 configs


def test_compare_reports_a_mismatch_and_fails(tmp_path, stories_artifact, monkeypatch):
    from lade_export import lookahead

    real = lookahead.LookaheadState.verify

    def broken(self, layout, outputs):  # accept one wrong token on the first step: output must no longer be exact
        accepted, kept = real(self, layout, outputs)
        if not getattr(self, "_broke", False):
            self._broke = True
            accepted[0] = (accepted[0] + 1) % 512
        return accepted, kept

    monkeypatch.setattr(lookahead.LookaheadState, "verify", broken)
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "small", "--dataset",
                                       str(_prompts(tmp_path)), "--limit", "2", "--max-new-tokens", "16",
                                       "--out", str(out)])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: 2 output(s) differ from greedy: first small on stories prompt 0")
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["exact"] for r in rows] == ["2", "0"]


def test_compare_under_sampling_reports_na_and_does_not_fail(tmp_path, stories_artifact):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "small", "--dataset",
                                       str(_prompts(tmp_path)), "--limit", "3", "--max-new-tokens", "32",
                                       "--temperature", "0.8", "--top-p", "0.9", "--seed", "5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["config"] for r in records[:2]] == ["sampling", "small"]
    assert all(r["exact"] is None for r in records)
    assert any(a["token_ids"] != b["token_ids"] for a, b in zip(records[0::2], records[1::2]))  # sampled: differ
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["exact"] for r in rows] == ["", ""] and float(rows[1]["compression_mean"]) > 1.0
    speed = [float(r["decode_tok_s"]) for r in rows]
    assert abs(float(rows[1]["speedup_vs_baseline"]) - speed[1] / speed[0]) < 1e-3
    md = (out / "summary.md").read_text()
    assert "- **decoding**: sampling T=0.8 top-p 0.9 seed 5" in md and "| n/a |" in md
    again = tmp_path / "again"
    CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "small", "--dataset",
                              str(_prompts(tmp_path)), "--limit", "3", "--max-new-tokens", "32", "--temperature", "0.8",
                              "--top-p", "0.9", "--seed", "5", "--out", str(again)])
    rerun = [json.loads(line) for line in (again / "results.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rerun] == [r["token_ids"] for r in records]  # same seeds, same outputs


def test_tune_with_a_tiny_grid_writes_a_loadable_profile(tmp_path, stories_artifact):
    out = tmp_path / "tuned.toml"
    result = CliRunner().invoke(main, ["tune", str(stories_artifact), "--dataset", str(_prompts(tmp_path)), "--limit",
                                       "4", "--max-new-tokens", "32", "--grid", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "# step-cost curve (one forward pass, past = 256):" in text
    assert "#   W=1 N=2 G=1 K=0 B=1: compression" in text and "#   W=2 N=3 G=2 K=4 B=1: compression" in text
    assert "# held-out check of " in text
    assert "# other-workload check (humaneval, 8 prompts): compression " in text
    profile = load_profile(out)
    assert profile.name == "tuned"
    if profile.enabled:
        assert (profile.window, profile.ngram, profile.guesses, profile.lookup) in ((1, 2, 1, 0), (2, 3, 2, 4))
        assert "wrote" in result.stdout and "speedup" in result.stdout
    else:
        assert "no profile beat greedy on this machine" in result.stdout
        assert "this file is the greedy setting" in text


def test_greedy_setting_decodes_like_greedy(stories_decoder, reference_greedy):
    from lade_export.profile import LookaheadProfile

    case = reference_greedy["cases"][0]
    off = LookaheadProfile(3, 4, 2, enabled=False)
    assert off.max_step == 1
    result = stories_decoder.generate(case["prompt_ids"], 32, off)
    assert result.token_ids == case["greedy_ids"][:32]
    assert result.stats.steps == 32


def _with_long_records(tmp_path, name="mixed.jsonl", bom=False):
    """Six short records with two that do not fit stories260K's 512-token context between them:
    record 1 has 600 prompt tokens, record 3 exactly 512 (no room for a new token)."""
    texts = ["Once upon a time", "dog " * 299, "The little dog", "dog " * 255, "One day, a girl named Lily",
             "The sun was shining", "Ben had a red ball"]
    f = tmp_path / name
    f.write_text(("\ufeff" if bom else "") + "".join(json.dumps({"prompt": t, "id": f"r{i}"}) + "\n"
                                                     for i, t in enumerate(texts)), encoding="utf-8")
    return f


def test_compare_skips_records_that_do_not_fit_and_says_so(tmp_path, stories_artifact):
    data = _with_long_records(tmp_path)
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "small", "--dataset", str(data),
                                       "--limit", "5", "--max-new-tokens", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    skip_lines = [
        f"skipped {data} record 1 (id r1), it does not fit the context: prompt (600 tokens) + max_new_tokens (1) = "
        "601 exceeds the model's context of 512 tokens",
        f"skipped {data} record 3 (id r3), it does not fit the context: prompt (512 tokens) + max_new_tokens (1) = "
        "513 exceeds the model's context of 512 tokens",
    ]
    assert [line for line in result.stderr.splitlines() if line.startswith("skipped")] == skip_lines
    assert result.stdout.strip().endswith("(2 record(s) skipped: they do not fit the context)")
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({r["prompt_id"] for r in records}) == ["r0", "r2", "r4"]
    assert all(r["exact"] and r["new_tokens"] == 8 for r in records)
    md = (out / "summary.md").read_text()
    assert "Skipped records (they do not fit the model's context; not in the table): 2" in md
    assert all(f"- {line}" in md for line in skip_lines)
    assert "| mixed | small | 3 |" in md


def test_compare_refuses_a_profile_named_as_its_baseline(tmp_path, stories_artifact):
    """``--profile greedy`` would be recorded under the baseline's label and merge with it."""
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", str(stories_artifact), "--profile", "greedy", "--limit", "1",
                                       "--max-new-tokens", "8", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("error: profile 'greedy' is the name of the baseline every comparison runs; "
                                     "compare lookahead profiles against it")
    assert not out.exists()


def test_tune_skips_records_that_do_not_fit_and_records_them(tmp_path, stories_artifact):
    data = _with_long_records(tmp_path, bom=True)  # and a byte-order mark, as a Windows editor writes it
    out = tmp_path / "tuned.toml"
    result = CliRunner().invoke(main, ["tune", str(stories_artifact), "--dataset", str(data), "--limit", "7",
                                       "--max-new-tokens", "8", "--grid", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert [line.split(",")[0] for line in result.stderr.splitlines() if line.startswith("skipped")] == [
        f"skipped {data} record 1 (id r1)", f"skipped {data} record 3 (id r3)"]
    text = out.read_text()
    assert "# 2 record(s) left out (they do not fit the model's context):" in text
    assert f"#   skipped {data} record 1 (id r1), it does not fit the context: prompt (600 tokens)" in text
    assert "(records 0..6, 8 new tokens)" in text
    load_profile(out)


def test_tune_api_names_a_prompt_that_does_not_fit(stories_decoder):
    import pytest

    from lade_export.errors import GenerationError
    from lade_export.evaluation.tune import grid_profiles, tune

    with pytest.raises(GenerationError, match=r"^tuning prompt 1 does not fit the context: prompt \(512 tokens\) \+ "
                                              r"max_new_tokens \(1\) = 513 exceeds the model's context of 512 tokens$"):
        tune(stories_decoder, [[1, 2, 3], [1] * 512, [1, 5]], grid_profiles("tiny"), 4)


def test_jsonl_dataset_with_a_byte_order_mark_reads_like_without(tmp_path):
    from lade_export.evaluation.datasets import load_prompts

    plain = _with_long_records(tmp_path, "plain.jsonl")
    marked = _with_long_records(tmp_path, "marked.jsonl", bom=True)
    assert marked.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert [(p.id, p.text, p.record) for p in load_prompts(str(marked))] == \
        [(p.id, p.text, p.record) for p in load_prompts(str(plain))]
    assert load_prompts(str(marked))[0].text == "Once upon a time"


def test_comparison_runs_an_extra_engine_per_prompt_and_counts_left_out_records_in_progress(tmp_path, stories_artifact,
                                                                                             stories_decoder):
    from lade_export.artifact import Artifact
    from lade_export.evaluation.compare import Comparison, ExtraEngine
    from lade_export.profile import resolve_profile

    small = resolve_profile("small")
    advances = []
    comparison = Comparison(stories_decoder, Artifact(stories_artifact).tokenizer(), False, [small], 6,
                            progress=advances.append, extra_engines=[ExtraEngine("again", stories_decoder, [small])])
    assert comparison.configurations == 4  # greedy, small, again greedy, again small
    records, skipped = comparison.run([str(_with_long_records(tmp_path))], 4)  # r0, r2 run; r1, r3 left out
    assert [r.prompt_id for r in skipped] == ["r1", "r3"]
    assert [(r.prompt_id, r.config, r.reference) for r in records] == [
        (p, c, ref) for p in ("r0", "r2")
        for c, ref in (("greedy", "greedy"), ("small", "greedy"), ("again greedy", "again greedy"),
                       ("again small", "again greedy"))]
    assert all(r.exact and r.new_tokens == 6 and r.token_ids == records[4 * (i // 4)].token_ids
               for i, r in enumerate(records))
    assert advances == [2 * 4] + [1] * 8  # the left-out records advance by every configuration, as the CLI counts
