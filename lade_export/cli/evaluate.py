"""``lade-export compare`` (greedy against profiles, other builds and peers, interleaved, on a
workload) and ``tune`` (measure a grid of profiles, write the winner); the work is
:mod:`lade_export.evaluation`'s."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..backends import DTYPES
from ..errors import GenerationError, ProfileError
from ..profile import bundled_profiles_dir
from .common import (_artifact_dir, _backend, _device, _load, _profiles, _sampling, _threads, _writable_beside,
                     _writable_folder, main)


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
@click.option("--out", required=True, type=click.Path(path_type=Path), callback=_writable_folder,
              help="Folder for results and summaries.")
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

    from ..evaluation.compare import environment, open_extra_engines, run_compare, summarize, write_outputs
    from ..evaluation.datasets import load_prompts
    from ..errors import CheckFailedError

    sampling = _sampling(temperature, top_k, top_p, seed, seed_off=seed)  # --seed: SEED + i whatever the decoding
    if out.exists() and not out.is_dir():
        raise GenerationError(f"--out {out} exists and is not a folder; give a folder for the results")
    if any(p.startswith("llama.cpp") for p in peers):  # bad llama.cpp setup fails before any work
        from ..evaluation.peers import check_gguf, check_peer_names, find_llama_cpp

        check_peer_names(peers, not sampling.greedy)
        find_llama_cpp(llama_cpp)
        if llama_gguf is not None:
            check_gguf(llama_gguf)
    named = _profiles(profile_values) if profile_values else None  # checked before the model loads
    model = _load(artifact_dir, backend, device, dtype, threads)
    artifact, tokenizer, decoder = model.artifact, model.tokenizer, model.decoder
    profiles = named or artifact.profiles()
    for profile in profiles:
        profile.check_fits(artifact.max_context)
    chat = artifact.has_chat_template
    counts = [len(load_prompts(d, limit=limit, chat=chat)) for d in datasets]
    peer_set = None
    if peers:
        from ..evaluation.peers import Peers

        peer_set = Peers(peers, artifact.spec.source.model, llama_cpp, llama_gguf, threads,
                         sampled=not sampling.greedy)
    extra_engines = open_extra_engines(also, artifact_dir, artifact, profiles,
                                  lambda path: _load(path, backend, device, dtype, threads))
    total = sum(counts) * (1 + len(profiles) + (len(peer_set.names) if peer_set else 0)
                           + sum(1 + len(other.profiles) for other in extra_engines))
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
            **({"also": ", ".join(f"{other.label}: {p}" for other, p in zip(extra_engines, also))} if also else {}),
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
    from ..evaluation.peers import UNCHECKED_PEERS

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
              callback=_writable_beside,
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

    from ..artifact import write_text_atomic
    from ..evaluation.compare import environment, fit_prompts
    from ..evaluation.datasets import load_prompts
    from ..evaluation.tune import grid_profiles
    from ..evaluation.tune import tune as run_tune

    if out.is_dir():
        raise ProfileError(f"--out {out} is a folder; give the path of the profile TOML to write")
    if out.resolve().parent == bundled_profiles_dir().resolve():
        raise ProfileError(f"--out {out} is in the folder of the shipped profiles ({bundled_profiles_dir()}); write "
                           "tuned profiles elsewhere (e.g. --out tuned.toml) and pass that path to --profile")
    profiles = grid_profiles(list(candidates) if candidates else grid)
    model = _load(artifact_dir, backend, "cpu", "float32", threads)
    artifact, tokenizer, decoder = model.artifact, model.tokenizer, model.decoder
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

