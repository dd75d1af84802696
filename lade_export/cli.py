"""The ``lade-export`` command line.

Every user error ends in one line on stderr (``error: …``) and a non-zero exit status:
2 for bad input, 1 for a failed check (parity, exactness), 130 when interrupted.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from .errors import GenerationError, LadeError
from .profile import resolve_profile


class _Group(click.Group):
    """Turns typed errors, usage errors and interrupts into one-line messages and exit codes."""

    def main(self, *args, **kwargs):
        kwargs.setdefault("standalone_mode", False)
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.UsageError as err:
            where = f" (see: lade-export {err.ctx.command_path.split(' ', 1)[1]} --help)" if err.ctx and " " in \
                err.ctx.command_path else " (see: lade-export --help)"
            click.echo(f"error: {err.format_message()}{where}", err=True)
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
        except KeyboardInterrupt:
            interrupted_build = ctx.invoked_subcommand in ("build", "export")
            click.echo("error: interrupted; nothing was written" if interrupted_build else "error: interrupted", err=True)
            sys.exit(130)


def _console():
    from rich.console import Console

    return Console(stderr=True)


@click.group(cls=_Group)
@click.version_option(package_name="lade-export")
def main():
    """Export LLaMA decoder steps for exact lookahead decoding, build engines, generate, compare."""


def _profiles(values) -> list:
    from .errors import ProfileError

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
              help="Profile TOML, shipped name (default, small, paper, gpu-large) or W,N,G[,K] (repeatable; "
                   "the first is the artifact's default).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Artifact directory to create.")
@click.option("--force", is_flag=True, help="Replace --out if it exists (after the new build succeeds).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime threads for the parity check.")
@click.option("--engine", type=click.Choice(["onnx", "tensorrt"]), default="onnx", show_default=True,
              help="onnx: the ONNX graph for ONNX Runtime; tensorrt: also one TensorRT engine per profile.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp16", show_default=True,
              help="TensorRT builder precision.")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="TensorRT timing cache file, read and updated (reuse it across builds).")
@click.option("--max-batch", type=click.IntRange(min=1), default=1, show_default=True, help="Largest batch the engines accept.")
@click.option("--max-prompt", type=int, default=None, help="Longest prompt prefilled at once (default: context/2).")
@click.option("--max-context", type=int, default=None, help="Context bound of the engines (default: the model's).")
@click.option("--version-compatible", is_flag=True, help="TensorRT version-compatible engines (for later runtimes).")
@click.option("--hardware-compatible", is_flag=True, help="TensorRT engines for any Ampere-or-newer GPU.")
@click.option("--dry-run", is_flag=True, help="Print what would be built (engines, optimization profiles); write nothing.")
def build(source, profile_values, out, force, threads, engine, precision, timing_cache, max_batch, max_prompt,
          max_context, version_compatible, hardware_compatible, dry_run):
    """Load a checkpoint, export its decoder step to ONNX, check parity, write DIR
    (and with --engine tensorrt, one TensorRT engine per profile)."""
    profiles = _profiles(profile_values)
    from .build import build_artifact
    from .optimization_profiles import describe_plan, engine_plans

    engine_options = None
    if engine == "tensorrt":
        engine_options = dict(precision=precision, max_batch=max_batch, max_prompt=max_prompt, max_context=max_context,
                              version_compatible=version_compatible, hardware_compatible=hardware_compatible)
    if dry_run:
        from .model_source import load_model
        from .specs import ModelDims

        dims = ModelDims.from_config(load_model(source).model.config)
        for profile in profiles:
            profile.check_fits(dims.max_context)
        click.echo(f"dry run: would write {out}/model.onnx, tokenizer/, manifest.json")
        if engine_options:
            for plan in engine_plans(profiles, dims, **engine_options):
                click.echo("\n".join(describe_plan(plan, dims.num_layers)))
        click.echo("nothing was written")
        return
    if engine_options:
        from .backends.tensorrt import require_tensorrt

        require_tensorrt()  # before any work: nothing is written without TensorRT and a GPU
    with _progress() as say:
        manifest = build_artifact(source, profiles, out, force=force, threads=threads, status=say,
                                  engine_options=engine_options, timing_cache=timing_cache)
    worst = max(manifest["parity"]["cases"], key=lambda c: c["max_abs"])
    click.echo(f"built {out}: {manifest['model']['dims']['num_layers']} layers, "
               f"profiles {', '.join(p['name'] for p in manifest['profiles'])}; parity max |Δlogit| "
               f"{worst['max_abs']:.2e} (relative {worst['rel']:.1e})", err=True)


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
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Artifact directory to create.")
@click.option("--force", is_flag=True)
def export(source, out, force):
    """Export and parity-check the step graph only (a build with the default profile)."""
    from .build import build_artifact

    with _progress() as say:
        manifest = build_artifact(source, _profiles(None), out, force=force, status=say)
    click.echo(f"exported {out / manifest['graph']['file']}")


def _read_prompt(prompt, prompt_file, prompt_from=None, chat=False):
    given = [n for n, v in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-from", prompt_from))
             if v is not None]
    if len(given) > 1:
        raise GenerationError(f"give only one of {', '.join(given)}")
    if prompt_from is not None:
        from .datasets import load_prompts

        name, _, index = prompt_from.rpartition(":")
        if not name or not index.isdigit():
            raise GenerationError(f"--prompt-from wants DATASET:INDEX (e.g. mt_bench:0), got {prompt_from!r}")
        prompts = load_prompts(name, limit=int(index) + 1, chat=chat)
        if len(prompts) <= int(index):
            raise GenerationError(f"{name} has only {len(prompts)} prompts; index {index} is out of range")
        return prompts[int(index)].text
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise GenerationError(f"prompt file not found: {prompt_file}") from None
        except (IsADirectoryError, PermissionError) as err:
            raise GenerationError(f"cannot read prompt file {prompt_file}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise GenerationError(f"prompt file {prompt_file} is not UTF-8 text (byte {err.start})") from None
    if prompt is None:
        raise GenerationError("give --prompt TEXT, --prompt-file PATH or --prompt-from DATASET:INDEX")
    return prompt


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="Read the prompt from a UTF-8 file.")
@click.option("--prompt-from", default=None, metavar="DATASET:INDEX",
              help="Take the prompt from a workload, e.g. mt_bench:0, humaneval:3, gsm8k:10.")
@click.option("--chat/--no-chat", default=None,
              help="Wrap the prompt in the model's chat template (default: when the model has one).")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--greedy", is_flag=True, help="Plain greedy decoding (no lookahead).")
@click.option("--profile", "profile_value", default=None,
              help="Lookahead profile: shipped name, TOML path or W,N,G[,K] (default: the build's default).")
@click.option("--stop", "stops", multiple=True, help="Stop string: the answer ends before it (repeatable).")
@click.option("--backend", type=click.Choice(["ort", "torch", "tensorrt"]), default="ort", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32",
              help="Compute dtype of the torch backend.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Engine threads (default: one per core).")
@click.option("--verify", is_flag=True, help="Also check the weights' sha256 before loading (~1 s per GB).")
@click.option("--check-greedy", is_flag=True, help="Also run plain greedy and report identity and speedup.")
def generate(artifact_dir, prompt, prompt_file, prompt_from, chat, max_new_tokens, greedy, profile_value, stops,
             backend, device, dtype, threads, verify, check_greedy):
    """Generate from a built artifact with lookahead (or --greedy) decoding: the text streams
    to stdout, the statistics go to stderr."""
    from .api import load

    model = load(artifact_dir, backend, threads=threads, device=device, dtype=dtype,
                 verify="full" if verify else "quick")
    use_chat = model.tokenizer.has_chat_template if chat is None else chat
    ids = model.encode(_read_prompt(prompt, prompt_file, prompt_from, use_chat), use_chat)
    profile = model.resolve_profile(profile_value, lookahead=not greedy)
    stream = model.stream(ids, max_new_tokens=max_new_tokens, profile=profile, lookahead=not greedy, stop=stops)
    for chunk in stream:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    result = stream.result
    if profile is not None and not profile.enabled:
        profile = None
    mode = f"lookahead {profile.name} (W={profile.window}, N={profile.ngram}, G={profile.guesses}" + \
        (f", K={profile.lookup})" if profile.lookup else ")") if profile else "greedy"
    click.echo(f"[{mode}] {result.stats.line()} · stop: {result.stop_reason}", err=True)
    if check_greedy and profile is not None:
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
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--profile", "profile_values", multiple=True, help="Profiles to compare (repeatable; default: the build's).")
@click.option("--dataset", "datasets", multiple=True, default=("mt_bench",), show_default=True,
              help="mt_bench, humaneval, gsm8k or a .jsonl path (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), default=16, show_default=True, help="Prompts per dataset.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--peer", "peers", multiple=True, type=click.Choice(["transformers-greedy", "transformers-prompt-lookup"]),
              help="Also run transformers' own generate on the same model and prompts.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder for results and summaries.")
@click.option("--backend", type=click.Choice(["ort", "torch", "tensorrt"]), default="ort", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32")
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--title", default="", help="Title for summary.md (e.g. the machine).")
def compare(artifact_dir, profile_values, datasets, limit, max_new_tokens, peers, out, backend, device, dtype, threads,
            title):
    """Run greedy and each profile (and peers) on a workload, interleaved; check exactness;
    write results.jsonl, summary.md/.csv and speedup.png."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .compare import environment, run_compare, summarize, write_outputs
    from .datasets import load_prompts
    from .errors import CheckFailedError

    artifact, tokenizer, decoder = _open_decoder(artifact_dir, backend, device, dtype, threads)
    profiles = [resolve_profile(v) for v in profile_values] if profile_values else artifact.profiles()
    for profile in profiles:
        profile.check_fits(artifact.max_context)
    chat = artifact.has_chat_template
    counts = [len(load_prompts(d, limit=limit, chat=chat)) for d in datasets]
    peer_model = None
    if peers:
        from .model_source import load_model

        peer_model = load_model(artifact.manifest["source"]["model"]).model
    total = sum(counts) * (1 + len(profiles) + len(peers))
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("comparing", total=total)
        records = run_compare(decoder, tokenizer, chat, list(datasets), profiles, limit, max_new_tokens, peers,
                              peer_model, progress=lambda n: progress.advance(task, n))
    rows = summarize(records)
    meta = {**environment(), "title": title, "artifact": str(artifact_dir), "model": artifact.manifest["source"]["model"],
            "backend": f"{backend} ({device}, {dtype if backend == 'torch' else 'float32'})",
            "threads": threads or "default", "datasets": ", ".join(datasets), "limit": limit,
            "max_new_tokens": max_new_tokens, "command": "lade-export compare " + " ".join(sys.argv[2:])}
    write_outputs(out, records, rows, meta)
    table = Table(title=f"compare: {', '.join(datasets)} ({limit} prompts, {max_new_tokens} new tokens max)")
    for col in ("dataset", "config", "compression", "tok/s", "speedup", "p50 ms/tok", "exact"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["dataset"], r["config"], f"{r['compression_mean']:.2f}", f"{r['decode_tok_s']:.1f}",
                      f"{r['speedup_vs_greedy']:.2f}x", f"{r['p50_ms_per_token']:.1f}", f"{r['exact']}/{r['prompts']}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    click.echo(f"wrote {out}/results.jsonl, summary.md, summary.csv, speedup.png")
    bad = [r for r in records if not r.exact and r.config not in ("transformers-greedy",)]
    if bad:
        first = bad[0]
        raise CheckFailedError(f"{len(bad)} output(s) differ from {first.reference}: first {first.config} on "
                               f"{first.dataset} prompt {first.prompt_id}")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--dataset", default="mt_bench", show_default=True, help="mt_bench, humaneval, gsm8k or a .jsonl path.")
@click.option("--limit", type=click.IntRange(min=2), default=8, show_default=True,
              help="Prompts: the first half measures the grid, the rest verifies the winner.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Per generation; use the length you will serve (acceptance grows with length).")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="Skip the first N prompts (tune on prompts a comparison does not use).")
@click.option("--grid", default="default", show_default=True, help="Named grid: default or tiny.")
@click.option("--candidate", "candidates", multiple=True, metavar="W,N,G[,K]", help="Grid entries instead of --grid.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("profiles/tuned.toml"), show_default=True)
@click.option("--backend", type=click.Choice(["ort", "torch", "tensorrt"]), default="ort", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None)
def tune(artifact_dir, dataset, limit, max_new_tokens, skip, grid, candidates, out, backend, threads):
    """Measure the step-cost curve and a grid of profiles, keep the fastest measured one
    that also beats greedy on held-out prompts, and write it as a profile TOML."""
    from rich.console import Console
    from rich.progress import Progress

    from .artifact import write_text_atomic
    from .compare import environment
    from .datasets import load_prompts
    from .tune import grid_profiles
    from .tune import tune as run_tune

    profiles = grid_profiles(list(candidates) if candidates else grid)
    artifact, tokenizer, decoder = _open_decoder(artifact_dir, backend, "cpu", "float32", threads)
    chat = artifact.has_chat_template
    prompts = [tokenizer.encode_prompt(p.text, chat) for p in load_prompts(dataset, limit=limit, chat=chat, skip=skip)]
    half = (len(prompts) + 1) // 2
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("tuning", total=half * len(profiles) + (len(prompts) - half))
        result = run_tune(decoder, prompts, profiles, max_new_tokens, progress=lambda n: progress.advance(task, n))
    result.name = out.stem if out.stem.replace("-", "").replace("_", "").isalnum() else "tuned"
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True)
    write_text_atomic(out, result.toml(f"{dataset} (prompts {skip}..{skip + len(prompts) - 1}, "
                                       f"{max_new_tokens} new tokens)", environment()))
    b, h = result.best, result.held_out
    click.echo(f"best on sample: {b.profile.name} (compression {b.compression:.2f}, speedup {b.speedup:.2f}x); "
               f"held out: compression {h.compression:.2f}, speedup {h.speedup:.2f}x")
    if result.chosen.enabled:
        click.echo(f"wrote {out}: W={result.chosen.window} N={result.chosen.ngram} G={result.chosen.guesses} "
                   f"K={result.chosen.lookup}")
    else:
        click.echo(f"no profile beat greedy on this machine; wrote the greedy setting to {out}")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--max-abs", type=float, default=1e-3, show_default=True, help="Bound on max |Δ| per output (float32).")
@click.option("--max-rel", type=float, default=1e-5, show_default=True, help="Bound on max |Δ| / max |reference|.")
def check(artifact_dir, max_abs, max_rel):
    """Validate DIR: checksums, then ONNX Runtime (and TensorRT engines) vs the PyTorch
    reference on lookahead-shaped feeds, with Polygraphy's comparator."""
    from rich.table import Table

    from .check import check_artifact
    from .errors import CheckFailedError

    console = _console()
    with console.status("checking") as status:
        report = check_artifact(artifact_dir, max_abs=max_abs, max_rel=max_rel,
                                status=lambda m: status.update(f"[bold]{m}…"))
    table = Table(title=f"{artifact_dir}: outputs vs PyTorch over {len(report.cases)} feeds ({', '.join(report.cases)})")
    for col in ("runner", "output", "max |Δ|", "relative", "worst case", "ok"):
        table.add_column(col)
    shown = [e for e in report.output_errors if not e.output.startswith("present.")]
    present = [e for e in report.output_errors if e.output.startswith("present.")]
    if present:
        worst = max(present, key=lambda e: e.max_abs)
        shown.append(dataclasses.replace(worst, output=f"present.* (worst: {worst.output})",
                                         ok=all(e.ok for e in present)))
    for e in shown:
        table.add_row(e.runner, e.output, f"{e.max_abs:.2e}", f"{e.rel:.1e}", e.case, "yes" if e.ok else "NO")
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 160).print(table)
    for msg in report.checksum_errors:
        click.echo(f"checksum: {msg}")
    if not report.ok:
        raise CheckFailedError("check failed: " + "; ".join(report.failures()))
    click.echo("check passed")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifest.")
def inspect(artifact_dir, as_json):
    """Print an artifact's manifest in a readable form."""
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .artifact import Artifact

    artifact = Artifact(artifact_dir, verify=False)
    m = artifact.manifest
    if as_json:
        click.echo(json.dumps(m, indent=2))
        return
    console = Console(width=None if sys.stdout.isatty() else 160)
    d = m["model"]["dims"]
    console.print(f"[bold]{artifact_dir}[/] · schema {m['schema_version']} · built {m['created']} from "
                  f"{m['source']['model']} ({m['source']['kind']})")
    console.print(f"model: {d['num_layers']} layers, {d['heads']} heads / {d['kv_heads']} kv heads × {d['head_dim']}, "
                  f"hidden {d['hidden']}, vocab {d['vocab']}, context {d['max_context']}, tied embeddings "
                  f"{d['tied_embeddings']}; stop ids {m['model']['stop_token_ids']}")
    prof = Table(title="lookahead profiles")
    for col in ("name", "W", "N", "G", "max step"):
        prof.add_column(col)
    for p in m["profiles"]:
        prof.add_row(p["name"], str(p["window"]), str(p["ngram"]), str(p["guesses"]), str(p["max_step"]))
    console.print(prof)
    io = Table(title=f"graph {m['graph']['file']} (opset {m['graph']['opset']})")
    for col in ("", "name", "shape", "dtype"):
        io.add_column(col)
    specs = [("in", s) for s in m["graph"]["inputs"]] + [("out", s) for s in m["graph"]["outputs"]]
    shown = [x for x in specs if not x[1]["name"].startswith(("past_key_values.", "present."))]
    for kind, s in shown:
        io.add_row(kind, s["name"], escape("[" + ", ".join(map(str, s["shape"])) + "]"), s["dtype"])
    io.add_row("in", f"past_key_values.{{0..{d['num_layers'] - 1}}}.key/.value",
               escape(f"[batch, {d['kv_heads']}, past, {d['head_dim']}]"), "float32")
    io.add_row("out", f"present.{{0..{d['num_layers'] - 1}}}.key/.value",
               escape(f"[batch, {d['kv_heads']}, step, {d['head_dim']}]"), "float32")
    console.print(io)
    console.print(escape(f"mask: {m['graph']['mask']}"))
    par = Table(title="parity (ONNX Runtime vs PyTorch)")
    for col in ("case", "step", "past", "max |Δlogit|", "relative", "argmax equal"):
        par.add_column(col)
    for c in m["parity"]["cases"]:
        par.add_row(c["label"], str(c["step"]), str(c["past"]), f"{c['max_abs']:.2e}", f"{c['rel']:.1e}",
                    str(c["argmax_equal"]))
    console.print(par)
    from .check import checksum_errors

    bad = dict(msg.split(": ", 1) for msg in checksum_errors(artifact))
    for name, e in m["files"].items():
        state = f"[red]{bad[name]}[/]" if name in bad else "ok"
        console.print(f"  {name}  {e['bytes']:,} bytes  sha256 {e['sha256'][:16]}…  {state}")
    for e in m.get("engines", []):
        console.print(f"  engine {e['file']} ({e.get('precision')}, TensorRT {e.get('tensorrt_version')})")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
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
              help="Requests one instance decodes at once (more wait).")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="Engine threads per instance (0: the engine's default).")
@click.option("--copy-artifact", is_flag=True, help="Copy the artifact into the repository instead of referencing it.")
@click.option("--artifact-path", default=None, help="The artifact's path as the server sees it (a mounted volume).")
@click.option("--force", is_flag=True, help="Replace REPO/NAME if this command wrote it.")
def triton(artifact_dir, repository, name, instances, profile_values, backend, device, max_new_tokens_limit,
           default_max_new_tokens, max_concurrent_requests, threads, copy_artifact, artifact_path, force):
    """Write a Triton Inference Server model (Python backend, streamed responses) for an artifact
    (docs/serving.md)."""
    from .serving.repository import write_model_repository

    out = write_model_repository(
        artifact_dir, repository, name=name, instances=instances, profiles=profile_values, backend=backend,
        device=device, max_new_tokens_limit=max_new_tokens_limit, default_max_new_tokens=default_max_new_tokens,
        max_concurrent_requests=max_concurrent_requests, threads=threads, copy_artifact=copy_artifact,
        artifact_path=artifact_path, force=force)
    click.echo(f"wrote {out} (model {out.name!r}); serve with: tritonserver --model-repository {out.parent}")


if __name__ == "__main__":
    main()
