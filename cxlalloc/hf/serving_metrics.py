"""Prometheus metrics of ``cxlalloc serve`` (``GET /metrics``, text format 0.0.4).

Two sources, one registry per server (:class:`ServeMetrics`):

* the HTTP layer (an ASGI middleware in front of transformers' routes):
  requests by route and status, requests in flight, end-to-end latency; on
  streamed completions the time to the first content chunk (TTFT) and the mean
  time per output chunk after it (TPOT); output and prompt tokens from the
  ``usage`` a non-streamed answer carries (a streamed answer counts its content
  chunks, one per token as transformers streams them);
* at each scrape, :func:`cxlalloc.hf.stats` of every served model: bytes per
  tier (KV and all allocations), continuous batching's counters (requests
  scheduled, VRAM prefix hits, KV store lookups, hit tokens and blocks, blocks
  stored, bytes loaded and stored, preemptions).

TTFT and TPOT are measured where the client sees them (after the chat
template, tokenisation, scheduling), on streamed requests only: a non-streamed
answer arrives whole, so only its latency is known.  Needs prometheus_client
(the ``kvserver`` or ``test`` extra; ``cxlalloc serve`` says once when it is
missing and serves without ``/metrics``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, Iterable, Optional

from cxlalloc.extras import install_hint

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
METRICS_ROUTE = "/metrics"
# seconds; TTFT on a CPU simulation runs from ~10 ms to tens of seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# continuous batching counters exported as Prometheus counters (name suffix, CBCounters field, help)
CB_COUNTERS = (
    ("cb_scheduled_requests", "scheduled_requests", "requests continuous batching scheduled"),
    ("cb_preemptions", "preemptions", "requests preempted (their blocks freed or swapped)"),
    ("kv_vram_hit_tokens", "vram_hit_tokens", "prompt tokens served from blocks already in the paged cache"),
    ("kv_store_lookups", "store_lookups", "KV store prefix lookups"),
    ("kv_store_hit_tokens", "store_hit_tokens", "prompt tokens loaded from the KV store instead of prefilled"),
    ("kv_store_hit_blocks", "store_hit_blocks", "blocks loaded from the KV store"),
    ("kv_store_stored_blocks", "stored_blocks", "blocks written to the KV store"),
    ("kv_store_loaded_bytes", "bytes_loaded", "bytes loaded from the KV store"),
    ("kv_store_stored_bytes", "bytes_stored", "bytes written to the KV store"),
)


class ServeMetrics:
    """The registry, the HTTP-layer metrics and the collector of served models' stats.

    Args:
        models: returns ``{name: wrapped model}`` at scrape time.
        stats: :func:`cxlalloc.hf.stats`.
    """

    def __init__(self, models: Callable[[], Dict[str, Any]], stats: Callable[[Any], dict], status=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("cxlalloc_serve_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.in_flight = Gauge("cxlalloc_serve_requests_in_flight", "completion requests being answered",
                               registry=r)
        self.latency = Histogram("cxlalloc_serve_request_seconds", "end-to-end time of a completion request",
                                 ["route", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("cxlalloc_serve_ttft_seconds", "time to the first streamed content chunk",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("cxlalloc_serve_tpot_seconds", "mean time per streamed output chunk after the first",
                              ["route"], buckets=TPOT_BUCKETS, registry=r)
        self.output_tokens = Counter("cxlalloc_serve_output_tokens", "output tokens answered", ["route"], registry=r)
        self.prompt_tokens = Counter("cxlalloc_serve_prompt_tokens", "prompt tokens of non-streamed answers",
                                     ["route"], registry=r)
        r.register(_StatsCollector(models, stats))
        if status is not None:
            r.register(_StatusCollector(status))

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def middleware(self, app):
        """``app`` (ASGI) with the HTTP-layer metrics taken around it."""
        metrics = self

        async def wrapped(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope.get("path", "")
            if path not in ROUTES:
                status = [500]

                async def plain_send(message):
                    if message["type"] == "http.response.start":
                        status[0] = message["status"]
                    await send(message)

                try:
                    await app(scope, receive, plain_send)
                finally:
                    if path != "/metrics":
                        metrics.requests.labels(route=_route_label(path), status=str(status[0])).inc()
                return
            watch = _Watch(metrics, path)
            metrics.in_flight.inc()
            try:
                await app(scope, receive, lambda m: watch.send(m, send))
            except Exception:  # Starlette's outer error middleware answers it with a 500
                if not watch.started:
                    watch.status = 500
                raise
            finally:
                metrics.in_flight.dec()
                watch.done()

        return wrapped


def _route_label(path: str) -> str:
    known = ROUTES + ("/v1/models", "/health", "/v1/cxlalloc/stats")
    return path if path in known else "other"


class _Watch:
    """One completion request's response, timed as it is sent."""

    def __init__(self, metrics: ServeMetrics, route: str) -> None:
        self.m, self.route = metrics, route
        self.t0 = time.perf_counter()
        self.status = 499  # no response started: the client went away, or the drain deadline cancelled it
        self.started = False
        self.stream = False
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.chunks = 0
        self.body = bytearray()
        self.pending = b""

    async def send(self, message, send) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.status = message["status"]
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            data = message.get("body", b"")
            if self.stream:
                self._events(data)
            elif len(self.body) < (1 << 20):
                self.body += data
        await send(message)

    def _events(self, data: bytes) -> None:
        self.pending += data
        *events, self.pending = self.pending.split(b"\n\n")
        for ev in events:
            text = ev.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue
            payload = text[5:].strip()
            if payload == "[DONE]":
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if any(_content(c) for c in obj.get("choices") or []) or (
                    obj.get("type") == "response.output_text.delta" and obj.get("delta")):  # /v1/responses
                now = time.perf_counter()
                self.first = self.first if self.first is not None else now
                self.last = now
                self.chunks += 1

    def done(self) -> None:
        m, route = self.m, self.route
        m.requests.labels(route=route, status=str(self.status)).inc()
        if self.status >= 400:
            return
        m.latency.labels(route=route, stream=str(self.stream).lower()).observe(time.perf_counter() - self.t0)
        if self.stream:
            if self.first is not None:
                m.ttft.labels(route=route).observe(self.first - self.t0)
                if self.chunks > 1:
                    m.tpot.labels(route=route).observe((self.last - self.first) / (self.chunks - 1))
            m.output_tokens.labels(route=route).inc(self.chunks)
            return
        try:
            usage = json.loads(bytes(self.body)).get("usage") or {}
        except ValueError:
            return
        # /v1/responses names them input_tokens and output_tokens
        m.output_tokens.labels(route=route).inc(int(usage.get("completion_tokens") or usage.get("output_tokens") or 0))
        m.prompt_tokens.labels(route=route).inc(int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0))


def _content(choice: dict) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content"))
    return bool(choice.get("text"))


class _StatsCollector:
    """``cxlalloc.hf.stats`` of every served model, read at each scrape."""

    def __init__(self, models: Callable[[], Dict[str, Any]], stats: Callable[[Any], dict]) -> None:
        self.models, self.stats = models, stats

    def describe(self) -> Iterable:
        return []  # collected at scrape time only (the models appear after the load)

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kv = GaugeMetricFamily("cxlalloc_kv_bytes", "KV cache bytes held, by tier", labels=["model", "tier"])
        mem = GaugeMetricFamily("cxlalloc_allocated_bytes", "bytes allocated by the served model's allocator, by tier",
                                labels=["model", "tier"])
        limit = GaugeMetricFamily("cxlalloc_limit_bytes", "the tier's limit", labels=["model", "tier"])
        peak = GaugeMetricFamily("cxlalloc_cb_kv_peak_bytes", "continuous batching's peak KV bytes, by tier",
                                 labels=["model", "tier"])
        counters = {name: CounterMetricFamily(f"cxlalloc_{name}", text, labels=["model"])
                    for name, _, text in CB_COUNTERS}
        for name, model in self.models().items():
            try:
                st = self.stats(model)
            except Exception:  # a model being unloaded: skip it this scrape
                continue
            for tier in ("device", "host"):
                kv.add_metric([name, tier], float((st.get("kv") or {}).get(f"{tier}_bytes", 0)))
                mem.add_metric([name, tier], float((st.get(tier) or {}).get("allocated_bytes", 0)))
                limit.add_metric([name, tier], float((st.get(tier) or {}).get("limit_bytes", 0)))
            cb = ((st.get("hf") or {}).get("continuous_batching") or {}).get("counters") or {}
            for tier in ("device", "host"):
                peak.add_metric([name, tier], float(cb.get(f"peak_kv_{tier}_bytes", 0)))
            for metric, field, _ in CB_COUNTERS:
                counters[metric].add_metric([name], float(cb.get(field, 0)))
        yield from (kv, mem, limit, peak, *counters.values())


class _StatusCollector:
    """The server's cancellations and continuous-batching queue (:class:`cxlalloc.hf.serving_drain.ServeStatus`)."""

    def __init__(self, status) -> None:
        self.status = status

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cancelled = CounterMetricFamily("cxlalloc_serve_cancelled_requests", "completion requests cancelled before their "
                                        "answer was sent: the client went away (disconnect) or the drain deadline "
                                        "ran out (drain)", labels=["reason"])
        with self.status.lock:
            counts, engines = dict(self.status.cancelled), dict(self.status.engine_cancelled)
        for reason, n in sorted(counts.items()):
            cancelled.add_metric([reason], float(n))
        cb = CounterMetricFamily("cxlalloc_serve_engine_cancelled_requests", "cancelled requests stopped where "
                                 "they were computed (continuous_batching: removed from transformers' scheduler, "
                                 "blocks freed; generate: a generate() stopped at its next token)", labels=["engine"])
        for engine, n in sorted(engines.items()):
            cb.add_metric([engine], float(n))
        queued = GaugeMetricFamily("cxlalloc_serve_cb_requests", "requests the continuous-batching scheduler holds "
                                   "(running and waiting)")
        queued.add_metric([], float(self.status.cb_requests()))
        yield from (cancelled, cb, queued)


def add_metrics(app, served, stats, status=None) -> None:
    """``GET /metrics`` (:class:`ServeMetrics`) on ``app`` for the models in ``served`` (``.lock``, ``.models``);
    without prometheus_client, said once on stderr and left out."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        import sys

        print("cxlalloc serve: warning: prometheus_client is not installed; serving without /metrics "
              f"({install_hint('serve')})", file=sys.stderr)
        return
    from fastapi.responses import Response

    def models():
        with served.lock:
            return dict(served.models)

    metrics = ServeMetrics(models, stats, status)

    class MetricsMiddleware:
        def __init__(self, inner):
            self.inner = metrics.middleware(inner)

        async def __call__(self, scope, receive, send):
            await self.inner(scope, receive, send)

    app.add_middleware(MetricsMiddleware)

    @app.get(METRICS_ROUTE)
    def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

