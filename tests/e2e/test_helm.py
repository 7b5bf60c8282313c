"""`helm install` of the chart on a real node: every pod Ready, and the learner trains."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from tests.e2e.adapt import adapt_chart
from tests.e2e.kube import NODE_LEARNERS, ROOT, assert_trains, fresh_namespace
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


def test_helm_install_pods_ready_and_learner_trains(e2e_node, e2e_images, e2e_report, tmp_path):
    try:
        helm = binaries("HELM")["HELM"]
    except Unavailable as e:
        pytest.skip(f"no Helm: {e}")
    chart = tmp_path / "chart"
    adapt_chart(ROOT / "k8s" / "helm" / "kuberl", chart)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(SMALL))
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
            assert_trains(e2e_node, NAMESPACE, e2e_report, "helm_chart", start)
        finally:
            subprocess.run([helm, "uninstall", "kuberl", "--namespace", NAMESPACE], env=env, capture_output=True,
                           timeout=120)
