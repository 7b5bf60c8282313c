"""The rendered manifests against a real kube-apiserver (tests/k8s/cluster.py: v1.20 on loopback).

1.20 predates one thing the manifests use, so where the server does not serve it the objects are
adapted, and only there: PodDisruptionBudgets are policy/v1 (served from 1.21) and are left out.
Everything else, the probes (httpGet) included, goes to the server as rendered. Offline strict validation against current schemas (test_render.py) covers what is left out.

- The rendered base applies with server-side apply in dry-run mode, and the server rejects a broken
  object the same way (so the dry run does validate).
- The planner, authenticated with a token of the rendered ServiceAccount and authorised by nothing but
  the rendered Role and RoleBinding, observes and scales the rendered actor Deployment and learner
  StatefulSet through the real KubernetesBackend and the real process, and is denied everything else
  (checked verb by verb with SubjectAccessReviews over every resource the server serves, for no object
  and for the learner and buffer StatefulSets by name, and by real calls).
- A learner, with a token of its rendered ServiceAccount, reads its StatefulSet's scale (the group's
  size, services/learner/membership.py) and nothing else, checked the same way.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from services.config import load_config
from services.planner.rbac import RESOURCE_NAMES, RULES
from tests.deploy.render import container, kustomize, of_kind, workloads
from tests.k8s.cluster import expand

VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


def served(cluster) -> set[str]:
    out = cluster.kubectl("api-versions")
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def for_this_server(cluster, objects: list[dict]) -> tuple[list[dict], list[str]]:
    """The objects as this API server can take them, and what was changed (see the module docstring)."""
    versions = served(cluster)
    kept, changes = [], []
    for obj in copy.deepcopy(objects):
        if obj["apiVersion"] not in versions:
            changes.append(f"left out {obj['kind']}/{obj['metadata']['name']}: {obj['apiVersion']} is not served")
            continue
        kept.append(obj)
    return kept, changes


def apply(cluster, namespace: str, objects: list[dict], *extra: str) -> subprocess.CompletedProcess:
    return cluster.kubectl("apply", "--server-side", "--field-manager=kuberl-test", "-n", namespace, *extra, "-f", "-",
                           input=yaml.safe_dump_all(objects))


def test_rendered_base_applies_with_server_side_dry_run(k8s_cluster, k8s_namespace, k8s_admin):
    from kubernetes import client
    rendered = kustomize("base")
    objects, changes = for_this_server(k8s_cluster, rendered)
    # Only what 1.20 cannot take is adapted: the four policy/v1 PDBs.
    assert len(objects) == len(rendered) - (len(of_kind(rendered, "PodDisruptionBudget"))
                                            if "policy/v1" not in served(k8s_cluster) else 0), changes
    out = apply(k8s_cluster, k8s_namespace, objects, "--dry-run=server")
    assert out.returncode == 0, out.stderr
    applied = [line for line in out.stdout.splitlines() if line.endswith("serverside-applied (server dry run)")]
    assert len(applied) == len(objects), out.stdout
    apps = client.AppsV1Api(k8s_admin)
    assert apps.list_namespaced_deployment(k8s_namespace).items == []     # nothing stored
    assert apps.list_namespaced_stateful_set(k8s_namespace).items == []
    assert any(line.startswith("statefulset.apps/kuberl-learner ") for line in applied)
    # The server does validate in a dry run: a Deployment whose selector misses its pods is refused.
    broken = copy.deepcopy([o for o in objects if o["kind"] == "Deployment"][0])
    broken["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "nobody"
    out = apply(k8s_cluster, k8s_namespace, [broken], "--dry-run=server")
    assert out.returncode != 0 and "selector" in out.stderr, out.stderr


def service_account_token(admin, namespace: str, workload: dict) -> str:
    """A token of the ServiceAccount `workload`'s pods run as (what the kubelet would mount)."""
    from kubernetes import client
    return client.CoreV1Api(admin).create_namespaced_service_account_token(
        workload["spec"]["template"]["spec"]["serviceAccountName"], namespace,
        client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)),
    ).status.token


def served_resources(cluster) -> set[tuple[str, str]]:
    """(apiGroup, resource) of everything the server serves, subresources included ("deployments/scale")."""
    resources = set()
    out = cluster.kubectl("get", "--raw", "/apis")
    groups = [(g["name"], g["preferredVersion"]["version"]) for g in json.loads(out.stdout)["groups"]]
    for group, version in [("", "v1"), *groups]:
        path = "/api/v1" if group == "" else f"/apis/{group}/{version}"
        for r in json.loads(cluster.kubectl("get", "--raw", path).stdout)["resources"]:
            resources.add((group, r["name"]))
    return resources


def granted(admin, cluster, user: str, namespace: str, name: str = "") -> set[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) SubjectAccessReviews say `user` may do in `namespace`, on an object
    called `name` ("": on no particular object, as for list or create)."""
    from kubernetes import client
    authz = client.AuthorizationV1Api(admin)
    allowed = set()
    for group, resource_name in served_resources(cluster):
        resource, _, sub = resource_name.partition("/")
        for verb in VERBS:
            review = authz.create_subject_access_review({"spec": {"user": user, "resourceAttributes": {
                "namespace": namespace, "group": group, "resource": resource, "subresource": sub, "verb": verb,
                "name": name}}})
            if review.status.allowed:
                allowed.add((group, resource_name, verb))
    return allowed


@pytest.fixture
def deployed(k8s_cluster, k8s_namespace, k8s_admin, tmp_path):
    """The rendered base applied for real in a fresh namespace; yields (rendered objects, config, token of
    the planner's ServiceAccount, a kubeconfig file for that token)."""
    rendered = kustomize("base")
    objects, _ = for_this_server(k8s_cluster, rendered)
    out = apply(k8s_cluster, k8s_namespace, objects)
    assert out.returncode == 0, out.stderr
    (cm,) = of_kind(rendered, "ConfigMap")
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    cfg = load_config(str(tmp_path / "config.yaml"))
    token = service_account_token(k8s_admin, k8s_namespace, workloads(rendered)["planner"])
    kubeconfig = tmp_path / "planner.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "planner",
        "clusters": [{"name": "test", "cluster": {"server": k8s_cluster.server,
                                                  "certificate-authority": str(k8s_cluster.ca_file)}}],
        "users": [{"name": "planner", "user": {"token": token}}],
        "contexts": [{"name": "planner", "context": {"cluster": "test", "user": "planner",
                                                     "namespace": k8s_namespace}}]}))
    yield rendered, cfg, token, kubeconfig


async def test_planner_scales_the_rendered_workloads_with_the_rendered_role(k8s_cluster, k8s_namespace, k8s_admin,
                                                                            deployed):
    from kubernetes import client

    from services.planner.kube import KubernetesBackend
    rendered, cfg, token, _ = deployed
    k = cfg.planner.kubernetes
    with k8s_cluster.client(token) as api:
        backend = KubernetesBackend(k, namespace=k8s_namespace, api_client=api)
        await backend.start()
        try:
            assert backend.leader                              # it could take the Lease
            states = await backend.observe()
            assert {role: s.desired for role, s in states.items()} == {"actor": 1, "learner": 1}
            assert all(not s.blocked for s in states.values())
            result = await backend.apply({"actor": 3, "learner": 2})
            assert result.applied == {"actor": 3, "learner": 2}
            assert {role: s.desired for role, s in (await backend.observe()).items()} == {"actor": 3, "learner": 2}
        finally:
            await backend.close()
        # Its own record of what it called is exactly what the Role grants: nothing granted goes unused.
        assert backend.calls == expand(RULES), (backend.calls ^ expand(RULES))
    apps = client.AppsV1Api(k8s_admin)
    assert apps.read_namespaced_deployment(k.actor_deployment, k8s_namespace).spec.replicas == 3
    assert apps.read_namespaced_stateful_set(k.learner_statefulset, k8s_namespace).spec.replicas == 2
    assert apps.read_namespaced_stateful_set("kuberl-buffer", k8s_namespace).spec.replicas == 1


def test_planner_identity_can_do_nothing_else(k8s_cluster, k8s_namespace, k8s_admin, deployed):
    from kubernetes import client
    rendered, cfg, token, _ = deployed
    user = f"system:serviceaccount:{k8s_namespace}:kuberl-planner"
    other = k8s_cluster.create_namespace("other")
    ws = workloads(rendered)
    learner, buffer = ws["learner"]["metadata"]["name"], ws["buffer"]["metadata"]["name"]

    # Every resource the server serves, every verb: allowed exactly where RULES say, in its namespace only;
    # the rules rbac.RESOURCE_NAMES narrows, only on the learner StatefulSet (never on the buffer's).
    assert {("apps", "deployments/scale"), ("apps", "statefulsets/scale"), ("", "secrets")} <= served_resources(k8s_cluster)
    narrowed = {(g, r, v) for g, r, v in expand(RULES) if r in RESOURCE_NAMES}
    assert narrowed and {r for _, r, _ in narrowed} == set(RESOURCE_NAMES)
    assert granted(k8s_admin, k8s_cluster, user, k8s_namespace) == expand(RULES) - narrowed
    assert granted(k8s_admin, k8s_cluster, user, k8s_namespace, learner) == expand(RULES)
    assert granted(k8s_admin, k8s_cluster, user, k8s_namespace, buffer) == expand(RULES) - narrowed
    assert granted(k8s_admin, k8s_cluster, user, other) == set()
    assert granted(k8s_admin, k8s_cluster, user, other, learner) == set()

    # And by real calls with its token: the scale subresources yes; the workloads themselves, the buffer's
    # StatefulSet, Pods, Secrets and the other namespace no.
    from kubernetes.client import ApiException
    with k8s_cluster.client(token) as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        actor = ws["actor"]["metadata"]["name"]
        apps.patch_namespaced_deployment_scale(actor, k8s_namespace, {"spec": {"replicas": 2}})
        apps.patch_namespaced_stateful_set_scale(learner, k8s_namespace, {"spec": {"replicas": 2}})
        denied = {
            "patch the Deployment": lambda: apps.patch_namespaced_deployment(
                actor, k8s_namespace, {"spec": {"template": {"spec": {"containers": [
                    {"name": "actor", "image": "evil/actor:latest"}]}}}}),
            "patch the StatefulSet": lambda: apps.patch_namespaced_stateful_set(
                learner, k8s_namespace, {"spec": {"template": {"spec": {"containers": [
                    {"name": "learner", "image": "evil/learner:latest"}]}}}}),
            "delete the Deployment": lambda: apps.delete_namespaced_deployment(actor, k8s_namespace),
            "scale the buffer": lambda: apps.patch_namespaced_stateful_set_scale(
                buffer, k8s_namespace, {"spec": {"replicas": 2}}),
            "read the buffer": lambda: apps.read_namespaced_stateful_set(buffer, k8s_namespace),
            "list pods": lambda: core.list_namespaced_pod(k8s_namespace),
            "read secrets": lambda: core.list_namespaced_secret(k8s_namespace),
            "scale elsewhere": lambda: apps.patch_namespaced_deployment_scale(actor, other, {"spec": {"replicas": 2}}),
            "grant itself more": lambda: client.RbacAuthorizationV1Api(api).patch_namespaced_role(
                "kuberl-planner", k8s_namespace, {"rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]}),
        }
        for what, call in denied.items():
            with pytest.raises(ApiException) as err:
                call()
            assert err.value.status == 403, what
    apps = client.AppsV1Api(k8s_admin)
    assert apps.read_namespaced_stateful_set(learner, k8s_namespace).spec.replicas == 2
    assert apps.read_namespaced_stateful_set(buffer, k8s_namespace).spec.replicas == 1
    with k8s_cluster.admin() as api:
        client.CoreV1Api(api).delete_namespace(other)


def test_learner_identity_reads_its_statefulsets_scale_and_nothing_else(k8s_cluster, k8s_namespace, k8s_admin,
                                                                        deployed):
    """--membership=statefulset: each learner reads spec.replicas of its StatefulSet's scale with the token of
    its ServiceAccount (services/learner/membership.py RBAC_RULES), authorised by the rendered Role alone."""
    from kubernetes import client
    from kubernetes.client import ApiException

    from services.learner.membership import RBAC_RULES
    rendered = deployed[0]
    ws = workloads(rendered)
    learner, buffer = ws["learner"]["metadata"]["name"], ws["buffer"]["metadata"]["name"]
    sa = ws["learner"]["spec"]["template"]["spec"]["serviceAccountName"]
    user = f"system:serviceaccount:{k8s_namespace}:{sa}"
    assert granted(k8s_admin, k8s_cluster, user, k8s_namespace, learner) == expand(RBAC_RULES)
    assert granted(k8s_admin, k8s_cluster, user, k8s_namespace) == set()
    assert granted(k8s_admin, k8s_cluster, user, k8s_namespace, buffer) == set()

    token = service_account_token(k8s_admin, k8s_namespace, ws["learner"])
    client.AppsV1Api(k8s_admin).patch_namespaced_stateful_set_scale(learner, k8s_namespace, {"spec": {"replicas": 3}})
    with k8s_cluster.client(token) as api:
        apps = client.AppsV1Api(api)
        assert apps.read_namespaced_stateful_set_scale(learner, k8s_namespace).spec.replicas == 3
        denied = {
            "scale its StatefulSet": lambda: apps.patch_namespaced_stateful_set_scale(
                learner, k8s_namespace, {"spec": {"replicas": 1}}),
            "read its StatefulSet": lambda: apps.read_namespaced_stateful_set(learner, k8s_namespace),
            "read the buffer's scale": lambda: apps.read_namespaced_stateful_set_scale(buffer, k8s_namespace),
            "list pods": lambda: client.CoreV1Api(api).list_namespaced_pod(k8s_namespace),
        }
        for what, call in denied.items():
            with pytest.raises(ApiException) as err:
                call()
            assert err.value.status == 403, what
    assert client.AppsV1Api(k8s_admin).read_namespaced_stateful_set_scale(learner, k8s_namespace).spec.replicas == 3


def test_planner_process_runs_with_the_rendered_args(k8s_cluster, k8s_namespace, k8s_admin, deployed, tmp_path):
    """`python -m services.planner` with the manifest's args (listen ports local, a kubeconfig for the
    ServiceAccount token in place of in-cluster auth) serves its health name, takes the Lease, and exits
    0 on SIGTERM within the pod's grace period."""
    from kubernetes import client
    rendered, cfg, _, kubeconfig = deployed
    planner = workloads(rendered)["planner"]
    c = container(planner)
    env = {e["name"]: k8s_namespace for e in c["env"]}      # POD_NAMESPACE
    args = [a.replace("$(POD_NAMESPACE)", env["POD_NAMESPACE"]) for a in c["args"]]
    args = [a for a in args if not a.startswith(("--config=", "--listen=", "--metrics-listen="))]
    ready = tmp_path / "planner.ready"
    args += [f"--config={tmp_path / 'config.yaml'}", "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
             f"--kubeconfig={kubeconfig}", f"--ready-file={ready}"]
    environ = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    with open(tmp_path / "planner.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.planner", *args], stdout=log, stderr=log, env=environ)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / "planner.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        endpoints = json.loads(ready.read_text())
        address = endpoints["address"]
        check = subprocess.run([sys.executable, "docker/healthcheck.py", "--service", "kuberl.v1.Planner", address],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and "SERVING" in check.stdout, check.stderr
        # What the kubelet asks: the rendered probes' paths on the metrics port.
        for probe in ("readinessProbe", "livenessProbe"):
            path = c[probe]["httpGet"]["path"]
            with urllib.request.urlopen(f"http://{endpoints['metrics']}{path}", timeout=30) as resp:
                assert resp.status == 200, (probe, path)
        lease = client.CoordinationV1Api(k8s_admin).read_namespaced_lease(cfg.planner.kubernetes.lease_name, k8s_namespace)
        assert lease.spec.holder_identity
        grace = planner["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(grace) == 0, (tmp_path / "planner.log").read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
