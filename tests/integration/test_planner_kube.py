"""The planner's Kubernetes backend against a real kube-apiserver + etcd (tests/k8s/cluster.py): scaling the
actor Deployment through deployments/scale and the learner StatefulSet through statefulsets/scale, 409s,
403s under the minimal Role from services/planner/rbac.py, refusing to fight an HPA on either (with
kube-controller-manager acting), the pause annotation on either, dry run, Endpoints discovery, Lease
leader election, and the client-side rate limit and Retry-After handling."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from kubernetes import client

from services.common.config import KubernetesPlannerConfig
from services.planner import rbac
from services.planner.backend import Conflict, DryRunBackend, Refused
from services.planner.kube import DEPLOYMENT, STATEFULSET, WORKLOADS, Kind, KubernetesBackend
from services.planner.kubeapi import ApiError, TokenBucket
from tests.k8s.cluster import TOKENS, expand, grant

ACTOR, LEARNER = "kuberl-actor", "kuberl-learner"
NAMES = {"actor": ACTOR, "learner": LEARNER}   # KubernetesPlannerConfig's defaults
ROLE_OF = {name: role for role, name in NAMES.items()} | {"kuberl-buffer": "learner"}   # (a StatefulSet too)
MERGE = "application/merge-patch+json"
# The planner's Role as the manifests grant it: rbac.RULES, the StatefulSet rules on the learners' only.
RESOURCE_NAMES = {resource: [LEARNER] for resource in rbac.RESOURCE_NAMES}


def workload(kind: Kind, name: str, replicas: int = 1, annotations: dict | None = None) -> dict:
    labels = {"app": name}
    spec = {"replicas": replicas, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                {"name": "main", "image": "kuberl/test:0"}]}}}
    if kind == STATEFULSET:
        spec["serviceName"] = f"{name}-group"
    return {"apiVersion": "apps/v1", "kind": kind.name, "metadata": {"name": name, "annotations": annotations or {}},
            "spec": spec}


def apps_call(api, verb: str, name: str, scale: bool = False):
    """The AppsV1Api method that does `verb` to the workload `name` (the actor Deployment or the learner
    StatefulSet, as kube.WORKLOADS says) or to its scale."""
    return WORKLOADS[ROLE_OF[name]].call(client.AppsV1Api(api), verb, scale)


def make_roles(api, ns: str, actors: int = 1, learners: int = 1, annotations: dict[str, dict] | None = None) -> None:
    """The actor Deployment and the learner StatefulSet; `annotations`: role -> its workload's annotations."""
    for role, replicas in (("actor", actors), ("learner", learners)):
        apps_call(api, "create", NAMES[role])(ns, workload(WORKLOADS[role], NAMES[role], replicas,
                                                           (annotations or {}).get(role)))


def spec_replicas(api, ns: str, name: str = ACTOR) -> int:
    return apps_call(api, "read", name)(name, ns).spec.replicas


def resource_version(api, ns: str, name: str = ACTOR) -> str:
    return apps_call(api, "read", name)(name, ns).metadata.resource_version


def scale_by_hand(api, ns: str, name: str, replicas: int) -> None:
    """What `kubectl scale` does: a patch of the scale subresource."""
    apps_call(api, "patch", name, scale=True)(name, ns, {"spec": {"replicas": replicas}}, _content_type=MERGE)


@pytest.fixture
async def backends(k8s_cluster):
    """make(namespace, api=None, kubeconfig=None, **config) -> a started KubernetesBackend (admin identity and
    leader election off unless told otherwise). Closes them all, and checks every call they made is one
    services/planner/rbac.RULES grants."""
    made, clients = [], []

    async def make(ns, *, api=None, kubeconfig=None, identity=None, policies=(), **overrides) -> KubernetesBackend:
        cfg = KubernetesPlannerConfig(**{"leader_election": False, "qps": 100.0, "burst": 100, **overrides})
        if api is None and kubeconfig is None:
            api = k8s_cluster.admin()
            clients.append(api)
        b = KubernetesBackend(cfg, namespace=ns, api_client=api, kubeconfig=kubeconfig, identity=identity,
                              policies=policies)
        made.append(b)
        await b.start()
        return b

    yield make
    for b in made:
        await b.close()
    for api in clients:
        api.close()
    for b in made:
        assert b.calls <= expand(rbac.RULES), b.calls - expand(rbac.RULES)


async def test_scale_up_and_down_through_the_scale_subresource(k8s_admin, k8s_namespace, backends):
    make_roles(k8s_admin, k8s_namespace, actors=1)
    b = await backends(k8s_namespace)
    state = await b.observe()
    assert (state["actor"].desired, state["learner"].desired) == (1, 1)
    assert not state["actor"].blocked and not state["learner"].blocked

    result = await b.apply({"actor": 3})
    assert result.applied == {"actor": 3} and not result.dry_run
    assert spec_replicas(k8s_admin, k8s_namespace) == 3
    assert spec_replicas(k8s_admin, k8s_namespace, LEARNER) == 1   # only the roles asked for
    assert (await b.observe())["actor"].desired == 3

    assert (await b.apply({"actor": 1})).applied == {"actor": 1}
    assert spec_replicas(k8s_admin, k8s_namespace) == 1
    # a second write without a fresh observe uses the resourceVersion of its own last write
    assert (await b.apply({"actor": 2})).applied == {"actor": 2}
    assert spec_replicas(k8s_admin, k8s_namespace) == 2

    # the learners, a StatefulSet, the same way: up, down, both roles at once
    result = await b.apply({"learner": 3})
    assert result.applied == {"learner": 3} and result.detail == "patched statefulsets/scale"
    assert spec_replicas(k8s_admin, k8s_namespace, LEARNER) == 3
    assert spec_replicas(k8s_admin, k8s_namespace) == 2
    assert (await b.observe())["learner"].desired == 3
    assert (await b.apply({"learner": 2, "actor": 4})).applied == {"learner": 2, "actor": 4}
    assert (spec_replicas(k8s_admin, k8s_namespace), spec_replicas(k8s_admin, k8s_namespace, LEARNER)) == (4, 2)
    # the only writes it ever makes are the scale subresources
    assert {c for c in b.calls if c[2] not in ("get", "list", "watch")} == {
        ("apps", "deployments/scale", "patch"), ("apps", "statefulsets/scale", "patch")}


@pytest.mark.parametrize("role", ["actor", "learner"])
async def test_a_concurrent_change_is_a_conflict_and_a_fresh_read_then_succeeds(k8s_admin, k8s_namespace, backends, role):
    name = NAMES[role]
    make_roles(k8s_admin, k8s_namespace, actors=2, learners=2)
    b = await backends(k8s_namespace)
    assert (await b.observe())[role].desired == 2
    # someone else (a person with kubectl scale) changes it between observe and apply
    scale_by_hand(k8s_admin, k8s_namespace, name, 5)
    with pytest.raises(Conflict, match=f"{role}: {WORKLOADS[role].name} '{name}' changed since it was read"):
        await b.apply({role: 3})
    assert spec_replicas(k8s_admin, k8s_namespace, name) == 5   # their change stands
    assert (await b.observe())[role].desired == 5      # the core re-reads and decides again
    assert (await b.apply({role: 3})).applied == {role: 3}
    assert spec_replicas(k8s_admin, k8s_namespace, name) == 3


async def test_minimal_role_scales_its_workloads_and_is_forbidden_everything_else(k8s_cluster, k8s_admin, k8s_namespace,
                                                                                  backends, tmp_path):
    """The planner as a token-auth user bound to a Role built from rbac.RULES (its StatefulSet rules on the
    learners' only, as the manifests grant them), through a kubeconfig."""
    ns = k8s_namespace
    make_roles(k8s_admin, ns, actors=1)
    client.AppsV1Api(k8s_admin).create_namespaced_stateful_set(ns, {
        "metadata": {"name": "other"}, "spec": {"replicas": 1, "serviceName": "other", "selector": {"matchLabels": {"app": "o"}},
                                               "template": {"metadata": {"labels": {"app": "o"}},
                                                            "spec": {"containers": [{"name": "m", "image": "x"}]}}}})
    client.CoreV1Api(k8s_admin).create_namespaced_secret(ns, {"metadata": {"name": "s"}, "stringData": {"k": "v"}})
    grant(k8s_admin, ns, "kuberl-planner", rbac.RULES, user="kuberl-planner", resource_names=RESOURCE_NAMES)

    kubeconfig = k8s_cluster.write_kubeconfig(tmp_path / "planner.kubeconfig", user="kuberl-planner", namespace=ns)
    b = await backends(None, kubeconfig=str(kubeconfig), leader_election=True, lease_duration_s=5)
    assert b.namespace == ns            # from the kubeconfig's context
    assert b.leader                     # leases: get/create/update are granted
    await b.observe()
    assert (await b.apply({"actor": 2, "learner": 2})).applied == {"actor": 2, "learner": 2}
    assert (spec_replicas(k8s_admin, ns), spec_replicas(k8s_admin, ns, LEARNER)) == (2, 2)

    with k8s_cluster.client(TOKENS["kuberl-planner"]) as planner:
        apps, core = client.AppsV1Api(planner), client.CoreV1Api(planner)
        forbidden = {
            "patch the Deployment spec": lambda: apps.patch_namespaced_deployment(
                ACTOR, ns, {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "evil"}]}}}},
                _content_type=MERGE),
            "create a Pod": lambda: core.create_namespaced_pod(ns, {
                "metadata": {"name": "p"}, "spec": {"containers": [{"name": "m", "image": "x"}]}}),
            "read a Secret": lambda: core.read_namespaced_secret("s", ns),
            "list Secrets": lambda: core.list_namespaced_secret(ns),
            "scale another StatefulSet": lambda: apps.patch_namespaced_stateful_set_scale(
                "other", ns, {"spec": {"replicas": 3}}, _content_type=MERGE),
            "read another StatefulSet": lambda: apps.read_namespaced_stateful_set("other", ns),
            "patch the learner StatefulSet": lambda: apps.patch_namespaced_stateful_set(
                LEARNER, ns, {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "evil"}]}}}},
                _content_type=MERGE),
            "delete the Deployment": lambda: apps.delete_namespaced_deployment(ACTOR, ns),
        }
        for what, call in forbidden.items():
            with pytest.raises(client.ApiException) as e:
                call()
            assert e.value.status == 403, what
    assert (spec_replicas(k8s_admin, ns), spec_replicas(k8s_admin, ns, LEARNER)) == (2, 2)
    assert client.AppsV1Api(k8s_admin).read_namespaced_stateful_set("other", ns).spec.replicas == 1


async def test_several_policies_observe_every_policys_learners_and_scale_the_actors(k8s_cluster, k8s_admin, k8s_namespace,
                                                                                     backends, tmp_path):
    """A run of several policies (services/planner/kube.py): each policy's learners are a StatefulSet
    `<learner_statefulset>-<policy>` behind the Service `<learner_service>-<policy>` (the Helm chart's names).
    The learner role is all of them: replicas from each Service's Endpoints carrying their policy, desired
    the sum, blocked saying why (not scaled as a whole); a learner count is refused before
    any write, the actors are scaled, and one policy's StatefulSet is scaled as the role learner/<policy>;
    all under the Role the chart grants (rbac.resource_names with the policies)."""
    ns, policies = k8s_namespace, ("red", "blue")
    apps, core = client.AppsV1Api(k8s_admin), client.CoreV1Api(k8s_admin)
    apps.create_namespaced_deployment(ns, workload(DEPLOYMENT, ACTOR, 1))
    for i, (policy, n) in enumerate((("red", 2), ("blue", 1))):
        name = f"{LEARNER}-{policy}"
        apps.create_namespaced_stateful_set(ns, workload(STATEFULSET, name, n))
        core.create_namespaced_service(ns, {"metadata": {"name": name}, "spec": {
            "clusterIP": "None", "selector": {"app": name}, "ports": [{"name": "grpc", "port": 50052}]}})
        core.create_namespaced_endpoints(ns, {"metadata": {"name": name}, "subsets": [{
            "addresses": [{"ip": f"10.2.{i}.{r}", "targetRef": {"kind": "Pod", "name": f"{name}-{r}", "namespace": ns}}
                          for r in range(n)], "ports": [{"name": "grpc", "port": 50052}]}]})
    cfg = KubernetesPlannerConfig()
    names = {r: list(v) for r, v in rbac.resource_names(cfg, policies).items()}
    assert names["statefulsets/scale"] == [f"{LEARNER}-red", f"{LEARNER}-blue"]
    grant(k8s_admin, ns, "kuberl-planner", rbac.RULES, user="kuberl-planner", resource_names=names)
    kubeconfig = k8s_cluster.write_kubeconfig(tmp_path / "planner.kubeconfig", user="kuberl-planner", namespace=ns)
    b = await backends(None, kubeconfig=str(kubeconfig), policies=policies)

    state = await b.observe()
    learner = sorted((r.name, r.address, r.policy) for r in state["learner"].replicas)
    assert learner == [(f"{LEARNER}-blue-0", "10.2.1.0:50052", "blue"), (f"{LEARNER}-red-0", "10.2.0.0:50052", "red"),
                       (f"{LEARNER}-red-1", "10.2.0.1:50052", "red")]
    assert state["learner"].desired == 3 and state["learner"].ready == 3
    assert state["learner"].blocked.startswith("several policies (config `policies`)")
    assert f"{LEARNER}-blue, {LEARNER}-red" in state["learner"].blocked
    assert state["actor"].desired == 1 and not state["actor"].blocked
    assert {p: (state[f"learner/{p}"].desired, [r.name for r in state[f"learner/{p}"].replicas]) for p in policies} == {
        "red": (2, [f"{LEARNER}-red-0", f"{LEARNER}-red-1"]), "blue": (1, [f"{LEARNER}-blue-0"])}
    assert not state["learner/red"].blocked

    with pytest.raises(Refused, match="learner: several policies"):
        await b.apply({"actor": 3, "learner": 2})
    assert spec_replicas(k8s_admin, ns) == 1                        # nothing written, not even the actors
    assert (await b.apply({"actor": 3})).applied == {"actor": 3}
    assert spec_replicas(k8s_admin, ns) == 3
    assert [apps.read_namespaced_stateful_set(f"{LEARNER}-{p}", ns).spec.replicas for p in policies] == [2, 1]
    assert (await b.apply({"learner/red": 3})).applied == {"learner/red": 3}
    assert [apps.read_namespaced_stateful_set(f"{LEARNER}-{p}", ns).spec.replicas for p in policies] == [3, 1]
    with pytest.raises(ValueError, match="unknown role 'learner/green'"):
        await b.apply({"learner/green": 3})

    # One policy's own reason comes first: its StatefulSet paused by hand, another's missing.
    apps.patch_namespaced_stateful_set(f"{LEARNER}-red", ns, {"metadata": {"annotations": {cfg.pause_annotation: "true"}}},
                                       _content_type=MERGE)
    apps.delete_namespaced_stateful_set(f"{LEARNER}-blue", ns)
    state = await b.observe()
    assert state["learner"].blocked.startswith(f"red: StatefulSet '{LEARNER}-red' is annotated")
    assert f"; blue: StatefulSet '{LEARNER}-blue' not found in namespace '{ns}'" in state["learner"].blocked
    assert state["learner"].desired == 3
    with pytest.raises(Refused, match="learner/red: StatefulSet .* is annotated"):
        await b.apply({"learner/red": 1})
    assert {c for c in b.calls if c[2] not in ("get", "list", "watch")} == {("apps", "deployments/scale", "patch"),
                                                                             ("apps", "statefulsets/scale", "patch")}


@pytest.mark.parametrize("role", ["actor", "learner"])
async def test_a_missing_permission_is_a_clear_error_naming_verb_and_resource(k8s_cluster, k8s_admin, k8s_namespace,
                                                                              backends, role):
    """A Role without the scale write of one kind (a broken manifest): the planner still observes, and apply
    says what it lacked; the planner identity here is a ServiceAccount (impersonated)."""
    ns, name, scale = k8s_namespace, NAMES[role], f"{WORKLOADS[role].resource}/scale"
    make_roles(k8s_admin, ns)
    rules = [(g, r, tuple(v for v in verbs if not (r == scale and v == "patch"))) for g, r, verbs in rbac.RULES]
    grant(k8s_admin, ns, "planner-without-scale", rules, service_account="kuberl-planner", resource_names=RESOURCE_NAMES)
    with k8s_cluster.as_service_account(ns, "kuberl-planner") as api:
        b = await backends(ns, api=api)
        assert (await b.observe())[role].desired == 1
        with pytest.raises(ApiError) as e:
            await b.apply({role: 2})
        assert e.value.status == 403
        message = str(e.value)
        assert f"patch apps/{scale} '{name}' in namespace '{ns}'" in message
        assert "HTTP 403 Forbidden" in message and "system:serviceaccount" in message and "rbac.py" in message
    assert spec_replicas(k8s_admin, ns, name) == 1


async def test_a_call_not_in_the_rbac_rules_is_a_bug(k8s_admin, k8s_namespace, backends):
    make_roles(k8s_admin, k8s_namespace)
    b = await backends(k8s_namespace)
    apps = client.AppsV1Api(k8s_admin)
    with pytest.raises(RuntimeError, match="bug: the planner tried to delete apps/deployments"):
        await b._call("delete", "apps", "deployments", ACTOR, apps.delete_namespaced_deployment, ACTOR, k8s_namespace)
    assert spec_replicas(k8s_admin, k8s_namespace) == 1   # never sent
    assert ("apps", "deployments", "delete") not in b.calls


OTHER = {"actor": "learner", "learner": "actor"}


@pytest.mark.parametrize("role", ["actor", "learner"])
async def test_refuses_to_fight_an_hpa(k8s_controller_manager, k8s_admin, k8s_namespace, backends, role):
    """An HPA on the actor Deployment or on the learner StatefulSet: that role is blocked, the other is not."""
    ns, name, kind, other = k8s_namespace, NAMES[role], WORKLOADS[role], OTHER[role]
    make_roles(k8s_admin, ns, **{f"{role}s": 4})
    client.AutoscalingV1Api(k8s_admin).create_namespaced_horizontal_pod_autoscaler(ns, {
        "metadata": {"name": f"{role}-hpa"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": kind.name, "name": name},
                 "minReplicas": 4, "maxReplicas": 6, "targetCPUUtilizationPercentage": 50}})
    # what would happen without the refusal: a scale to 2 is undone by the HPA within a sync or two
    scale_by_hand(k8s_admin, ns, name, 2)
    deadline = time.monotonic() + 30
    while spec_replicas(k8s_admin, ns, name) != 4:
        assert time.monotonic() < deadline, "the HPA did not restore its minimum"
        await asyncio.sleep(0.3)

    b = await backends(ns)
    state = await b.observe()
    assert f"HorizontalPodAutoscaler '{role}-hpa'" in state[role].blocked
    assert state[other].blocked == ""
    with pytest.raises(Refused, match=f"'{role}-hpa' targets {kind.name} '{name}'"):
        await b.apply({role: 2})
    with pytest.raises(Refused, match=f"{role}-hpa"):
        await b.apply({role: 2}, dry_run=True)
    with pytest.raises(Refused, match=f"{role}-hpa"):   # nothing is written when any role is refused
        await b.apply({other: 2, role: 5})
    assert spec_replicas(k8s_admin, ns, name) == 4
    assert spec_replicas(k8s_admin, ns, NAMES[other]) == 1
    assert not {c for c in b.calls if c[2] == "patch"}
    # the role no HPA targets is still the planner's (retry: the controllers bump resourceVersions)
    for _ in range(5):
        await b.observe()
        try:
            assert (await b.apply({other: 2})).applied == {other: 2}
            break
        except Conflict:
            continue
    else:
        pytest.fail(f"{other} never applied")
    assert spec_replicas(k8s_admin, ns, NAMES[other]) == 2


@pytest.mark.parametrize("role", ["actor", "learner"])
async def test_pause_annotation(k8s_admin, k8s_namespace, backends, role):
    ns, name = k8s_namespace, NAMES[role]
    key = KubernetesPlannerConfig().pause_annotation
    make_roles(k8s_admin, ns, actors=2, learners=2, annotations={role: {key: "true"}})
    b = await backends(ns)
    state = await b.observe()
    assert key in state[role].blocked and state[role].desired == 2
    assert f"{WORKLOADS[role].name} '{name}' is annotated {key}='true'" in state[role].blocked
    assert state[OTHER[role]].blocked == ""
    with pytest.raises(Refused, match="paused"):
        await b.apply({role: 3})
    assert spec_replicas(k8s_admin, ns, name) == 2

    annotate = apps_call(k8s_admin, "patch", name)
    annotate(name, ns, {"metadata": {"annotations": {key: "false"}}}, _content_type=MERGE)
    assert (await b.observe())[role].blocked == ""
    # paused by hand between observe and apply: the write is conditional, so it cannot slip through
    annotate(name, ns, {"metadata": {"annotations": {key: "true"}}}, _content_type=MERGE)
    with pytest.raises(Conflict):
        await b.apply({role: 3})
    assert key in (await b.observe())[role].blocked
    assert spec_replicas(k8s_admin, ns, name) == 2

    annotate(name, ns, {"metadata": {"annotations": {key: None}}}, _content_type=MERGE)
    await b.observe()
    assert (await b.apply({role: 3})).applied == {role: 3}
    assert spec_replicas(k8s_admin, ns, name) == 3


async def test_dry_run_changes_nothing(k8s_admin, k8s_namespace, backends):
    ns = k8s_namespace
    make_roles(k8s_admin, ns, actors=1)
    b = await backends(ns)
    await b.observe()
    before = {name: resource_version(k8s_admin, ns, name) for name in (ACTOR, LEARNER)}
    result = await b.apply({"actor": 5, "learner": 3}, dry_run=True)
    assert result.dry_run and result.applied == {"actor": 5, "learner": 3}
    assert spec_replicas(k8s_admin, ns) == 1 and spec_replicas(k8s_admin, ns, LEARNER) == 1
    assert {name: resource_version(k8s_admin, ns, name) for name in (ACTOR, LEARNER)} == before
    with pytest.raises(ApiError) as e:   # the server validates it for real: a negative count is 422
        await b._call("patch", "apps", "deployments/scale", ACTOR, client.AppsV1Api(k8s_admin).patch_namespaced_deployment_scale,
                      ACTOR, ns, {"spec": {"replicas": -1}}, dry_run="All", _content_type=MERGE)
    assert e.value.status == 422
    # a dry run still applies the resourceVersion precondition
    scale_by_hand(k8s_admin, ns, ACTOR, 2)
    scale_by_hand(k8s_admin, ns, LEARNER, 2)
    with pytest.raises(Conflict):
        await b.apply({"actor": 5}, dry_run=True)
    with pytest.raises(Conflict):
        await b.apply({"learner": 3}, dry_run=True)
    assert spec_replicas(k8s_admin, ns) == 2 and spec_replicas(k8s_admin, ns, LEARNER) == 2


async def test_the_dry_run_backend_decides_through_the_cluster_and_never_writes(k8s_admin, k8s_namespace, backends):
    """`kuberl planner --backend dry-run` in a cluster: observes the real workloads; every apply,
    whatever the caller asks, is a server-side dry run."""
    ns = k8s_namespace
    make_roles(k8s_admin, ns, actors=2)
    b = DryRunBackend(await backends(ns))
    assert b.leader and (await b.observe())["actor"].desired == 2
    before = resource_version(k8s_admin, ns)
    result = await b.apply({"actor": 4}, dry_run=False)
    assert result.dry_run and result.applied == {"actor": 4}
    assert spec_replicas(k8s_admin, ns) == 2 and resource_version(k8s_admin, ns) == before


async def test_replicas_come_from_the_endpoints_of_the_headless_services(k8s_admin, k8s_namespace, backends):
    ns = k8s_namespace
    make_roles(k8s_admin, ns, actors=3, learners=2)
    core = client.CoreV1Api(k8s_admin)
    for svc in (ACTOR, LEARNER, "kuberl-buffer"):
        core.create_namespaced_service(ns, {"metadata": {"name": svc}, "spec": {
            "clusterIP": "None", "selector": {"app": svc},
            "ports": [{"name": "metrics", "port": 9000}, {"name": "grpc", "port": 50053}]}})
    # no kubelet and no endpoints controller here: write the Endpoints the controller would
    def pod(name):
        return {"kind": "Pod", "name": name, "namespace": ns}

    core.create_namespaced_endpoints(ns, {"metadata": {"name": ACTOR}, "subsets": [{
        "addresses": [{"ip": "10.1.0.1", "targetRef": pod("actor-a")}, {"ip": "10.1.0.2", "targetRef": pod("actor-b")}],
        "notReadyAddresses": [{"ip": "10.1.0.3", "targetRef": pod("actor-c")}],
        "ports": [{"name": "metrics", "port": 9000}, {"name": "grpc", "port": 50053}]}]})
    # The learner StatefulSet's pods, by ordinal; the second one still starting.
    core.create_namespaced_endpoints(ns, {"metadata": {"name": LEARNER}, "subsets": [{
        "addresses": [{"ip": "10.1.0.7", "targetRef": pod(f"{LEARNER}-0")}],
        "notReadyAddresses": [{"ip": "10.1.0.8", "targetRef": pod(f"{LEARNER}-1")}],
        "ports": [{"name": "grpc", "port": 50052}]}]})
    core.create_namespaced_endpoints(ns, {"metadata": {"name": "kuberl-buffer"}, "subsets": [{
        "addresses": [{"ip": "10.1.0.9"}], "ports": [{"name": "metrics", "port": 9000}]}]})

    b = await backends(ns)
    state = await b.observe()
    actor = sorted(state["actor"].replicas, key=lambda r: r.name)
    assert [(r.name, r.address, r.ready) for r in actor] == [
        ("actor-a", "10.1.0.1:50053", True), ("actor-b", "10.1.0.2:50053", True), ("actor-c", "10.1.0.3:50053", False)]
    assert state["actor"].desired == 3 and state["actor"].ready == 2
    learner = sorted(state["learner"].replicas, key=lambda r: r.name)
    assert [(r.name, r.address, r.ready) for r in learner] == [
        (f"{LEARNER}-0", "10.1.0.7:50052", True), (f"{LEARNER}-1", "10.1.0.8:50052", False)]
    assert state["learner"].desired == 2 and state["learner"].ready == 1
    # an Endpoints without the grpc port: the replica exists but has no address to read stats from
    assert [(r.name, r.address) for r in await b.buffers()] == [("10.1.0.9", "")]

    core.delete_namespaced_endpoints(LEARNER, ns)   # no Endpoints yet: no replicas, not an error
    assert (await b.observe())["learner"].replicas == []


async def test_a_missing_workload_blocks_the_role_with_a_reason(k8s_admin, k8s_namespace, backends):
    """The learners must be a StatefulSet: a learner Deployment of that name (an install from before the
    learners were a StatefulSet) is not theirs, and the reason names the kind wanted."""
    apps = client.AppsV1Api(k8s_admin)
    apps.create_namespaced_deployment(k8s_namespace, workload(DEPLOYMENT, ACTOR, 1))
    apps.create_namespaced_deployment(k8s_namespace, workload(DEPLOYMENT, LEARNER, 1))
    b = await backends(k8s_namespace)
    state = await b.observe()
    assert state["actor"].blocked == "" and state["actor"].desired == 1
    assert state["learner"].blocked == f"StatefulSet '{LEARNER}' not found in namespace '{k8s_namespace}'"
    assert state["learner"].desired == 0
    with pytest.raises(ApiError) as e:   # nothing to write to either
        await b.apply({"learner": 2})
    assert e.value.status == 404 and f"get apps/statefulsets '{LEARNER}'" in str(e.value)
    assert apps.read_namespaced_deployment(LEARNER, k8s_namespace).spec.replicas == 1


async def test_leader_election_one_leads_and_another_takes_over(k8s_admin, k8s_namespace, backends):
    ns = k8s_namespace
    make_roles(k8s_admin, ns)
    lease = {"leader_election": True, "lease_duration_s": 2.0}
    a = await backends(ns, identity="planner-a", **lease)
    b = await backends(ns, identity="planner-b", **lease)
    assert a.leader and not b.leader
    coordination = client.CoordinationV1Api(k8s_admin)
    assert coordination.read_namespaced_lease("kuberl-planner", ns).spec.holder_identity == "planner-a"
    for _ in range(10):            # a renews (for longer than the lease lasts); b never gets in
        assert a.leader and not b.leader
        await asyncio.sleep(0.3)
    with pytest.raises(Refused, match="not the leader"):
        await b.apply({"actor": 2})
    assert spec_replicas(k8s_admin, ns) == 1
    await b.observe()
    assert (await b.apply({"actor": 2}, dry_run=True)).applied == {"actor": 2}   # previews need no lease

    last_renewal = a.lease.renewed_at   # (monotonic, this process's clock: b's too)
    await a.close(release=False)   # a crashes: it stops renewing and does not hand the lease back
    stopped = time.monotonic()
    while not b.leader:
        assert not a.leader
        # (a liveness bound only, far above the lease: a loaded API server answers late)
        assert time.monotonic() - stopped < 60, "b did not take over an expired lease"
        await asyncio.sleep(0.05)
    # Safety, whatever the load: b took the lease only a whole lease duration after a's last renewal began
    # (b judges expiry by when it saw the record change, which is after that renewal was written).
    took = time.monotonic() - last_renewal
    assert took >= 2.0, f"b took over a live lease {took:.2f} s after a's last renewal (duration 2 s)"
    assert coordination.read_namespaced_lease("kuberl-planner", ns).spec.holder_identity == "planner-b"
    await b.observe()
    assert (await b.apply({"actor": 2})).applied == {"actor": 2}

    await b.close()                # a clean stop hands the lease back: the next planner leads at once
    c = await backends(ns, identity="planner-c", **lease)
    assert c.leader
    spec = coordination.read_namespaced_lease("kuberl-planner", ns).spec
    assert spec.holder_identity == "planner-c" and spec.lease_transitions == 2


async def test_a_leader_that_cannot_renew_stops_leading_before_another_takes_over(k8s_cluster, k8s_admin, k8s_namespace,
                                                                                 backends):
    """Leadership is judged by time since the last successful renewal: when a's renewals start failing (its
    RoleBinding is deleted: 403), a stops calling itself leader before b can take the expired lease."""
    ns = k8s_namespace
    make_roles(k8s_admin, ns)
    for sa in ("planner-a", "planner-b"):
        grant(k8s_admin, ns, sa, rbac.RULES, service_account=sa)
    lease = {"leader_election": True, "lease_duration_s": 3.0}
    with k8s_cluster.as_service_account(ns, "planner-a") as api_a, k8s_cluster.as_service_account(ns, "planner-b") as api_b:
        a = await backends(ns, api=api_a, identity="planner-a", **lease)
        b = await backends(ns, api=api_b, identity="planner-b", **lease)
        assert a.leader and not b.leader
        client.RbacAuthorizationV1Api(k8s_admin).delete_namespaced_role_binding("planner-a", ns)
        revoked = time.monotonic()
        a_stopped = None
        while not b.leader:
            assert not (a.leader and b.leader)
            if a_stopped is None and not a.leader:
                a_stopped = time.monotonic() - revoked
            assert time.monotonic() - revoked < 60, "b never took over"   # (liveness only: see above)
            await asyncio.sleep(0.05)
        assert a_stopped is not None   # a stepped down before b led (never both: checked at every poll)
        assert not a.leader
        with pytest.raises(Refused, match="not the leader"):
            await a.apply({"actor": 2})
        await b.observe()
        assert (await b.apply({"actor": 2})).applied == {"actor": 2}
        await a.close()
        await b.close()


def test_token_bucket_allows_a_burst_then_qps():
    now = [100.0]
    bucket = TokenBucket(qps=2.0, burst=3, clock=lambda: now[0])
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve() == pytest.approx(0.5)
    assert bucket.reserve() == pytest.approx(1.0)
    now[0] += 1.0            # two tokens accrued, both already promised
    assert bucket.reserve() == pytest.approx(0.5)
    now[0] += 60.0           # a long idle spell saves up no more than the burst
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve() == pytest.approx(0.5)


async def test_calls_are_rate_limited(k8s_admin, k8s_namespace, backends):
    make_roles(k8s_admin, k8s_namespace)
    b = await backends(k8s_namespace, qps=10.0, burst=1)
    started = time.monotonic()
    await b.observe()        # 7 calls: the HPA list, then workload, scale and Endpoints per role
    assert time.monotonic() - started >= 0.55


class _Flaky(BaseHTTPRequestHandler):
    """An API server stand-in for what a real one cannot be made to do on cue: answer 429 with Retry-After,
    then 503, before the real answer."""
    script: ClassVar[dict[str, list[tuple[int, dict, dict]]]] = {}
    seen: ClassVar[list[tuple[float, str]]] = []

    def do_GET(self):
        self.seen.append((time.monotonic(), self.path))
        path = self.path.split("?")[0]
        steps = self.script.get(path, [])
        status, headers, body = steps.pop(0) if len(steps) > 1 else steps[0] if steps else (404, {}, {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
            "message": f"{path} not found"})
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


async def test_429_waits_for_retry_after_and_5xx_is_retried(tmp_path):
    ns = "flaky"
    hpas = f"/apis/autoscaling/v1/namespaces/{ns}/horizontalpodautoscalers"
    dep = f"/apis/apps/v1/namespaces/{ns}/deployments/{ACTOR}"
    too_many = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "TooManyRequests", "code": 429,
                "message": "too many requests"}
    _Flaky.seen, _Flaky.script = [], {
        hpas: [(429, {"Retry-After": "1"}, too_many),
               (200, {}, {"kind": "HorizontalPodAutoscalerList", "apiVersion": "autoscaling/v1", "metadata": {}, "items": []})],
        dep: [(503, {}, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503, "message": "busy"}),
              (404, {}, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                         "message": "deployments.apps \"kuberl-actor\" not found"})]}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": ns}}]}))
        b = KubernetesBackend(KubernetesPlannerConfig(leader_election=False, qps=100.0, burst=100), kubeconfig=str(kubeconfig))
        await b.start()
        try:
            assert b.namespace == ns
            state = await b.observe()
        finally:
            await b.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert "not found" in state["actor"].blocked and "not found" in state["learner"].blocked
    hpa_times = [t for t, p in _Flaky.seen if p.startswith(hpas)]
    assert len(hpa_times) == 2 and hpa_times[1] - hpa_times[0] >= 1.0, "Retry-After: 1 was not honoured"
    assert sum(p.startswith(dep) for _, p in _Flaky.seen) == 2   # the 503 was retried once, then 404 stood


BUFFER = "kuberl-buffer"
SHARD_ADDRESS = "dns:///kuberl-buffer-{i}.kuberl-buffer:50051"


def buffer_endpoints(core, ns: str, ready: int, starting: int = 0) -> None:
    """The buffer Service's Endpoints as the controller would write them: pods kuberl-buffer-0.. ready,
    then `starting` more not ready yet."""
    def pod(i):
        return {"ip": f"10.2.0.{i + 1}", "targetRef": {"kind": "Pod", "name": f"{BUFFER}-{i}", "namespace": ns}}
    body = {"metadata": {"name": BUFFER}, "subsets": [{
        "addresses": [pod(i) for i in range(ready)],
        "notReadyAddresses": [pod(i) for i in range(ready, ready + starting)],
        "ports": [{"name": "grpc", "port": 50051}]}]}
    try:
        core.replace_namespaced_endpoints(BUFFER, ns, body)
    except client.ApiException as e:
        if e.status != 404:
            raise
        core.create_namespaced_endpoints(ns, body)


async def test_buffer_shards_scale_the_buffer_statefulset_one_at_a_time(k8s_cluster, k8s_admin, k8s_namespace,
                                                                        backends, tmp_path):
    """With buffer_address, the backend names shards by the address actors were given (by pod ordinal,
    not IP), adds one by patching the buffer StatefulSet's scale up by one and removes the drained last
    one by patching it down; only the last can go. Under the planner's Role with the buffer StatefulSet
    named (rbac.resource_names), every call is one the Role grants; without buffer_address the backend
    does not scale shards at all."""
    ns, core = k8s_namespace, client.CoreV1Api(k8s_admin)
    make_roles(k8s_admin, ns)
    client.AppsV1Api(k8s_admin).create_namespaced_stateful_set(ns, workload(STATEFULSET, BUFFER, 1))
    buffer_endpoints(core, ns, ready=1)
    plain = await backends(ns)
    assert not plain.scales_buffers and [r.address for r in await plain.buffers()] == ["10.2.0.1:50051"]
    cfg = KubernetesPlannerConfig(buffer_address=SHARD_ADDRESS)
    names = rbac.resource_names(cfg)
    assert names["statefulsets/scale"] == (LEARNER, BUFFER)
    grant(k8s_admin, ns, "kuberl-planner", rbac.RULES, user="kuberl-planner",
          resource_names={r: list(v) for r, v in names.items()})
    kubeconfig = k8s_cluster.write_kubeconfig(tmp_path / "planner.kubeconfig", user="kuberl-planner", namespace=ns)
    b = await backends(None, kubeconfig=str(kubeconfig), buffer_address=SHARD_ADDRESS)
    assert b.scales_buffers and await b.buffer_list() == ["dns:///kuberl-buffer-0.kuberl-buffer:50051"]
    assert [(r.name, r.address, r.ready) for r in await b.buffers()] == [
        (f"{BUFFER}-0", "dns:///kuberl-buffer-0.kuberl-buffer:50051", True)]

    assert await b.add_buffer() == "dns:///kuberl-buffer-1.kuberl-buffer:50051"
    assert spec_replicas(k8s_admin, ns, BUFFER) == 2
    assert len(await b.buffer_list()) == 2                      # (by the scale: in the list once it serves)
    buffer_endpoints(core, ns, ready=1, starting=1)            # its pod starts: listed, not serving yet
    assert [(r.address, r.ready) for r in await b.buffers()] == [
        ("dns:///kuberl-buffer-0.kuberl-buffer:50051", True), ("", False)]
    buffer_endpoints(core, ns, ready=2)
    assert [r.address for r in await b.buffers() if r.ready] == [SHARD_ADDRESS.replace("{i}", str(i)) for i in (0, 1)]

    with pytest.raises(ValueError, match="is not the last of 2"):
        await b.remove_buffer("dns:///kuberl-buffer-0.kuberl-buffer:50051")
    await b.remove_buffer("dns:///kuberl-buffer-1.kuberl-buffer:50051")
    assert spec_replicas(k8s_admin, ns, BUFFER) == 1
    # Paused by hand: left alone, and the refusal says so.
    apps = client.AppsV1Api(k8s_admin)
    apps.patch_namespaced_stateful_set(BUFFER, ns, {"metadata": {"annotations": {cfg.pause_annotation: "true"}}})
    with pytest.raises(Refused, match="paused by hand"):
        await b.add_buffer()
    assert spec_replicas(k8s_admin, ns, BUFFER) == 1
