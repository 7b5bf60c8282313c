"""What a planner backend does: report the replicas it runs and where they serve, and set counts.

Backends: `local` (a process supervisor), `kubernetes` (the scale subresources of the actor Deployment
and the learner StatefulSet) and `dry-run` (decides, never applies). The planner core
(services/planner/core.py, through observe.py) only talks to this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# The roles the planner scales by replica counts. Buffer shards are scaled one at a time through a backend's
# optional `scales_buffers`, `buffer_list()`, `add_buffer()` and `remove_buffer(address)`
# (services/planner/shards.py).
ROLES = ("actor", "learner")


class Conflict(Exception):
    """The replica count changed under us (HTTP 409 on the scale subresource): re-read and decide again."""


class Refused(Exception):
    """The backend will not manage a role (e.g. an HPA targets its workload); the message says why."""


@dataclass
class Replica:
    """One running replica of a role, as the backend sees it."""
    name: str
    address: str          # host:port of its gRPC server ("" while it is not serving yet)
    ready: bool = True
    policy: str = ""      # a learner of a run of several policies (config `policies`): the one it trains


@dataclass
class RoleState:
    """A role as the backend sees it now."""
    desired: int                                    # the replica count currently set
    replicas: list[Replica] = field(default_factory=list)  # the ones that exist (ready or not)
    blocked: str = ""       # non-empty: the backend will not scale this role, and why (HPA, pause annotation)

    @property
    def ready(self) -> int:
        return sum(1 for r in self.replicas if r.ready and r.address)


@dataclass
class ApplyResult:
    applied: dict[str, int]               # role -> replica count now set (or that would be set, on dry run)
    dry_run: bool = False
    detail: str = ""


class Backend(Protocol):
    name: str

    async def start(self) -> None:
        """Connect; start what runs in the background (local: the initial processes; kubernetes: the
        leader-election loop)."""

    @property
    def leader(self) -> bool:
        """Whether this planner may write now (kubernetes: holds the Lease; others: always)."""

    async def observe(self) -> dict[str, RoleState]:
        """Current state of every role in ROLES."""

    async def buffers(self) -> list[Replica]:
        """The buffers (not scaled; the planner reads their GetStats for the realised replay ratio)."""

    async def apply(self, targets: dict[str, int], *, dry_run: bool = False) -> ApplyResult:
        """Set replica counts (only the roles in `targets`). Raises Conflict on a concurrent change,
        Refused when a role may not be managed; dry_run validates without changing anything."""

    async def close(self) -> None:
        """Stop what the backend runs (local: drains and stops its processes)."""


class DryRunBackend:
    """Decisions only: observes through another backend and never changes anything (every apply is
    a dry run, which the Kubernetes backend still validates server-side)."""
    name = "dry-run"

    def __init__(self, inner: Backend):
        self.inner = inner

    async def start(self) -> None:
        await self.inner.start()

    @property
    def leader(self) -> bool:
        return self.inner.leader

    async def observe(self) -> dict[str, RoleState]:
        return await self.inner.observe()

    async def buffers(self) -> list[Replica]:
        return await self.inner.buffers()

    async def apply(self, targets: dict[str, int], *, dry_run: bool = True) -> ApplyResult:
        return await self.inner.apply(targets, dry_run=True)

    async def close(self) -> None:
        await self.inner.close()
