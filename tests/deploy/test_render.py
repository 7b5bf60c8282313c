"""Every kustomize overlay and the Helm chart render, and what they render is valid Kubernetes.

Validation is strict (unknown fields are errors) against the schemas of SCHEMA_VERSIONS, offline.
"""

from __future__ import annotations

import copy
import json

import pytest

from tests.deploy.render import (CHART, OVERLAYS, RenderError, container, helm, helm_template, index, kustomize, of_kind,
                                 validate, workloads)

HELM_VARIANTS = {
    "defaults": [],
    "gpu+servicemonitor": ["--set", "learner.gpu.enabled=true", "--set", "serviceMonitor.enabled=true",
                           "--set", "serviceMonitor.labels.release=prometheus", "--set", "grafanaDashboard.enabled=true"],
    "renamed+no-persistence+no-netpol": ["--set", "nameOverride=rl", "--set", "learner.persistence.enabled=false",
                                         "--set", "networkPolicy.enabled=false"],
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay):
    objects = kustomize(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
            "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    # The learners' checkpoint claims come from their StatefulSet's volumeClaimTemplates, one per pod.
    assert "PersistentVolumeClaim" not in kinds
    # One learner group, kuberl-learner; k8s/overlays/policies: one per policy, kuberl-learner-<policy>.
    learners = [o for o in objects if o["metadata"]["name"].startswith("kuberl-learner") and o["kind"] == "StatefulSet"]
    assert [o["metadata"]["name"] for o in learners] == (
        ["kuberl-learner-predator", "kuberl-learner-prey"] if overlay == "overlays/policies" else ["kuberl-learner"])
    for learner in learners:
        assert [t["metadata"]["name"] for t in learner["spec"]["volumeClaimTemplates"]] == ["checkpoints"]
    assert validate(objects) == []


def test_validation_is_strict_and_catches_mistakes():
    """The validator is not a rubber stamp: a misspelt field, a wrong type and a probe without a port fail."""
    deployment = index(kustomize("base"))[("Deployment", "kuberl-actor")]
    broken = []
    for mutate in (lambda c: c.update(containerPorts=c.pop("ports")),            # unknown field
                   lambda c: c["resources"]["requests"].update(cpu=[1]),         # wrong type
                   lambda c: c["readinessProbe"]["httpGet"].pop("port")):        # a probe needs its port
        d = copy.deepcopy(deployment)
        mutate(d["spec"]["template"]["spec"]["containers"][0])
        broken.append(d)
    errors = validate(broken)
    assert len(errors) == 3 * 2, errors   # each one, under each schema version


@pytest.mark.parametrize("variant", HELM_VARIANTS)
def test_helm_template_validates_strictly(variant):
    objects = helm_template(*HELM_VARIANTS[variant])
    assert validate(objects) == []
    monitors = of_kind(objects, "ServiceMonitor")
    if variant == "gpu+servicemonitor":
        (monitor,) = monitors
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        services = [s for s in of_kind(objects, "Service")
                    if all(s["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
                    and "metrics" in {p["name"] for p in s["spec"]["ports"]}]
        assert len(services) == 4   # it scrapes every role's Service (the learner group's has no metrics port)
    else:
        assert monitors == []


def test_helm_lint_strict():
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out
    out = helm("lint", "--strict", str(CHART), "--set", "learner.gpu.enabled=true", "--set", "serviceMonitor.enabled=true")
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values, message", [
    (["--set", "actor.replicas=3"], "replicas"),                              # the planner is the only writer
    (["--set", "config.planner.learner.max=0"], "max"),                        # at least one learner
    (["--set", "config.planner.backend=local"], "backend"),                    # in a cluster: kubernetes
    (["--set", "buffer.resources.requests=null"], "requests"),             # requests everywhere
    (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "nameOverride=Not_A_Name"], "nameOverride"),
    (["--set", "learner.persistence.existingClaim=mine"], "existingClaim"),    # one claim per learner pod now
    (["--set", "learner.persistence.size=5GB"], "learner.persistence.size"),
    (["--set", "grafanaDashboard.label=not a label"], "grafanaDashboard.label"),
])
def test_values_schema_rejects_bad_values(values, message):
    with pytest.raises(RenderError) as err:
        helm_template(*values)
    assert "values don't meet the specifications of the schema" in str(err.value)
    assert message in str(err.value)


def test_learner_claims_come_from_the_statefulset_template():
    """Each learner pod's checkpoint claim is the StatefulSet's `checkpoints` template: its size and class
    from Helm learner.persistence (none when disabled), 5 Gi in k8s/base and 1 Gi in the dev overlay."""
    def template(objects):
        (learner,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["labels"][
            "app.kubernetes.io/component"] == "learner"]
        return {t["metadata"]["name"]: t["spec"] for t in learner["spec"].get("volumeClaimTemplates", [])}

    assert template(helm_template()) == {"checkpoints": {"accessModes": ["ReadWriteOnce"],
                                                         "resources": {"requests": {"storage": "5Gi"}}}}
    assert template(helm_template("--set", "learner.persistence.size=20Gi",
                                  "--set", "learner.persistence.storageClassName=fast-ssd")) == {
        "checkpoints": {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast-ssd",
                        "resources": {"requests": {"storage": "20Gi"}}}}
    assert template(helm_template("--set", "learner.persistence.enabled=false")) == {}
    for overlay, size in (("base", "5Gi"), ("overlays/dev", "1Gi"), ("overlays/gpu", "5Gi")):
        assert template(kustomize(overlay))["checkpoints"]["resources"]["requests"]["storage"] == size, overlay


def test_grafana_dashboard_configmap_from_the_chart():
    """grafanaDashboard.enabled: one ConfigMap labelled for Grafana's dashboard sidecar, holding the chart's
    dashboards/kuberl.json unchanged, every query filtered by the dashboard's $namespace; none by default.
    (tests/integration/test_dashboard.py runs every query against a real Prometheus.)"""
    def dashboards(objects):
        return [c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-grafana-dashboard")]

    assert dashboards(helm_template()) == []
    (cm,) = dashboards(helm_template("--set", "grafanaDashboard.enabled=true",
                                     "--set", "grafanaDashboard.annotations.grafana_folder=RL"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "RL"}
    dash = json.loads(cm["data"]["kuberl.json"])
    assert dash == json.loads((CHART / "dashboards" / "kuberl.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 40 and all('{namespace=~"$namespace"}' in e for e in exprs)
    (other,) = dashboards(helm_template("--set", "grafanaDashboard.enabled=true", "--set", "grafanaDashboard.label=dash",
                                        "--set", "grafanaDashboard.labelValue=kuberl"))
    assert other["metadata"]["labels"]["dash"] == "kuberl" and "annotations" not in other["metadata"]


def test_buffer_shards_from_the_chart():
    """buffer.shards: 3 runs 3 buffer pods, tells every actor and learner all three by their stable pod
    names in shard order, sets the config's topology.buffers (which then loads), and gives each shard a
    replay claim of its own; one shard renders as before shards existed (the Service's name, no topology)."""
    import yaml

    from services.config import config_from_dict

    def buffer_args(objects):
        out = {}
        for role, w in workloads(objects).items():
            out[role] = [a.removeprefix("--buffer=") for a in container(w).get("args", []) if a.startswith("--buffer=")]
        return out

    def config(objects):
        (cm,) = [o for o in of_kind(objects, "ConfigMap") if "config.yaml" in o.get("data", {})]
        return yaml.safe_load(cm["data"]["config.yaml"])

    one = helm_template()
    assert buffer_args(one) == {"actor": ["dns:///kuberl-buffer:50051"], "learner": ["dns:///kuberl-buffer:50051"],
                                "buffer": [], "planner": []}
    assert "buffers" not in config(one).get("topology", {})
    three = helm_template("--set", "buffer.shards=3", "--set", "buffer.checkpoint.enabled=true")
    assert validate(three) == []
    shards = ",".join(f"dns:///kuberl-buffer-{i}.kuberl-buffer:50051" for i in range(3))
    assert buffer_args(three) == {"actor": [shards], "learner": [shards], "buffer": [], "planner": []}
    buffer = workloads(three)["buffer"]
    assert buffer["spec"]["replicas"] == 3 and buffer["spec"]["serviceName"] == "kuberl-buffer"
    (claim,) = buffer["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "replay" and claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    volumes = {v["name"] for v in buffer["spec"]["template"]["spec"].get("volumes", [])}
    assert "replay" not in volumes                                         # the claim template's, per pod
    assert not [o for o in of_kind(three, "PersistentVolumeClaim") if "buffer" in o["metadata"]["name"]]
    assert config_from_dict(config(three)).topology.buffers == 3
    for values, message in ((["--set", "buffer.shards=2", "--set", "buffer.checkpoint.enabled=true",
                               "--set", "buffer.checkpoint.existingClaim=mine"], "buffer.checkpoint.existingClaim"),
                            (["--set", "buffer.shards=2", "--set", "config.topology.buffers=3"],
                             "config.topology.buffers: the chart sets it from buffer.shards (2)"),
                            (["--set", "buffer.shards=65"], "buffer.shards")):
        with pytest.raises(RenderError) as err:
            helm_template(*values)
        assert message in str(err.value)

    # The planner scales the shards (config.planner.buffer): even one shard is named by its pod, each gets
    # a claim of its own, the planner is told the pattern, and its Role names the buffer StatefulSet.
    scaled = helm_template("--set", "config.planner.buffer.min=1", "--set", "config.planner.buffer.max=4",
                           "--set", "buffer.checkpoint.enabled=true")
    assert validate(scaled) == []
    assert buffer_args(scaled)["actor"] == ["dns:///kuberl-buffer-0.kuberl-buffer:50051"]
    k8s = config_from_dict(config(scaled)).planner.kubernetes
    assert (k8s.buffer_statefulset, k8s.buffer_address) == ("kuberl-buffer",
                                                            "dns:///kuberl-buffer-{i}.kuberl-buffer:50051")
    assert workloads(scaled)["buffer"]["spec"]["volumeClaimTemplates"]
    (role,) = [o for o in of_kind(scaled, "Role") if o["metadata"]["name"] == "kuberl-planner"]
    assert {tuple(r.get("resourceNames", ())) for r in role["rules"] if r["resources"][0].startswith("statefulsets")} \
        == {("kuberl-learner", "kuberl-buffer")}
    with pytest.raises(RenderError, match="buffer.checkpoint.existingClaim"):
        helm_template("--set", "config.planner.buffer.min=1", "--set", "config.planner.buffer.max=4",
                      "--set", "buffer.checkpoint.enabled=true", "--set", "buffer.checkpoint.existingClaim=mine")
