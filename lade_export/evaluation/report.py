"""The report of a ``lade-export compare`` run, from its :class:`~.compare.RunRecord` list:
per dataset × configuration figures (:func:`summarize`), and the files written into
``--out`` (:func:`write_outputs`): ``results.jsonl`` (one record per prompt ×
configuration), ``summary.csv`` and ``summary.md`` (one row per dataset × configuration),
``speedup.png`` (needs matplotlib, the ``bench`` extra). :func:`environment` is the record
of the machine and versions every benchmark writes beside its figures.

Speedups are taken against the baseline configuration of the same prompts: :data:`GREEDY_BASELINE`,
or :data:`SAMPLING_BASELINE` under sampling (temperature > 0).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from .peers import PEERS

#: Record labels of the baselines (plain greedy decoding is :data:`lade_export.profile.GREEDY`).
GREEDY_BASELINE = "greedy"
SAMPLING_BASELINE = "sampling"  # the baseline under sampling: plain sampling, no lookahead
BASELINES = (GREEDY_BASELINE, SAMPLING_BASELINE)


def _pct(values, q):
    return float(np.percentile(values, q)) if values else 0.0


def summarize(records: list) -> list[dict]:
    """Per dataset × configuration: compression mean/median, decode tok/s, speedup vs the
    baseline (decode tok/s ratio; for exact greedy runs, which emit the same tokens, the
    ratio of total decode times), speedup vs the configuration's own greedy (its
    ``reference``: an extra engine's greedy, transformers or llama.cpp greedy for their
    lookahead peers), p50/p90 decode time per token (ms), exact count (None under sampling).

    Args:
        records: :class:`lade_export.evaluation.compare.RunRecord` objects, in run order.

    Returns:
        one dict per (dataset, configuration), in order of first appearance.
    """
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
    from .. import __version__

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": installed("torch"), "onnxruntime": installed("onnxruntime"),
            "transformers": installed("transformers"), "lade_export": __version__}


def write_outputs(out: Path, records: list, rows: list[dict], meta: dict) -> bool:
    """Write results.jsonl, summary.csv, summary.md and speedup.png into ``out`` as one set:
    every file is written beside its place first (hidden temporary names) and only then are
    the four renamed into place, so an interrupt or a failure while they are made (the plot
    takes a while) leaves the files of ``out`` as they were. Without matplotlib there is no
    new plot, and an earlier run's ``speedup.png`` is removed (it would not match).

    Args:
        out: the folder (made if missing).
        records: the run's :class:`lade_export.evaluation.compare.RunRecord` objects.
        rows: :func:`summarize` of them; meta: as for :func:`render_markdown`.

    Returns:
        whether speedup.png was written (it needs matplotlib, the ``bench`` extra).
    """
    import tempfile
    from importlib.util import find_spec

    from ..artifact import stage_text

    out.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0].keys()))
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})
    texts = {"results.jsonl": "".join(json.dumps(r.as_json()) + "\n" for r in records),
             "summary.csv": buf.getvalue(), "summary.md": render_markdown(rows, meta)}
    plotted = find_spec("matplotlib") is not None
    staged = []  # (temporary path, final path)
    try:
        for name, text in texts.items():
            staged.append((stage_text(out / name, text), out / name))
        if plotted:
            fd, tmp = tempfile.mkstemp(prefix=".speedup.", suffix=".png", dir=out)  # the suffix picks the format
            os.close(fd)
            staged.append((tmp, out / "speedup.png"))
            plot_summary(rows, Path(tmp))
            os.chmod(tmp, 0o644)
        for tmp, final in staged:
            os.replace(tmp, final)
        staged = []
    finally:
        for tmp, _ in staged:  # a failure or interrupt before the renames: nothing of this run stays
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    if not plotted:
        with contextlib.suppress(FileNotFoundError):
            (out / "speedup.png").unlink()
    return plotted


def render_markdown(rows: list[dict], meta: dict) -> str:
    """``summary.md``: a title, the run's metadata (``meta``: :func:`environment` and the
    command's settings, ``peers``, ``skipped``), how the columns are computed, and one table
    row per :func:`summarize` row."""
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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        tmp.replace(path)
    finally:
        plt.close(fig)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
