"""`helm install` of the chart on a real node: every pod Ready, and the learner trains."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from tests.e2e.adapt import adapt_chart
from tests.e2e.kube import NODE_LEARNERS, ROOT, assert_trains, fresh_namespace, pod_metrics, pods
from tests.helpers import wait_for
from tests.k8s.cluster import Unavailable, binaries

NAMESPACE = "kuberl-helm"
# The chart's default requests (actor 1 CPU, buffer 1, learner 2) are for real nodes; the e2e node has
# 2 cores, so the release asks for what the dev overlay asks for, and for no more learners than fit.
SMALL = {
    "actor": {"resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}},
    "buffer": {"resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}},
    "learner": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                "persistence": {"size": "1Gi"}},
    "planner": {"resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}},
    "config": {"planner": {"learner": {"min": 1, "max": NODE_LEARNERS}}},
}


@pytest.mark.parametrize("shards", [1, 2], ids=["one-buffer", "buffer-shards"])
def test_helm_install_pods_ready_and_learner_trains(e2e_node, e2e_images, e2e_report, tmp_path, shards):
    """With buffer.shards 2: both buffer pods Ready, every shard that an actor pushes to is streamed
    from by the learner (each by its pod's name through the headless Service), and the learner trains."""
    try:
        helm = binaries("HELM")["HELM"]
    except Unavailable as e:
        pytest.skip(f"no Helm: {e}")
    chart = tmp_path / "chart"
    adapt_chart(ROOT / "k8s" / "helm" / "kuberl", chart)
    values = tmp_path / "values.yaml"
    small = {**SMALL, "buffer": {**SMALL["buffer"], "shards": shards}}
    values.write_text(yaml.safe_dump(small))
    kubeconfig = e2e_node.cluster.write_kubeconfig(tmp_path / "kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KUBERL_E2E_PYTHON": sys.executable,
           "HELM_CACHE_HOME": str(tmp_path / "helm-cache"), "HELM_CONFIG_HOME": str(tmp_path / "helm-config"),
           "HELM_DATA_HOME": str(tmp_path / "helm-data")}
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE):
        try:
            proc = subprocess.run(
                [helm, "install", "kuberl", str(chart), "--namespace", NAMESPACE, "--create-namespace",
                 "--values", str(values), "--post-renderer", str(ROOT / "tests" / "e2e" / "helm-post-render")],
                env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"helm install failed:\n{proc.stderr}\n{proc.stdout}"
            assert_trains(e2e_node, NAMESPACE, e2e_report, "helm_chart" if shards == 1 else "helm_buffer_shards", start)
            if shards > 1:
                buffers = {p.metadata.name: p for p in pods(e2e_node, NAMESPACE, "buffer")}
                assert sorted(buffers) == [f"kuberl-buffer-{i}" for i in range(shards)]
                shard_stats = {name: pod_metrics(e2e_node, NAMESPACE, name) for name in buffers}
                received = {n: m.get("kuberl_buffer_fragments_received_total", 0.0) for n, m in shard_stats.items()}
                served = {n: m.get("kuberl_buffer_batches_served_total", 0.0) for n, m in shard_stats.items()}
                assert sum(received.values()) > 0, received
                fed = [n for n, r in received.items() if r > 0]
                # The learner streams from every shard that holds data (a shard with no actor stays empty).
                wait_for(lambda: all(pod_metrics(e2e_node, NAMESPACE, n).get("kuberl_buffer_batches_served_total", 0)
                                     > 0 for n in fed), timeout=120, what=f"batches served by {fed} ({served})")
                e2e_report["helm_buffer_shards"]["fragments_received"] = received
        finally:
            subprocess.run([helm, "uninstall", "kuberl", "--namespace", NAMESPACE], env=env, capture_output=True,
                           timeout=120)
