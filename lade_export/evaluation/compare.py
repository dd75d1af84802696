"""Side-by-side comparison runs: plain greedy, lookahead profiles and optional peers
(transformers, llama.cpp; see :mod:`lade_export.evaluation.peers`) on the same prompts, interleaved
prompt by prompt.

Interleaving means machine drift (thermal, other load) hits every configuration alike.
Every lookahead configuration's output is checked token for token against plain greedy
on the same engine; the transformers prompt-lookup peer is checked against the
transformers greedy peer (or against the engine's greedy when that peer is absent), and
llama.cpp's lookahead against llama.cpp's greedy (as text).

Under sampling (temperature > 0) the baseline is plain sampling on the same engine
(configuration ``sampling``), each prompt gets its own seed (``seed + prompt index``),
outputs cannot match token for token (the exact column reads n/a and nothing fails on a
mismatch), and the speedup is the ratio of decode tokens per second.

Outputs in ``--out``: ``results.jsonl`` (one record per prompt × configuration),
``summary.md`` and ``summary.csv`` (per dataset × configuration), ``speedup.png``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import platform
import time
from pathlib import Path

import numpy as np

from .peers import PEERS  # peer names; the peers themselves live in peers.py

GREEDY = "greedy"
SAMPLING = "sampling"  # the baseline under sampling: plain sampling, no lookahead
BASELINES = (GREEDY, SAMPLING)


@dataclasses.dataclass
class RunRecord:
    """One prompt × configuration. Times in seconds; ``exact`` against the reference greedy
    (None under sampling: outputs are not comparable token for token)."""

    dataset: str
    prompt_id: str
    config: str
    prompt_tokens: int
    new_tokens: int
    steps: int
    prefill_s: float
    decode_s: float
    acceptance_histogram: dict
    exact: bool | None
    reference: str
    token_ids: list
    host_s: float = 0.0
    text: str | None = None  # peers that print text only (llama.cpp): their output; token_ids is then empty

    def as_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["compression_ratio"] = self.new_tokens / self.steps if self.steps else 0.0
        return d


@dataclasses.dataclass(frozen=True)
class SkippedRecord:
    """A dataset record left out of a run because it does not fit the model's context.

    Attributes:
        path: the dataset file; record: its 0-based record index; prompt_id: the record's id.
        prompt_tokens: the prompt's length in tokens (chat template included when used).
        context: the artifact's declared context, tokens.
        reason: the runtime's own refusal (:meth:`lade_export.runtime.Decoder.check_request`).
    """

    path: str
    record: int
    prompt_id: str
    prompt_tokens: int
    context: int
    reason: str

    def line(self) -> str:
        """One line for stderr and the summaries."""
        return (f"skipped {self.path} record {self.record} (id {self.prompt_id}), it does not fit the context: "
                f"{self.reason}")


def fit_prompts(decoder, tokenizer, prompts, chat: bool) -> tuple[list, list]:
    """Encode ``prompts`` and split them into those that fit the context and those that do not.

    A record fits when the runtime accepts it with at least one new token
    (``decoder.check_request(prompt_tokens, 1)``); its generations are then capped at what
    the context leaves (``min(max_new_tokens, context − prompt_tokens)``).

    Args:
        decoder: the :class:`lade_export.runtime.Decoder` that will run them.
        tokenizer: its tokenizer; ``chat`` wraps prompts in the chat template.
        prompts: :class:`lade_export.evaluation.datasets.Prompt` objects.

    Returns:
        ``(kept, skipped)``: ``[(prompt, token_ids)]`` in order, and :class:`SkippedRecord` objects.
    """
    from ..errors import GenerationError

    kept, skipped = [], []
    for prompt in prompts:
        ids = tokenizer.encode_prompt(prompt.text, chat)
        try:
            decoder.check_request(len(ids), 1)
        except GenerationError as err:
            skipped.append(SkippedRecord(prompt.path or prompt.dataset, prompt.record, prompt.id, len(ids),
                                         decoder.max_context, str(err)))
            continue
        kept.append((prompt, ids))
    return kept, skipped


def _pct(values, q):
    return float(np.percentile(values, q)) if values else 0.0


def summarize(records: list[RunRecord]) -> list[dict]:
    """Per dataset × configuration: compression mean/median, decode tok/s, speedup vs the
    baseline (decode tok/s ratio; for exact greedy runs, which emit the same tokens, the
    ratio of total decode times), speedup vs the configuration's own greedy (its
    ``reference``: an extra engine's greedy, transformers or llama.cpp greedy for their
    lookahead peers), p50/p90 decode time per token (ms), exact count (None under sampling)."""
    rows = []
    keys = []
    for r in records:
        if (r.dataset, r.config) not in keys:
            keys.append((r.dataset, r.config))
    for dataset, config in keys:
        mine = [r for r in records if r.dataset == dataset and r.config == config]
        base = [r for r in records if r.dataset == dataset and r.config in BASELINES]
        peer = config in PEERS
        # Peers emit their first token in prefill; count decode tokens as new − 1 for them.
        tokens = sum(max(r.new_tokens - (1 if peer else 0), 0) for r in mine)
        decode = sum(r.decode_s for r in mine)
        base_decode = sum(r.decode_s for r in base)
        base_tokens = sum(r.new_tokens for r in base)  # baselines are ours: no prefill-emitted token
        comp = [r.new_tokens / r.steps for r in mine if r.steps]
        per_tok = [1000 * r.decode_s / max(r.new_tokens - (1 if peer else 0), 1) for r in mine]
        tok_s = tokens / decode if decode else 0.0
        base_tok_s = base_tokens / base_decode if base_decode else 0.0
        rows.append({
            "dataset": dataset,
            "config": config,
            "prompts": len(mine),
            "new_tokens": sum(r.new_tokens for r in mine),
            "compression_mean": float(np.mean(comp)) if comp else 0.0,
            "compression_median": float(np.median(comp)) if comp else 0.0,
            "decode_tok_s": tok_s,
            "speedup_vs_baseline": (tok_s / base_tok_s) if base_tok_s else 0.0,
            "p50_ms_per_token": _pct(per_tok, 50),
            "p90_ms_per_token": _pct(per_tok, 90),
            "exact": None if any(r.exact is None for r in mine) else sum(r.exact for r in mine),
            "host_share": (sum(r.host_s for r in mine) / decode) if decode and not peer else 0.0,
            "reference": mine[0].reference,
        })
    speed = {(r["dataset"], r["config"]): r["decode_tok_s"] for r in rows}
    for r in rows:
        own = speed.get((r["dataset"], r.pop("reference")), 0.0)
        r["speedup_vs_own_greedy"] = r["decode_tok_s"] / own if own else 0.0
    return rows


def environment() -> dict:
    """Date, CPU model, core count and versions, for the record of a benchmark (a package
    that is not installed is recorded as ``"not installed"``; nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    from .. import __version__

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": installed("torch"), "onnxruntime": installed("onnxruntime"),
            "transformers": installed("transformers"), "lade_export": __version__}


def write_outputs(out: Path, records: list[RunRecord], rows: list[dict], meta: dict) -> bool:
    """Write results.jsonl, summary.csv, summary.md and speedup.png into ``out`` (atomically per file).

    Returns:
        whether speedup.png was written (it needs matplotlib, the ``bench`` extra).
    """
    from importlib.util import find_spec

    from ..artifact import write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.jsonl", "".join(json.dumps(r.as_json()) + "\n" for r in records))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0].keys()))
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})
    write_text_atomic(out / "summary.csv", buf.getvalue())
    write_text_atomic(out / "summary.md", render_markdown(rows, meta))
    if find_spec("matplotlib") is None:
        return False
    plot_summary(rows, out / "speedup.png")
    return True


def render_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# lade-export compare — {meta.get('title', '')}".rstrip(" —"), ""]
    for k in ("date", "cpu", "cores", "artifact", "also", "model", "backend", "threads", "decoding", "datasets", "limit",
              "max_new_tokens", "python", "torch", "onnxruntime", "transformers", "lade_export", "command"):
        if k in meta:
            lines.append(f"- **{k}**: {meta[k]}")
    for k, v in meta.get("peers", {}).items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "Speedup = decode tokens/s of the configuration / decode tokens/s of the baseline on the same prompts "
              "(greedy; under sampling, plain sampling). Exact greedy runs emit the same tokens, so it is also the ratio "
              "of total decode times; peers count decode tokens as new tokens − 1 (their prefill emits one). "
              "Vs own greedy = against the same engine's greedy (an extra artifact's, or the peer's own). "
              "Compression = new tokens per forward pass. Exact = outputs identical to the reference (n/a under "
              "sampling): our lookahead and transformers' prompt lookup against their greedy, token ids; "
              "llama.cpp's lookahead against llama.cpp's greedy and llama.cpp's greedy against ours, as text.", "",
              "| dataset | configuration | prompts | compression mean | median | decode tok/s | speedup vs baseline | "
              "vs own greedy | p50 ms/token | p90 ms/token | host share | exact |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        host = "—" if r["config"] in PEERS else f"{100 * r['host_share']:.1f}%"
        lines.append(f"| {r['dataset']} | {r['config']} | {r['prompts']} | {r['compression_mean']:.2f} | "
                     f"{r['compression_median']:.2f} | {r['decode_tok_s']:.1f} | {r['speedup_vs_baseline']:.2f}× | "
                     f"{r['speedup_vs_own_greedy']:.2f}× | "
                     f"{r['p50_ms_per_token']:.1f} | {r['p90_ms_per_token']:.1f} | {host} | "
                     f"{'n/a' if r['exact'] is None else str(r['exact']) + '/' + str(r['prompts'])} |")
    if meta.get("skipped"):
        lines += ["", f"Skipped records (they do not fit the model's context; not in the table): {len(meta['skipped'])}",
                  ""]
        lines += [f"- {line}" for line in meta["skipped"]]
    return "\n".join(lines) + "\n"


def plot_summary(rows: list[dict], path: Path) -> None:
    """Grouped bars: speedup vs greedy and compression per configuration, one group per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(configs), 1)
    for ax, key, title in ((axes[0], "speedup_vs_baseline", "decode speedup vs baseline (×)"),
                           (axes[1], "compression_mean", "compression (tokens per forward pass)")):
        for i, config in enumerate(configs):
            vals = [next((r[key] for r in rows if r["dataset"] == d and r["config"] == config), 0.0) for d in datasets]
            ax.bar(np.arange(len(datasets)) + i * width, vals, width, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(datasets)) + width * (len(configs) - 1) / 2, datasets)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _continuation_text(tokenizer, prompt_ids: list, new_ids: list) -> str:
    """Text of ``new_ids`` as it continues the prompt, special tokens rendered (decoded with
    the prompt and the prompt's text cut off, so a leading space that a tokenizer drops at
    the start of a text is kept, as llama.cpp prints it)."""
    whole = tokenizer.decode(list(prompt_ids) + list(new_ids), skip_special_tokens=False)
    head = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new_ids, skip_special_tokens=False)


def run_compare(decoder, tokenizer, chat: bool, datasets: list[str], profiles: list, limit: int, max_new_tokens: int,
                peers=None, progress=None, sampling=None, extra_engines=()) -> tuple[list[RunRecord], list[SkippedRecord]]:
    """Run the baseline (greedy, or plain sampling), every profile and every peer on each
    prompt, interleaved.

    Records that do not fit the context are skipped (:func:`fit_prompts`) and returned
    beside the runs; the others generate up to ``min(max_new_tokens, context − prompt)``
    tokens.

    Args:
        decoder: a :class:`lade_export.runtime.Decoder` on the engine under test.
        tokenizer: its tokenizer; ``chat`` wraps prompts in the chat template.
        datasets: names or JSONL paths (see :func:`lade_export.evaluation.datasets.load_prompts`).
        profiles: lookahead profiles.
        limit: prompts per dataset; max_new_tokens: per generation.
        peers: a :class:`lade_export.evaluation.peers.Peers` (set up by the caller), or None.
        progress: optional ``callable(advance_by)``.
        sampling: :class:`lade_export.sampling.SamplingParams` (None or temperature 0:
            greedy); prompt ``i`` of the run samples with seed ``sampling.seed + i``.
        extra_engines: ``[(label, decoder, profiles)]``: more artifacts of the same model
            (e.g. its int4 and int8 builds) run on the same prompts in the same loop, as
            configurations ``"LABEL greedy"`` and ``"LABEL PROFILE"``; each lookahead
            configuration is checked against its own engine's greedy output.

    Returns:
        ``(records, skipped)``: every :class:`RunRecord` in run order, and the
        :class:`SkippedRecord` of each record left out.
    """
    import dataclasses as dc

    from .datasets import load_prompts

    sampled = sampling is not None and not sampling.greedy
    baseline = SAMPLING if sampled else GREEDY
    records, skipped = [], []
    stop_ids = sorted(decoder.stop_token_ids)
    index = 0
    for dataset in datasets:
        kept, left_out = fit_prompts(decoder, tokenizer, load_prompts(dataset, limit=limit, chat=chat), chat)
        skipped += left_out
        if progress and left_out:
            progress(len(left_out) * (1 + len(profiles) + (len(peers.names) if peers is not None else 0)))
        for prompt, ids in kept:
            budget = min(max_new_tokens, decoder.max_context - len(ids))
            params = dc.replace(sampling, seed=(sampling.seed or 0) + index) if sampled else None
            index += 1
            label = prompt.dataset

            def record(config, res_ids, steps, prefill, decode, hist, exact, reference, host=0.0, new=None, text=None):
                records.append(RunRecord(label, prompt.id, config, len(ids), len(res_ids) if new is None else new, steps,
                                         prefill, decode, hist, exact, reference, list(res_ids), host, text))
                if progress:
                    progress(1)

            def run_engine(engine, tag, engine_profiles):
                """Greedy (or plain sampling) on ``engine``, then each profile checked against it."""
                own = f"{tag} {baseline}" if tag else baseline

                def record_run(config, res, exact):
                    s = res.stats
                    record(config, res.token_ids, s.steps, s.prefill_s, s.decode_s, s.as_dict()["acceptance_histogram"],
                           exact, own, s.host_s)

                ref = engine.generate(ids, budget, None, sampling=params)
                record_run(own, ref, None if sampled else True)
                for profile in engine_profiles:
                    res = engine.generate(ids, budget, profile, sampling=params)
                    record_run(f"{tag} {profile.name}" if tag else profile.name, res,
                               None if sampled else res.token_ids == ref.token_ids)
                return ref

            base = run_engine(decoder, "", profiles)
            for tag, other, other_profiles in extra_engines:
                run_engine(other, tag, other_profiles)
            if peers is not None:
                text = tokenizer.render_chat([{"role": "user", "content": prompt.text}]) if chat else prompt.text
                for name, out, reference, exact in peers.run_prompt(
                        text, ids, budget, stop_ids, baseline, base.token_ids,
                        lambda: _continuation_text(tokenizer, ids, base.token_ids), params):
                    record(name, out.token_ids or [], out.steps, out.prefill_s, out.decode_s, {}, exact, reference,
                           new=out.new_tokens, text=out.text)
    return records, skipped
