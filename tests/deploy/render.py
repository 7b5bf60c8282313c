"""Render the deployment artefacts the way users do, for the tests in this package.

`kustomize(overlay)` runs `kubectl kustomize` (`kustomize_with` adds components), `helm_template(...)`
runs `helm template`; both return the objects as dicts. kubectl and Helm come from
tests/k8s/provision.sh's env file (tests/k8s/cluster.py `binaries`), else from PATH; where neither has
them, `tool()` skips the test with the reason.
`validate(objects)` checks every object strictly against the Kubernetes JSON schemas of each version in
SCHEMA_VERSIONS (PyPI kubernetes-validate, offline).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.k8s.cluster import CACHE, Unavailable, binaries

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CHART = K8S / "helm" / "kuberl"
OVERLAYS = ("base", "overlays/dev", "overlays/gpu", "overlays/secure", "overlays/policies")
# The chart with mutual TLS (certificates from cert-manager), tokens, simulators without certificates
# allowed from anywhere: the Helm counterpart of overlays/secure.
HELM_SECURE = ("--set", "tls.enabled=true", "--set", "tls.certManager.enabled=true",
               "--set", "tls.certManager.issuerRef.name=kuberl-ca", "--set", "auth.enabled=true",
               "--set", "networkPolicy.simulatorsFrom[0].ipBlock.cidr=0.0.0.0/0")
COMPONENTS = ("components/buffer-checkpoints",)   # kustomize Components, added to an overlay by users
# The oldest Kubernetes minor still in common support, and the newest the schemas know.
SCHEMA_VERSIONS = ("1.30.0", "1.37.0")
ROLES = ("actor", "buffer", "learner", "planner")
# Kinds that are not in the core schemas (CRDs): validated by their own checks, not by the schemas.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("cert-manager.io/v1", "Certificate")}


def tool(name: str) -> str:
    """Path of `kubectl` or `helm`; skips the calling test, with the reason, where it cannot be had."""
    key = name.upper()
    try:
        return binaries(key)[key]
    except Unavailable as e:
        found = shutil.which(name)
        if found and not (CACHE / "env").exists():  # provision.sh not run: try PATH; else it said why not
            return found
        pytest.skip(f"{name} is not available: {e}")


def _run(argv: list[str], timeout_s: float = 60) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RenderError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout


class RenderError(RuntimeError):
    pass


def load_all(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def kustomize(overlay: str) -> list[dict]:
    """`kubectl kustomize k8s/<overlay>` as a list of objects."""
    return load_all(_run([tool("kubectl"), "kustomize", str(K8S / overlay)]))


def kustomize_with(overlay: str, *components: str, namespace: str | None = "kuberl") -> list[dict]:
    """`kubectl kustomize` of an overlay a user would write: `resources: [k8s/<overlay>]`, `components:
    [k8s/<component>...]` and `namespace:` (as k8s/overlays/* set it), built in a temp dir."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = lambda p: os.path.relpath(K8S / p, tmp)   # noqa: E731 - kustomize takes no absolute dirs
        spec = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": [rel(overlay)], "components": [rel(c) for c in components]}
        if namespace:
            spec["namespace"] = namespace
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(spec))
        return load_all(_run([tool("kubectl"), "kustomize", tmp]))


def helm(*args: str) -> str:
    return _run([tool("helm"), *args])


def helm_template(*args: str, release: str = "kuberl", namespace: str = "kuberl") -> list[dict]:
    """`helm template RELEASE k8s/helm/kuberl -n NAMESPACE ARGS...` as a list of objects."""
    return load_all(helm("template", release, str(CHART), "--namespace", namespace, *args))


def validate(objects: list[dict]) -> list[str]:
    """Strict schema validation of every object against every version in SCHEMA_VERSIONS; returns the
    errors as 'Kind/name (version): message' (empty = all valid)."""
    import kubernetes_validate

    errors = []
    for obj in objects:
        if (obj.get("apiVersion"), obj.get("kind")) in CRD_KINDS:
            continue
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        for version in SCHEMA_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
                errors.append(f"{name} ({version}): {e}")
    return errors


def index(objects: list[dict]) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object."""
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def role_of(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(objects: list[dict]) -> dict[str, dict]:
    """role -> its Deployment or StatefulSet."""
    return {role_of(o): o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


# What kubelet adds to every container's environment (the `kubernetes` Service; 10.0.0.1 as in tests/k8s).
KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def pod_env(workload: dict, namespace: str = "kuberl") -> dict[str, str]:
    """The container's environment as the workload's first pod would see it: its env, with fieldRefs for a
    pod named <workload>-0 (a StatefulSet's ordinal 0; a Deployment's pods have other names, which no
    parser reads) in `namespace`, and what kubelet adds (KUBELET_ENV)."""
    fields = {"metadata.name": f"{workload['metadata']['name']}-0", "metadata.namespace": namespace}
    return {**KUBELET_ENV, **{e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
                              for e in container(workload).get("env", [])}}


def expand_vars(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args, from the container's env (values made up for fieldRefs)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
