"""Synchronous data-parallel training across learners: gradients averaged with torch.distributed (gloo
between CPU learners; NCCL between GPU learners, for the gradients only: `gradient_backend`).

Every learner pulls its own batches from the buffer and computes gradients on them; before each
optimizer step the learners all-reduce their gradients, weighted by the samples each trained on, so
every learner applies the same averaged gradient and their parameters stay identical (as in PyTorch's
DistributedDataParallel). Policy versions therefore agree across learners, any learner can serve
weights to actors, and only rank 0 writes checkpoints.

Collectives must be matched call for call on every rank. The learners therefore move in rounds: each
round starts with `agree`, an all-reduce of (stop wanted, no batch in hand); a round trains only when
every learner holds a batch, and all stop at the same round boundary when any wants to stop. A learner
with a batch it cannot use (malformed, or all fragments too stale) still joins the round's gradient
all-reduces with weight 0, so nobody waits forever. A peer that dies breaks the group: the others'
collectives raise `GroupBroken`. In a fixed group the learner then exits (its supervisor,
services/common/local/supervise.py, stops the rest and re-forms the whole group from the newest checkpoint,
under `kuberl up` with or without the planner; membership changes restart it the same way); a
StatefulSet's learners form the next group in their running processes (services/learner/membership.py).

A step whose gradient is not finite is skipped, and the group must skip it together or its members'
parameters part. The decision is therefore taken on the averaged gradient, which is the same on every
member (a NaN anywhere makes the sum NaN everywhere); a member whose own loss is not finite makes its
gradient NaN before the average, so its verdict reaches the others too (`average_over_group`,
`finite_gradients`).

**Generations** (`Rendezvous`). A StatefulSet's learners form group after group in the same processes,
at the same address (services/learner/membership.py). Each group is a *generation* with a namespace of
its own in rank 0's store, as TorchElastic's rendezvous rounds and torchft's quorums have: otherwise a
member reads the keys the previous group left (gloo's addresses of ranks that have moved on) and
waits on dead peers until the timeout, or two members count their groups differently (torch names its
default group by a process-wide counter that a failed attempt advances) and never meet. Rank 0 hosts
the store for as long as its process lives and alone opens generations; the group is built with a
`ProcessGroupGloo` of its own, not torch's process-wide default group, so nothing but the store carries
from one generation to the next.

**Backends.** The round's agreement and rank 0's state travel over gloo whatever the device (small,
CPU-side, and gloo's timeouts are what notice a departed peer). The gradients, the only large and
frequent traffic, go over NCCL when the learners train on CUDA and torch has NCCL: straight from the
GPU, as DistributedDataParallel does, without the two copies through the CPU that gloo needs. Each
generation builds its NCCL group in its own namespace of the store (`g/<g>/nccl/`), beside gloo's.
"""

from __future__ import annotations

import io
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
STORE_PREFIX = "kuberl/learners/"   # this package's keys in rank 0's store
POLL_S = 0.05                       # how often a member waiting for the others reads the store
KEEPALIVE_S = 10.0                  # a member that joined and is not heard from for this long is given up
GLOO_CONNECT_S = 20.0               # gloo's connections are made within this long of `go`
STORE_ATTEMPT_S = 1.0               # a member tries to reach rank 0's store in attempts this long


class GroupBroken(RuntimeError):
    """A collective failed: a peer learner died or could not be reached."""


class FormationAbandoned(GroupBroken):
    """The group being formed was given up at the caller's request (its size changed, or the learner is
    stopping): nothing failed, and the next attempt may start at once."""


@dataclass(frozen=True)
class GroupSpec:
    rank: int
    world_size: int
    address: str          # host:port of rank 0's rendezvous store
    timeout_s: float = 120.0

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world size: {self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: {self.rank} must lie in 0..{self.world_size - 1} (world size {self.world_size})")
        if self.world_size > 1 and not self.address:
            raise ValueError("a group of more than one learner needs the rendezvous address (host:port of rank 0)")
        if self.world_size > 1:
            host_port(self.address)


def host_port(address: str) -> tuple[str, int]:
    """('kuberl-learner-0.kuberl-learner-group', 29500) from its 'host:port' (ValueError naming it)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"the rendezvous address {address!r} must be host:port (rank 0's)")
    return host.strip("[]"), int(port)


class Rendezvous:
    """Where one learner meets its group, generation after generation: rank 0's TCPStore at `address`.

    The contract, in the store under STORE_PREFIX (rank 0 alone writes `generation`, `open`, `go`, `gone`):
    - Rank 0 hosts the store from its first formation until its process ends, so generation numbers
      only grow while anybody can read them; a restarted rank 0 starts a new store, and the others
      connect to it afresh (each of their formations opens a new connection). A member tries to connect
      in attempts of `store_attempt_s` until its deadline, and `abandon` is honoured between them, so a
      size change or a stop is not held up behind a rank 0 that is down.
    - Rank 0 opens generation g for n members: g = the store's atomic add on `generation`, then
      `open` = "g n".
    - A member of rank r joins the generation `open` names if it is for the member's own size n and
      neither closed (`g/<g>/go`) nor given up (`g/<g>/gone`): it writes `g/<g>/rank/<r>`. Otherwise it
      waits for the next one. So a pod that joins late (restarted) finds the current generation, and
      one that reads `open` before rank 0 has left the previous group waits for rank 0. Until rank 0's
      word, a member that joined adds 1 to its heartbeat `g/<g>/alive/<r>` at each read (every POLL_S).
    - Rank 0 closes g (writes `go`) once ranks 1..n-1 have all joined it, or gives it up (writes
      `gone`): at the timeout, on `abandon`, or once a member that joined has not moved its heartbeat
      for `keepalive_s` (it died: GroupBroken naming it, after `keepalive_s` rather than the timeout; as
      TorchElastic's rendezvous keep-alive, but judged by rank 0's own clock between its own reads, so
      neither clocks that differ nor a pause of rank 0 count anybody dead). On `gone` the members that
      joined look for the next generation.
    - On `go` every member builds gloo in the namespace `g/<g>/gloo/`, where no key of another
      generation lies. Its connections must be made within `gloo_connect_s` (a member that dies after
      `go` breaks the formation for the others after that long, GroupBroken, not after the timeout);
      the group's collectives then wait up to `timeout_s` for a slow peer.
    - Once g is closed, rank 0 deletes every key of the generations before it, gloo's included: nobody
      needs them, because a member still waiting on an earlier generation finds `open` naming a later one
      and takes its own as given up. So the store holds the keys of the last closed generation and of
      those opened since (and, at most, a heartbeat a late member wrote after the deletion, deleted at
      the next close).

    `form` waits for the others at most `timeout_s`, and for gloo's connections at most `gloo_connect_s`
    more (then GroupBroken). `abandon` set makes it raise FormationAbandoned at its next read of the
    store, except in a member that has joined a generation: rank 0 may be closing it with that member
    counted in, so it waits for `go` or `gone`."""

    def __init__(self, address: str, rank: int, timeout_s: float = 120.0, *, keepalive_s: float = KEEPALIVE_S,
                 gloo_connect_s: float = GLOO_CONNECT_S, store_attempt_s: float = STORE_ATTEMPT_S,
                 device: torch.device | None = None):
        self.device = device or torch.device("cpu")   # where the learner trains: picks the gradients' backend
        self.host, self.port = host_port(address)
        self.address, self.rank, self.timeout_s = address, rank, timeout_s
        self.keepalive_s, self.gloo_connect_s, self.store_attempt_s = keepalive_s, gloo_connect_s, store_attempt_s
        self.token = f"{os.getpid()}-{time.monotonic_ns()}"   # names this process's entries, for debugging
        self._server: dist.Store | None = None   # rank 0: the store it hosts, kept across generations

    def form(self, world_size: int, abandon: threading.Event | None = None) -> GradientSync:
        """Form a group of `world_size` with this learner at its rank; blocking (see the class)."""
        spec = GroupSpec(self.rank, world_size, self.address, self.timeout_s)
        abandon = abandon or threading.Event()
        deadline = time.monotonic() + self.timeout_s
        log.info("joining a group of %d learners as rank %d (rendezvous %s)", world_size, self.rank, self.address)
        try:
            store = self._store(deadline, abandon)
            g = self._open(store, world_size, deadline, abandon) if self.rank == 0 else \
                self._join(store, world_size, deadline, abandon)
            store.set(f"g/{g}/device/{self.rank}", device_id(self.device))
            pg = self._connect(store, g, world_size)
            # Every member set its device before connecting, so all are there once gloo is connected.
            devices = [store.get(f"g/{g}/device/{r}").decode() for r in range(world_size)]
            backend, why = gradient_backend(devices)
            grads = self._connect_nccl(store, g, world_size) if backend == "nccl" else None
        except GroupBroken:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises several kinds; all mean the same here
            raise GroupBroken(f"could not form the group of {world_size} learners at {self.address}: {err}") from err
        log.info("group of %d learners formed (generation %d), gradients over %s (%s)", world_size, g, backend, why)
        return GradientSync(spec, pg, g, grads=grads, device=self.device)

    def _store(self, deadline: float, abandon: threading.Event) -> dist.Store:
        if self.rank == 0:
            if self._server is None:
                self._server = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                             timeout=timedelta(seconds=self.timeout_s))
            store = self._server
        else:   # a new client each time: rank 0 may have restarted since (and with it, its store)
            store = self._client(deadline, abandon)
        return dist.PrefixStore(STORE_PREFIX, store)

    def _client(self, deadline: float, abandon: threading.Event) -> dist.TCPStore:
        """A new connection to rank 0's store, tried every `store_attempt_s` until `deadline` (GroupBroken)
        or `abandon` (FormationAbandoned)."""
        reported = False
        while True:
            started = time.monotonic()
            try:
                # A plain socket probes first: torch's client retries inside its constructor until its
                # timeout, deaf to `abandon`, and logs a stack trace at every try.
                socket.create_connection((self.host, self.port), timeout=self.store_attempt_s).close()
                client = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=self.store_attempt_s))
                client.set_timeout(timedelta(seconds=self.timeout_s))   # what a read may wait, from now on
                return client
            except (OSError, dist.DistError) as err:
                if not reported:
                    log.info("rank 0's store at %s is not reachable yet (%s); trying every %.1f s", self.address,
                             err, self.store_attempt_s)
                    reported = True
                if abandon.wait(max(0.0, started + self.store_attempt_s - time.monotonic())):
                    raise FormationAbandoned(f"stopped trying to reach rank 0's store at {self.address}") from err
                if time.monotonic() > deadline:
                    raise GroupBroken(f"waited {self.timeout_s:.0f} s for rank 0's store at {self.address}: "
                                      f"{err}") from err

    def _open(self, store: dist.Store, n: int, deadline: float, abandon: threading.Event) -> int:
        g = store.add("generation", 1)
        store.set("open", f"{g} {n}")
        roll = _Roll(store, g, n, self.keepalive_s)
        try:
            self._wait(roll.complete, deadline, abandon, f"ranks 1..{n - 1} to join generation {g}")
        except BaseException:
            store.set(f"g/{g}/gone", self.token)   # those that joined it look for the next one
            raise
        store.set(f"g/{g}/go", self.token)
        _forget_before(store, g)
        return g

    def _join(self, store: dist.Store, n: int, deadline: float, abandon: threading.Event) -> int:
        while True:
            g = self._wait(lambda: _joinable(store, n), deadline, abandon,
                           f"rank 0 to open a generation for {n} learners")
            store.set(f"g/{g}/rank/{self.rank}", self.token)
            # Joined, it waits for rank 0's word however `abandon` stands: rank 0 may be closing g with
            # it counted in, and gloo would then wait for it until `gloo_connect_s`.
            outcome = self._wait(lambda g=g: _outcome(store, g, self.rank), deadline, None,
                                 f"the others to join generation {g}")
            if outcome == "go":
                return g
            log.info("rank 0 gave generation %d up; joining its next", g)

    def _connect(self, store: dist.Store, g: int, n: int) -> dist.ProcessGroupGloo:
        """Gloo's connections among the n members of generation g, made within `gloo_connect_s`; its
        collectives then wait up to `timeout_s` (a peer may be slow: rank 0 loading a checkpoint)."""
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"g/{g}/gloo/", store), self.rank, n,
                                   timedelta(seconds=self.gloo_connect_s))
        pg.set_timeout(timedelta(seconds=self.timeout_s))
        return pg

    def _connect_nccl(self, store: dist.Store, g: int, n: int):
        """NCCL among the n members of generation g, on this learner's GPU, for the gradients."""
        torch.cuda.set_device(self.device.index if self.device.index is not None else torch.cuda.current_device())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=self.timeout_s)
        return dist.ProcessGroupNCCL(dist.PrefixStore(f"g/{g}/nccl/", store), self.rank, n, options)

    def _wait(self, ready, deadline: float, abandon: threading.Event | None, what: str):
        """ready()'s first truthy value, read every POLL_S; GroupBroken past `deadline`, FormationAbandoned
        once `abandon` is set."""
        while not (value := ready()):
            if abandon is not None and abandon.is_set():
                raise FormationAbandoned(f"stopped waiting for {what}")
            if time.monotonic() > deadline:
                raise GroupBroken(f"waited {self.timeout_s:.0f} s for {what} at {self.address}")
            time.sleep(POLL_S)
        return value


def _joinable(store: dist.Store, n: int) -> int | None:
    """The generation rank 0 has open for `n` members and not yet closed, if any."""
    if not store.check(["open"]):
        return None
    g, size = (int(x) for x in store.get("open").split())
    return g if size == n and not store.check([f"g/{g}/go"]) and not store.check([f"g/{g}/gone"]) else None


class _Roll:
    """Rank 0's roll of generation g for n members: who has joined, and whether they still live. A member
    that joined lives while its heartbeat `g/<g>/alive/<r>` moves between rank 0's reads; one whose
    heartbeat has not moved for `keepalive_s` of rank 0's clock is taken for dead."""

    def __init__(self, store: dist.Store, g: int, n: int, keepalive_s: float):
        self.store, self.g, self.n, self.keepalive_s = store, g, n, keepalive_s
        self.heard: dict[int, tuple[int, float]] = {}   # rank -> (its heartbeat, when rank 0 saw it move)

    def complete(self) -> bool:
        """Whether ranks 1..n-1 have all joined; GroupBroken once one that joined is taken for dead."""
        now = time.monotonic()
        for r in range(1, self.n):
            if r not in self.heard and not self.store.check([f"g/{self.g}/rank/{r}"]):
                continue
            beat = self.store.add(f"g/{self.g}/alive/{r}", 0)
            last, since = self.heard.get(r, (None, now))
            if beat != last:
                self.heard[r] = (beat, now)
            elif now - since > self.keepalive_s:
                raise GroupBroken(f"rank {r} joined generation {self.g} but has not been heard from for "
                                  f"{self.keepalive_s:g} s (its learner died?)")
        return len(self.heard) == self.n - 1


def _forget_before(store: dist.Store, g: int) -> None:
    """Delete the keys of every generation before g (`store` is rank 0's, under STORE_PREFIX)."""
    for key in store.list_keys():   # (a PrefixStore lists its own keys, without its prefix)
        parts = key.split("/")
        if parts[0] == "g" and int(parts[1]) < g:
            store.delete_key(key)


def _outcome(store: dist.Store, g: int, rank: int) -> str | None:
    """What became of generation g, which this member (`rank`) joined: "go" (closed: build gloo), "gone"
    (rank 0 gave it up, or opened a later one), or None (still open). Each read is a heartbeat for rank 0."""
    store.add(f"g/{g}/alive/{rank}", 1)
    if store.check([f"g/{g}/go"]):
        return "go"
    if store.check([f"g/{g}/gone"]) or int(store.get("open").split()[0]) != g:
        return "gone"
    return None


def device_id(device: torch.device) -> str:
    """What names the chip a learner trains on, the same in every process of the host: "cpu", or
    "cuda:" and the GPU's UUID (which does not depend on CUDA_VISIBLE_DEVICES' numbering)."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"cuda:{uuid}" if uuid is not None else f"cuda:{socket.gethostname()}/{index}"


def gradient_backend(devices: list[str]) -> tuple[str, str]:
    """(backend, why) for a group whose member r trains on `devices[r]` (`device_id`): "nccl" when every
    member has a GPU of its own and torch has NCCL, else "gloo" (CPU tensors; a CUDA learner copies
    its gradients through the CPU). NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), as
    two learners on a one-GPU machine would be: their group falls back to gloo instead of breaking
    at its first all-reduce, and is re-formed in vain."""
    if any(not d.startswith("cuda:") for d in devices):
        return "gloo", "not every learner trains on CUDA"
    if not dist.is_nccl_available():
        return "gloo", "this torch has no NCCL"
    first: dict[str, int] = {}
    for rank, d in enumerate(devices):
        if d in first:
            return "gloo", f"ranks {first[d]} and {rank} share the GPU {d[5:]}, and NCCL needs one GPU per rank"
        first[d] = rank
    return "nccl", f"{len(devices)} GPUs"


class GradientSync:
    """One learner's membership of one generation of the group (`Rendezvous.form` builds it). Blocking;
    the trainer calls it from its worker thread. `grads`: the process group gradients are averaged
    over when it is not gloo's `pg` (NCCL, on `device`)."""

    def __init__(self, spec: GroupSpec, pg: dist.ProcessGroupGloo, generation: int, *, grads=None,
                 device: torch.device | None = None):
        self.spec, self.generation = spec, generation
        self.rank, self.world_size = spec.rank, spec.world_size
        self._pg: dist.ProcessGroupGloo | None = pg
        self._grads = grads
        self.device = device or torch.device("cpu")
        self.backend = "gloo" if grads is None else "nccl"

    def _all_reduce(self, t: torch.Tensor, pg=None) -> torch.Tensor:
        try:
            (pg or self._pg).allreduce([t]).wait()
        except Exception as err:  # noqa: BLE001
            raise GroupBroken(f"all-reduce across {self.world_size} learners failed (a peer is gone?): {err}") from err
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the group (a copy; gloo reduces CPU tensors, on whatever device `t` is)."""
        return self._all_reduce(t.detach().cpu().clone()).to(t.device)

    def agree(self, stop: bool, ready: bool) -> tuple[bool, bool]:
        """One round's agreement: (someone wants to stop, everyone holds a batch)."""
        t = self._all_reduce(torch.tensor([float(stop), float(not ready)]))
        return bool(t[0] > 0), bool(t[1] == 0)

    def average_gradients(self, params: list[torch.nn.Parameter], weight: float) -> float:
        """Replace each parameter's gradient with the weighted mean over the group (weight: the samples
        this learner's gradient is the mean over; 0 contributes nothing). Returns the total weight; where
        it is 0 nobody had data and the step must be skipped (on every rank alike)."""
        # One flat buffer: on the learner's device for NCCL, else on the CPU (gloo reduces CPU tensors).
        on = self.device if self._grads is not None else torch.device("cpu")
        grads = [p.grad.detach().reshape(-1).to(on) if p.grad is not None else torch.zeros(p.numel(), device=on)
                 for p in params]
        flat = torch.cat([*grads, torch.ones(1, device=on)]) * weight
        self._all_reduce(flat, self._grads)
        total = float(flat[-1])
        if total > 0:
            for p, avg in zip(params, torch.split(flat[:-1] / total, [p.numel() for p in params])):
                p.grad = avg.view_as(p).to(p.device)
        return total

    def broadcast_state(self, state: dict | None) -> dict:
        """Rank 0's training state (weights, optimizer, version) to every rank, so the group starts equal.

        It travels as a checkpoint does: `torch.save` bytes (tensors and plain containers only),
        read back with `weights_only=True`, so nothing received can run code when loaded (unlike
        `broadcast_object_list`, which unpickles whatever arrives)."""
        try:
            if self.rank == 0:
                buf = io.BytesIO()
                torch.save(state, buf)
                payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
                size = torch.tensor([payload.numel()], dtype=torch.int64)
            else:
                size = torch.zeros(1, dtype=torch.int64)
            self._pg.broadcast([size], dist.BroadcastOptions()).wait()   # (root: rank 0)
            if self.rank != 0:
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
            self._pg.broadcast([payload], dist.BroadcastOptions()).wait()
        except Exception as err:  # noqa: BLE001
            raise GroupBroken(f"broadcasting rank 0's state failed: {err}") from err
        if self.rank == 0:
            return state
        return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)

    def close(self) -> None:
        """Leave the group: its connections close, so peers still in it see it broken at once."""
        groups, self._pg, self._grads = (self._pg, self._grads), None, None
        for pg in groups:
            if pg is None:
                continue
            try:
                pg.shutdown()
            except Exception as err:  # noqa: BLE001 - leaving a broken group must not mask why it broke
                log.debug("leaving the group: %s", err)
