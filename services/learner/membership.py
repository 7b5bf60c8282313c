"""Who is in the learner group: a fixed group given by flags, or the pods of a StatefulSet.

A **fixed group** (`--rank/--world-size/--group`, as `kuberl up`'s supervisor starts it) never changes
while its learners live: a member that leaves breaks the group, every learner exits, and the supervisor
forms the group again (services/common/local/supervise.py).

On Kubernetes the learners are the pods of a **StatefulSet** (`--membership=statefulset`): pod
`<name>-<i>` is rank i, rank 0 hosts the rendezvous at a stable DNS name of the StatefulSet's governing
Service, and the group's size is the StatefulSet's `spec.replicas`, which the planner writes through the
scale subresource. Each learner reads that number from the API server (its ServiceAccount may `get` the
scale of that one StatefulSet and nothing else: RBAC_RULES) and watches it. When it changes, or a peer
leaves, the group ends at a round boundary and is formed again inside the same processes (rank 0
checkpoints, and the new group starts from that checkpoint), so no pod restarts and kubelet's crash
back-off never delays a re-formation. Each group is a new generation at rank 0's rendezvous, in a
namespace of its own (services/learner/distributed.py, `Rendezvous`); a size that changes while a group
forms abandons that formation for one of the new size. A pod whose ordinal is outside the group (being
removed by a scale-down) waits, not ready, for its SIGTERM.

The API is read with the standard library (the learner image carries no Kubernetes client): the pod's
token is read again for every request, because projected tokens are rotated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from services.learner.distributed import GroupSpec, Rendezvous

log = logging.getLogger(__name__)

# What a learner's ServiceAccount must be granted, on its own StatefulSet only (resourceNames); the
# manifests (k8s/base, the Helm chart) must grant exactly this.
RBAC_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (("apps", "statefulsets/scale", ("get",)),)
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
POLL_S = 2.0          # how often a learner reads its StatefulSet's size
READ_TIMEOUT_S = 10.0
ORDINAL = re.compile(r"^(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-(?P<ordinal>\d+)$")


class MembershipError(RuntimeError):
    """The group's size could not be read (the message says what to fix)."""


def split_ordinal(pod_name: str) -> tuple[str, int]:
    """('kuberl-learner', 2) from 'kuberl-learner-2': a StatefulSet's pod name is its name and ordinal."""
    m = ORDINAL.match(pod_name)
    if m is None:
        raise ValueError(f"pod name {pod_name!r} is not <statefulset>-<ordinal>: with --membership=statefulset "
                         f"the learner id must be its StatefulSet pod's name (--learner-id=$(POD_NAME))")
    return m["name"], int(m["ordinal"])


class FixedGroup:
    """A group whose size and ranks are given once (or a learner alone: world size 1)."""

    elastic = False

    def __init__(self, spec: GroupSpec):
        self.spec, self.rank = spec, spec.rank
        self.rendezvous = Rendezvous(spec.address, spec.rank, spec.timeout_s) if spec.world_size > 1 else None

    async def world_size(self) -> int:
        return self.spec.world_size

    async def wait_for_change(self, world_size: int) -> int:
        await asyncio.Event().wait()   # never changes
        raise AssertionError("unreachable")


class ScaleReader:
    """`spec.replicas` of one StatefulSet, read through its scale subresource with the pod's token.

    `api` defaults to the in-cluster address ($KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, https,
    verified against the ServiceAccount's CA); `token_file` and `ca_file` default to the mounted
    ServiceAccount's. Blocking: callers run it in a thread."""

    def __init__(self, namespace: str, name: str, *, api: str | None = None, token_file: str | Path | None = None,
                 ca_file: str | Path | None = None, timeout_s: float = READ_TIMEOUT_S):
        api_from_env = api is None
        if api is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise MembershipError("--membership=statefulset needs the Kubernetes API: $KUBERNETES_SERVICE_HOST "
                                      "is not set (is this learner running in a pod?)")
            api = f"https://{f'[{host}]' if ':' in host else host}:{port}"
        self.namespace, self.name, self.timeout_s = namespace, name, timeout_s
        self.url = f"{api.rstrip('/')}/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}/scale"
        # An explicit `api` (e.g. `kubectl proxy`'s http://127.0.0.1:8001) may need no token: then the
        # ServiceAccount's is sent only where it exists.
        self.token_file = Path(token_file) if token_file is not None else SERVICE_ACCOUNT_DIR / "token"
        self.token_required = api_from_env or token_file is not None
        ca = Path(ca_file) if ca_file is not None else SERVICE_ACCOUNT_DIR / "ca.crt"
        self._context = None
        if self.url.startswith("https:"):
            self._context = ssl.create_default_context(cafile=str(ca) if ca.exists() or ca_file else None)

    def replicas(self) -> int:
        what = f"StatefulSet {self.name!r} in namespace {self.namespace!r}"
        headers = {"Accept": "application/json"}
        if self.token_required or self.token_file.exists():
            try:
                headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
            except OSError as err:
                raise MembershipError(f"reading the ServiceAccount token {self.token_file}: {err} (the learner "
                                      f"pod needs automountServiceAccountToken: true)") from err
        request = urllib.request.Request(self.url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context) as response:
                body = json.load(response)
        except urllib.error.HTTPError as err:
            hint = {401: " (the token was refused)",
                    403: f" (the learner's ServiceAccount must be granted {RBAC_RULES} on {self.name!r})",
                    404: " (no such StatefulSet: --learner-id must be the pod's name)"}.get(err.code, "")
            raise MembershipError(f"reading the scale of {what}: HTTP {err.code} {err.reason}{hint}") from err
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise MembershipError(f"reading the scale of {what} at {self.url}: {err}") from err
        replicas = (body.get("spec") or {}).get("replicas", 0) if isinstance(body, dict) else None
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise MembershipError(f"the scale of {what} has no valid spec.replicas: {json.dumps(body)[:200]}")
        return replicas


class StatefulSetGroup:
    """The learners are the pods of a StatefulSet (see the module docstring). `pod_name` gives the rank
    and, by default, the StatefulSet's name; `address` is rank 0's rendezvous host:port."""

    elastic = True

    def __init__(self, pod_name: str, address: str, *, namespace: str = "", api: str | None = None,
                 poll_s: float = POLL_S, timeout_s: float = 120.0):
        statefulset, self.rank = split_ordinal(pod_name)
        if not address:
            raise ValueError("--membership=statefulset needs --group: rank 0's rendezvous host:port "
                             "(<statefulset>-0.<governing service>:<port>)")
        namespace = namespace or os.environ.get("POD_NAMESPACE") or _own_namespace()
        self.address, self.poll_s, self.timeout_s = address, poll_s, timeout_s
        self.rendezvous = Rendezvous(address, self.rank, timeout_s)
        self.reader = ScaleReader(namespace, statefulset, api=api)
        self.read_errors = 0

    async def world_size(self) -> int:
        """The StatefulSet's replicas; read errors are logged and retried (the API server may be restarting)."""
        delay = self.poll_s
        while True:
            try:
                return await asyncio.to_thread(self.reader.replicas)
            except MembershipError as err:
                self.read_errors += 1
                log.warning("%s; trying again in %.0f s", err, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def wait_for_change(self, world_size: int) -> int:
        """Return the group's size once it differs from `world_size`."""
        while True:
            await asyncio.sleep(self.poll_s)
            n = await self.world_size()
            if n != world_size:
                log.info("the learner StatefulSet now has %d replicas (the group has %d)", n, world_size)
                return n


def _own_namespace() -> str:
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
    except OSError as err:
        raise MembershipError(f"no namespace: set $POD_NAMESPACE or mount the ServiceAccount ({err})") from err
