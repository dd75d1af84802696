"""``lade-export generate`` (decode from an artifact, text to stdout, statistics to stderr)
and ``inspect`` (print an artifact's manifest); both run on the base install."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

from ..backends import DTYPES
from ..errors import ArtifactError, GenerationError
from .common import _artifact_dir, _backend, _device, _engine_threads, _output_failed, _sampling, main


#: Bytes a prompt file may hold per token of the model's context: a file longer than context ×
#: this cannot fit (no token is that long), so it is refused after reading that much, not read
#: whole (``--prompt-file /dev/zero`` read until memory ran out).
PROMPT_BYTES_PER_TOKEN = 256


def _read_prompt(prompt, prompt_file, prompt_from=None, chat=False, context: int | None = None):
    given = [n for n, v in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-from", prompt_from))
             if v is not None]
    if len(given) > 1:
        raise GenerationError(f"give only one of {', '.join(given)}")
    if prompt_from is not None:
        from ..evaluation.datasets import load_prompts

        name, _, index = prompt_from.rpartition(":")
        if not name or not index.isdigit():
            raise GenerationError(f"--prompt-from wants DATASET:INDEX (e.g. mt_bench:0), got {prompt_from!r}")
        prompts = load_prompts(name, limit=int(index) + 1, chat=chat)
        if len(prompts) <= int(index):
            raise GenerationError(f"{name} has only {len(prompts)} prompts; index {index} is out of range")
        return prompts[int(index)].text
    if prompt_file is not None:
        import codecs

        limit = None if context is None else PROMPT_BYTES_PER_TOKEN * context
        size = -1 if limit is None else limit + 1  # one byte more than may fit: a longer file is seen as such
        try:
            if str(prompt_file) == "-":
                data = sys.stdin.buffer.read(size)
            else:
                with open(prompt_file, "rb") as fh:
                    data = fh.read(size)
        except FileNotFoundError:
            raise GenerationError(f"prompt file not found: {prompt_file}") from None
        except (IsADirectoryError, PermissionError) as err:
            raise GenerationError(f"cannot read prompt file {prompt_file}: {err.strerror}") from None
        if limit is not None and len(data) > limit:
            where = "standard input" if str(prompt_file) == "-" else f"prompt file {prompt_file}"
            raise GenerationError(f"{where} holds more than {limit:,} bytes, more than the model's context of "
                                  f"{context:,} tokens can hold")
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
    from ..api import load
    from ..profile import GREEDY

    if greedy and temperature > 0:
        raise GenerationError("--greedy means temperature 0; drop it to sample with --temperature")
    if greedy and click.get_current_context().get_parameter_source("lookahead") == ParameterSource.COMMANDLINE \
            and lookahead:
        raise GenerationError("--greedy means plain greedy decoding, without lookahead; drop --lookahead (lookahead "
                              "with temperature 0 is the default)")
    sampling = _sampling(temperature, top_k, top_p, seed)
    if check_greedy and not sampling.greedy:
        raise GenerationError("--check-greedy compares greedy outputs; it cannot be combined with --temperature > 0")
    if profile_value is not None and (greedy or not lookahead):
        raise GenerationError(f"--profile {profile_value} asks for lookahead, which "
                              f"{'--greedy' if greedy else '--no-lookahead'} turns off: give one of them")
    lookahead = lookahead and not greedy
    model = load(artifact_dir, backend, threads=threads, device=device, dtype=dtype,
                 verify="full" if verify else "quick")
    use_chat = model.tokenizer.has_chat_template if chat is None else chat
    ids = model.encode(_read_prompt(prompt, prompt_file, prompt_from, use_chat, model.decoder.max_context), use_chat,
                       parse_special_in_messages=parse_special)
    profile = model.resolve_profile(profile_value, lookahead=lookahead)  # GREEDY for --greedy, --no-lookahead
    stream = model.stream(ids, max_new_tokens=max_new_tokens, profile=profile, sampling=sampling, stop=stops)
    last = "\n"
    try:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk.text[-1:] or last
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError as err:  # the reader closed stdout (e.g. | head): stop quietly, as SIGPIPE would
        stream.close()
        _output_failed(err)
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
    mode = "no lookahead" if profile is GREEDY else \
        f"lookahead {profile.name} (W={profile.window}, N={profile.ngram}, G={profile.guesses}" + \
        (f", K={profile.lookup}" + (f", B={profile.lookup_branches}" if profile.lookup_branches > 1 else "") + ")"
         if profile.lookup else ")")
    click.echo(f"[{mode}, {sampling.describe()}] {result.stats.line()} · stop: {result.stop_reason}", err=True)
    library = model.artifact.custom_ops_path if backend == "ort" else None
    if library is not None:
        from ..kernels import running_path

        compute = model.artifact.spec.kernel_compute
        click.echo(f"[kernels] lade, {compute} compute, path: {running_path(library, compute)}", err=True)
    if backend == "tensorrt":
        click.echo(f"[tensorrt] {model.engine.runtime_description}; engines used: "
                   f"{', '.join(model.engine.loaded_engines)}", err=True)
    if check_greedy and profile is GREEDY:
        click.echo("[check-greedy] nothing to compare: this run decoded one token per step "
                   "(no lookahead profile)", err=True)
    elif check_greedy:
        base = model.generate(ids, max_new_tokens=max_new_tokens, profile=GREEDY, stop=stops)
        same = base.token_ids == result.token_ids
        speedup = base.stats.decode_s / result.stats.decode_s if result.stats.decode_s else 0.0
        click.echo(f"[check-greedy: no lookahead, greedy] {base.stats.line()}", err=True)
        click.echo(f"identical to greedy: {'yes' if same else 'NO'} · decode speedup {speedup:.2f}x", err=True)
        if not same:
            sys.exit(1)


def _path_here(library, compute: str) -> str | None:
    """What ``inspect`` says of the path the kernel library takes in this process: "this CPU
    takes <path>", the reason ``$LADE_KERNELS_PATH`` cannot be honoured, or None when there is
    no library or it cannot be loaded. ``library``: ``Artifact.custom_ops_path``, which has
    checked the file's size and sha256 against the manifest (a truncated library can crash the
    process that loads it)."""
    from ..kernels import running_path

    if library is None:
        return None
    try:
        chosen = running_path(library, compute)
    except OSError:  # not a loadable library (another platform's)
        return None
    return chosen[len("error: "):] if chosen.startswith("error: ") else f"this CPU takes {chosen}"


@main.command()
@_artifact_dir
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifest.")
def inspect(artifact_dir, as_json):
    """Print an artifact's manifest in a readable form."""
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..artifact import Artifact, checksum_errors  # not .check: that one needs the export extra

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
    for col in ("name", "W", "N", "G", "K", "B", "max step"):
        prof.add_column(col)
    for p in m.profiles:
        prof.add_row(p.name, str(p.window), str(p.ngram), str(p.guesses), str(p.lookup), str(p.lookup_branches),
                     str(p.max_step))
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
        first = cache.get(f"{name}.0.key")
        if first is None:  # a hand-edited manifest's list: what it lists is shown
            continue
        io.add_row(kind, f"{name}.{{0..{d.num_layers - 1}}}.key/.value",
                   escape("[" + ", ".join(map(str, first.shape)) + "]"), first.dtype)
    console.print(io)
    console.print(escape(f"mask: {m.graph.mask or '?'}"))
    q = m.quantization
    rows = q.graph.attention_rows if q is not None else None
    fused = q.graph.rotary_attention_rows if q is not None else None
    # an int8-compute lade build's attentions are the kernels' (the graph's record names the exported form)
    attention = f"{artifact.attention}, each as the lade kernels' AttentionRows ({rows})" if rows else artifact.attention
    if fused:
        attention += f", {fused} of them with their rotary embedding and head layout fused (RotaryAttentionRows)"
    console.print(escape(f"attention: {attention}; KV cache: {m.graph.kv_layout or artifact.kv_layout}"))
    if q is not None:
        spec, quality, library = q.spec, q.quality, q.kernels
        where = f" ({m.graph.custom_ops})" if m.graph.custom_ops else ""
        if spec.kernels == "lade":  # compute type, the paths the library holds (older builds: unlisted), this CPU's
            paths = ((library.paths if library is not None else None) or {}).get(spec.compute)
            try:  # a library that is not the build's is not loaded: the file check below names it
                here = _path_here(artifact.custom_ops_path, spec.compute)
            except ArtifactError:
                here = None
            built = library.path_at_build if library is not None else None
            where = (f" ({m.graph.custom_ops}; {spec.compute} compute"
                     + (f", paths {', '.join(paths)}" if paths else "")
                     + (f"; {here}" if here else "")
                     + (f", the build measured on {built}" if built else "") + ")")
        agreement = quality.top1_agreement
        head = f"{spec.head_bits}-bit" if spec.head_bits else "float32"
        console.print(escape(f"weights: {m.graph.precision} layers, {head} head and embedding, "
                             f"{spec.kernels} kernels{where}; lookahead exact: {m.graph.lookahead_exact}"
                             + (f"; top-1 agreement with float32 {100 * agreement:.1f}%" if agreement is not None
                                else "")
                             + (f" (answers to {quality.prompts})" if agreement is not None and quality.prompts
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
    artifact.check_listed()  # a file the manifest names but does not list went unchecked above
    if bad:
        raise ArtifactError(f"{len(bad)} of {len(m.files)} files differ from the manifest "
                            f"({'; '.join(f'{k}: {v}' for k, v in bad.items())}); rebuild the artifact")

