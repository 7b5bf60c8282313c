"""The one place where shipped manifests are changed to run on the e2e node (kubelet/apiserver 1.20).

The shipped manifests (k8s/, the Helm chart) target Kubernetes 1.21+. The node this harness can build
is 1.20 (tests/e2e/node.py), which does not serve one thing they use:

    policy/v1 PodDisruptionBudget (1.21+)    dropped: so voluntary-disruption limits are NOT checked here

The probes are plain httpGet probes of each role's metrics port (/readyz, /livez), which the 1.20
kubelet runs as any later one does: they are checked as shipped.

Nothing else is changed. NetworkPolicies are applied but not enforced (the CNI bridge plugin has no
policy engine), so they are not checked either. `UNCHECKED` lists these for the docs and test output.
"""

from __future__ import annotations

import copy

import yaml

UNCHECKED = (
    "PodDisruptionBudgets (policy/v1, Kubernetes 1.21+): dropped for the 1.20 node",
    "NetworkPolicy enforcement: the CNI bridge plugin enforces none",
)


def adapt_doc(doc: dict) -> dict | None:
    """One rendered object as the 1.20 node can run it, or None where it cannot be served at all."""
    if doc.get("kind") == "PodDisruptionBudget":
        return None
    return copy.deepcopy(doc)


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
