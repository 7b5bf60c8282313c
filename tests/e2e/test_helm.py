"""`helm install` of the chart on a real node: every pod Ready, and the learner trains."""

from __future__ import annotations

import time

import pytest

from tests.e2e.helm import SMALL, release
from tests.e2e.kube import assert_trains, fresh_namespace, pod_metrics, pods
from tests.helpers import wait_for

NAMESPACE = "kuberl-helm"


@pytest.mark.parametrize("shards", [1, 2], ids=["one-buffer", "buffer-shards"])
def test_helm_install_pods_ready_and_learner_trains(e2e_node, e2e_images, e2e_report, tmp_path, shards):
    """With buffer.shards 2: both buffer pods Ready, every shard that an actor pushes to is streamed
    from by the learner (each by its pod's name through the headless Service), and the learner trains."""
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE), \
            release(e2e_node, tmp_path, NAMESPACE, {**SMALL, "buffer": {**SMALL["buffer"], "shards": shards}}):
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
