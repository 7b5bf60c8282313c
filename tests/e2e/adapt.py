"""The one place where shipped manifests are changed to run on the e2e node (kubelet/apiserver 1.20).

The shipped manifests (k8s/, the Helm chart) target Kubernetes 1.24+. The node this harness can build
is 1.20 (tests/e2e/node.py), which does not serve two things they use:

    policy/v1 PodDisruptionBudget (1.21+)    dropped: so voluntary-disruption limits are NOT checked here
    native gRPC probes (`grpc:`, 1.24+)      turned into exec probes of the image's own health check
                                             (`kuberl-healthcheck --service S 127.0.0.1:PORT`), same
                                             service name, port, period and thresholds (a timeout of at
                                             least 20 s: it starts a Python process): so the probe
                                             *semantics* are checked, but not kubelet's gRPC prober itself

Nothing else is changed. NetworkPolicies are applied but not enforced (the CNI bridge plugin has no
policy engine), so they are not checked either. `UNCHECKED` lists these for the docs and test output.
"""

from __future__ import annotations

import copy

import yaml

UNCHECKED = (
    "PodDisruptionBudgets (policy/v1, Kubernetes 1.21+): dropped for the 1.20 node",
    "kubelet's native gRPC probes (1.24+): run as exec probes of kuberl-healthcheck instead",
    "NetworkPolicy enforcement: the CNI bridge plugin enforces none",
)
HEALTHCHECK = "/opt/kuberl/bin/kuberl-healthcheck"
EXEC_PROBE_TIMEOUT_S = 20


def _exec_probe(probe: dict, ports: dict[str, int]) -> dict:
    grpc = probe.pop("grpc")
    port = grpc["port"]
    port = ports.get(port, port) if isinstance(port, str) else port
    command = [HEALTHCHECK]
    if grpc.get("service"):
        command += ["--service", grpc["service"]]
    # The exec runs inside the container: its own timeout must end before kubelet's (default 1 s). It
    # also starts a Python process, which a native gRPC probe does not: on a 2-core node under load
    # that alone took over 5 s, and three such liveness timeouts restarted healthy pods. So the exec
    # probe gets at least 20 s; the probe's period and thresholds are kept.
    timeout_s = probe.get("timeoutSeconds", 1)
    probe["timeoutSeconds"] = max(timeout_s, EXEC_PROBE_TIMEOUT_S)
    command += ["--timeout", str(max(probe["timeoutSeconds"] - 1, 1)), f"127.0.0.1:{port}"]
    probe["exec"] = {"command": command}
    return probe


def adapt_doc(doc: dict) -> dict | None:
    """One rendered object as the 1.20 node can run it, or None where it cannot be served at all."""
    if doc.get("kind") == "PodDisruptionBudget":
        return None
    doc = copy.deepcopy(doc)
    spec = doc.get("spec", {}).get("template", {}).get("spec")
    if spec:
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
            for key in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "grpc" in container.get(key, {}):
                    _exec_probe(container[key], ports)
    return doc


def adapt(rendered: str) -> str:
    """A multi-document YAML stream (kubectl kustomize / helm template output), adapted for the node."""
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    out = [a for a in (adapt_doc(d) for d in docs) if a is not None]
    return yaml.safe_dump_all(out, sort_keys=False)


def adapt_chart(src, dest) -> None:
    """A copy of the Helm chart at `dest` whose Chart.yaml `kubeVersion` also admits the 1.20 node (Helm
    refuses to install a chart whose constraint the server does not meet; the objects themselves are
    adapted by the post-renderer, tests/e2e/helm-post-render, which runs adapt())."""
    import shutil
    from pathlib import Path
    shutil.copytree(src, dest)
    chart = Path(dest) / "Chart.yaml"
    meta = yaml.safe_load(chart.read_text())
    meta["kubeVersion"] = ">=1.20.0-0"
    chart.write_text(yaml.safe_dump(meta, sort_keys=False))


if __name__ == "__main__":   # Helm's post-renderer: rendered manifests on stdin, adapted ones on stdout
    import sys
    sys.stdout.write(adapt(sys.stdin.read()))
