"""`kubectl apply` of the dev overlay on a real node: every pod Ready, and the learner trains; and of the
several-policies overlay: each policy's learner StatefulSet trains, and the planner scales the actors."""

from __future__ import annotations

import time

from tests.e2e.kube import (NODE_LEARNERS, VERSION_METRIC, assert_trains, fit_node, fresh_namespace, kubectl, metrics,
                             pods, render_overlay, wait_metric, wait_ready, wait_until, with_config)

NAMESPACE = "kuberl"   # k8s/overlays/dev and k8s/overlays/policies put everything there


def test_dev_overlay_pods_ready_and_learner_trains(e2e_node, e2e_images, e2e_report):
    manifest = with_config(render_overlay(e2e_node, "k8s/overlays/dev"), fit_node)
    for tag in e2e_images.values():   # the overlay runs the images this session built
        assert f"image: {tag}" in manifest, f"k8s/overlays/dev does not run {tag}"
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-", input=manifest)
        assert_trains(e2e_node, NAMESPACE, e2e_report, "dev_overlay", start)


# k8s/overlays/policies: simple_tag's predators and prey, a learner StatefulSet each. The node has room
# for NODE_LEARNERS learner pods, so each policy keeps one (planner.learner.max); the actor starts capped
# at 100 env steps/s, so the planner, in its pod, scales the actor Deployment up.
POLICIES = ("predator", "prey")


def small_requests(manifest: str) -> str:
    """The rendered manifest with each role's container asking for what test_helm's releases ask for
    (tests/e2e/helm.py SMALL; the base's requests are for real nodes) and 1 Gi learner claims."""
    import yaml

    from tests.e2e.helm import SMALL
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            c["resources"] = SMALL[c["name"]]["resources"]
        for claim in d["spec"].get("volumeClaimTemplates", []):
            claim["spec"]["resources"]["requests"]["storage"] = SMALL["learner"]["persistence"]["size"]
    return yaml.safe_dump_all(docs, sort_keys=False)


def small_run(config: dict) -> None:
    """k8s/overlays/policies' config sized for the 2-core node (a with_config change)."""
    config["env"]["num_envs"] = 2
    config["ppo"].update({"rollout_steps": 16, "batch_steps": 128, "num_epochs": 1, "hidden_sizes": [16]})
    config.setdefault("actor", {})["max_env_steps_per_s"] = 100
    config["planner"].update({"interval_s": 5, "actor": {"min": 1, "max": 2},
                              "learner": {"min": 1, "max": NODE_LEARNERS // len(POLICIES)}})


def test_policies_overlay_trains_each_policy_in_its_own_learner_statefulset(e2e_node, e2e_images, e2e_report):
    from kubernetes import client
    manifest = small_requests(with_config(render_overlay(e2e_node, "k8s/overlays/policies"), small_run))
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-", input=manifest)
        ready_s = wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        assert sorted(p.metadata.name for p in pods(e2e_node, NAMESPACE, "learner")) == [
            f"kuberl-learner-{p}-0" for p in POLICIES]   # the base's one-policy group is gone
        versions = {}
        for policy in POLICIES:   # each policy's learner trains on its own agents' samples
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
        assert f"scaled actor (Deployment {NAMESPACE}/kuberl-actor) to 2" in log, log[-3000:]
        planner = metrics(e2e_node, NAMESPACE, "kuberl-planner")
        for policy in POLICIES:   # it read each policy's StatefulSet (its Role names them) and learners' rate
            assert planner.get(f"kuberl_planner_policies_{policy}_learner_replicas") == 1, planner
            assert planner.get(f"kuberl_planner_policies_{policy}_learner_rate_per_replica", 0) > 0, planner
        e2e_report["policies_overlay"] = {"apply_to_ready_s": round(ready_s, 1), "apply_to_training_s": round(training_s, 1),
                                          "policy_versions": versions, "training_to_actors_scaled_s": round(scaled_s, 1)}
