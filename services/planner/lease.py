"""One planner writes at a time: a coordination.k8s.io/v1 Lease, acquired and renewed in a background
task with client-go's algorithm and timings (written here because the aio client's LeaseLock cannot
create its Lease). Expiry is judged by this planner's own clock: when the holder's record last changed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from kubernetes import client

from services.planner.kubeapi import ApiError, KubeApi, micro_time

log = logging.getLogger(__name__)


class LeaderLease:
    """The Lease `name` in the API's namespace, held by `identity` while it renews it. Timings are
    client-go's, as fractions of `duration_s`: renewed every duration/5, and this planner leads only
    within 2/3 of the duration after its last successful renewal."""

    def __init__(self, api: KubeApi, name: str, identity: str, duration_s: float):
        self.api, self.name, self.identity = api, name, identity
        self._lease_s = max(1, math.ceil(duration_s))
        self._renew_deadline_s = duration_s * 2 / 3   # lead only this long after the last renewal
        self._retry_period_s = duration_s / 5
        self.renewed_at: float | None = None         # monotonic start of the last successful acquire/renew
        self._observed: tuple = ()                   # the other holder's record, and when we saw it change
        self._observed_at = 0.0
        self._leases: client.CoordinationV1Api | None = None

    def bind(self, api_client: client.ApiClient) -> None:
        """The API client to call through (known once the backend has loaded it)."""
        self._leases = client.CoordinationV1Api(api_client)

    def _coordination(self) -> client.CoordinationV1Api:
        assert self._leases is not None, "bind() first"
        return self._leases

    @property
    def leader(self) -> bool:
        """True only while this planner holds the Lease (renewed within the renew deadline)."""
        return self.renewed_at is not None and time.monotonic() - self.renewed_at < self._renew_deadline_s

    def forget(self) -> None:
        """No longer leading (closed)."""
        self.renewed_at = None

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self._retry_period_s)
            await self.elect_once()

    async def elect_once(self) -> None:
        try:
            await self._try_acquire_or_renew()
        except ApiError as e:   # keep trying; `leader` lapses by itself after the renew deadline
            log.warning("leader election: %s", e)

    async def _try_acquire_or_renew(self) -> None:
        started = time.monotonic()
        name, ns = self.name, self.api.namespace
        now = micro_time()
        try:
            lease = await self.api.call("get", "coordination.k8s.io", "leases", name,
                                     self._coordination().read_namespaced_lease, name, ns)
        except ApiError as e:
            if e.status != 404:
                raise
            body = {"metadata": {"name": name}, "spec": {
                "holderIdentity": self.identity, "leaseDurationSeconds": self._lease_s,
                "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
            try:
                await self.api.call("create", "coordination.k8s.io", "leases", name,
                                 self._coordination().create_namespaced_lease, ns, body)
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
            "acquireTime": micro_time(spec.acquire_time) if mine and spec.acquire_time else now, "renewTime": now,
            "leaseTransitions": (spec.lease_transitions or 0) + (0 if mine else 1)}}
        try:
            await self.api.call("update", "coordination.k8s.io", "leases", name,
                             self._coordination().replace_namespaced_lease, name, ns, body)
        except ApiError as e:
            if e.status == 409:   # someone else wrote it since we read it
                return self._not_leader()
            raise
        self._leading(started)

    def _leading(self, started: float) -> None:
        if not self.leader:
            log.info("leader election: %s now holds Lease %s/%s", self.identity, self.api.namespace, self.name)
        self.renewed_at = started

    def _not_leader(self) -> None:
        if self.renewed_at is not None:
            log.warning("leader election: %s lost Lease %s/%s", self.identity, self.api.namespace, self.name)
        self.renewed_at = None

    async def release(self) -> None:
        name = self.name
        lease = await self.api.call("get", "coordination.k8s.io", "leases", name,
                                 self._coordination().read_namespaced_lease, name, self.api.namespace)
        if (lease.spec.holder_identity or "") != self.identity:
            return
        now = micro_time()
        body = {"metadata": {"name": name, "resourceVersion": lease.metadata.resource_version}, "spec": {
            "holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
            "leaseTransitions": lease.spec.lease_transitions or 0}}
        await self.api.call("update", "coordination.k8s.io", "leases", name,
                         self._coordination().replace_namespaced_lease, name, self.api.namespace, body)
        log.info("leader election: %s released Lease %s/%s", self.identity, self.api.namespace, name)
