"""The planner process end to end on Kubernetes: `python -m services.planner --backend kubernetes` with
only the minimal Role of services/planner/rbac.py (its StatefulSet rules on the learners' only, as the
manifests grant it), discovering a real actor and learner through the Endpoints of headless Services (the
buffer's too), reading their GetStats, and scaling through the scale subresources of a real
kube-apiserver: the actor Deployment when the actors are the bottleneck, the learner StatefulSet when the
learners are (no kubelet runs: the new pods never start, so the new replicas never report and the planner
must not stack a second change on the first)."""

from __future__ import annotations

import contextlib
import json
import socket

import grpc
import pytest
from kubernetes import client

from kuberl.v1 import planner_pb2 as ppb
from kuberl.v1 import planner_pb2_grpc
from services.planner import rbac
from tests.helpers import TINY_DQN, Service, wait_for, write_config
from services.common.config import KubernetesPlannerConfig
from services.planner.kube import DEPLOYMENT, STATEFULSET
from tests.integration.test_planner_kube import ACTOR, LEARNER, spec_replicas, workload
from tests.k8s.cluster import grant


def host_ip() -> str | None:
    """A non-loopback IPv4 address of this machine (Endpoints may not hold loopback addresses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent; this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def endpoints(core, ns: str, name: str, ip: str, port: int, pod: str) -> None:
    core.create_namespaced_service(ns, {"metadata": {"name": name}, "spec": {
        "clusterIP": "None", "selector": {"app": name}, "ports": [{"name": "grpc", "port": port}]}})
    core.create_namespaced_endpoints(ns, {"metadata": {"name": name}, "subsets": [{
        "addresses": [{"ip": ip, "targetRef": {"kind": "Pod", "name": pod, "namespace": ns}}],
        "ports": [{"name": "grpc", "port": port}]}]})


@contextlib.contextmanager
def planner_on_kubernetes(tmp_path, k8s_cluster, k8s_admin, ns: str, config: dict, policies: tuple[str, ...] = ()):
    """A real buffer, learner and actor on this machine, found through the Endpoints of Services named as
    in a cluster (the learner as StatefulSet pod kuberl-learner-0); the actor Deployment and learner
    StatefulSet at one replica; and the planner process as a token user bound to the planner's Role.
    With `policies` (a run of several), a learner StatefulSet, Service and process per policy, as the Helm
    chart names them (kuberl-learner-<policy>, its pod kuberl-learner-<policy>-0), and the Role narrowed
    to them. Yields (planner Service, PlannerStub) once the planner holds the Lease."""
    ip = host_ip()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address here: Kubernetes Endpoints cannot point at loopback")
    config = write_config(tmp_path / "c.yaml", config)
    apps = client.AppsV1Api(k8s_admin)
    apps.create_namespaced_deployment(ns, workload(DEPLOYMENT, ACTOR, 1))
    learner_sets = {p: f"{LEARNER}-{p}" for p in policies} or {"": LEARNER}
    for name in learner_sets.values():
        apps.create_namespaced_stateful_set(ns, workload(STATEFULSET, name, 1))
    names = {r: list(v) for r, v in rbac.resource_names(KubernetesPlannerConfig(), policies).items()}
    grant(k8s_admin, ns, "kuberl-planner", rbac.RULES, user="kuberl-planner", resource_names=names)
    kubeconfig = k8s_cluster.write_kubeconfig(tmp_path / "kubeconfig", user="kuberl-planner", namespace=ns)

    procs = []
    try:
        buffer = Service("buffer", tmp_path, config, listen="0.0.0.0:0")
        procs.append(buffer)
        baddr = buffer.wait_ready()
        learners = {}
        for policy in learner_sets:
            learner = Service("learner", tmp_path, config, "--buffer", baddr, "--checkpoint-dir",
                              str(tmp_path / "ck" / policy), *(["--policy", policy] if policy else []),
                              listen="0.0.0.0:0")
            procs.append(learner)
            learners[policy] = learner.wait_ready()
        laddr = ",".join(f"{p}={a}" for p, a in learners.items()) if policies else learners[""]
        actor = Service("actor", tmp_path, config, "--buffer", baddr, "--learner", laddr, listen="0.0.0.0:0")
        procs.append(actor)
        aaddr = actor.wait_ready()
        core = client.CoreV1Api(k8s_admin)
        endpoints(core, ns, ACTOR, ip, int(aaddr.rsplit(":", 1)[1]), "actor-pod-0")
        for policy, name in learner_sets.items():
            endpoints(core, ns, name, ip, int(learners[policy].rsplit(":", 1)[1]), f"{name}-0")
        endpoints(core, ns, "kuberl-buffer", ip, int(baddr.rsplit(":", 1)[1]), "kuberl-buffer-0")

        planner = Service("planner", tmp_path, config, "--kubeconfig", str(kubeconfig), "--journal",
                          str(tmp_path / "decisions.jsonl"))
        procs.append(planner)
        paddr = planner.wait_ready()
        with grpc.insecure_channel(paddr) as ch:
            stub = planner_pb2_grpc.PlannerStub(ch)
            status = stub.GetStatus(ppb.GetStatusRequest(), timeout=10)
            assert status.backend == "kubernetes"
            wait_for(lambda: stub.GetStatus(ppb.GetStatusRequest(), timeout=10).leader, timeout=30,
                     what="the planner to take the Lease")
            yield planner, stub
        assert planner.terminate() == 0
        assert "stopped cleanly" in planner.output()
    finally:
        for p in reversed(procs):
            p.kill()


def applied_decisions(tmp_path) -> list[dict]:
    journal = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    return [d for d in journal if d.get("applied")]


def no_change_stacked(stub, first: dict) -> None:
    """No kubelet: the new pods never report, so the decisions after `first` are suppressed."""
    first_id = int(first["id"])  # uint64 is a string in proto JSON
    wait_for(lambda: stub.GetStatus(ppb.GetStatusRequest(), timeout=10).last_decision.id > first_id + 2,
             timeout=30, what="more decisions")
    last = stub.GetStatus(ppb.GetStatusRequest(), timeout=10).last_decision
    assert last.action == ppb.DECISION_ACTION_SUPPRESSED and "not converged" in last.reason


def set_replicas_as_leader(stub, role: str, replicas: int):
    """SetReplicas while this planner holds the Lease. Here the test's own API server shares two cores
    with a learner training flat out, and answered a Lease renewal 15 s late in a CI run: leadership
    lapsed for a moment and the planner rightly refused ("not the leader"). A user retries; so does this,
    and any other refusal fails at once."""
    for _ in range(5):
        wait_for(lambda: stub.GetStatus(ppb.GetStatusRequest(), timeout=30).leader, timeout=60,
                 what="the planner to hold the Lease")
        d = stub.SetReplicas(ppb.SetReplicasRequest(role=role, replicas=replicas, ttl_s=60), timeout=30)
        if not d.error.startswith("not the leader"):
            return d
    return d


def test_planner_scales_the_actor_deployment_from_measured_rates(tmp_path, k8s_cluster, k8s_admin, k8s_namespace):
    ns = k8s_namespace
    config = {**TINY_DQN, "dqn": {**TINY_DQN["dqn"], "replay_ratio": 8.0},
              "actor": {**TINY_DQN["actor"], "max_env_steps_per_s": 50},
              "planner": {"backend": "kubernetes", "interval_s": 1, "warmup_s": 1, "cooldown_s": 3,
                          "actor": {"max": 4, "max_step_up": 2},
                          # One planner: a long lease, whose renewals a loaded machine cannot miss (with 4 s, a
                          # renewal late by 2.7 s lost the lease and a SetReplicas was refused in a CI run).
                          "kubernetes": {"namespace": ns, "lease_duration_s": 30}}}
    with planner_on_kubernetes(tmp_path, k8s_cluster, k8s_admin, ns, config) as (planner, stub):
        # The planner measures the real actor (50 steps/s) against the learner's capacity and scales up.
        wait_for(lambda: spec_replicas(k8s_admin, ns) > 1, timeout=120, interval=0.5,
                 what=f"the actor Deployment scaled up; planner log:\n{planner.output()[-3000:]}")
        assert spec_replicas(k8s_admin, ns, LEARNER) == 1             # the learner stays at its max of 1
        scaled = applied_decisions(tmp_path)
        assert len(scaled) == 1 and scaled[0]["backend"] == "kubernetes" and scaled[0]["ratio"] < 0.85
        actor_role = {r["role"]: r for r in scaled[0]["roles"]}["actor"]
        # One step toward what the planner proposed (the count its measured rates call for), bounded by
        # actor.max_step_up (+2): 1 -> 3 where the learner was measured to keep up with three such actors or
        # more; on a machine loaded enough to halve the learner's rate it proposes fewer (seen with four test
        # workers on two cores: 1 -> 2). The Deployment holds the decision's target.
        scaled_to = actor_role["target"]
        assert 1 < scaled_to == min(actor_role["proposed"], 3) == spec_replicas(k8s_admin, ns), actor_role
        assert actor_role["rate_per_replica"] == pytest.approx(50, rel=0.3)
        # The buffer, found through its Service's Endpoints too, reports what reaches it.
        assert scaled[0]["buffer_samples_received_per_s"] > 0 and "buffer_size_samples" in scaled[0]

        no_change_stacked(stub, scaled[0])
        assert spec_replicas(k8s_admin, ns) == scaled_to

        # Preview asks the apiserver for a dry run and changes nothing.
        preview = stub.Preview(ppb.PreviewRequest(), timeout=30)
        assert preview.dry_run and not preview.applied and spec_replicas(k8s_admin, ns) == scaled_to

        # A manual override goes through the same subresource.
        d = set_replicas_as_leader(stub, "actor", 1)
        assert d.applied and not d.error, d
        assert spec_replicas(k8s_admin, ns) == 1


def test_planner_scales_the_learner_statefulset_when_the_learners_are_the_bottleneck(tmp_path, k8s_cluster, k8s_admin,
                                                                                   k8s_namespace):
    """One actor at 500 env steps/s feeds a learner that must train on each sample 256 times (the replay
    ratio): far more production than the learner can consume, whatever this machine's speed, and the actor
    count is fixed at 1. The planner adds learners: it patches statefulsets/scale of the learner
    StatefulSet (one step of +2), and leaves the actor Deployment alone."""
    ns = k8s_namespace
    config = {**TINY_DQN, "dqn": {**TINY_DQN["dqn"], "replay_ratio": 256.0},
              "actor": {**TINY_DQN["actor"], "max_env_steps_per_s": 500},
              "planner": {"backend": "kubernetes", "interval_s": 1, "warmup_s": 1, "cooldown_s": 3,
                          "actor": {"min": 1, "max": 1}, "learner": {"min": 1, "max": 4, "max_step_up": 2},
                          "kubernetes": {"namespace": ns, "lease_duration_s": 30}}}
    with planner_on_kubernetes(tmp_path, k8s_cluster, k8s_admin, ns, config) as (planner, stub):
        wait_for(lambda: spec_replicas(k8s_admin, ns, LEARNER) > 1, timeout=120, interval=0.5,
                 what=f"the learner StatefulSet scaled up; planner log:\n{planner.output()[-3000:]}")
        assert spec_replicas(k8s_admin, ns, LEARNER) == 3             # one step of +2
        assert spec_replicas(k8s_admin, ns) == 1                      # the actors are fixed at 1
        scaled = applied_decisions(tmp_path)
        assert len(scaled) == 1 and scaled[0]["backend"] == "kubernetes" and scaled[0]["ratio"] > 1.15
        roles = {r["role"]: r for r in scaled[0]["roles"]}
        assert (roles["learner"]["current"], roles["learner"]["target"]) == (1, 3)
        assert roles["learner"]["rate_per_replica"] > 0                # measured from the real learner

        no_change_stacked(stub, scaled[0])
        assert spec_replicas(k8s_admin, ns, LEARNER) == 3

        # A manual override of the learners goes through the StatefulSet's scale subresource too.
        d = set_replicas_as_leader(stub, "learner", 1)
        assert d.applied and not d.error, d
        assert spec_replicas(k8s_admin, ns, LEARNER) == 1


def test_planner_scales_the_actors_two_policies_share_and_leaves_each_policys_learner_statefulset(
        tmp_path, k8s_cluster, k8s_admin, k8s_namespace):
    """A run of two policies on Kubernetes, as the Helm chart deploys it: a learner StatefulSet per policy
    (kuberl-learner-first, kuberl-learner-rest) behind its own Service, each learner training its policy
    (--policy), and the actors told each policy's address. The planner process, under the Role the chart
    grants (rbac.resource_names with the policies), reads each policy's learners through its Service, weighs
    them by the policy's share of the samples, and scales the actor Deployment (capped at 50 steps/s, they
    are the bottleneck); it leaves the learner StatefulSets as they are and says why."""
    from tests.unit.actor.test_agents import COPIES, RELAY
    from tests.unit.actor.test_policies import TWO
    ns, policies = k8s_namespace, tuple(TWO)
    config = {**TINY_DQN, "env": {"id": RELAY, "num_envs": COPIES}, "policies": TWO,
              "dqn": {**TINY_DQN["dqn"], "replay_ratio": 8.0}, "actor": {**TINY_DQN["actor"], "max_env_steps_per_s": 50},
              "planner": {"backend": "kubernetes", "interval_s": 1, "warmup_s": 1, "cooldown_s": 3,
                          "actor": {"max": 4, "max_step_up": 2}, "kubernetes": {"namespace": ns, "lease_duration_s": 30}}}
    with planner_on_kubernetes(tmp_path, k8s_cluster, k8s_admin, ns, config, policies) as (planner, stub):
        wait_for(lambda: spec_replicas(k8s_admin, ns) > 1, timeout=120, interval=0.5,
                 what=f"the actor Deployment scaled up; planner log:\n{planner.output()[-3000:]}")
        assert spec_replicas(k8s_admin, ns) == 3                      # one step of +2
        (scaled,) = applied_decisions(tmp_path)
        assert scaled["backend"] == "kubernetes" and scaled["ratio"] < 0.85
        assert "learners taking its share (the tightest)" in scaled["reason"]
        learner = {r["role"]: r for r in scaled["roles"]}["learner"]
        assert learner["current"] == 2 and learner["rate_per_replica"] > 0   # both policies' learners, measured
        assert learner["blocked"].startswith("several policies (config `policies`)")
        apps = client.AppsV1Api(k8s_admin)
        assert [apps.read_namespaced_stateful_set(f"{LEARNER}-{p}", ns).spec.replicas for p in policies] == [1, 1]
