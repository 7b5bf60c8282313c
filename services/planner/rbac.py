"""Every Kubernetes API call the planner's Kubernetes backend makes, as RBAC rules.

This is the single source of truth for the planner's Role: the manifests (k8s/, the Helm chart) must
grant exactly these rules (those in RESOURCE_NAMES only on the object named there), and the backend
records each call against them (tests check both). Each rule: (apiGroup, resource, verbs).
"""

RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # The workloads it scales (services/planner/kube.WORKLOADS): the actor Deployment, the learner
    # StatefulSet. Their resourceVersion and pause annotation; the only writes are their scale subresource.
    ("apps", "deployments", ("get",)),
    ("apps", "deployments/scale", ("get", "patch")),
    ("apps", "statefulsets", ("get",)),
    ("apps", "statefulsets/scale", ("get", "patch")),
    ("autoscaling", "horizontalpodautoscalers", ("list",)),     # refuse to fight an HPA
    ("", "endpoints", ("get",)),                                # discover replicas of the headless Services
    ("coordination.k8s.io", "leases", ("get", "create", "update")),  # leader election: one active planner
)

# The manifests narrow the rules on these resources to the learner StatefulSet(s) (resourceNames:
# planner.kubernetes.learner_statefulset, or each policy's; `resource_names`). The buffer is a StatefulSet
# too, and must stay out of the planner's reach, unless the planner scales the buffer shards
# (planner.kubernetes.buffer_address set, which the chart does with planner.buffer): then the same rules
# name the buffer StatefulSet (planner.kubernetes.buffer_statefulset) too.
RESOURCE_NAMES: tuple[str, ...] = ("statefulsets", "statefulsets/scale")


def policy_learners(k8s, policies: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """policy -> (its learner StatefulSet, its learners' headless Service) in a run of several policies
    (services/planner/kube.py): `<learner_statefulset>-<policy>` and `<learner_service>-<policy>`."""
    return {p: (f"{k8s.learner_statefulset}-{p}", f"{k8s.learner_service}-{p}") for p in policies}


def resource_names(k8s, policies: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """resource -> the objects the manifests grant it on, for a planner.kubernetes config `k8s` (and the
    policies of a run of several: each policy's learner StatefulSet in place of the one)."""
    names = tuple(s for s, _ in policy_learners(k8s, policies).values()) or (k8s.learner_statefulset,)
    if k8s.buffer_address:
        names += (k8s.buffer_statefulset,)
    return dict.fromkeys(RESOURCE_NAMES, names)


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(g == group and r == resource and verb in verbs for g, r, verbs in RULES)
