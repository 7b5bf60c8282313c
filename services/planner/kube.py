"""The Kubernetes backend: roles are workloads, replicas are the Endpoints of their headless Services.

Each role the planner scales is a workload of one kind (WORKLOADS): the actors a Deployment, the learners
a StatefulSet (its pods' ordinals are the learner group's ranks). For each it reads the workload
(`deployments` / `statefulsets` get) and its scale subresource, lists the HPAs of the namespace and
reads the Endpoints of the role's headless Service; it writes ONLY the scale subresource
(`deployments/scale`, `statefulsets/scale`: a merge patch that carries the resourceVersion it read, with
the configured field manager), so a concurrent change gives 409 -> `Conflict`, and the planner core
re-reads and decides again. It refuses (`Refused`, naming the HPA) to scale a workload an HPA targets,
and leaves alone a workload annotated `<pause_annotation>: "true"`. Both kinds go through the same code,
parameterised by `Kind`. One planner writes at a time: a coordination.k8s.io/v1 Lease, renewed in a
background task (client-go's algorithm, written here because the aio client's LeaseLock cannot create
its Lease).

Every API call goes through `_call`, which checks it against services/planner/rbac.RULES (a call not
listed there is a bug and raises), records it in `calls`, waits on a client-side token bucket
(qps/burst), runs the blocking official client in a thread, retries 429 (honouring Retry-After), 5xx and
connection failures with capped exponential backoff and jitter, and turns what remains into an
`ApiError` whose message names the verb, resource, object and namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import math
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from services.common.config import KubernetesPlannerConfig
from services.planner import rbac
from services.planner.backend import ROLES, ApplyResult, Conflict, Refused, Replica, RoleState

log = logging.getLogger(__name__)

IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
MAX_ATTEMPTS = 5            # per call: the first try plus up to 4 retries of 429 / 5xx / connection failures
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 10.0
RETRY_AFTER_CAP_S = 60.0
MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    """The Kubernetes API refused or failed a call; `status` is the HTTP status (0: no response)."""

    def __init__(self, verb: str, group: str, resource: str, name: str, namespace: str, status: int,
                 reason: str, message: str, retry_after: float | None = None):
        self.verb, self.group, self.resource, self.name, self.namespace = verb, group, resource, name, namespace
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after
        what = f"{verb} {group + '/' if group else ''}{resource}" + (f" {name!r}" if name else "")
        where = f" in namespace {namespace!r}" if namespace else ""
        status_text = f"HTTP {status} {reason}".strip() if status else "no response"
        hint = ""
        if status in (401, 403):
            hint = (" (the planner's identity lacks this permission: its Role must grant the rules in "
                    "services/planner/rbac.py)")
        super().__init__(f"kubernetes API: {what}{where} failed with {status_text}: {message}{hint}")


class TokenBucket:
    """Client-side rate limit: `qps` tokens per second, at most `burst` saved up. `reserve()` takes a
    token (the bucket may go negative) and returns how long the caller must wait before using it."""

    def __init__(self, qps: float, burst: int, clock=time.monotonic):
        self.qps, self.burst, self._clock = qps, burst, clock
        self._tokens = float(burst)
        self._last = clock()

    def reserve(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
        self._last = now
        self._tokens -= 1
        return max(0.0, -self._tokens / self.qps)

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            await asyncio.sleep(delay)


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


@dataclass(frozen=True)
class Workload:
    kind: Kind
    name: str

    def __str__(self) -> str:
        return f"{self.kind.name} {self.name!r}"


def _retry_after(headers) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped; None if absent/bad."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = (email.utils.parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP_S)


def _status_message(e: ApiException) -> str:
    try:
        return json.loads(e.body).get("message") or e.body
    except (TypeError, ValueError, AttributeError):
        return (e.body or "").strip() or str(e.reason)


def _micro_time(dt: datetime | None = None) -> str:
    """RFC 3339 with microseconds, as a MicroTime field wants it."""
    return (dt or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubernetesBackend:
    """Backend over the workloads named in `cfg` (see the module docstring).

    `namespace` overrides cfg.namespace; `kubeconfig` is a file to load (default: in-cluster service-account
    auth, else ~/.kube/config); `api_client` (tests) is used as given and not closed. `identity` names this
    planner in the Lease (default: hostname + a random suffix). All methods are coroutines that never block
    the event loop; API failures raise ApiError."""

    name = "kubernetes"

    def __init__(self, cfg: KubernetesPlannerConfig, *, namespace: str | None = None, kubeconfig: str | None = None,
                 api_client: client.ApiClient | None = None, identity: str | None = None,
                 request_timeout_s: float = 15.0):
        self.cfg = cfg
        self.namespace = namespace or cfg.namespace
        self.identity = identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.calls: set[tuple[str, str, str]] = set()   # (group, resource, verb) of every call made
        self._kubeconfig = kubeconfig
        self._api = api_client
        self._owns_api = api_client is None
        self._timeout = request_timeout_s
        self._limiter = TokenBucket(cfg.qps, cfg.burst)
        names = {"actor": cfg.actor_deployment, "learner": cfg.learner_statefulset}
        self._workloads = {role: Workload(WORKLOADS[role], names[role]) for role in ROLES}
        self._services = {"actor": cfg.actor_service, "learner": cfg.learner_service, "buffer": cfg.buffer_service}
        self._read: dict[str, tuple[str, str]] = {}    # role -> (resourceVersion, pause reason) as last read
        # Leader election (client-go's timings as fractions of the lease duration).
        self._lease_s = max(1, math.ceil(cfg.lease_duration_s))
        self._renew_deadline_s = cfg.lease_duration_s * 2 / 3   # lead only this long after the last renewal
        self._retry_period_s = cfg.lease_duration_s / 5
        self._renewed_at: float | None = None          # monotonic start of the last successful acquire/renew
        self._observed: tuple = ()                     # the other holder's record, and when we saw it change
        self._observed_at = 0.0
        self._task: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect and, with leader election on, try for the Lease once and keep trying in the background."""
        if self._api is None:
            self._api, detected = await asyncio.to_thread(_load_client, self._kubeconfig)
            self.namespace = self.namespace or detected
        self.namespace = self.namespace or "default"
        self._apps = client.AppsV1Api(self._api)
        self._core = client.CoreV1Api(self._api)
        self._autoscaling = client.AutoscalingV1Api(self._api)
        self._coordination = client.CoordinationV1Api(self._api)
        log.info("kubernetes backend: namespace %s, workloads %s, identity %s, leader election %s",
                 self.namespace, {role: str(w) for role, w in self._workloads.items()}, self.identity,
                 self.cfg.leader_election)
        if self.cfg.leader_election:
            await self._elect_once()
            self._task = asyncio.create_task(self._elect_forever(), name="planner-lease")

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
                await self._release()
        self._renewed_at = None
        if self._owns_api and self._api is not None:
            self._api.close()
            self._api = None

    @property
    def leader(self) -> bool:
        """True only while this planner holds the Lease (renewed within the renew deadline); always True
        with leader_election off."""
        if not self.cfg.leader_election:
            return True
        return self._renewed_at is not None and time.monotonic() - self._renewed_at < self._renew_deadline_s

    # ---- observe -------------------------------------------------------------------------------------
    async def observe(self) -> dict[str, RoleState]:
        hpas = await self._hpa_targets()
        return {role: await self._observe_role(role, hpas) for role in ROLES}

    async def _observe_role(self, role: str, hpas: dict[tuple[str, str], str]) -> RoleState:
        w = self._workloads[role]
        try:
            desired, _, paused = await self._read_workload(role)
        except ApiError as e:
            if e.status != 404:
                raise
            self._read.pop(role, None)
            return RoleState(desired=0, blocked=f"{w} not found in namespace {self.namespace!r}")
        blocked = self._hpa_reason(w, hpas) or paused
        return RoleState(desired=desired, replicas=await self._replicas(role), blocked=blocked)

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

    async def buffers(self) -> list[Replica]:
        return await self._replicas("buffer")

    async def _replicas(self, role: str) -> list[Replica]:
        """The replicas in the Endpoints of the role's headless Service (ready and not ready), addressed at
        the port named cfg.grpc_port_name ("" where the Service has no such port)."""
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
                    replicas.append(Replica(name=name, address=f"{host}:{port}" if port else "", ready=ready))
        return replicas

    # ---- apply ---------------------------------------------------------------------------------------
    async def apply(self, targets: dict[str, int], *, dry_run: bool = False) -> ApplyResult:
        """Patch the scale subresource of each role's workload in `targets`, conditional on the resourceVersion
        read by the last observe(); raises Conflict (409: changed since), Refused (an HPA targets it, it is
        paused, or this planner is not the leader) before writing anything, ValueError for an unknown role or
        a negative count. dry_run: the API server validates and nothing is stored (dryRun=All)."""
        for role, n in targets.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}: the planner scales {ROLES}")
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

    # ---- leader election -----------------------------------------------------------------------------
    async def _elect_forever(self) -> None:
        while True:
            await asyncio.sleep(self._retry_period_s)
            await self._elect_once()

    async def _elect_once(self) -> None:
        try:
            await self._try_acquire_or_renew()
        except ApiError as e:   # keep trying; `leader` lapses by itself after the renew deadline
            log.warning("leader election: %s", e)

    async def _try_acquire_or_renew(self) -> None:
        started = time.monotonic()
        name, ns = self.cfg.lease_name, self.namespace
        now = _micro_time()
        try:
            lease = await self._call("get", "coordination.k8s.io", "leases", name,
                                     self._coordination.read_namespaced_lease, name, ns)
        except ApiError as e:
            if e.status != 404:
                raise
            body = {"metadata": {"name": name}, "spec": {
                "holderIdentity": self.identity, "leaseDurationSeconds": self._lease_s,
                "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
            try:
                await self._call("create", "coordination.k8s.io", "leases", name,
                                 self._coordination.create_namespaced_lease, ns, body)
            except ApiError as e2:
                if e2.status == 409:   # another planner created it first
                    return self._not_leader()
                raise
            return self._leading(started)
        spec = lease.spec
        holder = spec.holder_identity or ""
        record = (holder, str(spec.renew_time), spec.lease_transitions)
        if record != self._observed:   # judge expiry by our own clock: when did the record last change?
            self._observed, self._observed_at = record, started
        duration = spec.lease_duration_seconds or self._lease_s
        if holder and holder != self.identity and started - self._observed_at < duration:
            return self._not_leader()
        mine = holder == self.identity
        body = {"metadata": {"name": name, "resourceVersion": lease.metadata.resource_version}, "spec": {
            "holderIdentity": self.identity, "leaseDurationSeconds": self._lease_s,
            "acquireTime": _micro_time(spec.acquire_time) if mine and spec.acquire_time else now, "renewTime": now,
            "leaseTransitions": (spec.lease_transitions or 0) + (0 if mine else 1)}}
        try:
            await self._call("update", "coordination.k8s.io", "leases", name,
                             self._coordination.replace_namespaced_lease, name, ns, body)
        except ApiError as e:
            if e.status == 409:   # someone else wrote it since we read it
                return self._not_leader()
            raise
        self._leading(started)

    def _leading(self, started: float) -> None:
        if not self.leader:
            log.info("leader election: %s now holds Lease %s/%s", self.identity, self.namespace, self.cfg.lease_name)
        self._renewed_at = started

    def _not_leader(self) -> None:
        if self._renewed_at is not None:
            log.warning("leader election: %s lost Lease %s/%s", self.identity, self.namespace, self.cfg.lease_name)
        self._renewed_at = None

    async def _release(self) -> None:
        name = self.cfg.lease_name
        lease = await self._call("get", "coordination.k8s.io", "leases", name,
                                 self._coordination.read_namespaced_lease, name, self.namespace)
        if (lease.spec.holder_identity or "") != self.identity:
            return
        now = _micro_time()
        body = {"metadata": {"name": name, "resourceVersion": lease.metadata.resource_version}, "spec": {
            "holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
            "leaseTransitions": lease.spec.lease_transitions or 0}}
        await self._call("update", "coordination.k8s.io", "leases", name,
                         self._coordination.replace_namespaced_lease, name, self.namespace, body)
        log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, name)

    # ---- the one way to the API ----------------------------------------------------------------------
    async def _call(self, verb: str, group: str, resource: str, name: str, fn, *args, **kwargs):
        """Run one blocking client call in a thread, rate-limited and retried (see the module docstring)."""
        if not rbac.allowed(group, resource, verb):
            raise RuntimeError(f"bug: the planner tried to {verb} {group or 'core'}/{resource}, which "
                               f"services/planner/rbac.py RULES does not grant")
        self.calls.add((group, resource, verb))
        for attempt in range(MAX_ATTEMPTS):
            await self._limiter.acquire()
            try:
                return await asyncio.to_thread(fn, *args, _request_timeout=self._timeout, **kwargs)
            except ApiException as e:
                err = ApiError(verb, group, resource, name, self.namespace, e.status or 0, e.reason or "",
                               _status_message(e), _retry_after(e.headers))
            except (urllib3.exceptions.HTTPError, OSError) as e:
                err = ApiError(verb, group, resource, name, self.namespace, 0, "", f"connection failed: {e}")
            if not (err.status in (0, 429) or err.status >= 500) or attempt == MAX_ATTEMPTS - 1:
                raise err
            delay = err.retry_after
            if delay is None:
                delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt) * random.uniform(0.5, 1.0)
            log.info("%s; retrying in %.2f s (attempt %d of %d)", err, delay, attempt + 2, MAX_ATTEMPTS)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")


def _load_client(kubeconfig: str | None) -> tuple[client.ApiClient, str]:
    """Blocking: an ApiClient from `kubeconfig` if given, else in-cluster auth, else ~/.kube/config; and the
    namespace that source names ("" if none). urllib3 retries only failed connections: status codes
    (429/5xx) are retried by KubernetesBackend._call, which honours Retry-After and the rate limit."""
    cfg = client.Configuration()
    namespace = ""
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            with contextlib.suppress(OSError), open(IN_CLUSTER_NAMESPACE) as f:
                namespace = f.read().strip()
        except config.ConfigException:
            kubeconfig = os.path.expanduser("~/.kube/config")
    if kubeconfig is not None:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
        _, active = config.list_kube_config_contexts(kubeconfig)
        namespace = (active or {}).get("context", {}).get("namespace", "")
    cfg.retries = urllib3.Retry(total=None, connect=2, read=0, redirect=0, status=0, other=0,
                                respect_retry_after_header=False)
    return client.ApiClient(cfg), namespace
