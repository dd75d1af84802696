"""The Prometheus metrics of ``lade-export serve`` (``GET /metrics``, :mod:`.openai_api`).

Counters and histograms the server updates as requests run (:class:`Metrics`: requests
by endpoint and status, prompt and completion tokens, cancellations, time to the first
token, time per later token, tokens per decode pass — the compression of Fu et al. 2023,
arXiv 2402.02057), and gauges read from the server and its scheduler at scrape time
(:class:`SchedulerCollector`). Text format: prometheus_client's ``generate_latest``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class SchedulerCollector:
    """Scheduler and admission values read at scrape time (a prometheus_client custom
    collector).

    Args:
        server: the :class:`~lade_export.serving.openai_api.OpenAIServer` (its ``running``
            and ``waiting`` counts, and its model's ``scheduler`` when it has one).
    """

    def __init__(self, server):
        self.server = server

    def collect(self):
        """The gauges and counters of this scrape: running and queued requests; with a
        scheduler its admitted requests, KV pool bytes, passes, token rows over all passes
        and mean requests per pass."""
        s = self.server
        sched = getattr(s.model, "scheduler", None)
        yield GaugeMetricFamily("lade_requests_running", "Requests holding a slot of the server (max_concurrent).",
                                value=s.running)
        yield GaugeMetricFamily("lade_requests_queued", "Requests waiting for a slot.", value=s.waiting)
        if sched is not None:
            yield GaugeMetricFamily("lade_scheduler_active_requests", "Requests admitted by the scheduler.",
                                    value=sched.active_requests)
            yield GaugeMetricFamily("lade_kv_cache_bytes", "Bytes of the scheduler's KV pool.", value=sched.pool.nbytes)
            yield CounterMetricFamily("lade_scheduler_passes", "Forward passes the scheduler ran.", value=sched.passes)
            shapes = dict(sched.pass_shapes)
            passes = sum(shapes.values())
            rows = sum(r * n for (_, r), n in shapes.items())
            reqs = sum(q * n for (q, _), n in shapes.items())
            yield CounterMetricFamily("lade_scheduler_pass_rows", "Token rows over all passes.", value=rows)
            yield GaugeMetricFamily("lade_scheduler_requests_per_pass", "Mean requests in a pass.",
                                    value=reqs / passes if passes else 0.0)


class Metrics:
    """The server's metrics in a registry of their own (:attr:`registry`, what
    ``GET /metrics`` renders).

    Attributes:
        requests: counter by ``endpoint`` (``completions``, ``chat``) and HTTP ``status``.
        prompt_tokens, completion_tokens: counters of tokens (prompt tokens counted when
            a request finishes).
        cancelled: counter of requests ended by a client disconnect.
        ttft: histogram of seconds from admission to the first token.
        tpot: histogram of seconds per generated token after the first.
        compression: histogram of a request's tokens per decode forward pass.

    Args:
        server: the :class:`~lade_export.serving.openai_api.OpenAIServer` whose admission
            and scheduler :class:`SchedulerCollector` reads.
    """

    def __init__(self, server):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lade_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("lade_prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.completion_tokens = Counter("lade_completion_tokens", "Tokens generated.", registry=r)
        self.cancelled = Counter("lade_requests_cancelled", "Requests cancelled by a client disconnect.", registry=r)
        self.ttft = Histogram("lade_time_to_first_token_seconds", "Seconds from admission to the first token.",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.tpot = Histogram("lade_time_per_output_token_seconds", "Seconds per generated token after the first.",
                              buckets=(.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28), registry=r)
        self.compression = Histogram("lade_compression_ratio", "Tokens per decode forward pass of a request.",
                                     buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8), registry=r)
        r.register(SchedulerCollector(server))
