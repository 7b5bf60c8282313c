"""The HTTP probes of the metrics port (/livez, /readyz): what kubelets ask when gRPC probes cannot
present a client certificate. They follow the gRPC server's health and its event loop."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import pytest

from services.common.service import prometheus
from services.common.net.grpcutil import start_server
from services.common.service.prometheus import serve_metrics
from services.common.stats import Metrics
from tests.helpers import http_get


class LoopThread:
    """An event loop in its own thread, as a role's loop is to the metrics thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def role():
    lt = LoopThread()
    srv = lt.run(start_server("127.0.0.1:0", lambda s: None, ["kuberl.v1.Test"], max_message_bytes=1 << 20))
    prom = serve_metrics(Metrics("test"), "127.0.0.1:0", health=srv)
    yield lt, srv, prom.address
    prom.close()
    lt.run(srv.close())
    lt.close()


def test_ready_follows_the_services_health_and_live_does_not(role):
    lt, srv, address = role
    assert http_get(address, "/readyz") == (503, "kuberl.v1.Test not serving\n")  # a server starts NOT_SERVING
    assert http_get(address, "/livez") == (200, "ok\n")
    lt.run(srv.set_serving(True))
    assert http_get(address, "/readyz") == (200, "ok\n")
    lt.run(srv.set_serving(False))  # shutdown begins: out of the Service, but not restarted
    assert http_get(address, "/readyz")[0] == 503
    assert http_get(address, "/livez") == (200, "ok\n")


def test_a_blocked_event_loop_fails_both(role, monkeypatch):
    lt, srv, address = role
    lt.run(srv.set_serving(True))
    monkeypatch.setattr(prometheus, "PROBE_TIMEOUT_S", 0.2)
    release = threading.Event()
    lt.loop.call_soon_threadsafe(release.wait)  # the loop is stuck in this callback until released
    try:
        for path in ("/livez", "/readyz"):
            code, body = http_get(address, path)
            assert code == 503 and body == "the server's event loop did not answer within 0.2 s\n"
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while http_get(address, "/livez")[0] != 200:  # answers again once the loop runs
        assert time.monotonic() < deadline, "/livez stayed failing after the loop was released"


def test_metrics_and_unknown_paths(role):
    _, _, address = role
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    code, body = http_get(address, "/nope")
    assert code == 404 and body == "no /nope: this port serves /metrics, /livez, /readyz\n"


def test_without_health_only_metrics_is_served():
    prom = serve_metrics(Metrics("test"), "127.0.0.1:0")
    try:
        assert http_get(prom.address, "/livez") == (404, "no /livez: this port serves /metrics\n")
    finally:
        prom.close()
