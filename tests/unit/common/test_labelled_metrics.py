"""Labelled series in the Prometheus exposition (Metrics.add_labelled): one family per name, a counter
for `_total` names, each series with its labels; absent from GetStats (its map has no labels). The
actor's per-session figures (services/actor/sessions.py, SessionHub.session_figures) use it."""

from __future__ import annotations

from services.common.service.prometheus import serve_metrics
from services.common.stats import Metrics
from tests.helpers import http_get


def test_labelled_series_are_exposed_per_label_and_follow_the_provider():
    metrics = Metrics("actor")
    sessions = {"sim-a": (64.0, 2.0), 'odd "id"\\': (8.0, 0.0)}

    def figures():
        return [(name, {"session": sid}, v[i]) for sid, v in sessions.items()
                for i, name in enumerate(("actor/session_env_steps_total", "actor/session_return_mean"))]

    metrics.add_labelled(figures)
    server = serve_metrics(metrics, "127.0.0.1:0")
    try:
        status, text = http_get(server.address, "/metrics")
        assert status == 200
        assert "# TYPE kuberl_actor_session_env_steps_total counter" in text
        assert 'kuberl_actor_session_env_steps_total{session="sim-a"} 64.0' in text
        assert 'kuberl_actor_session_env_steps_total{session="odd \\"id\\"\\\\"} 8.0' in text
        assert "# TYPE kuberl_actor_session_return_mean gauge" in text
        assert 'kuberl_actor_session_return_mean{session="sim-a"} 2.0' in text
        del sessions["sim-a"]                      # a closed session's series go with it
        assert "sim-a" not in http_get(server.address, "/metrics")[1]
    finally:
        server.close()
    assert not any(k.startswith("actor/session_") for k in metrics.snapshot())   # GetStats: no labels
