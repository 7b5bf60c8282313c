"""An external simulator outside the cluster trains through an actor pod, reached over a NodePort Service.

The actors run with env.mode: external (they step no envs); the simulator is this test process
stepping CartPole-v1 with kuberl_client.gym.serve_gym_env, as a game server or robot would, against
the node's address and the Service's nodePort. Training must progress: the learner's policy version
rises while the simulator's episodes come back with the actor's actions.
"""

from __future__ import annotations

import time

from tests.e2e.kube import (VERSION_METRIC, Simulator, fit_node, fresh_namespace, kubectl, metrics, render_overlay,
                            wait_metric, wait_ready, with_config)
from tests.e2e.node import NODE_IP

NAMESPACE = "kuberl"
SIM_SERVICE = """
apiVersion: v1
kind: Service
metadata: {name: kuberl-actor-sim, namespace: kuberl}
spec:
  type: NodePort
  selector: {app.kubernetes.io/name: kuberl, app.kubernetes.io/component: actor}
  ports: [{name: grpc, port: 50053, targetPort: grpc, protocol: TCP}]
"""


def external(config: dict) -> None:
    config["env"]["mode"] = "external"
    config["planner"]["actor"] = {"min": 1, "max": 1}   # one actor: the simulator connects to it
    fit_node(config)


def test_simulator_outside_the_cluster_trains_through_a_nodeport(e2e_node, e2e_images, e2e_report):
    from kubernetes import client

    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-", input=with_config(render_overlay(e2e_node, "k8s/overlays/dev"), external))
        kubectl(e2e_node, "apply", "-f", "-", input=SIM_SERVICE)
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        with e2e_node.cluster.admin() as api:
            node_port = client.CoreV1Api(api).read_namespaced_service("kuberl-actor-sim", NAMESPACE).spec.ports[0].node_port
        address = f"{NODE_IP}:{node_port}"
        first = metrics(e2e_node, NAMESPACE, "kuberl-learner").get(VERSION_METRIC, 0.0)

        with Simulator(address, "e2e-sim-0") as sim:
            version, _ = wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=first + 2)
            seconds = round(time.monotonic() - sim.started, 1)
            result = sim.finish()
        e2e_report["external_simulator"] = {
            "address": "NODE_IP:nodePort", "seconds_to_policy_version": seconds,
            "policy_version": version, "env_steps": result["env_steps"], "episodes": result["episodes"]}
