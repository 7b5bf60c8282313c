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
from tests.e2e.kube import assert_policies_train_and_actors_scale, fresh_namespace

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
    start = time.monotonic()
    values = {**SMALL, "config": CONFIG}
    with fresh_namespace(e2e_node, NAMESPACE), release(e2e_node, tmp_path, NAMESPACE, values):
        e2e_report["helm_two_policies"] = assert_policies_train_and_actors_scale(e2e_node, NAMESPACE, POLICIES, start)
