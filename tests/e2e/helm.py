"""A Helm release of the chart on the e2e node, as a user installs it (tests/e2e/helm-post-render adapts
what the chart renders for the 1.20 node)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.e2e.adapt import adapt_chart
from tests.e2e.kube import NODE_LEARNERS, ROOT
from tests.k8s.cluster import Unavailable, binaries

# The chart's default requests (actor 1 CPU, buffer 1, learner 2) are for real nodes; the e2e node has
# 2 cores, so a release asks for what the dev overlay asks for, and for no more learners than fit.
SMALL = {
    "actor": {"resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}},
    "buffer": {"resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}},
    "learner": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                "persistence": {"size": "1Gi"}},
    "planner": {"resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}},
    "config": {"planner": {"learner": {"min": 1, "max": NODE_LEARNERS}}},
}


@contextmanager
def release(node, tmp_path: Path, namespace: str, values: dict):
    """`helm install kuberl` of the chart into `namespace` with `values`; uninstalled on the way out
    (the caller's fresh_namespace deletes the namespace). Skips the test where no Helm binary is had."""
    try:
        helm = binaries("HELM")["HELM"]
    except Unavailable as e:
        pytest.skip(f"no Helm: {e}")
    chart = tmp_path / "chart"
    adapt_chart(ROOT / "k8s" / "helm" / "kuberl", chart)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    env = {**os.environ, "KUBECONFIG": str(node.cluster.write_kubeconfig(tmp_path / "kubeconfig")),
           "KUBERL_E2E_PYTHON": sys.executable, "HELM_CACHE_HOME": str(tmp_path / "helm-cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "helm-config"), "HELM_DATA_HOME": str(tmp_path / "helm-data")}
    try:
        proc = subprocess.run(
            [helm, "install", "kuberl", str(chart), "--namespace", namespace, "--create-namespace",
             "--values", str(path), "--post-renderer", str(ROOT / "tests" / "e2e" / "helm-post-render")],
            env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"helm install failed:\n{proc.stderr}\n{proc.stdout}"
        yield
    finally:
        subprocess.run([helm, "uninstall", "kuberl", "--namespace", namespace], env=env, capture_output=True,
                       timeout=120)
