"""`kubectl apply` of the dev overlay on a real node: every pod Ready, and the learner trains."""

from __future__ import annotations

import time

from tests.e2e.kube import assert_trains, fit_node, fresh_namespace, kubectl, render_overlay, with_config

NAMESPACE = "kuberl"   # k8s/overlays/dev puts everything there


def test_dev_overlay_pods_ready_and_learner_trains(e2e_node, e2e_images, e2e_report):
    manifest = with_config(render_overlay(e2e_node, "k8s/overlays/dev"), fit_node)
    for tag in e2e_images.values():   # the overlay runs the images this session built
        assert f"image: {tag}" in manifest, f"k8s/overlays/dev does not run {tag}"
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-", input=manifest)
        assert_trains(e2e_node, NAMESPACE, e2e_report, "dev_overlay", start)
