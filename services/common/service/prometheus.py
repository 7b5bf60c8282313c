"""Prometheus exposition of a service's Metrics on an HTTP `/metrics` endpoint (prometheus_client).

Names map one to one from GetStats: `actor/env_steps_per_s` -> `kuberl_actor_env_steps_per_s`.
Names ending in `_total` are counters; distributions (staleness) are histograms with `le` buckets
plus the rolling `_mean/_p50/_p95/_max` gauges; everything else is a gauge. The endpoint serves the
same snapshot GetStats does, from its own thread, so scraping never touches the event loop.

The same port answers the probes of a role's health over plain HTTP, for kubelets and load balancers,
which cannot present a client certificate: under mutual TLS (docs/security.md) a native gRPC probe of
the role's port fails its handshake, so the manifests probe these instead.

- `/livez`: 200 when the role's event loop runs a callback within PROBE_TIMEOUT_S (a hung process
  fails it; a role that is merely not ready yet, or draining, does not).
- `/readyz`: 200 when, in addition, every service of the role's gRPC server reports SERVING: what a
  gRPC health check of the role's service answers (NOT_SERVING before the role is ready and from the
  start of its shutdown).

A failing probe is 503 with the reason in the body; anything else but `/metrics` is 404.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from services.common.stats import Metrics

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

DOCS = "see docs/metrics.md"
PROBE_TIMEOUT_S = 3.0  # under the manifests' probe timeoutSeconds (4-5 s), so a slow loop reads as a 503 with its reason
PROBES = {"/livez": False, "/readyz": True}  # path -> whether the role's services must be SERVING


class Probed(Protocol):
    """What the probes ask (services.common.net.grpcutil.Serving): None when healthy, else why not."""

    def probe(self, ready: bool, timeout_s: float) -> str | None: ...


def prometheus_name(name: str) -> str:
    return "kuberl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _Collector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.metrics.snapshot().items()):
            prom = prometheus_name(name)
            if name.endswith("_total"):
                yield CounterMetricFamily(prom[: -len("_total")], f"{name} ({DOCS})", value=value)
            else:
                yield GaugeMetricFamily(prom, f"{name} ({DOCS})", value=value)
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for name, labels, value in self.metrics.labelled():
            family = families.get(name)
            if family is None:
                prom, keys = prometheus_name(name), sorted(labels)
                family = families[name] = (
                    CounterMetricFamily(prom[: -len("_total")], f"{name} ({DOCS})", labels=keys)
                    if name.endswith("_total") else GaugeMetricFamily(prom, f"{name} ({DOCS})", labels=keys))
            family.add_metric([labels[k] for k in sorted(labels)], value)
        yield from (families[name] for name in sorted(families))
        for name, hist in sorted(self.metrics.histograms.items()):
            yield HistogramMetricFamily(prometheus_name(name), f"{name} distribution ({DOCS})",
                                        buckets=hist.cumulative(), sum_value=hist.sum)


@dataclass
class MetricsServer:
    """A running /metrics (and /livez, /readyz) endpoint; `address` is the bound host:port."""
    address: str
    _httpd: WSGIServer

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes and probes every few seconds: not worth a log line each
        pass


def _app(registry: CollectorRegistry, health: Probed | None) -> WSGIApplication:
    metrics_app: WSGIApplication = make_wsgi_app(registry)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path in PROBES and health is not None:
            why = health.probe(PROBES[path], PROBE_TIMEOUT_S)
            status, body = ("200 OK", b"ok\n") if why is None else ("503 Service Unavailable", f"{why}\n".encode())
        else:
            known = ", ".join(["/metrics", *(PROBES if health is not None else ())])
            status, body = "404 Not Found", f"no {path}: this port serves {known}\n".encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve_metrics(metrics: Metrics, listen: str, health: Probed | None = None) -> MetricsServer:
    """Start serving `metrics` on http://listen/metrics (port 0 picks a free port), and with `health`
    (the role's gRPC server) the /livez and /readyz probes. Non-blocking: one thread per request."""
    shown, port = listen.rsplit(":", 1)
    host = shown.strip("[]")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    family = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class: type[ThreadingWSGIServer] = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
    httpd = make_server(host, int(port), _app(registry, health), server_class, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return MetricsServer(f"{shown}:{httpd.server_port}", httpd)
