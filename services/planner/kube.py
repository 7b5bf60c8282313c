"""The Kubernetes backend: roles are workloads, replicas are the Endpoints of their headless Services.

Each role the planner scales is a workload of one kind (WORKLOADS): the actors a Deployment, the learners
a StatefulSet (its pods' ordinals are the learner group's ranks). For each it reads the workload
(`deployments` / `statefulsets` get) and its scale subresource, lists the HPAs of the namespace and
reads the Endpoints of the role's headless Service; it writes ONLY the scale subresource
(`deployments/scale`, `statefulsets/scale`: a merge patch that carries the resourceVersion it read, with
the configured field manager), so a concurrent change gives 409 -> `Conflict`, and the planner core
re-reads and decides again. It refuses (`Refused`, naming the HPA) to scale a workload an HPA targets,
and leaves alone a workload annotated `<pause_annotation>: "true"`. Both kinds go through the same code,
parameterised by `Kind`.

Buffer shards (services/planner/shards.py), when `buffer_address` names them: shard i is pod ordinal i
of the buffer StatefulSet, addressed as actors and learners were told (`buffer_address` with {i}
replaced); a shard is added by patching that StatefulSet's scale up by one, and a drained one removed
by patching it down by one (a StatefulSet removes its highest ordinal: the last shard, the one
drained), through the same checks (HPA, pause annotation, resourceVersion). One planner writes at a time: a coordination.k8s.io/v1 Lease (lease.py).
Every API call goes through `KubeApi.call` (kubeapi.py: RBAC-checked, rate-limited, retried, errors
naming the call).

A run of several policies (config `policies`, `policies=` here) has a learner StatefulSet per policy,
`<learner_statefulset>-<policy>`, behind the headless Service `<learner_service>-<policy>` (as the Helm
chart names them). The learner role is then every policy's learners: its replicas are each Service's
Endpoints, each carrying its policy (services/planner/observe.py weighs each policy's learners by its
share of the samples), its desired count the sum of the StatefulSets' scales. It is not scaled as a
whole (the role is reported blocked, saying why; `apply` refuses a learner count), as in the local
backend: each policy's StatefulSet is the role `learner/<policy>`, observed and scaled through the same
checks, sized by the decisions with the actors (services/planner/balance.py, `plan`) or by hand (`kuberl scale
learner/<policy> N`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from dataclasses import dataclass

from kubernetes import client

from services.common.config import KubernetesPlannerConfig
from services.planner.backend import ROLES, ApplyResult, Conflict, Refused, Replica, RoleState
from services.planner.kubeapi import ApiError, KubeApi, load_client
from services.planner.lease import LeaderLease
from services.planner.rbac import policy_learners

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Kind:
    """A workload kind the planner scales: its name in messages and HPA targets, its apps/v1 resource
    (RBAC and URLs) and the stem of the official client's AppsV1Api methods."""
    name: str          # "Deployment"
    resource: str      # "deployments"; the scale subresource is "<resource>/scale"
    method: str        # "deployment": read_namespaced_deployment, read_/patch_namespaced_deployment_scale

    def call(self, apps: client.AppsV1Api, verb: str, scale: bool = False):
        """The AppsV1Api method that does `verb` ("read", "patch") to a workload of this kind or its scale."""
        return getattr(apps, f"{verb}_namespaced_{self.method}{'_scale' if scale else ''}")


DEPLOYMENT = Kind("Deployment", "deployments", "deployment")
STATEFULSET = Kind("StatefulSet", "statefulsets", "stateful_set")
# role -> the kind of workload it runs as. Learners are a StatefulSet: rank = pod ordinal, and each learner
# reads the StatefulSet's scale to know the group's size (services/learner/membership.py).
WORKLOADS = {"actor": DEPLOYMENT, "learner": STATEFULSET}
SHARDS = "buffer"   # the buffer StatefulSet, scaled one shard at a time (add_buffer/remove_buffer)
SEVERAL_POLICIES = ("several policies (config `policies`): the learners are scaled per policy, each policy's "
                    "StatefulSet ({names}) as the role learner/<policy> (the decisions size them with the "
                    "actors; `kuberl scale learner/<policy> N` sets one)")


@dataclass(frozen=True)
class Workload:
    kind: Kind
    name: str

    def __str__(self) -> str:
        return f"{self.kind.name} {self.name!r}"


class KubernetesBackend:
    """Backend over the workloads named in `cfg` (see the module docstring).

    `namespace` overrides cfg.namespace; `kubeconfig` is a file to load (default: in-cluster service-account
    auth, else ~/.kube/config); `api_client` (tests) is used as given and not closed. `identity` names this
    planner in the Lease (default: hostname + a random suffix). `policies`: the policies of a run of
    several (config `policies`; see the module docstring), else empty. All methods are coroutines that
    never block the event loop; API failures raise ApiError."""

    name = "kubernetes"

    def __init__(self, cfg: KubernetesPlannerConfig, *, namespace: str | None = None, kubeconfig: str | None = None,
                 api_client: client.ApiClient | None = None, identity: str | None = None,
                 request_timeout_s: float = 15.0, policies: tuple[str, ...] = ()):
        self.cfg = cfg
        self.namespace = namespace or cfg.namespace
        self.identity = identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self._kubeconfig = kubeconfig
        self._api = api_client
        self._owns_api = api_client is None
        self.kube = KubeApi(cfg.qps, cfg.burst, request_timeout_s, self.namespace or "")
        self.calls = self.kube.calls                   # (group, resource, verb) of every call made
        self.lease = LeaderLease(self.kube, cfg.lease_name, self.identity, cfg.lease_duration_s)
        names = {"actor": cfg.actor_deployment, "learner": cfg.learner_statefulset}
        self._workloads = {role: Workload(WORKLOADS[role], names[role]) for role in ROLES}
        if cfg.buffer_address:   # (services/planner/shards.py; rbac.BUFFER_RESOURCES)
            self._workloads[SHARDS] = Workload(STATEFULSET, cfg.buffer_statefulset)
        self._services = {"actor": cfg.actor_service, "learner": cfg.learner_service, "buffer": cfg.buffer_service}
        # Several policies: "learner" is then every policy's learners, read as "learner/<policy>" each.
        self.policies = tuple(policies)
        for policy, (statefulset, service) in policy_learners(cfg, self.policies).items():
            self._workloads[f"learner/{policy}"] = Workload(STATEFULSET, statefulset)
            self._services[f"learner/{policy}"] = service
        if self.policies:
            del self._workloads["learner"], self._services["learner"]
        self._read: dict[str, tuple[str, str]] = {}    # role -> (resourceVersion, pause reason) as last read
        self._task: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect and, with leader election on, try for the Lease once and keep trying in the background."""
        if self._api is None:
            self._api, detected = await asyncio.to_thread(load_client, self._kubeconfig)
            self.namespace = self.namespace or detected
        self.namespace = self.namespace or "default"
        self.kube.namespace = self.namespace
        self.lease.bind(self._api)
        self._apps = client.AppsV1Api(self._api)
        self._core = client.CoreV1Api(self._api)
        self._autoscaling = client.AutoscalingV1Api(self._api)
        log.info("kubernetes backend: namespace %s, workloads %s, identity %s, leader election %s",
                 self.namespace, {role: str(w) for role, w in self._workloads.items()}, self.identity,
                 self.cfg.leader_election)
        if self.cfg.leader_election:
            await self.lease.elect_once()
            self._task = asyncio.create_task(self.lease.run_forever(), name="planner-lease")

    async def close(self, *, release: bool = True) -> None:
        """Stop renewing; with `release`, hand the Lease back so another planner takes over at once
        (release=False behaves like a crash: the others wait for the lease to expire)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if release and self.leader and self.cfg.leader_election:
            with contextlib.suppress(ApiError):
                await self.lease.release()
        self.lease.forget()
        if self._owns_api and self._api is not None:
            self._api.close()
            self._api = None

    @property
    def leader(self) -> bool:
        """True only while this planner holds the Lease (renewed within the renew deadline); always True
        with leader_election off."""
        return not self.cfg.leader_election or self.lease.leader

    # ---- observe -------------------------------------------------------------------------------------
    async def observe(self) -> dict[str, RoleState]:
        hpas = await self._hpa_targets()
        states = {role: await self._observe_role(role, hpas) for role in ROLES if role in self._workloads}
        if self.policies:
            states.update(await self._observe_policies(hpas))
        return states

    async def _observe_role(self, role: str, hpas: dict[tuple[str, str], str], policy: str = "") -> RoleState:
        w = self._workloads[role]
        try:
            desired, _, paused = await self._read_workload(role)
        except ApiError as e:
            if e.status != 404:
                raise
            self._read.pop(role, None)
            return RoleState(desired=0, blocked=f"{w} not found in namespace {self.namespace!r}")
        blocked = self._hpa_reason(w, hpas) or paused
        return RoleState(desired=desired, replicas=await self._replicas(role, policy), blocked=blocked)

    async def _observe_policies(self, hpas: dict[tuple[str, str], str]) -> dict[str, RoleState]:
        """A run of several policies: each policy's StatefulSet as the role learner/<policy>, and the
        learner role, all of them together, blocked (not scaled as a whole) with each
        policy's own reason (not found, HPA, paused) where one has one, else with the several-policies
        reason."""
        states = {f"learner/{p}": await self._observe_role(f"learner/{p}", hpas, policy=p) for p in self.policies}
        own = [f"{r.split('/', 1)[1]}: {s.blocked}" for r, s in states.items() if s.blocked]
        return {**states, "learner": RoleState(desired=sum(s.desired for s in states.values()),
                                               replicas=[r for s in states.values() for r in s.replicas],
                                               blocked="; ".join(own) or self.several_policies_reason)}

    @property
    def several_policies_reason(self) -> str:
        statefulsets = sorted(name for name, _ in policy_learners(self.cfg, self.policies).values())
        return SEVERAL_POLICIES.format(names=", ".join(statefulsets))

    async def _read_workload(self, role: str) -> tuple[int, str, str]:
        """(desired replicas from the scale subresource, resourceVersion, pause reason or "")."""
        w = self._workloads[role]
        for _ in range(3):   # the workload and its scale must be the same version of the object
            obj = await self._call("get", "apps", w.kind.resource, w.name, w.kind.call(self._apps, "read"),
                                   w.name, self.namespace)
            scale = await self._call("get", "apps", f"{w.kind.resource}/scale", w.name,
                                     w.kind.call(self._apps, "read", scale=True), w.name, self.namespace)
            if scale.metadata.resource_version == obj.metadata.resource_version:
                break
        annotations = obj.metadata.annotations or {}
        value = annotations.get(self.cfg.pause_annotation, "")
        paused = (f"{w} is annotated {self.cfg.pause_annotation}={value!r}: paused by hand; "
                  f"remove the annotation to let the planner manage it") if value.strip().lower() == "true" else ""
        rv = scale.metadata.resource_version
        self._read[role] = (rv, paused)
        return (scale.spec.replicas or 0) if scale.spec else 0, rv, paused

    async def _hpa_targets(self) -> dict[tuple[str, str], str]:
        """(kind, name) of each workload an HPA (autoscaling/v1) targets -> that HPA's name."""
        hpas = await self._call("list", "autoscaling", "horizontalpodautoscalers", "",
                                self._autoscaling.list_namespaced_horizontal_pod_autoscaler, self.namespace)
        targets = {}
        for hpa in hpas.items or []:
            ref = hpa.spec.scale_target_ref if hpa.spec else None
            if ref is not None:
                targets.setdefault((ref.kind, ref.name), hpa.metadata.name)
        return targets

    def _hpa_reason(self, w: Workload, hpas: dict[tuple[str, str], str]) -> str:
        hpa = hpas.get((w.kind.name, w.name))
        if hpa is None:
            return ""
        return (f"HorizontalPodAutoscaler {hpa!r} targets {w} in namespace {self.namespace!r}: the planner "
                f"will not fight it (delete the HPA to let the planner manage it)")

    @property
    def scales_buffers(self) -> bool:
        return bool(self.cfg.buffer_address)

    def shard_address(self, ordinal: int) -> str:
        return self.cfg.buffer_address.replace("{i}", str(ordinal))

    async def buffers(self) -> list[Replica]:
        """The buffer shards: the Endpoints of the buffer Service; with `buffer_address`, each pod of the
        buffer StatefulSet by its ordinal, in shard order, under the address actors and learners use."""
        replicas = await self._replicas("buffer")
        if not self.scales_buffers:
            return replicas
        prefix = f"{self.cfg.buffer_statefulset}-"
        shards = []
        for r in replicas:
            ordinal = r.name[len(prefix):]
            if r.name.startswith(prefix) and ordinal.isdigit():
                shards.append((int(ordinal), Replica(r.name, self.shard_address(int(ordinal)) if r.ready else "",
                                                     r.ready)))
        return [r for _, r in sorted(shards, key=lambda s: s[0])]

    async def buffer_list(self) -> list[str]:
        """Every shard's address, in shard order: one per replica the buffer StatefulSet's scale asks for,
        whether its pod serves now or not (a restarting shard stays in the list)."""
        desired, _, _ = await self._read_workload(SHARDS)
        return [self.shard_address(i) for i in range(desired)]

    async def add_buffer(self) -> str:
        """Scale the buffer StatefulSet up by one; returns the new shard's address (it serves once its pod is
        ready in the Endpoints)."""
        n = await self._patch_shards(+1)
        return self.shard_address(n - 1)

    async def remove_buffer(self, address: str) -> None:
        """Scale the buffer StatefulSet down by one, which removes the drained last shard: ValueError for any
        other address."""
        await self._patch_shards(-1, last=address)

    async def _patch_shards(self, step: int, last: str | None = None) -> int:
        """Patch the buffer StatefulSet's scale by `step`, after the same checks as `apply` (and, given
        `last`, that it is the address of the highest ordinal, the one a scale-down removes); the count set."""
        desired, _, _ = await self._read_workload(SHARDS)
        if last is not None and last != self.shard_address(desired - 1):
            raise ValueError(f"buffer shard {last} is not the last of {desired} ({self.shard_address(desired - 1)}):"
                             f" a StatefulSet removes only its highest ordinal")
        n = desired + step
        if n < 1:
            raise ValueError(f"buffer shards: {n} must be >= 1")
        await self.apply({SHARDS: n})
        return n

    async def _replicas(self, role: str, policy: str = "") -> list[Replica]:
        """The replicas in the Endpoints of the role's headless Service (ready and not ready), addressed at
        the port named cfg.grpc_port_name ("" where the Service has no such port); `policy`: the one they
        train (a learner role of a run of several policies)."""
        svc = self._services[role]
        try:
            ep = await self._call("get", "", "endpoints", svc, self._core.read_namespaced_endpoints, svc, self.namespace)
        except ApiError as e:
            if e.status == 404:
                return []
            raise
        replicas = []
        for subset in ep.subsets or []:
            port = next((p.port for p in subset.ports or [] if p.name == self.cfg.grpc_port_name), None)
            for addresses, ready in ((subset.addresses, True), (subset.not_ready_addresses, False)):
                for a in addresses or []:
                    host = f"[{a.ip}]" if ":" in a.ip else a.ip
                    name = a.target_ref.name if a.target_ref is not None and a.target_ref.name else (a.hostname or a.ip)
                    replicas.append(Replica(name=name, address=f"{host}:{port}" if port else "", ready=ready,
                                            policy=policy))
        return replicas

    # ---- apply ---------------------------------------------------------------------------------------
    async def apply(self, targets: dict[str, int], *, dry_run: bool = False) -> ApplyResult:
        """Patch the scale subresource of each role's workload in `targets`, conditional on the resourceVersion
        read by the last observe(); raises Conflict (409: changed since), Refused (an HPA targets it, it is
        paused, or this planner is not the leader) before writing anything, ValueError for an unknown role or
        a negative count. dry_run: the API server validates and nothing is stored (dryRun=All)."""
        if self.policies and "learner" in targets:
            raise Refused(f"learner: {self.several_policies_reason}")
        for role, n in targets.items():
            if role not in self._workloads:
                raise ValueError(f"unknown role {role!r}: the planner scales {tuple(self._workloads)}")
            if n < 0:
                raise ValueError(f"{role}: replica count {n} must be >= 0")
        if not dry_run and not self.leader:
            raise Refused(f"planner {self.identity!r} is not the leader (Lease {self.namespace}/{self.cfg.lease_name} "
                          f"is held by another planner); it does not write")
        hpas = await self._hpa_targets()
        for role in targets:
            if reason := self._hpa_reason(self._workloads[role], hpas):
                raise Refused(f"{role}: {reason}")
            if role not in self._read:
                await self._read_workload(role)
            if paused := self._read[role][1]:
                raise Refused(f"{role}: {paused}")
        applied = {}
        for role, n in targets.items():
            w, (rv, _) = self._workloads[role], self._read[role]
            try:
                scale = await self._call(
                    "patch", "apps", f"{w.kind.resource}/scale", w.name, w.kind.call(self._apps, "patch", scale=True),
                    w.name, self.namespace, {"metadata": {"resourceVersion": rv}, "spec": {"replicas": n}},
                    field_manager=self.cfg.field_manager, dry_run="All" if dry_run else None, _content_type=MERGE_PATCH)
            except ApiError as e:
                if e.status == 409:
                    self._read.pop(role, None)
                    done = f" (already {'validated' if dry_run else 'set'}: {applied})" if applied else ""
                    raise Conflict(f"{role}: {w} changed since it was read at resourceVersion {rv}; "
                                   f"re-read and decide again{done}") from e
                raise
            applied[role] = scale.spec.replicas
            if not dry_run:
                self._read[role] = (scale.metadata.resource_version, "")
                log.info("scaled %s (%s %s/%s) to %d", role, w.kind.name, self.namespace, w.name, n)
        patched = ", ".join(sorted({f"{self._workloads[role].kind.resource}/scale" for role in targets}))
        return ApplyResult(applied=applied, dry_run=dry_run,
                           detail=("dry run (dryRun=All): nothing stored" if dry_run else f"patched {patched}"))

    async def _call(self, verb: str, group: str, resource: str, name: str, fn, *args, **kwargs):
        """Every API call (services/planner/kubeapi.py: checked against RBAC, rate-limited, retried)."""
        return await self.kube.call(verb, group, resource, name, fn, *args, **kwargs)
