"""Cross-checks that catch drift between the deployment artefacts and the code they deploy.

Every render (each kustomize overlay, the Helm chart with several value sets) is checked against what
the services actually serve and accept: each container's args parse with the role's own argument
parser; ports and probe paths are the services' own; peers are addressed
through headless Services that exist and select the right pods; grace periods outlast each role's
shutdown deadline; the config in the ConfigMap loads with the strict loader and names the objects the
planner scales; the planner's Role grants exactly services/planner/rbac.py RULES, and the learners' Role
exactly services/learner/membership.py RBAC_RULES on their own StatefulSet; the learners' --group is rank
0 of their StatefulSet behind its governing Service; the NetworkPolicies allow exactly the flows in
docs/architecture.md (section 6); and the Dockerfiles and `make images` agree with all of it.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from unittest import mock
from urllib.parse import urlparse

import pytest
import yaml

from services.config import load_config
from services.common.service.prometheus import PROBE_TIMEOUT_S, PROBES
from services.planner.kube import WORKLOADS
from services.planner.rbac import RULES, resource_names
from tests.deploy.render import (HELM_SECURE, ROLES, ROOT, container, expand_vars, helm_template, index, kustomize, of_kind,
                                 pod_env, role_of, validate, workloads)

API_ROLES = ("learner", "planner")   # the roles whose pods call the Kubernetes API (and so get a token)
HEALTH_NAMES = {"actor": "kuberl.v1.Actor", "buffer": "kuberl.v1.Buffer", "learner": "kuberl.v1.Learner",
                "planner": "kuberl.v1.Planner"}
RENDERS = {
    "kustomize base": lambda: kustomize("base"),
    "kustomize dev": lambda: kustomize("overlays/dev"),
    "kustomize gpu": lambda: kustomize("overlays/gpu"),
    "helm defaults": lambda: helm_template(),
    "helm gpu": lambda: helm_template("--set", "learner.gpu.enabled=true"),
    "helm renamed": lambda: helm_template("--set", "nameOverride=rl", "--set", "learner.persistence.enabled=false"),
    # The planner adds and drains buffer shards (docs/planner.md, "Buffer shards"), with replay checkpoints.
    "helm scaled shards": lambda: helm_template("--set", "buffer.shards=2", "--set", "config.planner.buffer.min=1",
                                               "--set", "config.planner.buffer.max=4",
                                               "--set", "buffer.checkpoint.enabled=true"),
    # Mutual TLS, tokens and external simulators let in (docs/security.md; tests/deploy/test_security.py).
    "kustomize secure": lambda: kustomize("overlays/secure"),
    "helm secure": lambda: helm_template(*HELM_SECURE),
}
# The renders whose actor NetworkPolicy lets external simulators in (from anywhere outside the pod network).
SIMULATORS_LET_IN = {"kustomize secure", "helm secure"}


@pytest.fixture(scope="module", params=list(RENDERS))
def render(request):
    return RENDERS[request.param]()


def health_names_in_protos() -> dict[str, str]:
    """role -> the full gRPC service name its server registers for health (from the descriptors)."""
    from kuberl.v1 import actor_pb2, buffer_pb2, learner_pb2, planner_pb2
    mods = {"actor": (actor_pb2, "Actor"), "buffer": (buffer_pb2, "Buffer"), "learner": (learner_pb2, "Learner"),
            "planner": (planner_pb2, "Planner")}
    return {role: m.DESCRIPTOR.services_by_name[name].full_name for role, (m, name) in mods.items()}


def parser_of(role: str):
    main = importlib.import_module(f"services.{role}.main")
    return main.build_parser().parse_args if hasattr(main, "build_parser") else main.parse_args


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def named_port(c: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return port


def parsed_args(workload: dict):
    """The container's args, $(VAR)-expanded from its env as its first pod sees it, parsed by the role's own
    parser in that pod's environment (parsers read defaults from it)."""
    c = container(workload)
    env = pod_env(workload)
    args = [expand_vars(a, env) for a in c["args"]]
    try:
        with mock.patch.dict(os.environ, env):
            return parser_of(role_of(workload))(args)
    except SystemExit:
        pytest.fail(f"{role_of(workload)}: the role's parser rejects the manifest's args {args}")


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def config_of(render, tmp_path) -> tuple[object, str]:
    (cm,) = [o for o in of_kind(render, "ConfigMap") if "config.yaml" in o.get("data", {})]
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    return load_config(str(path)), cm["metadata"]["name"]


def test_health_names_are_the_registered_services():
    assert health_names_in_protos() == HEALTH_NAMES


def role_rules(render, role: str) -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """The rules of `role`'s Role as (apiGroup, resource, verbs, resourceNames), after checking that it is the
    only Role of that role, bound by the only RoleBinding of that role to the role's pods' ServiceAccount."""
    (obj,) = [r for r in of_kind(render, "Role") if role_of(r) == role]
    (binding,) = [b for b in of_kind(render, "RoleBinding") if role_of(b) == role]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": obj["metadata"]["name"]}
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount"
    assert subject["name"] == workloads(render)[role]["spec"]["template"]["spec"]["serviceAccountName"]
    rules = []
    for rule in obj["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, f"unexpected keys in {rule}"
        rules += [(g, r, tuple(rule["verbs"]), tuple(rule.get("resourceNames", ()))) for g in rule["apiGroups"]
                  for r in rule["resources"]]
    return rules


def test_only_the_planner_and_the_learners_have_roles(render):
    assert not of_kind(render, "ClusterRole") and not of_kind(render, "ClusterRoleBinding")
    assert sorted(role_of(r) for r in of_kind(render, "Role")) == sorted(API_ROLES)
    assert sorted(role_of(b) for b in of_kind(render, "RoleBinding")) == sorted(API_ROLES)


def test_planner_role_grants_exactly_the_rbac_rules(render, tmp_path):
    cfg, _ = config_of(render, tmp_path)
    rules = role_rules(render, "planner")
    assert sorted((g, r, verbs) for g, r, verbs, _ in rules) == sorted(RULES)
    # Narrowed to the objects rbac.resource_names names: the learner StatefulSet, and the buffer's only
    # where the planner scales the shards.
    names = {r: names for _, r, _, names in rules}
    narrowed = resource_names(cfg.planner.kubernetes)
    assert names == {r: narrowed.get(r, ()) for _, r, _ in RULES}
    buffer = workloads(render)["buffer"]["metadata"]["name"]
    scaled = cfg.planner.buffer is not None
    assert (buffer in {n for ns in names.values() for n in ns}) == scaled
    assert (cfg.planner.kubernetes.buffer_statefulset == buffer) if scaled else not cfg.planner.kubernetes.buffer_address


def test_learner_role_grants_exactly_the_membership_rules_on_its_statefulset(render, tmp_path):
    """services/learner/membership.py reads the scale of its own StatefulSet, and the manifests grant that and
    nothing more: RBAC_RULES, on that one StatefulSet."""
    from services.learner.membership import RBAC_RULES
    cfg, _ = config_of(render, tmp_path)
    learner = workloads(render)["learner"]
    assert learner["kind"] == "StatefulSet" and learner["metadata"]["name"] == cfg.planner.kubernetes.learner_statefulset
    rules = role_rules(render, "learner")
    assert sorted((g, r, verbs) for g, r, verbs, _ in rules) == sorted(RBAC_RULES)
    assert {names for *_, names in rules} == {(learner["metadata"]["name"],)}


@pytest.mark.parametrize("role", ROLES)
def test_container_matches_what_the_service_serves_and_accepts(render, role):
    w = workloads(render)[role]
    c, pod = container(w), w["spec"]["template"]["spec"]
    args = parsed_args(w)
    default_port = port_of(parser_of(role)([]).listen)
    # gRPC: the service's default port everywhere (the images EXPOSE it too; see test_dockerfiles).
    assert port_of(args.listen) == named_port(c, "grpc") == default_port
    # HTTP probes of the metrics port, which serves them (services/common/service/prometheus.PROBES): readiness
    # (and startup) the role's services SERVING, liveness its event loop answering; each with a timeout
    # longer than the endpoint's own wait, so that a slow loop is a 503 with its reason.
    wants_ready = {"startupProbe": True, "readinessProbe": True, "livenessProbe": False}
    for probe, ready in wants_ready.items():
        http = c[probe]["httpGet"]
        assert http["port"] == "metrics" and PROBES[http["path"]] is ready, (probe, http)
        assert c[probe]["timeoutSeconds"] > PROBE_TIMEOUT_S, probe
    # Metrics: --metrics-listen, the container port and the scrape annotation agree.
    annotations = w["spec"]["template"]["metadata"]["annotations"]
    assert port_of(args.metrics_listen) == named_port(c, "metrics") == int(annotations["prometheus.io/port"])
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    # --config is the ConfigMap's config.yaml, mounted read-only.
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (config_vol,) = [n for n, v in volumes.items() if "configMap" in v]
    assert args.config == mounts[config_vol]["mountPath"] + "/config.yaml" and mounts[config_vol]["readOnly"]
    cm = index(render)[("ConfigMap", volumes[config_vol]["configMap"]["name"])]
    assert "config.yaml" in cm["data"]
    # Requests on every container; SIGKILL only after the role's shutdown deadline.
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    deadline = getattr(importlib.import_module(f"services.{role}.main"), "SHUTDOWN_DEADLINE_S", None)
    if role != "planner":
        assert deadline is not None, f"services.{role}.main.SHUTDOWN_DEADLINE_S is gone: check the grace period"
    assert pod["terminationGracePeriodSeconds"] > (deadline or 0) + 5
    # Only the planner and the learners get an API token; each role runs as its own ServiceAccount.
    sa = index(render)[("ServiceAccount", pod["serviceAccountName"])]
    assert role_of(sa) == role
    assert pod["automountServiceAccountToken"] is sa["automountServiceAccountToken"] is (role in API_ROLES)
    # Non-root, as the images' USER.
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_peers_are_headless_services_that_select_the_right_pods(render):
    ws = workloads(render)
    services = {s["metadata"]["name"]: s for s in of_kind(render, "Service")}
    peers = {"actor": {"buffer": parsed_args(ws["actor"]).buffer, "learner": parsed_args(ws["actor"]).learner},
             "learner": {"buffer": parsed_args(ws["learner"]).buffer}}
    for role, listed in peers.items():
        for peer, targets in listed.items():
            for i, target in enumerate(targets.split(",")):   # (buffer shards: one address per shard)
                # dns:/// + round_robin (services/common/net/grpcutil.make_channel) balances over every pod.
                assert target.startswith("dns:///"), f"{role} --{peer}={target}: use dns:/// for per-pod balancing"
                host, port = urlparse(target).path.lstrip("/").rsplit(":", 1)
                if host in services:
                    svc = services[host]
                else:   # one pod of a StatefulSet by its stable name, <pod>.<governing Service>
                    pod, _, governing = host.partition(".")
                    svc = services[governing]
                    assert ws[peer]["kind"] == "StatefulSet" and ws[peer]["spec"]["serviceName"] == governing
                    assert pod == f"{ws[peer]['metadata']['name']}-{i}", f"{role} --{peer}: shard {i} is {pod}"
                assert selects(svc["spec"]["selector"], pod_labels(ws[peer]))
                (grpc,) = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
                assert grpc["port"] == int(port) == named_port(container(ws[peer]), "grpc")
    for name, svc in services.items():
        spec = svc["spec"]
        assert spec["clusterIP"] == "None", f"Service {name} must be headless"
        (target,) = [w for w in ws.values() if selects(spec["selector"], pod_labels(w))]
        names = {p["name"] for p in container(target)["ports"]}
        for p in spec["ports"]:
            assert p["targetPort"] in names
            assert p.get("appProtocol") == {"grpc": "grpc", "metrics": "http"}.get(p["name"])   # rendezvous: raw TCP
    for w in ws.values():
        if w["kind"] == "StatefulSet":
            assert services[w["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"


def test_learner_group_meets_at_rank_0_of_its_statefulset(render):
    """The learners' --group is where rank 0 listens: pod <statefulset>-0 (rank = ordinal, as
    services/learner/membership.py reads it from --learner-id=$(POD_NAME)) under the StatefulSet's governing
    Service, which publishes it before it is Ready, at the port its container names `rendezvous`."""
    from services.learner.membership import split_ordinal
    w = workloads(render)["learner"]
    name, spec = w["metadata"]["name"], w["spec"]
    assert w["kind"] == "StatefulSet"
    # Every rank must start before rank 0 can turn Ready (OrderedReady would wait for it forever).
    assert spec["podManagementPolicy"] == "Parallel"
    c = container(w)
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    args = parsed_args(w)
    assert args.membership == "statefulset" and "--learner-id=$(POD_NAME)" in c["args"]
    assert split_ordinal(f"{name}-0") == (name, 0)
    host, port = args.group.rsplit(":", 1)
    assert host == f"{name}-0.{spec['serviceName']}"
    assert int(port) == named_port(c, "rendezvous")
    group = {s["metadata"]["name"]: s for s in of_kind(render, "Service")}[spec["serviceName"]]["spec"]
    assert group["clusterIP"] == "None" and group["publishNotReadyAddresses"] is True
    assert selects(group["selector"], pod_labels(w))
    (rendezvous,) = group["ports"]
    assert rendezvous["name"] == rendezvous["targetPort"] == "rendezvous" and rendezvous["port"] == int(port)


def test_planner_managed_counts_are_not_in_the_templates(render, tmp_path):
    cfg, _ = config_of(render, tmp_path)
    k = cfg.planner.kubernetes
    objects = index(render)
    for role, name in (("actor", k.actor_deployment), ("learner", k.learner_statefulset)):
        w = objects[(WORKLOADS[role].name, name)]    # of the kind the planner's backend scales
        assert role_of(w) == role
        assert "replicas" not in w["spec"], f"{name}: the planner is the only writer of replicas"
    buffer = workloads(render)["buffer"]
    if cfg.planner.buffer is None:   # out of the planner Role's reach
        assert buffer["kind"] == "StatefulSet" and buffer["spec"]["replicas"] == cfg.topology.buffers
    else:   # the planner scales it: an upgrade keeps the live count (a `lookup`; none under `helm template`)
        assert buffer["spec"]["replicas"] == cfg.topology.buffers and k.buffer_statefulset == buffer["metadata"]["name"]
        chart = (ROOT / "k8s" / "helm" / "kuberl" / "templates" / "buffer.yaml").read_text()
        assert 'lookup "apps/v1" "StatefulSet"' in chart


def test_config_map_loads_and_names_the_objects_the_planner_uses(render, tmp_path):
    cfg, _ = config_of(render, tmp_path)
    assert cfg.planner.backend == "kubernetes"
    assert cfg.planner.learner.max > 1   # the learners scale, as a group
    k = cfg.planner.kubernetes
    ws = workloads(render)
    services = {s["metadata"]["name"]: s for s in of_kind(render, "Service")}
    for role, name in (("actor", k.actor_service), ("learner", k.learner_service), ("buffer", k.buffer_service)):
        svc = services[name]
        assert selects(svc["spec"]["selector"], pod_labels(ws[role]))
        assert k.grpc_port_name in {p["name"] for p in svc["spec"]["ports"]}
    assert parsed_args(ws["planner"]).backend == "kubernetes"
    assert not k.namespace, "the planner must use its own namespace ($POD_NAMESPACE) in a cluster"
    env = {e["name"]: e for e in container(ws["planner"])["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_learner_checkpoints_are_on_a_volume(render):
    """Each learner pod mounts its own claim from the StatefulSet's volumeClaimTemplates at --checkpoint-dir
    (rank 0's holds the checkpoints: only rank 0 writes them)."""
    w = workloads(render)["learner"]
    args = parsed_args(w)
    mounts = {m["mountPath"]: m["name"] for m in container(w)["volumeMounts"]}
    name = mounts[args.checkpoint_dir]
    templates = {t["metadata"]["name"]: t for t in w["spec"].get("volumeClaimTemplates", [])}
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
    if name in templates:
        assert name not in volumes     # a pod volume of that name would shadow the claim
        assert templates[name]["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert templates[name]["spec"]["resources"]["requests"]["storage"]
        # A StatefulSet replaces a pod only after the old one is gone: a RWO claim is never wanted twice.
        assert w["spec"].get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
    else:
        assert "emptyDir" in volumes[name]    # helm learner.persistence.enabled=false
    assert not of_kind(render, "PersistentVolumeClaim")   # no claim shared by every learner pod


def test_every_role_has_a_disruption_budget(render):
    ws = workloads(render)
    pdbs = of_kind(render, "PodDisruptionBudget")
    assert {p["apiVersion"] for p in pdbs} == {"policy/v1"}
    covered = sorted(role for p in pdbs for role, w in ws.items() if selects(p["spec"]["selector"]["matchLabels"], pod_labels(w)))
    assert covered == sorted(ROLES)


# ---- NetworkPolicy: evaluate the policies and compare with the flows in docs/architecture.md section 6 ----
# Entities: the four roles (namespace "app"), another pod in that namespace, Prometheus (namespace
# "monitoring"), cluster DNS, an external simulator and the kube-apiserver (outside the pod network).
# Pods of one role may talk to each other (learners do). Each role also listens on an unnamed,
# unlisted port (EPHEMERAL, as gloo's between learners), which only a rule without ports opens.
EPHEMERAL = ("ephemeral", (43817, "TCP"))
OTHERS = {
    "client": {"namespace": "app", "labels": {"run": "kuberl-cli"}, "ports": {}},
    "prometheus": {"namespace": "monitoring", "labels": {"app": "prometheus"}, "ports": {}},
    "kube-dns": {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}, "ports": {"dns-udp": (53, "UDP"), "dns-tcp": (53, "TCP")}},
    "simulator": {"namespace": None, "labels": {}, "ports": {}},
    "apiserver": {"namespace": None, "labels": {}, "ports": {"https": (443, "TCP"), "https-alt": (6443, "TCP")}},
}
_IN_CLUSTER = [name for name, e in OTHERS.items() if e["namespace"] is not None]
EXPECTED_FLOWS = {
    ("actor", "buffer", "grpc"), ("learner", "buffer", "grpc"), ("actor", "learner", "grpc"),
    ("planner", "actor", "grpc"), ("planner", "buffer", "grpc"), ("planner", "learner", "grpc"),
    ("planner", "apiserver", "https"), ("planner", "apiserver", "https-alt"),
    # The learner group: rank 0's rendezvous, gloo's connections between every pair, on any port. And the
    # StatefulSet's scale, read from the API server (services/learner/membership.py).
    *{("learner", "learner", port) for port in ("grpc", "metrics", "rendezvous", "ephemeral")},
    ("learner", "apiserver", "https"), ("learner", "apiserver", "https-alt"),
    *{(role, "kube-dns", port) for role in ROLES for port in ("dns-udp", "dns-tcp")},
    # External simulators reach actors only where a render lets them in (SIMULATORS_LET_IN).
    # The planner's API: from pods in its own namespace (docs/deploy.md).
    ("client", "planner", "grpc"),
    # Metrics: Prometheus may run in any namespace, so any pod outside the kuberl roles may scrape
    # (the Helm value networkPolicy.metricsFrom narrows it).
    *{(other, role, "metrics") for other in _IN_CLUSTER for role in ROLES},
}


def _peer_matches(peer: dict, src: dict) -> bool:
    if src["namespace"] is None:          # outside the pod network: only an ipBlock could match
        return "ipBlock" in peer
    if "ipBlock" in peer:
        return False
    ns_ok = ("namespaceSelector" not in peer and src["namespace"] == "app") or (
        "namespaceSelector" in peer and selects(peer["namespaceSelector"].get("matchLabels", {}),
                                                {"kubernetes.io/metadata.name": src["namespace"]}))
    pod_ok = "podSelector" not in peer or selects(peer["podSelector"].get("matchLabels", {}), src["labels"])
    return ns_ok and pod_ok


def _port_matches(rule_ports: list | None, dst: dict, port_name: str) -> bool:
    if not rule_ports:
        return True
    number, protocol = dst["ports"][port_name]
    return any(p.get("protocol", "TCP") == protocol and p["port"] in (port_name, number) for p in rule_ports)


def _allowed(policies: list[dict], target: dict, direction: str, peer: dict, dst: dict, port_name: str) -> bool:
    """Whether `target`'s policies let traffic through in `direction` (ingress from peer / egress to peer)."""
    mine = [p for p in policies if target["namespace"] == "app" and selects(p["spec"]["podSelector"].get("matchLabels", {}), target["labels"])
            and direction.capitalize() in p["spec"]["policyTypes"]]
    if not mine:
        return True                        # not isolated in this direction
    key, peers_key = ("ingress", "from") if direction == "ingress" else ("egress", "to")
    return any(_port_matches(rule.get("ports"), dst, port_name)
               and (peers_key not in rule or any(_peer_matches(q, peer) for q in rule[peers_key]))
               for p in mine for rule in p["spec"].get(key, []))


def test_network_policies_allow_exactly_the_design_flows(render, request):
    let_in = request.node.callspec.params["render"] in SIMULATORS_LET_IN   # from anything outside the pod network
    if not of_kind(render, "NetworkPolicy"):
        pytest.skip("this render turns NetworkPolicies off (networkPolicy.enabled=false)")
    assert_design_flows(render, workloads(render), let_in)


def assert_design_flows(render, ws: dict[str, dict], let_in: bool) -> None:
    """The flows the render's NetworkPolicies allow between the workloads `ws` (role -> one workload) and
    OTHERS are exactly EXPECTED_FLOWS (and external simulators -> actors where `let_in`)."""
    expected = EXPECTED_FLOWS | {(other, "actor", "grpc") for other, e in OTHERS.items() if let_in and e["namespace"] is None}
    policies = of_kind(render, "NetworkPolicy")
    entities = dict(OTHERS)
    for role, w in ws.items():
        c = container(w)
        entities[role] = {"namespace": "app", "labels": pod_labels(w), "ports": dict(
            [*((p["name"], (p["containerPort"], p.get("protocol", "TCP"))) for p in c["ports"]), EPHEMERAL])}
    flows = {(s, d, port) for s, src in entities.items() for d, dst in entities.items()
             if (s != d or s in ws) and (s in ws or d in ws) for port in dst["ports"]
             if _allowed(policies, src, "egress", dst, dst, port) and _allowed(policies, dst, "ingress", src, dst, port)}
    assert flows == expected, (f"allowed but not in docs/architecture.md: {sorted(flows - expected)}; "
                               f"in docs/architecture.md but blocked: {sorted(expected - flows)}")


# ---- A run of several policies (config.policies): a learner StatefulSet per policy -----------------------------
SEVERAL_CONFIG = {   # configs/simple_tag_ppo.yaml's policies, with two learners each
    "algorithm": "ppo", "env": {"id": "pettingzoo:mpe2.simple_tag_v3", "num_envs": 4},
    "policies": {"predator": {"agents": ["adversary_*"]}, "prey": {"agents": ["agent_*"]}},
    "topology": {"actors": 1, "learners": 2}}


@pytest.fixture(scope="module", params=["helm", "kustomize"])
def several(request, tmp_path_factory):
    """Two policies' objects, and the config they load: the chart with SEVERAL_CONFIG, mutual TLS, tokens
    and simulators let in; or k8s/overlays/policies (its own config, the same policies). (objects, config)"""
    tmp = tmp_path_factory.mktemp("several")
    if request.param == "kustomize":
        render = kustomize("overlays/policies")
    else:
        (tmp / "values.yaml").write_text(yaml.safe_dump({"config": SEVERAL_CONFIG}))
        render = helm_template("-f", str(tmp / "values.yaml"), *HELM_SECURE)
    cfg, _ = config_of(render, tmp)
    return render, cfg


def learner_sets(render) -> dict[str, dict]:
    """policy -> its learner StatefulSet (by the label it selects on)."""
    return {w["spec"]["selector"]["matchLabels"]["kuberl.io/policy"]: w for w in of_kind(render, "StatefulSet")
            if role_of(w) == "learner"}


def test_several_policies_render_a_learner_group_per_policy(several):
    """Each policy's learners: a StatefulSet of topology.learners pods named as the planner's backend finds
    it (rbac.policy_learners), selecting its own pods only, whose learners train that policy (--policy, as
    the config reads it) and meet at rank 0 of their own StatefulSet under its own governing Service."""
    from services.learner.membership import split_ordinal
    from services.planner.rbac import policy_learners
    render, cfg = several
    assert not validate(render)
    sets = learner_sets(render)
    names = policy_learners(cfg.planner.kubernetes, cfg.policy_names)
    assert sorted(sets) == sorted(cfg.policy_names) == ["predator", "prey"]
    services = {s["metadata"]["name"]: s for s in of_kind(render, "Service")}
    for policy, w in sets.items():
        statefulset, service = names[policy]
        spec = w["spec"]
        # The chart starts each at topology.learners; kustomize leaves the count to the planner (no replicas).
        assert w["metadata"]["name"] == statefulset and spec.get("replicas", 1) == cfg.topology.learners
        for other, v in sets.items():
            assert selects(spec["selector"]["matchLabels"], pod_labels(v)) == (other == policy)
            assert selects(services[service]["spec"]["selector"], pod_labels(v)) == (other == policy)
        args = parsed_args(w)
        assert cfg.policy(args.policy) == policy
        assert args.membership == "statefulset" and split_ordinal(f"{statefulset}-1") == (statefulset, 1)
        host, port = args.group.rsplit(":", 1)
        assert host == f"{statefulset}-0.{spec['serviceName']}" and int(port) == named_port(container(w), "rendezvous")
        group = services[spec["serviceName"]]["spec"]
        assert group["publishNotReadyAddresses"] is True and group["clusterIP"] == "None"
        assert [v for v in sets.values() if selects(group["selector"], pod_labels(v))] == [w]
        assert [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]] == ["checkpoints"]
    # No Service of the one-policy learners' name: nothing to dial that would mix the policies' weights.
    assert cfg.planner.kubernetes.learner_service not in services
    for name, svc in services.items():   # every Service selects the pods of exactly one workload
        assert len([w for w in of_kind(render, "StatefulSet") + of_kind(render, "Deployment")
                    if selects(svc["spec"]["selector"], pod_labels(w))]) == 1, name


def test_several_policies_actors_reach_each_policys_learners(several):
    """The actors' --learner names every policy's Service (the actor's own parser of it), and that Service
    selects that policy's learner pods at their gRPC port."""
    from services.common.net.policy import learner_addresses
    render, cfg = several
    actor = workloads(render)["actor"]
    addresses = learner_addresses(parsed_args(actor).learner, cfg.policy_names)
    services = {s["metadata"]["name"]: s for s in of_kind(render, "Service")}
    for policy, w in learner_sets(render).items():
        target = addresses[policy]
        assert target.startswith("dns:///")
        host, port = urlparse(target).path.lstrip("/").rsplit(":", 1)
        assert selects(services[host]["spec"]["selector"], pod_labels(w))
        (grpc,) = [p for p in services[host]["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc["port"] == int(port) == named_port(container(w), "grpc")


def test_several_policies_roles_budgets_certificates_and_network(several):
    """The planner's Role names every policy's learner StatefulSet (rbac.resource_names), the learners' Role
    those alone; each learner StatefulSet has its own disruption budget; the learners' certificate names
    each policy's Service; and each policy's learners have exactly the design's flows."""
    from services.learner.membership import RBAC_RULES
    render, cfg = several
    sets = learner_sets(render)
    statefulsets = tuple(sorted(w["metadata"]["name"] for w in sets.values()))
    planner = {r: names for _, r, _, names in role_rules(render, "planner")}
    assert planner == {r: resource_names(cfg.planner.kubernetes, cfg.policy_names).get(r, ()) for _, r, _ in RULES}
    assert tuple(sorted(planner["statefulsets/scale"])) == statefulsets
    learner = role_rules(render, "learner")
    assert sorted((g, r, verbs) for g, r, verbs, _ in learner) == sorted(RBAC_RULES)
    assert {tuple(sorted(names)) for *_, names in learner} == {statefulsets}
    pdbs = of_kind(render, "PodDisruptionBudget")
    for w in sets.values():
        assert len([p for p in pdbs if selects(p["spec"]["selector"]["matchLabels"], pod_labels(w))]) == 1
    certs = [c for c in of_kind(render, "Certificate") if role_of(c) == "learner"]   # (the chart's, with TLS)
    for cert in certs:
        assert {s["metadata"]["name"] for s in of_kind(render, "Service") if role_of(s) == "learner"
                and "-group" not in s["metadata"]["name"]} <= set(cert["spec"]["dnsNames"])
    chart = all(o["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == "Helm"
                for o in render if o["kind"] != "Namespace")
    assert len(certs) == (1 if chart else 0)   # (the chart is rendered with TLS, the overlay without)
    for w in sets.values():
        assert_design_flows(render, {**workloads(render), "learner": w}, let_in=bool(certs))


@pytest.mark.parametrize("policies, message", [
    ({"solo": {"agents": ["*"]}}, "config.policies: Must have at least 2 properties"),
    ({"Red": {"agents": ["r*"]}, "blue": {"agents": ["b*"]}}, "config.policies: Does not match pattern"),
    ({"a-policy-name-of-thirty-letters": {"agents": ["r*"]}, "b": {"agents": ["b*"]}}, "Kubernetes allows 52"),
])
def test_several_policies_bad_names_are_refused_by_the_chart(tmp_path, policies, message):
    from tests.deploy.render import RenderError
    (tmp_path / "values.yaml").write_text(yaml.safe_dump({"config": {**SEVERAL_CONFIG, "policies": policies}}))
    with pytest.raises(RenderError, match=message):
        helm_template("-f", str(tmp_path / "values.yaml"), "--set", "nameOverride=a-long-release-prefix")


# ---- Dockerfiles and `make images` ---------------------------------------------------------------------------
def dockerfile(role: str) -> dict:
    """The instructions of docker/<role>.Dockerfile by stage: {"build": [...], "runtime": [...]}, each (OP, rest)."""
    text = (ROOT / "docker" / f"{role}.Dockerfile").read_text().replace("\\\n", " ")
    stages, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        if op.upper() == "FROM":
            current = "build" if " AS build" in rest else "runtime"
            stages[current] = []
        elif current is not None:
            stages[current].append((op.upper(), rest.strip()))
    return stages


def make_images() -> list[str]:
    """The `docker build` commands `make images images-cuda` runs (IMAGES_PRINT_ONLY=1: printed, not run)."""
    out = subprocess.run(["make", "-s", "images", "images-cuda", "IMAGES_PRINT_ONLY=1"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line.startswith("docker build ")]


@pytest.mark.parametrize("role", ROLES)
def test_dockerfile_runs_the_role_as_deployed(role):
    stages = dockerfile(role)
    build = [rest for op, rest in stages["build"] if op == "RUN"]
    assert build == [f"sh docker/install.sh {role} /src /opt/kuberl"]   # what tests/deploy/test_role_install.py runs
    has_torch_arg = any(op == "ARG" and rest.startswith("TORCH_INDEX_URL=") for op, rest in stages["build"])
    assert has_torch_arg == (role in ("actor", "learner"))
    runtime = dict(stages["runtime"][i] for i in range(len(stages["runtime"])) if stages["runtime"][i][0] != "ENV")
    assert yaml.safe_load(runtime["ENTRYPOINT"]) == ["python", "-m", f"services.{role}"]
    port = port_of(parser_of(role)([]).listen)
    assert set(runtime["EXPOSE"].split()) == {str(port), "9400"}
    health = yaml.safe_load(re.sub(r"^.*?CMD ", "", runtime["HEALTHCHECK"]))
    assert health == ["kuberl-healthcheck", "--service", HEALTH_NAMES[role], f"127.0.0.1:{port}"]
    assert runtime["USER"] == "10001:10001"
    assert yaml.safe_load(runtime["CMD"]) == ["--listen", f"0.0.0.0:{port}"]


def test_dockerignore_lets_in_what_the_dockerfiles_copy():
    allowed = {line.strip("!/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for role in ROLES:
        for op, rest in dockerfile(role)["build"]:
            if op == "COPY":
                sources = rest.split()[:-1]
                assert set(sources) <= allowed, f"{role}.Dockerfile copies {sources}; .dockerignore lets in {allowed}"


def test_manifests_run_the_images_make_builds():
    builds = make_images()
    tags = {line.split(" -t ")[1].split()[0]: line for line in builds}
    version = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert set(tags) == {f"kuberl/{r}:{version}" for r in ROLES} | {f"kuberl/learner:{version}-cuda"}
    assert "--build-arg TORCH_INDEX_URL= " in tags[f"kuberl/learner:{version}-cuda"]   # PyPI's CUDA torch
    for name, render in RENDERS.items():
        try:
            objects = render()
        except pytest.skip.Exception:    # no Helm here: check the kustomize renders alone
            continue
        for role, w in workloads(objects).items():
            image = container(w)["image"]
            assert image in tags, f"{name}: {role} runs {image}, which `make images` does not build"
            assert f"-f docker/{role}.Dockerfile " in tags[image]
            assert image.endswith("-cuda") == (name in ("kustomize gpu", "helm gpu") and role == "learner")


# ---- the Helm chart and the kustomize base make the same objects ------------------------------------------
def _comparable(objects: list[dict], tmp_path) -> dict:
    """What must agree between the two: object kinds and names (the ConfigMap without kustomize's hash),
    each container's args, ports, probes, resources, env and mounts, each pod's grace period, accounts and
    security context, each StatefulSet's governing Service, pod management and claim templates, each
    Service's ports and whether it publishes unready pods, the Roles' rules, the PDB budgets and the loaded
    config."""
    names = sorted((o["kind"], re.sub(r"^(kuberl-config)-[a-z0-9]+$", r"\1", o["metadata"]["name"])) for o in objects)
    pods = {}
    for role, w in workloads(objects).items():
        spec = w["spec"]["template"]["spec"]
        c = dict(container(w))
        c.pop("image"), c.pop("imagePullPolicy")
        pods[role] = {"kind": w["kind"], "replicas": w["spec"].get("replicas"), "strategy": w["spec"].get("strategy"),
                      "container": c, **{k: spec[k] for k in ("terminationGracePeriodSeconds", "serviceAccountName",
                                                              "automountServiceAccountToken", "securityContext")},
                      "volumes": sorted(v["name"] for v in spec["volumes"]),
                      **{k: w["spec"].get(k) for k in ("serviceName", "podManagementPolicy")},
                      "claims": {t["metadata"]["name"]: t["spec"] for t in w["spec"].get("volumeClaimTemplates", [])}}
    services = {s["metadata"]["name"]: (s["spec"]["ports"], s["spec"].get("publishNotReadyAddresses", False))
                for s in of_kind(objects, "Service")}
    rules = {r["metadata"]["name"]: r["rules"] for r in of_kind(objects, "Role")}
    pdbs = {p["metadata"]["name"]: {k: v for k, v in p["spec"].items() if k != "selector"}
            for p in of_kind(objects, "PodDisruptionBudget")}
    cfg, _ = config_of(objects, tmp_path)
    return {"names": names, "pods": pods, "services": services, "rules": rules, "pdbs": pdbs,
            "config": cfg.to_dict()}


def test_helm_chart_and_kustomize_base_agree(tmp_path):
    base = _comparable(kustomize("base"), tmp_path)
    chart = _comparable(helm_template(), tmp_path)
    for key in base:
        assert chart[key] == base[key], key
