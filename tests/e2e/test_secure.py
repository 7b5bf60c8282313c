"""k8s/overlays/secure on a real node: mutual TLS between the roles, tokens, and an external simulator.

The test makes a CA and one certificate per role as docs/security.md's openssl recipe does (the Service's
names, kuberl-role, 127.0.0.1), and the token Secret, then applies the overlay with the config's
protect_reads on. Every pod turning Ready shows the HTTP probes work where gRPC probes could not present
a certificate; the planner's balance ratio shows it reads every role's stats over mutual TLS with its
token; and a simulator outside the cluster, holding a certificate and an envsession token, trains
through a NodePort, while clients without a certificate, without a token or with the wrong token's
scope are refused with the right status. The buffer and the learner authorise their internal RPCs per
role (tls.role_names): training shows the actors' and the learner's certificates pass.
"""

from __future__ import annotations

import base64
import time

import grpc
import yaml

from kuberl.v1 import actor_pb2_grpc, common_pb2
from services.common.net.tokens import bearer_metadata
from services.common.net.tls import TlsConfig
from services.common.net.tls import open_channel
from tests.certs import Pki
from tests.e2e.kube import (VERSION_METRIC, Simulator, fit_node, fresh_namespace, kubectl, metrics, pod_metrics,
                            render_overlay, wait_metric, wait_ready, with_config)
from tests.e2e.node import NODE_IP
from tests.e2e.test_external import SIM_SERVICE

NAMESPACE = "kuberl"
ROLES = ("actor", "buffer", "learner", "planner")
TOKENS = "e2e-simulator-token envsession\ne2e-planner-token read\n"


def secure(config: dict) -> None:
    config["env"]["mode"] = "external"
    config["planner"]["actor"] = {"min": 1, "max": 1}   # one actor: the simulator connects to it
    config["auth"] = {"protect_reads": True, "max_sessions_per_token": 4}
    fit_node(config)


def secrets(pki: Pki) -> list[dict]:
    """The Secrets k8s/overlays/secure mounts, with the keys cert-manager (or the recipe) writes."""
    out = []
    for role in ROLES:
        issued = pki.issue(f"kuberl-{role}", sans=(f"kuberl-{role}", f"kuberl-{role}.{NAMESPACE}",
                                                   f"kuberl-{role}.{NAMESPACE}.svc", "kuberl-role", "127.0.0.1"))
        data = {"tls.crt": issued.cert.read_bytes(), "tls.key": issued.key.read_bytes(), "ca.crt": pki.ca.read_bytes()}
        out.append(secret(f"kuberl-{role}-tls", data))
    out.append(secret("kuberl-tokens", {"tokens": TOKENS.encode(), "planner": b"e2e-planner-token\n"}))
    return out


def secret(name: str, data: dict[str, bytes]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def stats_code(address: str, tls: TlsConfig | None, token: str | None) -> grpc.StatusCode:
    """The status of one Actor.GetStats (protected by protect_reads) from a client with these settings."""
    with open_channel(address, tls) as channel:
        try:
            actor_pb2_grpc.ActorStub(channel).GetStats(common_pb2.GetStatsRequest(), timeout=20,
                                                      metadata=bearer_metadata(token, tls is not None) or None)
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return err.code()


def test_secure_overlay_trains_with_mutual_tls_and_tokens(e2e_node, e2e_images, e2e_report, tmp_path):
    from kubernetes import client

    pki = Pki(tmp_path / "pki")
    docs = [d for d in yaml.safe_load_all(with_config(render_overlay(e2e_node, "k8s/overlays/secure"), secure)) if d]
    namespaces = [d for d in docs if d["kind"] == "Namespace"]
    manifest = yaml.safe_dump_all([*namespaces, *secrets(pki), *(d for d in docs if d["kind"] != "Namespace")],
                                  sort_keys=False)
    simulator = pki.issue("e2e-simulator", sans=("e2e-simulator",))
    tls = TlsConfig(enabled=True, cert_file=str(simulator.cert), key_file=str(simulator.key), ca_file=str(pki.ca),
                    server_name="kuberl-actor")
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-", input=manifest)
        kubectl(e2e_node, "apply", "-f", "-", input=SIM_SERVICE)
        ready_s = wait_ready(e2e_node, NAMESPACE, timeout_s=400)   # HTTP probes, under mutual TLS
        with e2e_node.cluster.admin() as api:
            node_port = client.CoreV1Api(api).read_namespaced_service("kuberl-actor-sim", NAMESPACE).spec.ports[0].node_port
        address = f"{NODE_IP}:{node_port}"
        # Refusals, each with its status, while the run goes on for good clients.
        no_cert = TlsConfig(enabled=True, ca_file=str(pki.ca), server_name="kuberl-actor")
        refusals = {
            "plaintext": stats_code(address, None, "e2e-planner-token"),
            "no client certificate": stats_code(address, no_cert, "e2e-planner-token"),
            "no token": stats_code(address, tls, None),
            "a token without the read scope": stats_code(address, tls, "e2e-simulator-token"),
            "the read token": stats_code(address, tls, "e2e-planner-token"),
        }
        assert refusals == {"plaintext": grpc.StatusCode.UNAVAILABLE,
                            "no client certificate": grpc.StatusCode.UNAVAILABLE,
                            "no token": grpc.StatusCode.UNAUTHENTICATED,
                            "a token without the read scope": grpc.StatusCode.PERMISSION_DENIED,
                            "the read token": grpc.StatusCode.OK}, refusals
        first = metrics(e2e_node, NAMESPACE, "kuberl-learner").get(VERSION_METRIC, 0.0)
        with Simulator(address, "e2e-secure-sim", ca_file=str(pki.ca), cert_file=str(simulator.cert),
                       key_file=str(simulator.key), server_name="kuberl-actor", token="e2e-simulator-token") as sim:
            version, _ = wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=first + 2)
            # The planner read the actors' and learners' stats (protect_reads: with its own token, over mTLS).
            ratio, _ = wait_metric(e2e_node, NAMESPACE, "kuberl-planner", "kuberl_planner_production_consumption_ratio",
                                   above=0.0, timeout_s=120)
            result = sim.finish()
        # Per-role authorisation is on (tls.role_names, from $KUBERL_TLS_ROLE_NAMES): it counts wrong-role
        # callers from its start, and the actors' and the learner's certificates were all admitted.
        buffer = pod_metrics(e2e_node, NAMESPACE, "kuberl-buffer-0")
        learner = pod_metrics(e2e_node, NAMESPACE, "kuberl-learner-0")
        assert buffer.get("kuberl_buffer_auth_wrong_role_total") == 0.0, buffer
        assert learner.get("kuberl_learner_auth_wrong_role_total") == 0.0, learner
        assert buffer["kuberl_buffer_fragments_received_total"] > 0 and buffer["kuberl_buffer_samples_served_total"] > 0
        e2e_report["secure_overlay"] = {
            "apply_to_ready_s": round(ready_s, 1), "apply_to_policy_version_s": round(time.monotonic() - start, 1),
            "policy_version": version, "planner_ratio": round(ratio, 3), "env_steps": result["env_steps"],
            "refusals": {k: v.name for k, v in refusals.items()}}
