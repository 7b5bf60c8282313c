"""Prometheus exposition of a service's Metrics on an HTTP `/metrics` endpoint (prometheus_client).

Names map one to one from GetStats: `actor/env_steps_per_s` -> `kuberl_actor_env_steps_per_s`.
Names ending in `_total` are counters; distributions (staleness) are histograms with `le` buckets
plus the rolling `_mean/_p50/_p95/_max` gauges; everything else is a gauge. The endpoint serves the
same snapshot GetStats does, from its own thread, so scraping never touches the event loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from services.common.stats import Metrics

DOCS = "see docs/metrics.md"


def prometheus_name(name: str) -> str:
    return "kuberl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _Collector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        for name, value in sorted(self.metrics.snapshot().items()):
            prom = prometheus_name(name)
            if name.endswith("_total"):
                yield CounterMetricFamily(prom[: -len("_total")], f"{name} ({DOCS})", value=value)
            else:
                yield GaugeMetricFamily(prom, f"{name} ({DOCS})", value=value)
        for name, hist in sorted(self.metrics.histograms.items()):
            yield HistogramMetricFamily(prometheus_name(name), f"{name} distribution ({DOCS})",
                                        buckets=hist.cumulative(), sum_value=hist.sum)


@dataclass
class MetricsServer:
    """A running /metrics endpoint; `address` is the bound host:port."""
    address: str
    _httpd: object

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(metrics: Metrics, listen: str) -> MetricsServer:
    """Start serving `metrics` on http://listen/metrics (port 0 picks a free port). Non-blocking."""
    host, port = listen.rsplit(":", 1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    httpd, _ = start_http_server(int(port), addr=host, registry=registry)
    return MetricsServer(f"{host}:{httpd.server_port}", httpd)
