"""The ``lade-export`` command line.

Every user error ends in one line on stderr (``error: …``) and a non-zero exit status:
2 for bad input, 1 for a failed check (parity, exactness), 130 when interrupted; 141, without a
message, when ``generate``'s reader closes stdout (as SIGPIPE would).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

import click

from .errors import ArtifactError, GenerationError, LadeError, ProfileError
from .backends import BACKENDS, DTYPES
from .kernels import COMPUTE, KERNELS
from .profile import bundled_profile_names, bundled_profiles_dir, resolve_profile


#: Modules of the optional extras (pyproject.toml) -> the extra that installs them.
_EXTRAS = {"torch": "export", "transformers": "export", "safetensors": "export", "gguf": "export",
           "accelerate": "export", "onnx": "export", "onnxscript": "export", "onnxslim": "export",
           "polygraphy": "export", "matplotlib": "bench", "tritonclient": "serve", "starlette": "http",
           "uvicorn": "http", "prometheus_client": "http"}


class _Group(click.Group):
    """Turns typed errors, usage errors and interrupts into one-line messages and exit codes."""

    def main(self, *args, **kwargs):
        kwargs.setdefault("standalone_mode", False)
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.exceptions.NoArgsIsHelpError as err:  # a bare group: its help, as click prints it
            click.echo(err.format_message(), err=True)
            sys.exit(2)
        except click.UsageError as err:
            # the command as it was run, as click's own usage lines name it ("lade-export serve",
            # "python -m lade_export.cli serve"): the hint runs as written where the error appeared
            where = err.ctx.command_path if err.ctx else "lade-export"
            click.echo(f"error: {err.format_message()} (see: {where} --help)", err=True)
            sys.exit(2)
        except click.ClickException as err:
            click.echo(f"error: {err.format_message()}", err=True)
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LadeError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(err.exit_code)
        except ModuleNotFoundError as err:
            extra = _EXTRAS.get((err.name or "").split(".")[0])
            if extra is None:
                raise
            click.echo(f"error: lade-export {ctx.invoked_subcommand} needs {err.name}, which this install lacks: "
                       f"pip install 'lade-export[{extra}]'", err=True)
            sys.exit(2)
        except KeyboardInterrupt as err:
            message = "error: interrupted"
            if ctx.invoked_subcommand in ("build", "export"):
                message = f"error: {err}" if str(err).startswith("interrupted after") else \
                    "error: interrupted; nothing was written"
            click.echo(message, err=True)
            sys.exit(130)


def _console():
    from rich.console import Console

    return Console(stderr=True)


# Parameters that several commands declare alike, written once. Each use of one of these
# decorators adds a parameter of its own to its command (click makes a new Option per use),
# so a command's --help is what it was when each command wrote them out.
_artifact_dir = click.argument("artifact_dir", type=click.Path(path_type=Path))  # the commands that read a build
_artifact_out = click.option("--out", required=True, type=click.Path(path_type=Path),
                             help="Artifact directory to create.")  # build, export
_backend = click.option("--backend", type=click.Choice(BACKENDS), default="ort",
                        show_default=True)  # generate, compare, tune
_device = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu",
                       show_default=True)  # generate, compare
_engine_threads = click.option("--threads", type=click.IntRange(min=1), default=None,
                               help="Engine threads (default: one per core).")  # generate, serve
_threads = click.option("--threads", type=click.IntRange(min=1), default=None)  # compare, tune
_token_budget = click.option("--token-budget", type=click.IntRange(min=1), default=None,
                             help="Scheduler: rows of a pass that holds decode steps (default 64).")  # triton, serve


def _kv_tokens(help: str):
    """``--kv-tokens`` of triton and serve: the same option; its help names each command's
    own request limit."""
    return click.option("--kv-tokens", type=click.IntRange(min=1), default=None, help=help)


@click.group(cls=_Group, name="lade-export")  # the name click's test runner gives the program
@click.version_option(package_name="lade-export")
def main():
    """Export LLaMA decoder steps for exact lookahead decoding, build engines, generate, compare."""


def _profiles(values) -> list:
    profiles = [resolve_profile(v) for v in (values or ("default",))]
    names = [p.name for p in profiles]
    for name in names:
        if names.count(name) > 1:
            raise ProfileError(f"profile {name!r} is given twice; each --profile needs its own name")
    return profiles


@main.command()
@click.option("--model", "source", default="smollm2-135m-instruct", show_default=True,
              help="HF directory, .gguf file, hub id, or smollm2-135m-instruct.")
@click.option("--profile", "profile_values", multiple=True,
              help=f"Profile TOML, shipped name ({', '.join(bundled_profile_names())}) or W,N,G[,K[,B]] "
                   "(repeatable; the first is the artifact's default).")
@_artifact_out
@click.option("--force", is_flag=True, help="Replace --out if it exists (after the new build succeeds).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime threads for the parity check.")
@click.option("--engine", type=click.Choice(["onnx", "tensorrt"]), default="onnx", show_default=True,
              help="onnx: the ONNX graph for ONNX Runtime; tensorrt: also one TensorRT engine per profile.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="The weights' numeric format. ONNX Runtime: fp32 (default), int8 or int4 (weight-only "
                   "MatMulNBits); TensorRT: fp16 (default), bf16 or fp32 (TensorRT 10: builder flags on the float32 "
                   "graph; 11: a strongly typed network from the step exported in that precision).")
@click.option("--block-size", type=int, default=None, help="int8/int4: weights per quantization scale (default 32).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=None,
              help="int8/int4: MatMulNBits compute type (default: 1, float32, for int4; 4, int8 activations, for "
                   "int8). Only 0 and 1 keep lookahead exact; other levels make an artifact that decodes without "
                   "lookahead.")
@click.option("--head-bits", type=click.Choice(["0", "4", "8"]), default=None,
              help="int8/int4: bits of the LM head and the tied embedding (0: float32; default 0, or 8 with "
                   "--kernels lade). With ONNX Runtime's kernels 8 is fast only with --accuracy-level 4.")
@click.option("--kernels", type=click.Choice(KERNELS), default="onnxruntime", show_default=True,
              help="int8/int4: onnxruntime: ONNX Runtime's MatMulNBits; lade: this project's block-quantized "
                   "kernels (GGML Q4_1/Q8_0 blocks; see --compute), a library compiled at build time into the "
                   "artifact (needs g++; ONNX Runtime's headers are downloaded once, ~150 MB).")
@click.option("--compute", type=click.Choice(COMPUTE), default=None,
              help="--kernels lade: int8 (default): activations rounded to int8 per row and block of 32, integer "
                   "dot products (VNNI, AMX, AVX2; the same bits on every CPU), attention by the kernels too; "
                   "float32: float32 FMAs, tokens closer to the float32 engine's. Lookahead is exact with both.")
@click.option("--attention", type=click.Choice(["auto", "onnx-ops", "group-query-attention"]), default="auto",
              show_default=True,
              help="ONNX Runtime builds: group-query-attention fuses each layer's RoPE and attention into ONNX "
                   "Runtime's GroupQueryAttention over a head-major cache the step writes in place (head width a "
                   "multiple of 16); onnx-ops keeps standard operators (what TensorRT parses). auto: the first "
                   "where it applies.")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="TensorRT timing cache file, read and updated (reuse it across builds).")
@click.option("--max-batch", type=click.IntRange(min=1), default=1, show_default=True, help="Largest batch the engines accept.")
@click.option("--max-prompt", type=int, default=None,
              help="TensorRT engines: longest prompt prefilled at once (default: context/2).")
@click.option("--max-context", type=int, default=None,
              help="TensorRT engines: context bound of their optimization profiles (default: the model's).")
@click.option("--version-compatible", is_flag=True, help="TensorRT version-compatible engines (for later runtimes).")
@click.option("--hardware-compatible", is_flag=True, help="TensorRT engines for any Ampere-or-newer GPU.")
@click.option("--dry-run", is_flag=True, help="Print what would be built (engines, optimization profiles); write nothing.")
def build(source, profile_values, out, force, threads, engine, precision, block_size, accuracy_level, head_bits,
          kernels, compute, attention, timing_cache, max_batch, max_prompt, max_context, version_compatible, hardware_compatible, dry_run):
    """Load a checkpoint, export its decoder step to ONNX, check parity, write DIR
    (int8/int4: a weight-only quantized graph; with --engine tensorrt, one TensorRT engine
    per profile)."""
    from .export.build import (build_artifact, default_profile_for, refuse_fused_attention_on_rows_exact,
                        refuse_fused_attention_on_tensorrt)
    from .manifest import Manifest
    from .export.optimization_profiles import describe_plan, engine_plans
    from .export.quantize import ORT_PRECISIONS, QuantSpec

    precision = precision or ("fp16" if engine == "tensorrt" else "fp32")
    if engine == "onnx" and precision not in ORT_PRECISIONS:
        raise ProfileError(f"--precision {precision} is a TensorRT (or torch backend) precision; ONNX Runtime engines "
                           "take fp32, int8 or int4")
    if engine == "tensorrt" and kernels == "lade":
        raise ProfileError("--kernels lade makes ONNX Runtime custom operators, which TensorRT cannot parse; "
                           "--engine tensorrt takes fp16, bf16 or fp32")
    if engine == "tensorrt" and precision in ("int8", "int4"):
        raise ProfileError(f"--precision {precision} makes MatMulNBits weights, which TensorRT cannot parse; "
                           "--engine tensorrt takes fp16, bf16 or fp32")
    refuse_fused_attention_on_tensorrt(attention, engine == "tensorrt")
    quantized = engine == "onnx" and bool(ORT_PRECISIONS.get(precision))
    for option, value in (("--block-size", block_size), ("--accuracy-level", accuracy_level),
                          ("--kernels", None if kernels == "onnxruntime" else kernels), ("--compute", compute)):
        if value is not None and not quantized:
            raise ProfileError(f"{option} applies to int8/int4 ONNX Runtime builds (--precision int8 or int4); "
                               f"this build is {precision}")
    if head_bits is not None and int(head_bits) and not quantized:
        raise ProfileError(f"--head-bits {head_bits} quantizes the head of an int8/int4 ONNX Runtime build; "
                           f"give --precision int8 or int4")
    quantization = QuantSpec.for_precision(precision, block_size, accuracy_level,
                                           None if head_bits is None else int(head_bits), kernels,
                                           compute) if quantized else None
    if kernels == "lade":
        from .kernels import cpu_has_avx2, cpu_has_avx512, require_toolchain

        # before any work: no compiler or headers (downloaded now if missing, not in a dry run), nothing is written
        headers_at_hand = require_toolchain(fetch=not dry_run)
        if quantization.compute == "float32" and cpu_has_avx512() is False:
            click.echo("note: this CPU lacks AVX-512 (avx512f/bw/vl/dq); the float32-compute lade kernels take their "
                       "portable path here, about 12x slower than on an AVX-512 CPU: --compute int8 (AVX2) is faster "
                       "on it", err=True)
        elif quantization.compute == "int8" and cpu_has_avx2() is False:
            click.echo("note: this CPU lacks AVX2 (avx2/fma/f16c); the lade kernels take their portable path here, "
                       "many times slower: --kernels onnxruntime is faster on it", err=True)
    profiles = _profiles(profile_values or (default_profile_for(precision, kernels),))
    if quantization is not None and quantization.kernels == "lade" and quantization.compute == "int8":
        refuse_fused_attention_on_rows_exact(attention)  # before any work
    if quantization is not None and not quantization.lookahead_exact and any(p.enabled for p in profiles):
        raise ProfileError(f"--precision {precision} with accuracy level {quantization.accuracy_level} computes one-token "
                           "and multi-token steps differently (int8 activations), so lookahead would not be exact; "
                           "give --profile greedy-only, or build int4 (float32 compute)")
    engine_options = None
    if engine == "tensorrt":
        engine_options = dict(precision=precision, max_batch=max_batch, max_prompt=max_prompt, max_context=max_context,
                              version_compatible=version_compatible, hardware_compatible=hardware_compatible)
    if dry_run:
        from .graph import DecoderStep
        from .export.model_source import load_model

        step = DecoderStep(load_model(source).model)
        dims = step.dims
        if step.rope.reason:
            click.echo(f"note: {step.rope.reason}", err=True)
        for profile in profiles:
            profile.check_fits(dims.max_context)
        library = (", kernels/liblade_kernels.so (compiled" + ("" if headers_at_hand else "; ONNX Runtime's headers "
                   "downloaded first, ~150 MB") + ")") if kernels == "lade" else ""
        click.echo(f"dry run: would write {out}/model.onnx, tokenizer/, manifest.json{library}")
        if engine_options:
            from .backends.tensorrt_install import SUPPORTED_MAJORS, installed_tensorrt_major
            from .export.tensorrt_build import describe_precision_plan, precision_plan

            major = installed_tensorrt_major()
            majors = (major,) if major in SUPPORTED_MAJORS else SUPPORTED_MAJORS
            installed = f"installed TensorRT {major}" if major in SUPPORTED_MAJORS else \
                f"TensorRT {major} is not supported" if major else "no TensorRT installed"
            for plan in engine_plans(profiles, dims, **engine_options):
                click.echo("\n".join(describe_plan(plan, dims.num_layers)))
                click.echo(f"  precision plan ({installed}):")
                for m in majors:
                    click.echo(f"    {describe_precision_plan(precision_plan(precision, m))}")
        click.echo("nothing was written")
        return
    if engine_options:
        from .export.tensorrt_build import require_builder

        require_builder()  # before any work: nothing is written without TensorRT and a GPU
    with _interrupt_names_written_build(out):
        with _progress() as say:
            manifest = Manifest.from_dict(build_artifact(
                source, profiles, out, force=force, threads=threads, status=say, engine_options=engine_options,
                timing_cache=timing_cache, quantization=quantization, attention=attention))
        worst = max(manifest.parity.cases, key=lambda c: c["max_abs"])
        click.echo(f"built {out}: {manifest.model.dims.num_layers} layers, "
                   f"profiles {', '.join(p.name for p in manifest.profiles)}; parity max |Δlogit| "
                   f"{worst['max_abs']:.2e} (relative {worst['rel']:.1e})", err=True)
        if quantization is not None:
            q = manifest.quantization
            click.echo(f"{precision} weights: {q.graph.bytes_after / 2**20:.0f} MB (float32 "
                       f"{q.graph.bytes_before / 2**20:.0f} MB); against the float32 graph: top-1 agreement "
                       f"{100 * q.quality.top1_agreement:.1f}% over {q.quality.positions} answer "
                       f"tokens, max |Δlogit| {q.quality.max_abs_logit_diff:.2f}", err=True)
        _echo_rope_note(manifest)


@contextlib.contextmanager
def _interrupt_names_written_build(out):
    """A KeyboardInterrupt that lands once ``out`` is the new build (the directory was
    replaced: another inode) says so, instead of the "nothing was written" of an interrupt
    before that (:func:`lade_export.artifact.atomic_directory` keeps the previous build then)."""
    def identity():
        try:
            st = os.stat(out)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    before = identity()
    try:
        yield
    except KeyboardInterrupt as err:
        if identity() != before and not str(err).startswith("interrupted after"):
            raise KeyboardInterrupt(f"interrupted after the new build was written to {Path(out).resolve()}") \
                from None
        raise


def _echo_rope_note(manifest) -> None:
    """Repeat the rope note after the build on a terminal, whose spinner does not keep stage
    lines (elsewhere the stage line ``[  t s] note: …`` stays in the log);
    ``manifest`` is a :class:`lade_export.manifest.Manifest`."""
    rope = manifest.model.rope
    if rope is not None and rope.reason and _console().is_terminal:
        click.echo(f"note: {rope.reason}", err=True)


class _progress:
    """Stage messages of a slow command on stderr: a live spinner on a terminal, else one
    line per stage with the seconds since the start (so logs and CI show progress)."""

    def __enter__(self):
        import time

        self.t0 = time.perf_counter()
        self.console = _console()
        self.status = None
        if self.console.is_terminal:
            self.status = self.console.status("starting")
            self.status.__enter__()
        return self.say

    def say(self, message: str) -> None:
        import time

        if self.status is not None:
            self.status.update(f"[bold]{message}…")
        else:
            click.echo(f"[{time.perf_counter() - self.t0:6.1f}s] {message}", err=True)

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.__exit__(*exc)


@main.command()
@click.option("--model", "source", default="smollm2-135m-instruct", show_default=True)
@_artifact_out
@click.option("--force", is_flag=True)
def export(source, out, force):
    """Export and parity-check the step graph only (a build with the default profile)."""
    from .export.build import build_artifact
    from .manifest import Manifest

    with _interrupt_names_written_build(out):
        with _progress() as say:
            manifest = Manifest.from_dict(build_artifact(source, _profiles(None), out, force=force, status=say))
        click.echo(f"exported {out / manifest.graph.file}")
        _echo_rope_note(manifest)


def _read_prompt(prompt, prompt_file, prompt_from=None, chat=False):
    given = [n for n, v in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-from", prompt_from))
             if v is not None]
    if len(given) > 1:
        raise GenerationError(f"give only one of {', '.join(given)}")
    if prompt_from is not None:
        from .evaluation.datasets import load_prompts

        name, _, index = prompt_from.rpartition(":")
        if not name or not index.isdigit():
            raise GenerationError(f"--prompt-from wants DATASET:INDEX (e.g. mt_bench:0), got {prompt_from!r}")
        prompts = load_prompts(name, limit=int(index) + 1, chat=chat)
        if len(prompts) <= int(index):
            raise GenerationError(f"{name} has only {len(prompts)} prompts; index {index} is out of range")
        return prompts[int(index)].text
    if prompt_file is not None:
        import codecs

        try:
            data = sys.stdin.buffer.read() if str(prompt_file) == "-" else Path(prompt_file).read_bytes()
        except FileNotFoundError:
            raise GenerationError(f"prompt file not found: {prompt_file}") from None
        except (IsADirectoryError, PermissionError) as err:
            raise GenerationError(f"cannot read prompt file {prompt_file}: {err.strerror}") from None
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # a byte-order mark is not prompt text
        try:
            return data[bom:].decode("utf-8")
        except UnicodeDecodeError as err:
            raise GenerationError(f"prompt file {prompt_file} is not UTF-8 text (byte {bom + err.start})") from None
    if prompt is None:
        raise GenerationError("give --prompt TEXT, --prompt-file PATH or --prompt-from DATASET:INDEX")
    return prompt


@main.command()
@_artifact_dir
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None,
              help="Read the prompt from a UTF-8 file, or from stdin with - (a leading byte-order mark is ignored).")
@click.option("--prompt-from", default=None, metavar="DATASET:INDEX",
              help="Take the prompt from a workload: mt_bench:0, humaneval:3, gsm8k:10 (read from $LADE_DATASETS; "
                   "docs/datasets.md) or a JSONL file, prompts.jsonl:0.")
@click.option("--chat/--no-chat", default=None,
              help="Wrap the prompt in the model's chat template (default: when the model has one).")
@click.option("--parse-special-in-messages", "parse_special", is_flag=True,
              help="Read special-token strings (e.g. </s>) in a chat-wrapped prompt as control tokens "
                   "(default: they are text; --no-chat text is always read raw).")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--greedy", is_flag=True, help="Plain greedy decoding: no lookahead, temperature 0.")
@click.option("--lookahead/--no-lookahead", default=True, show_default=True,
              help="Lookahead decoding, or one token per step (with either decoding rule).")
@click.option("--profile", "profile_value", default=None,
              help="Lookahead profile: shipped name, TOML path or W,N,G[,K[,B]] (default: the build's default).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 (or below 1e-5): greedy decoding; from 1e-5: sampling (lookahead keeps plain sampling's "
                   "distribution).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample among the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1.0: off).")
@click.option("--seed", type=int, default=None, help="Seed of the sampler (same seed, same output).")
@click.option("--stop", "stops", multiple=True, help="Stop string: the answer ends before it (repeatable).")
@_backend
@_device
@click.option("--dtype", type=click.Choice(DTYPES), default="float32",
              help="Compute dtype of the torch backend.")
@_engine_threads
@click.option("--verify", is_flag=True, help="Also check the weights' sha256 before loading (~1 s per GB).")
@click.option("--check-greedy", is_flag=True, help="Also run plain greedy and report identity and speedup.")
def generate(artifact_dir, prompt, prompt_file, prompt_from, chat, max_new_tokens, greedy, lookahead, profile_value,
             temperature, top_k, top_p, seed, stops, backend, device, dtype, threads, verify, check_greedy,
             parse_special):
    """Generate from a built artifact with lookahead (or --no-lookahead) decoding, greedy or
    sampled: the text streams to stdout, the statistics go to stderr."""
    from .api import load
    from .sampling import SamplingParams

    if greedy and temperature > 0:
        raise GenerationError("--greedy means temperature 0; drop it to sample with --temperature")
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    for option, value, off in (("--top-k", top_k, 0), ("--top-p", top_p, 1.0), ("--seed", seed, None)):
        if sampling.greedy and value != off:
            raise GenerationError(f"{option} needs --temperature > 0 (without it decoding is greedy)")
    if check_greedy and not sampling.greedy:
        raise GenerationError("--check-greedy compares greedy outputs; it cannot be combined with --temperature > 0")
    lookahead = lookahead and not greedy
    model = load(artifact_dir, backend, threads=threads, device=device, dtype=dtype,
                 verify="full" if verify else "quick")
    use_chat = model.tokenizer.has_chat_template if chat is None else chat
    ids = model.encode(_read_prompt(prompt, prompt_file, prompt_from, use_chat), use_chat,
                       parse_special_in_messages=parse_special)
    profile = model.resolve_profile(profile_value, lookahead=lookahead)
    stream = model.stream(ids, max_new_tokens=max_new_tokens, profile=profile, lookahead=lookahead, stop=stops,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    last = "\n"
    try:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk.text[-1:] or last
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the reader closed stdout (e.g. | head): stop quietly, as SIGPIPE would
        stream.close()
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        sys.exit(141)
    except KeyboardInterrupt:
        stream.close()
        if last != "\n":  # the error line on stderr starts on its own line, not after the text
            try:
                sys.stdout.write("\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                pass
        raise
    result = stream.result
    if profile is not None and not profile.enabled:
        profile = None
    mode = f"lookahead {profile.name} (W={profile.window}, N={profile.ngram}, G={profile.guesses}" + \
        (f", K={profile.lookup}" + (f", B={profile.lookup_branches}" if profile.lookup_branches > 1 else "") + ")"
         if profile.lookup else ")") if profile else "no lookahead"
    click.echo(f"[{mode}, {sampling.describe()}] {result.stats.line()} · stop: {result.stop_reason}", err=True)
    library = model.artifact.custom_ops_path if backend == "ort" else None
    if library is not None:
        from .kernels import running_path

        compute = model.artifact.spec.kernel_compute
        click.echo(f"[kernels] lade, {compute} compute, path: {running_path(library, compute)}", err=True)
    if backend == "tensorrt":
        click.echo(f"[tensorrt] {model.engine.runtime_description}; engines used: "
                   f"{', '.join(model.engine.loaded_engines)}", err=True)
    if check_greedy and profile is None:
        click.echo("[check-greedy] nothing to compare: this run decoded one token per step "
                   "(no lookahead profile)", err=True)
    elif check_greedy:
        base = model.generate(ids, max_new_tokens=max_new_tokens, lookahead=False, stop=stops)
        same = base.token_ids == result.token_ids
        speedup = base.stats.decode_s / result.stats.decode_s if result.stats.decode_s else 0.0
        click.echo(f"[greedy] {base.stats.line()}", err=True)
        click.echo(f"identical to greedy: {'yes' if same else 'NO'} · decode speedup {speedup:.2f}x", err=True)
        if not same:
            sys.exit(1)


def _open_decoder(artifact_dir, backend, device, dtype, threads):
    from .api import load

    model = load(artifact_dir, backend, threads=threads, device=device, dtype=dtype)
    return model.artifact, model.tokenizer, model.decoder


@main.command()
@_artifact_dir
@click.option("--profile", "profile_values", multiple=True, help="Profiles to compare (repeatable; default: the build's).")
@click.option("--dataset", "datasets", multiple=True, default=("mt_bench",), show_default=True,
              help="mt_bench, humaneval, gsm8k (read from $LADE_DATASETS) or a .jsonl path (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), default=16, show_default=True, help="Prompts per dataset.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--peer", "peers", multiple=True,
              type=click.Choice(["transformers-greedy", "transformers-prompt-lookup", "llama.cpp-greedy",
                                 "llama.cpp-lookahead"]),
              help="Also run another implementation on the same prompts (repeatable): transformers' generate on the "
                   "float32 weights, or llama.cpp's greedy CLI / lookahead example on a GGUF.")
@click.option("--llama-cpp", "llama_cpp", default=None, type=click.Path(path_type=Path),
              help="Folder with llama-completion and llama-lookahead (default: $LADE_LLAMA_CPP; build them with "
                   "bench/build_llama_cpp.sh).")
@click.option("--llama-gguf", "llama_gguf", default=None, type=click.Path(path_type=Path),
              help="GGUF the llama.cpp peers run (default: the Q4_1 file shipped for SmolLM2).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder for results and summaries.")
@_backend
@_device
@click.option("--dtype", type=click.Choice(DTYPES), default="float32")
@_threads
@click.option("--also", "also", multiple=True, type=click.Path(path_type=Path),
              help="Another artifact of the same model (e.g. its int4 build) to run in the same loop: its greedy and its "
                   "default profile (repeatable).")
@click.option("--title", default="", help="Title for summary.md (e.g. the machine).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="> 0: compare under sampling (baseline: plain sampling; exactness n/a).")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Prompt i samples with seed SEED + i.")
def compare(artifact_dir, profile_values, datasets, limit, max_new_tokens, peers, llama_cpp, llama_gguf, out, also, backend,
            device, dtype, threads, title, temperature, top_k, top_p, seed):
    """Run the baseline (greedy, or plain sampling with --temperature) and each profile (and
    peers) on a workload, interleaved; check exactness (greedy); write results.jsonl,
    summary.md/.csv and speedup.png."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .evaluation.compare import environment, run_compare, summarize, write_outputs
    from .evaluation.datasets import load_prompts
    from .errors import CheckFailedError
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    if out.exists() and not out.is_dir():
        raise GenerationError(f"--out {out} exists and is not a folder; give a folder for the results")
    if any(p.startswith("llama.cpp") for p in peers):  # bad llama.cpp setup fails before any work
        from .evaluation.peers import check_gguf, check_peer_names, find_llama_cpp

        check_peer_names(peers, not sampling.greedy)
        find_llama_cpp(llama_cpp)
        if llama_gguf is not None:
            check_gguf(llama_gguf)
    artifact, tokenizer, decoder = _open_decoder(artifact_dir, backend, device, dtype, threads)
    profiles = [resolve_profile(v) for v in profile_values] if profile_values else artifact.profiles()
    for profile in profiles:
        profile.check_fits(artifact.max_context)
    chat = artifact.has_chat_template
    counts = [len(load_prompts(d, limit=limit, chat=chat)) for d in datasets]
    peer_set = None
    if peers:
        from .evaluation.peers import Peers

        peer_set = Peers(peers, artifact.spec.source.model, llama_cpp, llama_gguf, threads,
                         sampled=not sampling.greedy)
    extra_engines = []
    for path in also:
        other = _open_decoder(path, backend, device, dtype, threads)
        if other[0].dims != artifact.dims:
            raise GenerationError(f"--also {path} is a build of another model ({other[0].spec.source.model}: "
                                  f"{other[0].dims.num_layers} layers, vocab {other[0].dims.vocab}) than {artifact_dir} "
                                  f"({artifact.dims.num_layers} layers, vocab {artifact.dims.vocab})")
        tag = other[0].spec.graph.precision
        tags = [t for t, _, _ in extra_engines]
        tag = tag if tag not in tags and tag != artifact.spec.graph.precision else path.name
        default = other[0].default_profile()
        use = [] if not other[2].lookahead_exact else [default] if default is not None and default.enabled else \
            [p for p in profiles if p.enabled]  # a greedy default: still measure the compared profiles there
        extra_engines.append((tag, other[2], use))
    total = sum(counts) * (1 + len(profiles) + (len(peer_set.names) if peer_set else 0)
                           + sum(1 + len(p) for _, _, p in extra_engines))
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("comparing", total=total)
        records, skipped = run_compare(decoder, tokenizer, chat, list(datasets), profiles, limit, max_new_tokens,
                                       peer_set, progress=lambda n: progress.advance(task, n), sampling=sampling,
                                       extra_engines=extra_engines)
    _report_skipped(skipped, records, decoder.max_context)
    rows = summarize(records)
    meta = {**environment(), "title": title, "artifact": str(artifact_dir), "model": artifact.spec.source.model,
            "backend": f"{backend} ({device}, {dtype})",
            "threads": threads or "default", "decoding": sampling.describe(), "datasets": ", ".join(datasets),
            "limit": limit, "max_new_tokens": max_new_tokens,
            "command": "lade-export compare " + " ".join(sys.argv[2:]), "skipped": [r.line() for r in skipped],
            **({"also": ", ".join(f"{t}: {p}" for (t, _, _), p in zip(extra_engines, also))} if also else {}),
            "peers": peer_set.describe() if peer_set is not None else {}}
    plotted = write_outputs(out, records, rows, meta)
    table = Table(title=f"compare: {', '.join(datasets)} ({limit} prompts, {max_new_tokens} new tokens max)")
    for col in ("dataset", "config", "compression", "tok/s", "speedup", "p50 ms/tok", "exact"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["dataset"], r["config"], f"{r['compression_mean']:.2f}", f"{r['decode_tok_s']:.1f}",
                      f"{r['speedup_vs_baseline']:.2f}x", f"{r['p50_ms_per_token']:.1f}",
                      "n/a" if r["exact"] is None else f"{r['exact']}/{r['prompts']}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    for key, value in meta["peers"].items():
        click.echo(f"{key}: {value}", err=True)
    click.echo(f"wrote {out}/results.jsonl, summary.md, summary.csv"
               + (", speedup.png" if plotted else " (no speedup.png: plotting needs pip install 'lade-export[bench]')")
               + (f" ({len(skipped)} record(s) skipped: they do not fit the context)" if skipped else ""))
    from .evaluation.peers import UNCHECKED_PEERS

    bad = [r for r in records if r.exact is False and r.config not in UNCHECKED_PEERS]
    if bad:
        first = bad[0]
        raise CheckFailedError(f"{len(bad)} output(s) differ from {first.reference}: first {first.config} on "
                               f"{first.dataset} prompt {first.prompt_id}")


def _report_skipped(skipped, kept, context: int) -> None:
    """One stderr line per record left out for not fitting the context; an error (its one
    line only) when none fits.

    Raises:
        GenerationError: every record was left out (nothing is written then).
    """
    if skipped and not kept:
        first = skipped[0]
        raise GenerationError(f"none of the {len(skipped)} record(s) fits the model's context of {context} tokens "
                              f"(the first, {first.path} record {first.record}, has {first.prompt_tokens} prompt "
                              "tokens); nothing was written")
    for record in skipped:
        click.echo(record.line(), err=True)


@main.command()
@_artifact_dir
@click.option("--dataset", default="mt_bench", show_default=True,
              help="mt_bench, humaneval, gsm8k (read from $LADE_DATASETS) or a .jsonl path.")
@click.option("--limit", type=click.IntRange(min=2), default=8, show_default=True,
              help="Prompts: the first half measures the grid, the rest verifies the winner.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Per generation; use the length you will serve (acceptance grows with length).")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="Skip the first N prompts (tune on prompts a comparison does not use).")
@click.option("--grid", default="default", show_default=True, help="Named grid: default or tiny.")
@click.option("--candidate", "candidates", multiple=True, metavar="W,N,G[,K[,B]]", help="Grid entries instead of --grid.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("tuned.toml"), show_default=True,
              help="Profile TOML to write (not in the shipped profiles folder).")
@_backend
@click.option("--validate-dataset", default=None,
              help="Also verify the winner on another workload (default: humaneval, or mt_bench when tuning on "
                   "humaneval, read from $LADE_DATASETS; 'none' to skip).")
@click.option("--validate-limit", type=click.IntRange(min=1), default=8, show_default=True)
@_threads
def tune(artifact_dir, dataset, limit, max_new_tokens, skip, grid, candidates, out, backend, threads,
         validate_dataset, validate_limit):
    """Measure the step-cost curve and a grid of profiles, keep the fastest measured one
    that also beats greedy on held-out prompts, and write it as a profile TOML."""
    from rich.console import Console
    from rich.progress import Progress

    from .artifact import write_text_atomic
    from .evaluation.compare import environment, fit_prompts
    from .evaluation.datasets import load_prompts
    from .evaluation.tune import grid_profiles
    from .evaluation.tune import tune as run_tune

    if out.is_dir():
        raise ProfileError(f"--out {out} is a folder; give the path of the profile TOML to write")
    if out.resolve().parent == bundled_profiles_dir().resolve():
        raise ProfileError(f"--out {out} is in the folder of the shipped profiles ({bundled_profiles_dir()}); write "
                           "tuned profiles elsewhere (e.g. --out tuned.toml) and pass that path to --profile")
    profiles = grid_profiles(list(candidates) if candidates else grid)
    artifact, tokenizer, decoder = _open_decoder(artifact_dir, backend, "cpu", "float32", threads)
    chat = artifact.has_chat_template
    kept, skipped = fit_prompts(decoder, tokenizer, load_prompts(dataset, limit=limit, chat=chat, skip=skip), chat)
    _report_skipped(skipped, kept, decoder.max_context)
    prompts = [ids for _, ids in kept]
    half = (len(prompts) + 1) // 2
    by_default = validate_dataset is None
    validate_dataset = validate_dataset or next(d for d in ("humaneval", "mt_bench") if d != dataset)
    validation = []
    if validate_dataset != "none":
        try:
            vprompts = load_prompts(validate_dataset, limit=validate_limit, chat=chat)
        except GenerationError as err:
            if not by_default:
                raise
            raise GenerationError(f"{err}; tune verifies the winner on {validate_dataset} by default: "
                                  "--validate-dataset none skips it (or name another dataset)") from None
        vkept, vskipped = fit_prompts(decoder, tokenizer, vprompts, chat)
        _report_skipped(vskipped, vkept, decoder.max_context)
        validation = [ids for _, ids in vkept]
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("tuning", total=half * len(profiles) + (len(prompts) - half) + len(validation))
        result = run_tune(decoder, prompts, profiles, max_new_tokens, progress=lambda n: progress.advance(task, n),
                          validation_ids=validation, validation_label=f"{validate_dataset}, {len(validation)} prompts")
    result.skipped = [r.line() for r in skipped]
    result.name = out.stem if out.stem.replace("-", "").replace("_", "").isalnum() else "tuned"
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True)
    write_text_atomic(out, result.toml(f"{dataset} (records {skip}..{skip + len(prompts) + len(skipped) - 1}, "
                                       f"{max_new_tokens} new tokens)", environment()))
    b, h = result.best, result.held_out
    click.echo(f"best on sample: {b.profile.name} (compression {b.compression:.2f}, speedup {b.speedup:.2f}x); "
               f"held out: compression {h.compression:.2f}, speedup {h.speedup:.2f}x"
               + (f"; other workload ({result.validation_label}): compression {result.validation.compression:.2f}, "
                  f"speedup {result.validation.speedup:.2f}x" if result.validation else ""))
    if result.chosen.enabled:
        click.echo(f"wrote {out}: W={result.chosen.window} N={result.chosen.ngram} G={result.chosen.guesses} "
                   f"K={result.chosen.lookup} B={result.chosen.lookup_branches}")
    else:
        click.echo(f"no profile beat greedy on this machine; wrote the greedy setting to {out}")


@main.command()
@_artifact_dir
@click.option("--max-abs", type=float, default=1e-3, show_default=True, help="Bound on max |Δ| per output (float32).")
@click.option("--max-rel", type=float, default=1e-5, show_default=True, help="Bound on max |Δ| / max |reference|.")
def check(artifact_dir, max_abs, max_rel):
    """Validate DIR: checksums, then ONNX Runtime (and TensorRT engines) vs the PyTorch
    reference on lookahead-shaped feeds, with Polygraphy's comparator."""
    from rich.table import Table

    from .export.check import check_artifact
    from .errors import CheckFailedError

    console = _console()
    with console.status("checking") as status:
        report = check_artifact(artifact_dir, max_abs=max_abs, max_rel=max_rel,
                                status=lambda m: status.update(f"[bold]{m}…"))
    table = Table(title=f"{artifact_dir}: outputs vs PyTorch over {len(report.cases)} feeds ({', '.join(report.cases)})")
    for col in ("runner", "output", "max |Δ|", "relative", "worst case", "ok"):
        table.add_column(col)
    shown = [e for e in report.output_errors if not e.output.startswith("present.")]
    for runner in dict.fromkeys(e.runner for e in report.output_errors):
        present = [e for e in report.output_errors if e.output.startswith("present.") and e.runner == runner]
        if present:
            worst = max(present, key=lambda e: (not e.ok, e.max_abs))
            shown.append(dataclasses.replace(worst, output=f"present.* (worst: {worst.output})",
                                             ok=all(e.ok for e in present)))
    for e in shown:
        verdict = "n/a (quantized)" if not e.judged else "yes" if e.ok else "NO"
        table.add_row(e.runner, e.output, f"{e.max_abs:.2e}", f"{e.rel:.1e}", e.case, verdict)
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 160).print(table)
    for note in report.notes:
        click.echo(f"note: {note}")
    for msg in report.checksum_errors:
        click.echo(f"checksum: {msg}")
    if not report.ok:
        raise CheckFailedError("check failed: " + "; ".join(report.failures()))
    click.echo("check passed")


@main.command()
@_artifact_dir
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifest.")
def inspect(artifact_dir, as_json):
    """Print an artifact's manifest in a readable form."""
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .artifact import Artifact, checksum_errors  # not .check: that one needs the export extra

    artifact = Artifact(artifact_dir, verify=False)
    if as_json:
        click.echo(json.dumps(artifact.manifest, indent=2))  # the raw JSON object, as on disk
        return
    m = artifact.spec
    console = Console(width=None if sys.stdout.isatty() else 160)
    d = m.model.dims
    console.print(f"[bold]{artifact_dir}[/] · schema {m.schema_version} · built {m.created} from "
                  f"{m.source.model} ({m.source.kind})")
    console.print(f"model: {d.num_layers} layers, {d.heads} heads / {d.kv_heads} kv heads × {d.head_dim}, "
                  f"hidden {d.hidden}, vocab {d.vocab}, context {d.max_context}, tied embeddings "
                  f"{d.tied_embeddings}; stop ids {list(m.model.stop_token_ids)}")
    rope = m.model.rope
    if rope:
        console.print(f"rope {rope.type}: {rope.handling}, context {rope.declared_context} of "
                      f"{rope.max_position_embeddings}" + (f", thresholds {list(rope.thresholds)}" if rope.thresholds
                                                           else ""))
    prof = Table(title="lookahead profiles")
    for col in ("name", "W", "N", "G", "max step"):
        prof.add_column(col)
    for p in m.profiles:
        prof.add_row(p.name, str(p.window), str(p.ngram), str(p.guesses), str(p.max_step))
    console.print(prof)
    io = Table(title=f"graph {m.graph.file} (opset {m.graph.opset})")
    for col in ("", "name", "shape", "dtype"):
        io.add_column(col)
    specs = [("in", t) for t in m.graph.inputs] + [("out", t) for t in m.graph.outputs]
    shown = [x for x in specs if not x[1].name.startswith(("past_key_values.", "present."))]
    for kind, t in shown:
        io.add_row(kind, t.name, escape("[" + ", ".join(map(str, t.shape)) + "]"), t.dtype)
    cache = {t.name: t for _, t in specs}
    for kind, name in (("in", "past_key_values"), ("out", "present")):
        first = cache[f"{name}.0.key"]
        io.add_row(kind, f"{name}.{{0..{d.num_layers - 1}}}.key/.value",
                   escape("[" + ", ".join(map(str, first.shape)) + "]"), first.dtype)
    console.print(io)
    console.print(escape(f"mask: {m.graph.mask or '?'}"))
    console.print(escape(f"attention: {artifact.attention}; KV cache: {m.graph.kv_layout or artifact.kv_layout}"))
    q = m.quantization
    if q is not None:
        spec, quality, library = q.spec, q.quality, q.kernels
        where = f" ({m.graph.custom_ops})" if m.graph.custom_ops else ""
        if spec.kernels == "lade":  # compute type, and the paths the library holds (older builds: unlisted)
            paths = ((library.paths if library is not None else None) or {}).get(spec.compute)
            where = (f" ({m.graph.custom_ops}; {spec.compute} compute"
                     + (f", paths {', '.join(paths)}" if paths else "") + ")")
        agreement = quality.top1_agreement
        head = f"{spec.head_bits}-bit" if spec.head_bits else "float32"
        console.print(escape(f"weights: {m.graph.precision} layers, {head} head and embedding, "
                             f"{spec.kernels} kernels{where}; lookahead exact: {m.graph.lookahead_exact}"
                             + (f"; top-1 agreement with float32 {100 * agreement:.1f}%" if agreement is not None
                                else "")))
    par = Table(title="parity (ONNX Runtime vs PyTorch)")
    for col in ("case", "step", "past", "max |Δlogit|", "relative", "argmax equal"):
        par.add_column(col)
    for c in m.parity.cases if m.parity is not None else ():
        par.add_row(c["label"], str(c["step"]), str(c["past"]), f"{c['max_abs']:.2e}", f"{c['rel']:.1e}",
                    str(c["argmax_equal"]))
    console.print(par)
    reference = m.parity.transformers if m.parity is not None else None
    if reference:
        ref = Table(title=f"parity (ONNX Runtime vs {reference['reference']})")
        for col in ("case", "tokens", "rows", "max |Δlogit|", "argmax equal"):
            ref.add_column(col)
        for c in reference["cases"]:
            ref.add_row(c["label"], str(c["tokens"]), str(c["rows"]), f"{c['max_abs']:.2e}", str(c["argmax_equal"]))
        console.print(ref)
    bad = dict(msg.split(": ", 1) for msg in checksum_errors(artifact))
    for name, e in m.files.items():
        state = f"[red]{escape(bad[name])}[/]" if name in bad else "ok"
        console.print(f"  {name}  {e.bytes:,} bytes  sha256 {e.sha256[:16]}…  {state}")
    for e in m.engines:
        plan = e.precision_plan or {}
        flags = ", version-compatible" if e.version_compatible else ""
        console.print(f"  engine {e.file} ({e.precision}, {plan.get('network', '?')} network, TensorRT "
                      f"{e.tensorrt_version}{flags})")
    if bad:
        raise ArtifactError(f"{len(bad)} of {len(m.files)} files differ from the manifest "
                            f"({'; '.join(f'{k}: {v}' for k, v in bad.items())}); rebuild the artifact")


@main.command()
@_artifact_dir
@click.option("--out", "repository", required=True, type=click.Path(path_type=Path),
              help="Triton model repository (created if missing; other models in it are kept).")
@click.option("--name", default=None, help="Model name (default: from the artifact's source model).")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Model instances (one Triton stub process each; per GPU with --device cuda).")
@click.option("--profile", "profile_values", multiple=True,
              help="Profile clients may name (repeatable; the first is the default; default: the artifact's). "
                   "'greedy' is always served.")
@click.option("--backend", type=click.Choice(["ort", "tensorrt"]), default="ort", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Default: cpu for ort, cuda for tensorrt.")
@click.option("--max-new-tokens-limit", type=int, default=None,
              help="Most new tokens a request may ask for (default: the context minus one).")
@click.option("--default-max-new-tokens", type=click.IntRange(min=1), default=None,
              help="For requests without max_new_tokens (default: min(256, limit)).")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests one instance decodes at once, sharing its scheduler's passes (more wait).")
@click.option("--no-batching", is_flag=True,
              help="Each request runs its own passes instead of the instance's scheduler (always so with tensorrt).")
@_token_budget
@_kv_tokens(help="Scheduler: most tokens an instance's KV pool holds over its requests (default: "
                 "max-concurrent-requests x the model's context).")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="Engine threads per instance (0: the engine's default).")
@click.option("--copy-artifact", is_flag=True, help="Copy the artifact into the repository instead of referencing it.")
@click.option("--artifact-path", default=None, help="The artifact's path as the server sees it (a mounted volume).")
@click.option("--force", is_flag=True, help="Replace REPO/NAME if this command wrote it.")
def triton(artifact_dir, repository, name, instances, profile_values, backend, device, max_new_tokens_limit,
           default_max_new_tokens, max_concurrent_requests, no_batching, token_budget, kv_tokens, threads,
           copy_artifact, artifact_path, force):
    """Write a Triton Inference Server model (Python backend, streamed responses) for an artifact
    (docs/serving.md)."""
    from .serving.repository import serve_hints, write_model_repository

    out = write_model_repository(
        artifact_dir, repository, name=name, instances=instances, profiles=profile_values, backend=backend,
        device=device, max_new_tokens_limit=max_new_tokens_limit, default_max_new_tokens=default_max_new_tokens,
        max_concurrent_requests=max_concurrent_requests, threads=threads, copy_artifact=copy_artifact,
        artifact_path=artifact_path, force=force, batching=False if no_batching else None,
        token_budget=token_budget, kv_tokens=kv_tokens)
    click.echo(f"wrote {out} (model {out.name!r})")
    for line in serve_hints(out.parent):
        click.echo(line)


@main.command()
@_artifact_dir
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (localhost only unless told otherwise; 0.0.0.0 for every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port (0: a free one, printed at start).")
@click.option("--profile", "profile_values", multiple=True,
              help="Lookahead profile requests may pick (repeatable; the first is the default; default: the "
                   "artifact's).")
@click.option("--model-name", default=None, help="The model id clients send (default: the artifact folder's name).")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="Environment variable holding the API key clients must send (Authorization: Bearer KEY).")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded at once, sharing the scheduler's passes.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting for a slot; one more is answered 429.")
@click.option("--max-new-tokens-limit", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Largest max_tokens a request may ask (also the default, capped by the context left).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True,
              help="Largest request body (413 beyond).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, seconds the requests in flight may take to finish before they are cancelled "
                   "(each stream then ends with a server_shutdown error event, other requests get a 503).")
@_token_budget
@_kv_tokens(help="Scheduler: most tokens the KV pool holds over all requests (default: max-concurrent x the "
                 "model's context).")
@_engine_threads
def serve(artifact_dir, host, port, profile_values, model_name, api_key_env, max_concurrent, max_queue,
          max_new_tokens_limit, max_body_bytes, drain_timeout, token_budget, kv_tokens, threads):
    """Serve an artifact over the OpenAI HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics) with continuous batching (docs/serving.md)."""
    import os

    from . import load
    from .errors import ServingError
    from .serving.openai_api import OpenAIServer, ServerConfig, bind, run

    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env, "")
        if not api_key.strip():
            raise ServingError(f"--api-key-env {api_key_env}: the environment variable {api_key_env} is not set "
                               "or empty; set it to the key clients must send")
    sock = bind(host, port)
    try:
        # every running request gets a place in the passes
        model = load(artifact_dir, batching=True, threads=threads, max_batch=max_concurrent,
                     token_budget=token_budget, kv_tokens=kv_tokens)
        profiles = {}
        for value in profile_values or (None,):
            prof = model.resolve_profile(value)
            if prof.name in profiles:
                raise ProfileError(f"profile {prof.name!r} is given twice; each --profile needs its own name")
            model.decoder.check_request(1, 1, prof)
            profiles[prof.name] = prof
        name = model_name or Path(artifact_dir).resolve().name
        server = OpenAIServer(model, ServerConfig(name, profiles, api_key, max_concurrent, max_queue,
                                                  max_new_tokens_limit, max_body_bytes))
        where = sock.getsockname()
        click.echo(f"serving {name!r} at http://{host}:{where[1]}/v1 (profiles: {', '.join(profiles)}; "
                   f"{max_concurrent} at once, {max_queue} waiting{'; API key required' if api_key else ''})",
                   nl=True)
        sys.stdout.flush()
        code = run(server, sock, drain_s=drain_timeout)
    finally:
        sock.close()
    model.close()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
