"""The planner, in its pod with its own ServiceAccount, scales the actor Deployment on a real node.

The start is imbalanced on purpose: one actor capped at 150 env steps/s (actor.max_env_steps_per_s)
feeds a learner that could take far more, so the planner's balance model asks for more actors. The
test waits for the planner to raise the Deployment's replicas, then for the new pods to be Ready and
to produce (each one's own /metrics, read through the API server's pod proxy).
"""

from __future__ import annotations

import time

from tests.e2e.kube import fresh_namespace, kubectl, pod_metrics, pod_ready, render_overlay, wait_ready, with_config

NAMESPACE = "kuberl"
MAX_ACTORS = 3
STEPS = "kuberl_actor_env_steps_total"


def imbalanced(config: dict) -> None:
    config.setdefault("actor", {})["max_env_steps_per_s"] = 150
    # One learner throughout: this test is about the actors (the learner StatefulSet is scaled the same way,
    # through its scale subresource: tests/integration/test_planner_kube_e2e.py).
    config["planner"].update(interval_s=5, actor={"min": 1, "max": MAX_ACTORS}, learner={"min": 1, "max": 1})


def test_planner_scales_actor_pods_and_new_pods_produce(e2e_node, e2e_images, e2e_report):
    from kubernetes import client
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-",
                input=with_config(render_overlay(e2e_node, "k8s/overlays/dev"), imbalanced))
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        with e2e_node.cluster.admin() as api:
            apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
            # The planner runs as its own ServiceAccount (k8s/base/planner-rbac.yaml), not as the harness.
            (planner,) = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=planner").items
            assert planner.spec.service_account_name == "kuberl-planner"

            deadline = time.monotonic() + 300
            replicas = 1
            while time.monotonic() < deadline:
                replicas = apps.read_namespaced_deployment("kuberl-actor", NAMESPACE).spec.replicas or 1
                if replicas > 1:
                    break
                time.sleep(1)
            assert replicas > 1, (f"the planner did not scale the actors up within 300 s:\n"
                                  f"{kubectl(e2e_node, '-n', NAMESPACE, 'logs', 'deploy/kuberl-planner', '--tail=30')}")
            decided = time.monotonic()
            assert replicas <= MAX_ACTORS

            deadline = time.monotonic() + 300
            producing: dict[str, float] = {}
            while time.monotonic() < deadline:
                pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=actor").items
                ready = [p.metadata.name for p in pods if pod_ready(p)]
                for name in ready:
                    if name not in producing:
                        try:
                            if pod_metrics(e2e_node, NAMESPACE, name).get(STEPS, 0) > 0:
                                producing[name] = time.monotonic() - decided
                        except client.ApiException:
                            pass
                if len(producing) >= replicas:
                    break
                time.sleep(1)
            assert len(producing) >= replicas, (f"{replicas} actors wanted; producing: {sorted(producing)}")
        e2e_report["planner_scale_up"] = {
            "replicas": replicas, "decision_to_all_producing_s": round(max(producing.values()), 1)}
