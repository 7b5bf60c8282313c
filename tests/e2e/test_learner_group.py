"""More than one learner on a real node: the planner scales the learner StatefulSet, and its pods form
one gradient-averaging group whose size follows the replica count (services/learner/membership.py).

The planner is asked through its own API (`SetReplicas`, what `kuberl scale learner N` sends), called
from the host on the planner pod's address. The test then reads each learner pod's /metrics through the
API server's pod proxy: both report a group of 2 and train, rank 0 re-formed its group in the same
container (no restart). Scaled back to 1, pod 1 goes and rank 0 trains alone again.
"""

from __future__ import annotations

import time

import grpc

from kuberl.v1 import planner_pb2, planner_pb2_grpc
from tests.e2e.kube import (VERSION_METRIC, fit_node, fresh_namespace, kubectl, pod_metrics_or_empty, pods,
                            render_overlay, wait_ready, wait_until, with_config)

NAMESPACE = "kuberl"
GROUP_SIZE = "kuberl_learner_group_size"
REFORMS = "kuberl_learner_group_reforms_total"


def _scale_learners(node, replicas: int) -> None:
    (planner,) = pods(node, NAMESPACE, "planner")
    with grpc.insecure_channel(f"{planner.status.pod_ip}:50054") as ch:
        decision = planner_pb2_grpc.PlannerStub(ch).SetReplicas(
            planner_pb2.SetReplicasRequest(role="learner", replicas=replicas, ttl_s=900), timeout=60)
    assert decision.applied and not decision.error, decision


def _learner_metrics(node, ordinal: int) -> dict[str, float]:
    return pod_metrics_or_empty(node, NAMESPACE, f"kuberl-learner-{ordinal}")


def _wait(what: str, predicate, node, timeout_s: float = 300) -> float:
    return wait_until(node, NAMESPACE, what, predicate, timeout_s)


def _restarts(node, ordinal: int) -> int:
    pod = next(p for p in pods(node, NAMESPACE, "learner") if p.metadata.name == f"kuberl-learner-{ordinal}")
    return sum(cs.restart_count for cs in pod.status.container_statuses or [])


def test_planner_scales_the_learner_statefulset_and_the_group_follows(e2e_node, e2e_images, e2e_report):
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-", input=with_config(render_overlay(e2e_node, "k8s/overlays/dev"), fit_node))
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        _wait("learner 0 training alone", lambda: _learner_metrics(e2e_node, 0).get(VERSION_METRIC, 0) >= 2, e2e_node)
        assert _learner_metrics(e2e_node, 0)[GROUP_SIZE] == 1

        asked = time.monotonic()
        _scale_learners(e2e_node, 2)

        def group_of_two() -> bool:
            m0, m1 = _learner_metrics(e2e_node, 0), _learner_metrics(e2e_node, 1)
            return m0.get(GROUP_SIZE) == 2 and m1.get(GROUP_SIZE) == 2
        formed_s = _wait("a group of 2 learners", group_of_two, e2e_node)
        version = _learner_metrics(e2e_node, 1)[VERSION_METRIC]
        _wait("the group of 2 training", lambda: _learner_metrics(e2e_node, 1).get(VERSION_METRIC, 0) >= version + 2,
              e2e_node)
        trained_s = time.monotonic() - asked
        m0, m1 = _learner_metrics(e2e_node, 0), _learner_metrics(e2e_node, 1)
        assert m0[REFORMS] >= 1 and m1["kuberl_learner_rank"] == 1 and m1["kuberl_learner_samples_total"] > 0
        assert _restarts(e2e_node, 0) == 0, "rank 0 formed the new group in its running container"
        wait_ready(e2e_node, NAMESPACE, timeout_s=120)   # both learner pods Ready

        asked = time.monotonic()
        _scale_learners(e2e_node, 1)
        alone_s = _wait("learner 0 alone", lambda: _learner_metrics(e2e_node, 0).get(GROUP_SIZE) == 1, e2e_node)
        version = _learner_metrics(e2e_node, 0)[VERSION_METRIC]
        _wait("learner 0 training alone again",
              lambda: _learner_metrics(e2e_node, 0).get(VERSION_METRIC, 0) >= version + 2, e2e_node)
        down_s = time.monotonic() - asked
        _wait("learner 1 gone", lambda: len(pods(e2e_node, NAMESPACE, "learner")) == 1, e2e_node)
        gone_s = time.monotonic() - asked
        assert _restarts(e2e_node, 0) == 0
        e2e_report["learner_group"] = {"ask_to_group_of_2_s": round(formed_s, 1),
                                       "ask_to_group_of_2_training_s": round(trained_s, 1),
                                       "ask_to_alone_s": round(alone_s, 1), "ask_to_alone_training_s": round(down_s, 1),
                                       "ask_to_learner_1_gone_s": round(gone_s, 1)}
