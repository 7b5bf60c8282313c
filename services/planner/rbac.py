"""Every Kubernetes API call the planner's Kubernetes backend makes, as RBAC rules.

This is the single source of truth for the planner's Role: the manifests (k8s/, the Helm chart) must
grant exactly these rules, and the backend records each call against them (tests check both).
Each rule: (apiGroup, resource, verbs).
"""

RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("apps", "deployments", ("get",)),                          # its resourceVersion and pause annotation
    ("apps", "deployments/scale", ("get", "patch")),            # the only write: the scale subresource
    ("autoscaling", "horizontalpodautoscalers", ("list",)),     # refuse to fight an HPA
    ("", "endpoints", ("get",)),                                # discover replicas of the headless Services
    ("coordination.k8s.io", "leases", ("get", "create", "update")),  # leader election: one active planner
)


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(g == group and r == resource and verb in verbs for g, r, verbs in RULES)
