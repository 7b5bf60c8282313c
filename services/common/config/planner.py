"""The `planner` section: how the planner measures, when it acts and within which bounds
(services/planner, docs/planner.md), and where its Kubernetes backend finds the roles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from services.common.settings import require


@dataclass(frozen=True)
class RolePlanConfig:
    """The planner's bounds and step sizes for one scalable role (actor or learner)."""
    min: int = 1                      # fewest replicas the planner keeps
    max: int = 8                      # most replicas the planner starts (>= min and >= 1)
    cost: float = 1.0          # budget units one replica uses (cores locally, pods or cores in a cluster)
    max_step_up: int = 2       # most replicas added by one decision
    max_step_down: int = 1     # most replicas removed by one decision

    def __post_init__(self) -> None:
        require(self.min >= 0, "min", self.min, "must be >= 0")
        require(self.max >= max(self.min, 1), "max", self.max, f"must be >= min ({self.min}) and >= 1")
        require(self.cost > 0, "cost", self.cost, "must be > 0")
        require(self.max_step_up >= 1, "max_step_up", self.max_step_up, "must be >= 1")
        require(self.max_step_down >= 1, "max_step_down", self.max_step_down, "must be >= 1")


@dataclass(frozen=True)
class KubernetesPlannerConfig:
    """Where the planner's Kubernetes backend finds and scales the roles (all in one namespace)."""
    # Keys of older configs that are gone, and what to write instead (see services/common/settings.build).
    _replaced: ClassVar[dict[str, str]] = {
        "learner_deployment": "replaced by planner.kubernetes.learner_statefulset: the learners are a StatefulSet "
                              "now (pod ordinal = rank in the group); rename the key (its value names the "
                              "learner StatefulSet, default kuberl-learner)"}
    namespace: str = ""                     # "" = the pod's own namespace in a cluster, else the kubeconfig's
    actor_deployment: str = "kuberl-actor"  # the actors: a Deployment
    learner_statefulset: str = "kuberl-learner"  # the learners: a StatefulSet (pod ordinal = rank in the group)
    actor_service: str = "kuberl-actor"     # headless Services whose Endpoints list the replicas
    learner_service: str = "kuberl-learner"  # the learners' headless Service
    buffer_service: str = "kuberl-buffer"  # the buffers' headless Service
    # Buffer shards the planner adds and drains (planner.buffer): the buffer StatefulSet (shard i = pod
    # ordinal i), and shard i's address as actors and learners name it, "{i}" standing for the ordinal
    # (the chart: dns:///kuberl-buffer-{i}.kuberl-buffer:50051). Unset: the planner leaves the shards be.
    buffer_statefulset: str = "kuberl-buffer"  # the buffer StatefulSet (shard i = pod ordinal i), scaled with planner.buffer
    buffer_address: str = ""          # shard i's address, {i} for the ordinal; empty: the planner leaves the shards be
    grpc_port_name: str = "grpc"            # the Service port the planner reads GetStats on
    field_manager: str = "kuberl-planner"  # the field manager of the planner's server-side apply
    pause_annotation: str = "kuberl.io/planner-paused"  # "true" on the Deployment or StatefulSet: left alone
    leader_election: bool = True            # one active planner per namespace (a coordination.k8s.io Lease)
    lease_name: str = "kuberl-planner"  # the leader election's Lease
    lease_duration_s: float = 15.0    # a leader that has not renewed the Lease this long is replaced
    qps: float = 5.0                        # client-side rate limit on API writes and reads
    burst: int = 10                   # the client-side rate limit's burst of API calls

    def __post_init__(self) -> None:
        require(self.qps > 0, "qps", self.qps, "must be > 0")
        require(self.burst >= 1, "burst", self.burst, "must be >= 1")
        require(self.lease_duration_s >= 2, "lease_duration_s", self.lease_duration_s, "must be >= 2")
        require(bool(self.field_manager), "field_manager", self.field_manager, "must not be empty")
        require(not self.buffer_address or self.buffer_address.count("{i}") == 1, "buffer_address",
                self.buffer_address, "must hold {i} once, where the shard's ordinal goes "
                "(e.g. dns:///kuberl-buffer-{i}.kuberl-buffer:50051), or be empty")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner: how it measures, when it acts and within which bounds (see docs/planner.md)."""
    # Keys of older configs that are gone, and what to write instead (see services/common/settings.build).
    _replaced: ClassVar[dict[str, str]] = {
        "max_policy_lag": "replaced by planner.staleness_target (the same setting under its own name: no actor "
                          "scale-up while the learners' mean policy lag is above it, 0 = none); max_policy_lag is "
                          "only PPO's bound on each fragment, ppo.max_policy_lag"}
    enabled: bool = True            # `kuberl up` runs the planner; false keeps topology.actors fixed
    backend: str = "local"          # "local" (processes), "kubernetes" (workloads' scale) or "dry-run" (decide only)
    interval_s: float = 5.0         # one decision this often
    tolerance: float = 0.15         # act only when production/consumption is outside 1 +- tolerance
    budget: float = 0.0             # total cost of actors + learners; 0 = only the per-role max bounds
    # What a replica costs against the budget: "configured" (planner.<role>.cost) or "measured" (the CPU
    # cores its process was measured to use, EWMA after warm-up; the configured cost until then).
    costs: str = "configured"         # a replica's cost against the budget: configured (<role>.cost) or measured (CPU cores)
    rate_halflife_s: float = 10.0   # EWMA half-life of the per-replica rates
    warmup_s: float = 10.0          # a replica's rates count only after it has reported this long
    cooldown_s: float = 20.0        # no change within this long of the last one (must exceed warmup_s)
    scale_down_window_s: float = 60.0  # scale down only to the largest target seen over this window
    stale_after_s: float = 15.0     # metrics older than this are stale: no scale-down on them
    converge_timeout_s: float = 120.0  # a change not converged by then is reported and no longer blocks
    drain_timeout_s: float = 30.0   # local backend: an actor stopped by a scale-down gets this long to flush
    # Staleness target: no actor scale-up while the learners' recent mean policy lag (learner version -
    # sample's policy_version, `learner/policy_lag_mean`) exceeds this many versions; 0 = no target.
    # A target for the mean, which no sample is held to: the bound on each fragment is ppo.max_policy_lag.
    staleness_target: float = 0.0     # no actor scale-up while the learners' mean policy lag exceeds this (0 = no target)
    # Saturation: once a scale-up has converged, the role's measured total rate must have risen by at
    # least this share of what the balance model predicted; else the planner caps the role at the count
    # that paid, for saturation_hold_s (replicas sharing cores or another bottleneck). 0 = not checked.
    min_scale_gain: float = 0.5       # share of its predicted gain a scale-up must deliver, else capped (0 = off)
    saturation_hold_s: float = 300.0  # how long a role stays capped after a scale-up that did not pay
    actor: RolePlanConfig = field(default_factory=lambda: RolePlanConfig(min=1, max=8))  # the actors' bounds and steps
    # More than one learner: they train as a group (gradients averaged), re-formed from the latest checkpoint
    # whenever the planner changes its size (local backend: it restarts the group; kubernetes: the learners
    # watch their StatefulSet's scale and re-form in their processes).
    learner: RolePlanConfig = field(default_factory=lambda: RolePlanConfig(min=1, max=1))  # the learners' bounds and steps
    # Buffer shards (docs/architecture.md, "Buffer shards"): unset, topology.buffers stays fixed; set, the
    # planner adds a shard while the run is communication-bound and drains one while every shard idles,
    # one shard at a time, within min..max (the local backend; see docs/planner.md). Not in the budget.
    buffer: RolePlanConfig | None = None  # the buffer shards' bounds and steps; null: topology.buffers stays fixed
    kubernetes: KubernetesPlannerConfig = field(default_factory=KubernetesPlannerConfig)  # the kubernetes backend's objects

    def __post_init__(self) -> None:
        require(self.backend in ("local", "kubernetes", "dry-run"), "backend", self.backend,
                "must be 'local', 'kubernetes' or 'dry-run'")
        require(self.interval_s > 0, "interval_s", self.interval_s, "must be > 0")
        require(self.costs in ("configured", "measured"), "costs", self.costs, "must be 'configured' or 'measured'")
        require(0 < self.tolerance < 1, "tolerance", self.tolerance, "must be in (0, 1)")
        require(self.budget >= 0, "budget", self.budget, "must be >= 0 (0 = no budget)")
        require(self.rate_halflife_s > 0, "rate_halflife_s", self.rate_halflife_s, "must be > 0")
        require(self.warmup_s >= 0, "warmup_s", self.warmup_s, "must be >= 0")
        require(self.cooldown_s > self.warmup_s, "cooldown_s", self.cooldown_s,
                f"must be longer than warmup_s ({self.warmup_s}): a change is judged only on warmed-up replicas")
        require(self.scale_down_window_s >= 0, "scale_down_window_s", self.scale_down_window_s, "must be >= 0")
        require(self.stale_after_s > 0, "stale_after_s", self.stale_after_s, "must be > 0")
        require(self.converge_timeout_s > 0, "converge_timeout_s", self.converge_timeout_s, "must be > 0")
        require(self.drain_timeout_s > 0, "drain_timeout_s", self.drain_timeout_s, "must be > 0")
        require(0 <= self.min_scale_gain <= 1, "min_scale_gain", self.min_scale_gain,
                "must be in [0, 1] (0 = scale-ups are not checked)")
        require(self.saturation_hold_s > 0, "saturation_hold_s", self.saturation_hold_s, "must be > 0")
        require(self.staleness_target >= 0, "staleness_target", self.staleness_target,
                "must be >= 0 (0 = no staleness target)")
        # (Whether the budget fits every role's minimum is the experiment's check: it knows the policies.)
