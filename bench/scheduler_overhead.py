"""Concurrency 1 through the scheduler against today's single-request path (issue 21,
done-when 4: within 3%).

One model is loaded per artifact with ``batching=True``; each request is run either by
its :class:`~lade_export.runtime.Decoder` (``model.decoder.stream``: what
``lade_export.load()`` without batching runs) or by its
:class:`~lade_export.scheduler.Scheduler` (``model.scheduler.stream``: what every
request of a ``batching=True`` model runs), on the same ONNX Runtime session, one request
at a time. A round runs the same requests (bench/prompts/chat.jsonl records, chat
template where the model has one, --max-new-tokens each) through both paths, the order alternating from round to
round and from request to request (so both paths see the same load); one request
through each path first is a warm-up and is not counted.

Per round and path it measures:

* per token — each request's seconds from its first new token to its last over the new
  tokens after the first (decode only), summed over the requests, divided by their tokens;
* total — wall seconds of the whole request set (prefill, decode, scheduler bookkeeping);
* host per step — seconds of decode outside the engine's run (``stats.host_s``: the
  lookahead algorithm, the runtime's or scheduler's bookkeeping) over decode steps: the
  overhead itself, less sensitive to a loaded machine than the ratios; and host CPU per
  step — this thread's CPU seconds (``time.thread_time``) outside the engine's run over
  decode steps (prefill included): insensitive to other processes' load, the figure to
  compare where the machine is shared.

and prints, per artifact and decoding, the median over rounds of the ratio scheduler /
today (1.00 = no overhead; done-when 4 asks ≤ 1.03), its range, and whether every output
of both paths is the same token for token.

Usage:
    python bench/scheduler_overhead.py /work/artifacts/smollm2-lade-int8 /work/artifacts/smollm2 \\
        --rounds 5 --prompts 4 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve_batched import chat_prompts  # noqa: E402


class EngineCPU:
    """Wraps an engine's ``run`` to add up this thread's CPU seconds inside it
    (``time.thread_time``), so the caller's CPU outside the engine is host work."""

    def __init__(self, engine):
        self.seconds = 0.0
        run = engine.run

        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t

        engine.run = timed


def run_request(runner, ids, max_new_tokens, profile, engine_cpu):
    """Run one request through ``runner`` (a Decoder or a Scheduler); returns (wall s,
    decode s after the first new token, new tokens after the first, host s, host CPU s,
    steps, ids)."""
    first = last = None
    tokens, after_first = [], 0
    cpu0, in_engine0 = time.thread_time(), engine_cpu.seconds
    t0 = time.perf_counter()
    stream = runner.stream(ids, max_new_tokens, profile)
    for chunk in stream:
        if chunk.token_ids:
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                after_first += len(chunk.token_ids)
            last = now
            tokens += chunk.token_ids
        if chunk.final:
            stats = chunk.stats
    wall = time.perf_counter() - t0
    host_cpu = time.thread_time() - cpu0 - (engine_cpu.seconds - in_engine0)
    return wall, (last - first) if first is not None else 0.0, after_first, stats.host_s, host_cpu, stats.steps, tokens


def measure(model, requests, profile, rounds, max_new_tokens):
    """Rounds of both paths on one model, interleaved request by request (the order of the
    two paths alternating from request to request and round to round); per-round ratios,
    per-round figures and whether both paths gave the same tokens."""
    paths = {"today": model.decoder, "scheduler": model.scheduler}
    engine_cpu = EngineCPU(model.decoder.engine)  # the scheduler runs the decoder's engine
    for runner in paths.values():  # warm-up
        run_request(runner, requests[0], max_new_tokens, profile, engine_cpu)
    keys = ("wall", "decode_s", "decode_n", "host_s", "host_cpu", "steps")
    per_token, total, same = [], [], True
    figures = {name: {"per_token_ms": [], "total_s": [], "host_ms_per_step": [], "host_cpu_ms_per_step": []}
               for name in paths}
    for r in range(rounds):
        sums = {name: dict.fromkeys(keys, 0.0) for name in paths}
        for i, ids in enumerate(requests):
            order = ("today", "scheduler") if (r + i) % 2 == 0 else ("scheduler", "today")
            outputs = {}
            for name in order:
                *values, outputs[name] = run_request(paths[name], ids, max_new_tokens, profile, engine_cpu)
                for key, value in zip(keys, values):
                    sums[name][key] += value
            same &= outputs["today"] == outputs["scheduler"]
        for name, s in sums.items():
            figures[name]["per_token_ms"].append(1e3 * s["decode_s"] / max(s["decode_n"], 1))
            figures[name]["total_s"].append(s["wall"])
            figures[name]["host_ms_per_step"].append(1e3 * s["host_s"] / max(s["steps"], 1))
            figures[name]["host_cpu_ms_per_step"].append(1e3 * s["host_cpu"] / max(s["steps"], 1))
        per_token.append(figures["scheduler"]["per_token_ms"][-1] / figures["today"]["per_token_ms"][-1])
        total.append(figures["scheduler"]["total_s"][-1] / figures["today"]["total_s"][-1])
    return per_token, total, same, figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="artifact directories (e.g. the lade int8 and fp32 builds)")
    parser.add_argument("--rounds", type=int, default=5, help="counted alternations (≥ 5 for done-when 4)")
    parser.add_argument("--prompts", type=int, default=4, help="chat prompts per round (records 12…)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--decoding", nargs="+", default=["greedy", "lookahead"], choices=["greedy", "lookahead"],
                        help="lookahead: the artifact's default profile")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads")
    args = parser.parse_args(argv)

    import lade_export

    prompts = chat_prompts(12, args.prompts)
    rows = []
    for artifact in args.artifacts:
        model = lade_export.load(artifact, threads=args.threads, batching=True)
        try:
            requests = [model.encode(p, model.tokenizer.has_chat_template) for p in prompts]
            for decoding in args.decoding:
                profile = model.default_profile if decoding == "lookahead" else None
                per_token, total, same, figures = measure(model, requests, profile, args.rounds, args.max_new_tokens)
                name = decoding if profile is None else f"{decoding} ({profile.name})"
                rows.append((Path(artifact).name, name, figures, per_token, total, same))
                print(f"{Path(artifact).name} {name}: per-token ratios {[round(x, 3) for x in per_token]}, "
                      f"total ratios {[round(x, 3) for x in total]}, outputs equal: {same}", file=sys.stderr)
        finally:
            model.close()

    print(f"\n{args.rounds} alternating rounds of {args.prompts} requests × {args.max_new_tokens} new tokens, "
          "concurrency 1, medians over rounds\n")
    print("| artifact | decoding | today ms/token | scheduler ms/token | per-token ratio (range) "
          "| today total s | scheduler total s | total ratio (range) | host ms/step today / scheduler "
          "| host CPU ms/step today / scheduler | outputs equal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for art, name, fig, per_token, total, same in rows:
        med = statistics.median
        print(f"| {art} | {name} | {med(fig['today']['per_token_ms']):.2f} | {med(fig['scheduler']['per_token_ms']):.2f}"
              f" | {med(per_token):.3f} ({min(per_token):.3f}–{max(per_token):.3f}) | {med(fig['today']['total_s']):.2f}"
              f" | {med(fig['scheduler']['total_s']):.2f} | {med(total):.3f} ({min(total):.3f}–{max(total):.3f})"
              f" | {med(fig['today']['host_ms_per_step']):.2f} / {med(fig['scheduler']['host_ms_per_step']):.2f}"
              f" | {med(fig['today']['host_cpu_ms_per_step']):.3f} / {med(fig['scheduler']['host_cpu_ms_per_step']):.3f}"
              f" | {'yes' if same else 'NO'} |")
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
