"""Prometheus /metrics on every service: scrapeable, valid text format, and in agreement with GetStats."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from services.common.service.prometheus import prometheus_name
from tests.helpers import TINY_PPO, Service, http_get, stats, wait_for, write_config

STUBS = {"buffer": buffer_pb2_grpc.BufferStub, "learner": learner_pb2_grpc.LearnerStub,
         "actor": actor_pb2_grpc.ActorStub}


def _key(name: str, labels: dict) -> str:
    return name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))


def scrape(address: str) -> dict[str, tuple[str, dict[str, float]]]:
    """{family name: (type, {sample name + labels: value})} parsed with prometheus_client's own parser."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, {_key(s.name, s.labels): s.value for s in fam.samples})
    return out


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    config = write_config(tmp / "c.yaml", TINY_PPO)
    procs = {"buffer": Service("buffer", tmp, config)}
    buffer = procs["buffer"].wait_ready()
    procs["learner"] = Service("learner", tmp, config, "--buffer", buffer, "--checkpoint-dir", str(tmp / "ck"))
    learner = procs["learner"].wait_ready()
    procs["actor"] = Service("actor", tmp, config, "--buffer", buffer, "--learner", learner)
    procs["actor"].wait_ready()
    wait_for(lambda: stats(learner, learner_pb2_grpc.LearnerStub).get("learner/updates_per_s", 0) > 0,
             what="rates to be measured")
    yield procs
    for p in procs.values():
        assert p.terminate() == 0


@pytest.mark.parametrize("role", ["buffer", "learner", "actor"])
def test_metrics_endpoint_parses_and_types_follow_the_names(running, role):
    families = scrape(running[role].metrics)
    ours = {k: v for k, v in families.items() if k.startswith(f"kuberl_{role}_")}
    assert len(ours) >= 8
    for name, (kind, _) in ours.items():
        if name.endswith("_per_s") or name.endswith("_mean"):
            assert kind == "gauge", name
    counters = [n for n, (kind, _) in ours.items() if kind == "counter"]
    assert counters and all(f"{n}_total" in ours[n][1] for n in counters)


def test_staleness_is_a_histogram(running):
    kind, samples = scrape(running["learner"].metrics)["kuberl_learner_policy_lag"]
    assert kind == "histogram"
    buckets = [v for k, v in samples.items() if k.startswith("kuberl_learner_policy_lag_bucket")]
    assert buckets == sorted(buckets) and samples["kuberl_learner_policy_lag_count"] == max(buckets) > 0
    assert samples["kuberl_learner_policy_lag_bucket{le=+Inf}"] == max(buckets)


@pytest.mark.parametrize("role", ["buffer", "learner", "actor"])
def test_metrics_agree_with_get_stats(running, role):
    """Counters: GetStats before <= /metrics <= GetStats after. Rates (EWMA, updated once a second):
    whenever both GetStats calls saw the same value, /metrics shows exactly that value."""
    proc, stub = running[role], STUBS[role]
    compared_rates = 0
    for _ in range(20):
        before = stats(proc.address, stub)
        families = scrape(proc.metrics)
        after = stats(proc.address, stub)
        for name, value in before.items():
            prom = prometheus_name(name)
            if name.endswith("_total"):
                got = families[prom[: -len("_total")]][1][prom]
                assert value <= got <= after[name], name
            elif name.endswith("_per_s") and after.get(name) == value:
                assert families[prom][1][prom] == pytest.approx(value), name
                compared_rates += 1
        if compared_rates >= 3:
            break
    assert compared_rates >= 3, "never caught the rates between two ticks"


@pytest.mark.parametrize("role", ["buffer", "learner", "actor"])
def test_probes_on_the_metrics_port(running, role):
    """What the manifests' httpGet probes ask of every role (k8s/base): live and ready while it serves."""
    assert http_get(running[role].metrics, "/livez") == (200, "ok\n")
    assert http_get(running[role].metrics, "/readyz") == (200, "ok\n")
    code, body = http_get(running[role].metrics, "/healthz")
    assert code == 404 and "/metrics, /livez, /readyz" in body
