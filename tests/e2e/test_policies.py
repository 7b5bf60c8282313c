"""A run of two policies on a real node: `helm install` with config.policies (docs/deploy.md section 9).

The chart renders a learner StatefulSet per policy; the one actor Deployment plays both policies' agents
of kuberl_envs.relay (shipped in the actor and learner images), sends each policy's fragments to its
table in the buffer and takes each policy's weights from its own learners. The actor starts capped at
100 env steps/s, so the planner, in its pod, scales the actor Deployment up, weighing each policy's
learners by its share of the samples, and leaves both learner StatefulSets at their one pod.
"""

from __future__ import annotations

import time

from tests.e2e.helm import SMALL, release
from tests.e2e.kube import VERSION_METRIC, fresh_namespace, kubectl, pods, wait_metric, wait_ready, wait_until

NAMESPACE = "kuberl-policies"
POLICIES = ("first", "rest")
CONFIG = {
    "algorithm": "ppo",
    "env": {"id": "pettingzoo:kuberl_envs.relay", "num_envs": 2},
    "policies": {"first": {"agents": ["a"]}, "rest": {"agents": ["*"]}},   # relay's agents: a, b, c
    "ppo": {"rollout_steps": 8, "batch_steps": 64, "num_epochs": 1, "hidden_sizes": [16]},
    "actor": {"max_env_steps_per_s": 100},
    "topology": {"actors": 1, "learners": 1},
    "planner": {"interval_s": 5, "actor": {"min": 1, "max": 2}},
}


def test_helm_install_of_two_policies_trains_each_in_its_own_learner_statefulset(e2e_node, e2e_images, e2e_report,
                                                                                  tmp_path):
    from kubernetes import client
    start = time.monotonic()
    values = {**SMALL, "config": CONFIG}
    with fresh_namespace(e2e_node, NAMESPACE), release(e2e_node, tmp_path, NAMESPACE, values):
        ready_s = wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        assert sorted(p.metadata.name for p in pods(e2e_node, NAMESPACE, "learner")) == [
            f"kuberl-learner-{p}-0" for p in POLICIES]
        versions = {}
        for policy in POLICIES:   # each policy's learner trains: its own version rises
            versions[policy], _ = wait_metric(e2e_node, NAMESPACE, f"kuberl-learner-{policy}", VERSION_METRIC, above=2)
        training_s = time.monotonic() - start
        with e2e_node.cluster.admin() as api:
            apps = client.AppsV1Api(api)
            scaled_s = wait_until(
                e2e_node, NAMESPACE, "the planner scaled the actor Deployment to 2",
                lambda: (apps.read_namespaced_deployment("kuberl-actor", NAMESPACE).spec.replicas or 1) == 2,
                log_pod="deploy/kuberl-planner")
            assert [apps.read_namespaced_stateful_set(f"kuberl-learner-{p}", NAMESPACE).spec.replicas
                    for p in POLICIES] == [1, 1]
        log = kubectl(e2e_node, "-n", NAMESPACE, "logs", "deploy/kuberl-planner")
        # (Why it scaled, each policy's learners weighed by its share, is in the planner's decisions:
        # tests/integration/test_planner_kube_e2e.py reads them.)
        assert f"scaled actor (Deployment {NAMESPACE}/kuberl-actor) to 2" in log, log[-3000:]
        e2e_report["helm_two_policies"] = {"apply_to_ready_s": round(ready_s, 1), "apply_to_training_s": round(training_s, 1),
                                           "policy_versions": versions, "training_to_actors_scaled_s": round(scaled_s, 1)}
