"""``lade-export build``, ``export`` and ``check``: the commands of the export side (they need
the ``export`` extra). The build's options are checked by
:class:`lade_export.export.build_options.BuildOptions`, the same checks
:func:`lade_export.export.build.build_artifact` runs for API callers."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

import click

from ..errors import INTERRUPTED_AFTER_BUILD, interrupted_after_build
from ..kernels import COMPUTE, KERNELS
from ..profile import bundled_profile_names
from .common import BUILD_WRITTEN, THREADS, _artifact_dir, _artifact_out, _console, _finite, _profiles, main


@main.command()
@click.option("--model", "source", default="smollm2-135m-instruct", show_default=True,
              help="HF directory, .gguf file, hub id, or smollm2-135m-instruct.")
@click.option("--profile", "profile_values", multiple=True,
              help=f"Profile TOML, shipped name ({', '.join(bundled_profile_names())}) or W,N,G[,K[,B]] "
                   "(repeatable; the first is the artifact's default).")
@_artifact_out
@click.option("--force", is_flag=True, help="Replace --out if it exists (after the new build succeeds).")
@click.option("--threads", type=THREADS, default=None, help="ONNX Runtime threads for the parity check.")
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
@click.option("--dry-run", is_flag=True, is_eager=True, help="Print what would be built (engines, optimization profiles); write nothing.")
def build(source, profile_values, out, force, threads, engine, precision, block_size, accuracy_level, head_bits,
          kernels, compute, attention, timing_cache, max_batch, max_prompt, max_context, version_compatible,
          hardware_compatible, dry_run):
    """Load a checkpoint, export its decoder step to ONNX, check parity, write DIR
    (int8/int4: a weight-only quantized graph; with --engine tensorrt, one TensorRT engine
    per profile)."""
    from ..export.build import build_artifact
    from ..export.build import dry_run as plan_dry_run
    from ..export.build_options import BuildOptions
    from ..manifest import Manifest

    options = BuildOptions(engine=engine, precision=precision, block_size=block_size, accuracy_level=accuracy_level,
                           head_bits=None if head_bits is None else int(head_bits), kernels=kernels, compute=compute, attention=attention,
                           max_batch=max_batch, max_prompt=max_prompt, max_context=max_context,
                           version_compatible=version_compatible, hardware_compatible=hardware_compatible)
    options.check()  # the flags' own errors before the profiles'
    profiles = _profiles(profile_values or (options.default_profile,))
    options.check(profiles)
    options.check_timing_cache(timing_cache)
    # before any work: no compiler or headers (downloaded now if missing, not in a dry run), nothing is written
    if not dry_run and options.kernels == "lade" and options.quantized:
        from ..kernels import HEADERS_PACKAGE, header_cache, headers_to_fetch

        if headers_to_fetch():  # ~150 MB once: say so, or the first build looks stuck
            click.echo(f"note: downloading ONNX Runtime's C/C++ headers ({HEADERS_PACKAGE}, ~150 MB, once) into "
                       f"{header_cache()}", err=True)
    headers_at_hand, notes = options.prepare_kernels(fetch=not dry_run)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if dry_run:
        plan = plan_dry_run(source, profiles, out, options, headers_at_hand, force=force)
        for note in plan.notes:
            click.echo(f"note: {note}", err=True)
        for line in plan.lines:
            click.echo(line)
        click.echo("nothing was written")
        return
    with _interrupt_names_written_build(out):
        with _progress() as say:
            manifest = Manifest.from_dict(build_artifact(source, profiles, out, force=force, threads=threads,
                                                         status=say, timing_cache=timing_cache, options=options))
        _mark_written(out)
        worst = max(manifest.parity.cases, key=lambda c: c["max_abs"])
        click.echo(f"built {out}: {manifest.model.dims.num_layers} layers, "
                   f"profiles {', '.join(p.name for p in manifest.profiles)}; parity max |Δlogit| "
                   f"{worst['max_abs']:.2e} (relative {worst['rel']:.1e})", err=True)
        if options.quantized:
            q = manifest.quantization
            click.echo(f"{options.weights} weights: {q.graph.bytes_after / 2**20:.0f} MB (float32 "
                       f"{q.graph.bytes_before / 2**20:.0f} MB); against the float32 graph: top-1 agreement "
                       f"{100 * q.quality.top1_agreement:.1f}% over {q.quality.positions} answer "
                       f"tokens{f' to {q.quality.prompts}' if q.quality.prompts else ''}, max |Δlogit| "
                       f"{q.quality.max_abs_logit_diff:.2f}", err=True)
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
        if identity() != before and not str(err).startswith(INTERRUPTED_AFTER_BUILD):
            raise KeyboardInterrupt(interrupted_after_build(Path(out).resolve())) from None
        raise


def _mark_written(out) -> None:
    """Note that ``out`` now holds the complete new build, so that an interrupt on the
    command's way out (its last lines, leaving the ``with``, click's return) says it was
    written, as one inside :func:`_interrupt_names_written_build` does; the group's handler
    reads the note."""
    click.get_current_context().meta[BUILD_WRITTEN] = Path(out).resolve()


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
    from ..export.build import build_artifact
    from ..manifest import Manifest

    with _interrupt_names_written_build(out):
        with _progress() as say:
            manifest = Manifest.from_dict(build_artifact(source, _profiles(None), out, force=force, status=say))
        _mark_written(out)
        click.echo(f"exported {out / manifest.graph.file}")
        _echo_rope_note(manifest)


@main.command()
@_artifact_dir
@click.option("--max-abs", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True,
              callback=_finite, help="Bound on max |Δ| per output (float32).")
@click.option("--max-rel", type=click.FloatRange(min=0, min_open=True), default=1e-5, show_default=True,
              callback=_finite, help="Bound on max |Δ| / max |reference|.")
def check(artifact_dir, max_abs, max_rel):
    """Validate DIR: checksums, then ONNX Runtime (and TensorRT engines) vs the PyTorch
    reference on lookahead-shaped feeds, with Polygraphy's comparator."""
    from rich.table import Table

    from ..export.check import check_artifact
    from ..errors import CheckFailedError

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

