"""`kubectl apply` of the dev overlay on a real node: every pod Ready, and the learner trains; and of the
several-policies overlay: each policy's learner StatefulSet trains, and the planner scales the actors."""

from __future__ import annotations

import time

from tests.e2e.kube import (NODE_LEARNERS, assert_policies_train_and_actors_scale, assert_trains, fit_node,
                             fresh_namespace, kubectl, render_overlay, with_config)

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
    manifest = small_requests(with_config(render_overlay(e2e_node, "k8s/overlays/policies"), small_run))
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-", input=manifest)
        e2e_report["policies_overlay"] = assert_policies_train_and_actors_scale(e2e_node, NAMESPACE, POLICIES, start)
