"""The CLI end to end on stories260K, and its one-line errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout)


PROGRESS = re.compile(r"^\[\s*\d+\.\ds\] ")  # a build's stage lines on a non-terminal stderr


def one_line_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_build_nonexistent_model_fails_cleanly(tmp_path):
    out = tmp_path / "x"
    proc = run_cli("build", "--model", "/nonexistent", "--out", out)
    assert proc.returncode == 2
    assert one_line_error(proc) == "error: model path not found: /nonexistent"
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_build_non_llama_config_fails_cleanly(tmp_path):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    out = tmp_path / "out"
    proc = run_cli("build", "--model", src, "--out", out)
    assert proc.returncode == 2
    assert one_line_error(proc).startswith(f"error: {src}/config.json: model_type 'gpt2' is not supported")
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["gpt2"]


#: Build flags that do not go together, the same options for the API, and the one message both give.
BAD_BUILD_OPTIONS = [
    (["--engine", "tensorrt", "--kernels", "lade"], dict(engine="tensorrt", kernels="lade"),
     "--kernels lade makes ONNX Runtime custom operators, which TensorRT cannot parse; --engine tensorrt takes fp16, "
     "bf16 or fp32"),
    (["--precision", "int8", "--profile", "default"], dict(precision="int8"),
     "--precision int8 with accuracy level 4 computes one-token and multi-token steps differently (int8 activations), "
     "so lookahead would not be exact; give --profile greedy-only, or build int4 (float32 compute)"),
    (["--precision", "int4", "--kernels", "lade", "--block-size", "64"],
     dict(precision="int4", kernels="lade", block_size=64),
     "--kernels lade uses blocks of 32 weights (GGML's Q4_1/Q8_0); drop --block-size 64"),
    (["--attention", "group-query-attention"], dict(attention="group-query-attention"),  # stories' heads: 8 wide
     "--attention group-query-attention needs a head width that is a multiple of 16 (ONNX Runtime's kernel); this "
     "model's is 8: use --attention onnx-ops"),
    (["--max-prompt", "64"], dict(max_prompt=64),
     "--max-prompt bounds the TensorRT engines; this build is for ONNX Runtime only: add --engine tensorrt or drop it"),
    (["--precision", "int4", "--block-size", "0"], dict(precision="int4", block_size=0),
     "--block-size must be a power of two ≥ 16, got 0"),
    (["--precision", "int4", "--compute", "float32"], dict(precision="int4", compute="float32"),  # float32 given
     "--compute picks the arithmetic of --kernels lade; ONNX Runtime's MatMulNBits takes --accuracy-level instead: "
     "drop --compute float32 or add --kernels lade"),
]


@pytest.mark.parametrize("flags, options, message", BAD_BUILD_OPTIONS,
                         ids=["tensorrt-lade", "int8-lookahead", "lade-block-size", "gqa-head-width",
                              "tensorrt-bound-on-onnx", "block-size-zero", "compute-without-lade"])
def test_the_build_refuses_bad_options_with_the_message_the_cli_prints(tmp_path, stories_dir, flags, options,
                                                                        message):
    """The API (``build_artifact``) checks the options the CLI checks: the same one line, as
    BuildOptionError, and nothing written at the destination either way."""
    from click.testing import CliRunner

    from lade_export.cli import main
    from lade_export.errors import BuildOptionError
    from lade_export.export.build import build_artifact
    from lade_export.export.build_options import BuildOptions
    from lade_export.profile import resolve_profile

    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["build", "--model", str(stories_dir), *flags, "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 2
    assert one_line_error(result) == f"error: {message}"
    with pytest.raises(BuildOptionError) as refused:
        build_artifact(str(stories_dir), [resolve_profile("default")], out, options=BuildOptions(**options))
    assert str(refused.value) == message
    assert os.listdir(tmp_path) == []


def test_the_builds_older_keywords_get_the_same_checks(tmp_path, stories_dir):
    """``quantization=`` (a QuantSpec) and ``engine_options=`` are checked as ``options=`` is:
    an int8 engine is not exact for lookahead profiles, TensorRT parses no MatMulNBits."""
    from lade_export.errors import BuildOptionError
    from lade_export.export.build import build_artifact
    from lade_export.export.build_options import BuildOptions
    from lade_export.export.quantize import QuantSpec
    from lade_export.profile import resolve_profile

    out, default = tmp_path / "o", [resolve_profile("default")]
    with pytest.raises(BuildOptionError, match=r"^--precision int8 with accuracy level 4 computes one-token and "):
        build_artifact(str(stories_dir), default, out, quantization=QuantSpec.for_precision("int8"))
    with pytest.raises(BuildOptionError, match=r"^--precision int4 makes MatMulNBits weights, which TensorRT cannot "
                                               r"parse; --engine tensorrt takes fp16, bf16 or fp32$"):
        build_artifact(str(stories_dir), default, out, quantization=QuantSpec.for_precision("int4"),
                       engine_options={"precision": "fp16"})
    with pytest.raises(BuildOptionError, match=r"^give the build's options either as options= or as "
                                               r"engine_options=, quantization= and attention=, not both$"):
        build_artifact(str(stories_dir), default, out, options=BuildOptions(), attention="onnx-ops")
    assert os.listdir(tmp_path) == []


def test_build_options_bound_the_tensorrt_engines_within_the_model(stories_dir):
    """TensorRT's bounds are checked as flags (each named, ≥ 1, the prompt below the
    context, the context within the model's), and the head's bits as --head-bits."""
    from lade_export.errors import BuildOptionError
    from lade_export.export.build_options import BuildOptions
    from lade_export.specs import ModelDims

    cases = [(dict(engine="tensorrt", max_batch=0), "--max-batch must be an integer ≥ 1, got 0"),
             (dict(engine="tensorrt", max_context=0), "--max-context must be an integer ≥ 2, got 0"),
             (dict(engine="tensorrt", max_prompt=64, max_context=64),
              "--max-prompt 64 must be below --max-context 64 (a prompt leaves room for new tokens)"),
             (dict(max_batch=0), "--max-batch bounds the TensorRT engines; this build is for ONNX Runtime only: "
                                 "add --engine tensorrt or drop it"),
             (dict(precision="int4", head_bits=3), "--head-bits must be 0 (float32), 4 or 8, got 3")]
    for options, message in cases:
        with pytest.raises(BuildOptionError) as refused:
            BuildOptions(**options).check()
        assert str(refused.value) == message, options
    dims = ModelDims(num_layers=5, heads=8, kv_heads=4, head_dim=8, hidden=64, vocab=512, max_context=512,
                     tied_embeddings=True)
    with pytest.raises(BuildOptionError, match=r"^--max-context 100000 exceeds the model's context of 512 tokens$"):
        BuildOptions(engine="tensorrt", max_context=100000).attention_for(dims)
    with pytest.raises(BuildOptionError, match=r"^--max-prompt 600 must be below the engines' context of 512 tokens$"):
        BuildOptions(engine="tensorrt", max_prompt=600).attention_for(dims)
    assert BuildOptions(engine="tensorrt", max_prompt=256, max_context=512).attention_for(dims) == "onnx-ops"


def test_build_inspect_generate_on_stories(tmp_path, stories_dir, reference_greedy):
    out = tmp_path / "art"
    proc = run_cli("build", "--model", stories_dir, "--profile", "small", "--profile", "default", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx", "tokenizer"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["name"] for p in manifest["profiles"]] == ["small", "default"]

    proc = run_cli("inspect", out)
    assert proc.returncode == 0
    assert "past_key_values.{0..4}.key/.value" in proc.stdout and "[batch, past, 4, 8]" in proc.stdout
    # the profiles' table: W, N, G, history lookup K and its branches B, max step (default: W=1 N=3 G=2 K=6 B=2)
    rows = {cells[0]: cells[1:] for line in proc.stdout.splitlines()
            if len(cells := [c.strip() for c in re.split("[│┃]", line.strip("│┃ "))]) == 7}
    assert rows["name"] == ["W", "N", "G", "K", "B", "max step"]
    assert rows["small"] == ["2", "3", "2", "0", "1", "9"] and rows["default"][:5] == ["1", "3", "2", "6", "2"]

    proc = run_cli("generate", out, "--prompt", "Once upon a time", "--max-new-tokens", "40", "--check-greedy")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected_text(reference_greedy, 40) + "\n"  # the text alone on stdout
    assert "[lookahead small (W=2, N=3, G=2), greedy] steps " in proc.stderr
    assert "identical to greedy: yes" in proc.stderr
    proc = run_cli("generate", out, "--prompt", "Once upon a time", "--max-new-tokens", "8", "--greedy",
                   "--check-greedy")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("[check-greedy] nothing to compare: this run decoded one token per "
                                                    "step (no lookahead profile)")

    proc = run_cli("build", "--model", stories_dir, "--out", out)
    assert proc.returncode == 2
    assert one_line_error(proc) == f"error: {out} already exists; pass --force to replace it"


def test_sampled_generate_is_reproducible_with_a_seed(stories_artifact):
    args = ["generate", stories_artifact, "--prompt", "Once upon a time", "--max-new-tokens", "48", "--temperature", "0.9",
            "--top-k", "40", "--seed", "11"]
    first, second = run_cli(*args), run_cli(*args)
    other = run_cli(*args[:-1], "12")
    plain = run_cli(*args, "--no-lookahead")
    assert first.returncode == second.returncode == other.returncode == plain.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout != other.stdout and len(first.stdout) > 40
    assert "sampling T=0.9 top-k 40 seed 11] steps" in first.stderr
    assert "[no lookahead, sampling T=0.9 top-k 40 seed 11] steps 48 · tokens 48" in plain.stderr


def expected_text(reference_greedy, n: int) -> str:
    """The oracle's text of the first ``n`` greedy tokens after "Once upon a time"."""
    from tokenizers import Tokenizer

    from .conftest import STORIES

    return Tokenizer.from_file(str(STORIES / "tokenizer.json")).decode(reference_greedy["cases"][0]["greedy_ids"][:n])


def test_generate_on_missing_artifact(tmp_path):
    proc = run_cli("generate", tmp_path, "--prompt", "hi")
    assert proc.returncode == 2
    assert one_line_error(proc) == f"error: {tmp_path} has no manifest.json: not a lade-export build (run lade-export build)"


def test_prompt_file_with_a_byte_order_mark_gives_the_same_tokens(tmp_path, stories_artifact, reference_greedy):
    """A UTF-8 BOM (as some Windows editors save) is not prompt text: same prefill, same output."""
    from click.testing import CliRunner

    from lade_export.cli import main

    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("Once upon a time", encoding="utf-8")
    marked.write_text("Once upon a time", encoding="utf-8-sig")
    assert marked.read_bytes()[:3] == b"\xef\xbb\xbf"
    runs = [CliRunner().invoke(main, ["generate", str(stories_artifact), "--prompt-file", str(f), "--max-new-tokens",
                                      "20", "--greedy"]) for f in (plain, marked)]
    assert [r.exit_code for r in runs] == [0, 0]
    assert runs[1].stdout == runs[0].stdout == expected_text(reference_greedy, 20) + "\n"
    assert "(prefill 5 tokens in" in runs[1].stderr  # BOS + 4, not 3 more for the mark


def test_prompt_file_not_utf8_names_the_byte_after_a_byte_order_mark(tmp_path, stories_artifact):
    from click.testing import CliRunner

    from lade_export.cli import main

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xef\xbb\xbfcaf\xe9")
    result = CliRunner().invoke(main, ["generate", str(stories_artifact), "--prompt-file", str(bad)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: prompt file {bad} is not UTF-8 text (byte 6)"


def test_prompt_file_dash_reads_the_prompt_from_stdin(stories_artifact):
    from click.testing import CliRunner

    from lade_export.cli import main

    args = ["generate", str(stories_artifact), "--max-new-tokens", "8", "--greedy"]
    piped = CliRunner().invoke(main, [*args, "--prompt-file", "-"], input="Once upon a time", catch_exceptions=False)
    given = CliRunner().invoke(main, [*args, "--prompt", "Once upon a time"], catch_exceptions=False)
    assert piped.exit_code == given.exit_code == 0, piped.stderr
    assert piped.stdout == given.stdout and len(piped.stdout) > 5


def test_an_interrupt_while_streaming_puts_the_error_on_its_own_line(stories_artifact, monkeypatch):
    from click.testing import CliRunner

    from lade_export import api
    from lade_export.cli import main

    closed = []
    real_next, real_close = api.Stream.__next__, api.Stream.close

    def next_then_interrupt(self):
        if len(self._taken) >= 3:
            raise KeyboardInterrupt
        return real_next(self)

    monkeypatch.setattr(api.Stream, "__next__", next_then_interrupt)
    monkeypatch.setattr(api.Stream, "close", lambda self: (closed.append(True), real_close(self)))
    result = CliRunner().invoke(main, ["generate", str(stories_artifact), "--prompt", "Once upon a time",
                                       "--max-new-tokens", "40"], catch_exceptions=False)
    assert result.exit_code == 130
    assert result.stderr == "error: interrupted\n"
    assert len(result.stdout) > 3 and result.stdout.endswith("\n") and not result.stdout.endswith("\n\n")
    assert closed  # the request was stopped (its cache freed), not left to the garbage collector


def test_a_closed_stdout_ends_generate_quietly_with_status_141(stories_artifact):
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "generate", str(stories_artifact), "--prompt",
                             "Once upon a time", "--max-new-tokens", "64"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    proc.stdout.close()  # the reader is gone before the first token (as `| head` is after its lines)
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141  # like a process killed by SIGPIPE (`yes | head`)
    assert err == ""


def test_an_output_that_cannot_be_written_is_one_line_and_a_closed_stream_is_the_null_device(stories_artifact,
                                                                                          tmp_path):
    """A full disk on standard output (/dev/full), for a command's output and for click's own
    help, ends in one line and exit 2 (was an OSError traceback); `inspect | head` ends 141 as
    `generate` does (rich's console exited 1, a failed check's status); a standard stream the
    caller closed (`>&-`, `<&-`) is the null device (was an AttributeError traceback)."""
    cli = [sys.executable, str(ROOT / "cli.py")]
    gen = [*cli, "generate", str(stories_artifact), "--no-chat", "--max-new-tokens", "4"]
    for args in ([*gen, "--prompt", "Once"], [*cli, "inspect", str(stories_artifact)], [*cli, "--help"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, cwd=ROOT)
        assert (done.returncode, done.stderr) == (2, "error: cannot write the output: No space left on device\n"), args
    proc = subprocess.Popen([*cli, "inspect", str(stories_artifact)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    proc.stdout.close()
    assert (proc.wait(timeout=300), proc.stderr.read()) == (141, "")
    closed_out = subprocess.run([*gen, "--prompt", "Once"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, timeout=300, cwd=ROOT,
                                preexec_fn=lambda: os.close(1))
    assert closed_out.returncode == 0 and "Traceback" not in closed_out.stderr, closed_out.stderr
    closed_in = subprocess.run([*gen, "--prompt-file", "-"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=300, cwd=ROOT, preexec_fn=lambda: os.close(0))
    assert closed_in.returncode == 0 and "Traceback" not in closed_in.stderr, closed_in.stderr  # an empty prompt


def test_a_usage_error_hint_names_the_command_as_it_was_run():
    """``python -m lade_export.cli`` and the installed ``lade-export`` script each get a --help
    hint that runs as written (the program name of click's own usage lines)."""
    script = Path(sys.executable).with_name("lade-export")
    assert script.is_file(), f"{script}: the lade-export entry point is not installed (pip install -e .)"
    for program, name in (([sys.executable, "-m", "lade_export.cli"], "python -m lade_export.cli"),
                          ([str(script)], "lade-export")):
        bad_value = subprocess.run([*program, "serve", "--port", "x"], capture_output=True, text=True, timeout=60)
        assert bad_value.returncode == 2
        assert one_line_error(bad_value) == ("error: Invalid value for '--port': 'x' is not a valid integer range. "
                                             f"(see: {name} serve --help)")
        unknown = subprocess.run([*program, "nosuch"], capture_output=True, text=True, timeout=60)
        assert unknown.returncode == 2
        assert one_line_error(unknown) == f"error: No such command 'nosuch'. (see: {name} --help)"


def test_the_program_run_bare_prints_its_help_not_an_error():
    bare = subprocess.run([sys.executable, "-m", "lade_export.cli"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2  # click's exit status for a group run with no command
    assert bare.stderr.startswith("Usage: python -m lade_export.cli [OPTIONS] COMMAND [ARGS]...\n")
    assert "error:" not in bare.stderr and "(see:" not in bare.stderr
    assert "\n  build " in bare.stderr and "\n  serve " in bare.stderr  # the command list
