"""The planner, in its pod with its own ServiceAccount, scales the actor Deployment on a real node.

The start is imbalanced on purpose: one actor capped at 150 env steps/s (actor.max_env_steps_per_s)
feeds a learner that could take far more, so the planner's balance model asks for more actors. The
test waits for the planner to raise the Deployment's replicas, then for the new pods to be Ready and
to produce (each one's own /metrics, read through the API server's pod proxy).
"""

from __future__ import annotations

import time

import yaml

from tests.e2e.kube import kubectl, provide_volumes, release_volumes, render_overlay, wait_ready

NAMESPACE = "kuberl"
MAX_ACTORS = 3


def imbalanced(manifest: str) -> str:
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    for d in docs:
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kuberl-config"):
            config = yaml.safe_load(d["data"]["config.yaml"])
            config.setdefault("actor", {})["max_env_steps_per_s"] = 150
            config["planner"].update(interval_s=5, actor={"min": 1, "max": MAX_ACTORS})
            d["data"]["config.yaml"] = yaml.safe_dump(config)
    return yaml.safe_dump_all(docs, sort_keys=False)


def pod_steps(node, pod: str) -> float:
    from kubernetes import client
    with node.cluster.admin() as api:
        text = client.CoreV1Api(api).connect_get_namespaced_pod_proxy_with_path(
            f"{pod}:9400", NAMESPACE, "metrics", _preload_content=False).data.decode()
    for line in text.splitlines():
        if line.startswith("kuberl_actor_env_steps_total "):
            return float(line.split()[1])
    return 0.0


def test_planner_scales_actor_pods_and_new_pods_produce(e2e_node, e2e_images, e2e_report):
    from kubernetes import client
    provide_volumes(e2e_node)
    try:
        kubectl(e2e_node, "apply", "-f", "-", input=imbalanced(render_overlay(e2e_node, "k8s/overlays/dev")))
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
                ready = [p.metadata.name for p in pods if any(
                    c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
                for name in ready:
                    if name not in producing:
                        try:
                            if pod_steps(e2e_node, name) > 0:
                                producing[name] = time.monotonic() - decided
                        except client.ApiException:
                            pass
                if len(producing) >= replicas:
                    break
                time.sleep(1)
            assert len(producing) >= replicas, (f"{replicas} actors wanted; producing: {sorted(producing)}")
        e2e_report["planner_scale_up"] = {
            "replicas": replicas, "decision_to_all_producing_s": round(max(producing.values()), 1)}
    finally:
        e2e_node.delete_namespace(NAMESPACE)
        release_volumes(e2e_node)
