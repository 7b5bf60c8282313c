"""What the planner knows of a run: every replica's rates (rates.py), the buffers' ratio and CPU, the
actors' send queues, read from each role's GetStats. The planner (core.py) decides from a snapshot
of it (`Observer.inputs`); nothing here decides or applies.

Where the stats come from is a `StatsSource`: `GrpcStats` calls GetStats over the role's channel
(TLS and tokens as configured); tests hand in a source of their own."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import grpc

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.common.net.shards import combined_samples_per_insert
from services.common.net.tls import TlsError, open_channel
from services.common.net.tokens import AuthError, bearer_metadata, read_client_token
from services.common.stats import Metrics
from services.config import ExperimentConfig
from services.planner.backend import ROLES, Backend, Replica, RoleState
from services.planner.balance import RoleInputs, Transport
from services.planner.rates import CounterRate, ReplicaRate

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 3.0
COUNTERS = {"actor": ("actor/env_steps_total", "actor/pace_wait_seconds_total"),
            "learner": ("learner/samples_total", "learner/starved_seconds_total")}
LAG_KEY = "learner/policy_lag_mean"
# What the planner records from each buffer's GetStats: key -> (Decision field, how buffers combine).
# The replay ratio combines as served over produced, summed over the shards (services/common/net/shards.py).
BUFFER_KEYS = {"buffer/samples_per_insert": ("buffer_samples_per_insert", "ratio"),
               "buffer/samples_received_per_s": ("buffer_samples_received_per_s", "sum"),
               "buffer/size_samples": ("buffer_size_samples", "sum")}
BUFFER_READ = (*BUFFER_KEYS, "buffer/samples_produced")


class StatsSource(Protocol):
    """GetStats of one replica: the response, or None when it could not be read (the source counts it)."""

    async def get_stats(self, role: str, name: str, address: str,
                        request: pb.GetStatsRequest) -> pb.GetStatsResponse | None: ...

    async def forget(self, live: set[str]) -> None:
        """Let go of what is held for addresses not in `live`."""

    async def close(self) -> None: ...


class GrpcStats:
    """GetStats over one channel per address, with this planner's TLS and token (auth.client_token_file)."""

    STUBS = {"actor": actor_pb2_grpc.ActorStub, "learner": learner_pb2_grpc.LearnerStub,
             "buffer": buffer_pb2_grpc.BufferStub}

    def __init__(self, cfg: ExperimentConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, role: str, address: str):
        """The role's stub on this source's channel to `address` (one channel per address, kept)."""
        ch = self.channels.get(address)
        if ch is None:
            ch = self.channels[address] = open_channel(address, self.cfg.tls, aio=True)
        return self.STUBS[role](ch)

    def metadata(self):
        """This planner's token as call metadata (None without one), read at every call so that a rotated
        one is sent; needed by roles with auth.protect_reads. AuthError naming the file it cannot read."""
        token_file = self.cfg.auth.client_token_file
        token = read_client_token(token_file, "auth.client_token_file") if token_file else None
        return bearer_metadata(token, self.cfg.tls.enabled) or None

    async def get_stats(self, role, name, address, request):
        try:
            return await self.stub(role, address).GetStats(request, timeout=STATS_TIMEOUT_S, metadata=self.metadata())
        except grpc.RpcError as err:
            log.debug("stats from %s %s (%s) failed: %s", role, name, address, err.code().name)
        except (AuthError, TlsError) as err:  # this planner's own certificate or token files: tried next time
            log.warning("stats from %s %s (%s) not read: %s", role, name, address, err)
        self.metrics.inc("planner/stats_errors_total")
        return None

    async def forget(self, live: set[str]) -> None:
        for addr in set(self.channels) - live:
            await self.channels.pop(addr).close()

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()
        self.channels.clear()


class Observer:
    """Reads every serving replica of the backend, and every buffer shard, once per `measure()`."""

    def __init__(self, cfg: ExperimentConfig, backend: Backend, metrics: Metrics, stats: StatsSource | None = None,
                 clock=time.monotonic):
        self.cfg, self.backend, self.metrics, self.clock = cfg, backend, metrics, clock
        self.stats: StatsSource = stats if stats is not None else GrpcStats(cfg, metrics)
        self.rates: dict[str, dict[str, ReplicaRate]] = {r: {} for r in ROLES}
        self.buffer_stats: dict[str, tuple[float, dict[str, float]]] = {}  # buffer name -> (when read, metrics)
        # Transport (the communication bottleneck): per actor its dropped samples/s and send-queue fill,
        # per buffer shard its CPU cores.
        self.dropped: dict[str, CounterRate] = {}
        self.queue_fill: dict[str, tuple[float, float]] = {}   # actor -> (when read, share of its bound)
        self.buffer_cpu: dict[str, CounterRate] = {}
        # A run of several policies: each buffer table's samples received, (buffer, policy) -> rate.
        self.table_received: dict[tuple[str, str], CounterRate] = {}
        self.states: dict[str, RoleState] = {}
        self.buffers: list[Replica] = []   # the buffer shards at the last measurement

    async def _read_buffer(self, name: str, address: str) -> None:
        resp = await self.stats.get_stats("buffer", name, address, pb.GetStatsRequest())
        if resp is None:
            return
        now = self.clock()
        self.buffer_stats[name] = (now, {k: resp.metrics[k] for k in BUFFER_READ if k in resp.metrics})
        if (cpu := resp.metrics.get("buffer/cpu_seconds_total")) is not None:
            self.buffer_cpu.setdefault(name, CounterRate(self.cfg.planner.rate_halflife_s)).update(now, cpu)
        for policy in self.cfg.policies:   # (several policies: each one's table)
            if (got := resp.metrics.get(f"buffer/policies/{policy}/samples_received_total")) is not None:
                self.table_received.setdefault((name, policy), CounterRate(self.cfg.planner.rate_halflife_s)) \
                    .update(now, got)

    async def _read(self, role: str, name: str, address: str, tracker: ReplicaRate) -> None:
        resp = await self.stats.get_stats(role, name, address, pb.GetStatsRequest(episodes_after=2**63))
        if resp is None:
            return
        count_key, busy_key = COUNTERS[role]
        m = resp.metrics
        if count_key not in m or busy_key not in m:
            return
        now = self.clock()
        tracker.update(now, m[count_key], m[busy_key], m.get(f"{role}/cpu_seconds_total"))
        if LAG_KEY in m:
            tracker.policy_lag = m[LAG_KEY]
        if role == "actor":
            if (dropped := m.get("actor/samples_dropped_total")) is not None:
                self.dropped.setdefault(name, CounterRate(self.cfg.planner.rate_halflife_s)).update(now, dropped)
            # Against the actor's own bounds; of several policies' queues (their gauges scoped to each
            # policy, services/common/stats.py), the fullest.
            fills = [v for k, v in m.items() if k == "actor/push_queue_fill"
                     or k.startswith("actor/policies/") and k.endswith("/push_queue_fill")]
            if fills:
                self.queue_fill[name] = (now, max(fills))
            elif (queued := m.get("actor/push_queue_fragments")) is not None:   # an actor from before the gauge
                self.queue_fill[name] = (now, queued / self.cfg.actor.queue_fragments)

    async def measure(self) -> dict[str, RoleState]:
        """Observe the backend and read every serving replica's stats once."""
        self.states = await self.backend.observe()
        now = self.clock()
        reads = []
        for role in ROLES:
            known = self.rates[role]
            names = {r.name for r in self.states[role].replicas}
            for gone in set(known) - names:
                del known[gone]
                self.dropped.pop(gone, None)
                self.queue_fill.pop(gone, None)
            for rep in self.states[role].replicas:
                tracker = known.setdefault(rep.name, ReplicaRate(self.cfg.planner.rate_halflife_s,
                                                                 self.cfg.planner.warmup_s, now))
                if rep.ready and rep.address:
                    reads.append(self._read(role, rep.name, rep.address, tracker))
        try:
            buffers = await self.backend.buffers()
        except Exception as err:  # noqa: BLE001 - a backend error must not stop the actor/learner reads
            log.debug("listing buffers failed: %s", err)
            buffers = []
        self.buffers = buffers
        for gone in set(self.buffer_stats) - {b.name for b in buffers}:
            del self.buffer_stats[gone]
            self.buffer_cpu.pop(gone, None)
            for policy in self.cfg.policy_names:
                self.table_received.pop((gone, policy), None)
        reads += [self._read_buffer(b.name, b.address) for b in buffers if b.ready and b.address]
        await asyncio.gather(*reads)
        await self.stats.forget({rep.address for s in self.states.values() for rep in s.replicas}
                                | {b.address for b in buffers})
        return self.states

    def buffer_view(self) -> dict[str, float]:
        """Decision fields from the buffers whose stats are fresh (empty when none are)."""
        now, stale = self.clock(), self.cfg.planner.stale_after_s
        fresh = [m for t, m in self.buffer_stats.values() if now - t <= stale]
        out = {}
        for key, (field, how) in BUFFER_KEYS.items():
            if how == "ratio":
                if (ratio := combined_samples_per_insert(fresh)) is not None:
                    out[field] = ratio
            elif values := [m[key] for m in fresh if key in m]:
                out[field] = sum(values)
        return out

    def role_inputs(self, role: str, now: float, override: int | None) -> RoleInputs:
        """The inputs of `role`: actor, learner, or (several policies) one policy's learners, learner/<p>,
        whose replicas are among the learner role's and whose share of the samples its tables measure."""
        state = self.states[role]
        p = self.cfg.planner
        known = self.rates[role.split("/", 1)[0]]
        trackers = [known[r.name] for r in state.replicas if r.name in known]
        usable = [t for t in trackers if t.usable(now, p.stale_after_s)]
        stale = len(trackers) < state.desired or any(t.stale(now, p.stale_after_s) for t in trackers)
        cores = [t.cores for t in usable if t.cores is not None]
        rate = (sum(t.rate for t in usable) / len(usable)) if usable else None
        share = None
        if role == "learner" and role not in self.cfg.learner_roles:   # every policy's, shown; each one's decided
            rate = self.policies_rate(now, state)
        elif role.startswith("learner/"):
            share = self.shares(now).get(role.split("/", 1)[1])
        return RoleInputs(desired=state.desired, ready=state.ready, reporting=len(usable), rate=rate,
                          cores=(sum(cores) / len(cores)) if cores else None,
                          stale=stale, blocked=state.blocked, override=override, share=share)

    def received(self, now: float) -> dict[str, float]:
        """Several policies: the samples/s each policy's tables receive, all buffer shards together (fresh rates)."""
        stale = self.cfg.planner.stale_after_s
        return {policy: sum(r for (_, q), c in self.table_received.items()
                            if q == policy and (r := c.fresh(now, stale)) is not None)
                for policy in self.cfg.policy_names}

    def shares(self, now: float) -> dict[str, float]:
        """Each policy's share of the samples the actors make (empty until any table has received some)."""
        received = self.received(now)
        total = sum(received.values())
        return {policy: got / total for policy, got in received.items()} if total > 0 else {}

    def policies_rate(self, now: float, state: RoleState) -> float | None:
        """A run of several policies: the learners' rate per replica as the balance model takes it, so
        that n_L * rate is the samples/s of the actors' output (every policy's agents together) the
        learners can take, as decisions show the learners of all policies together (each policy's are
        decided from its own rate and share: services/planner/balance.py, `plan`). The actors make each policy's
        share s_p of their samples (measured: what each table received), and an actor holds while any
        policy's table is behind, so they can be fed only as fast as the tightest policy takes its
        share: min over policies of C_p / s_p, where C_p is what policy p's learners consume (their
        rates summed). None until every policy that gets samples has a learner with a usable rate."""
        p = self.cfg.planner
        shares = self.shares(now)
        if not shares or not state.desired:
            return None
        capacity: dict[str, float] = {}
        for rep in state.replicas:
            tracker = self.rates["learner"].get(rep.name)
            if tracker is not None and tracker.usable(now, p.stale_after_s):
                capacity[rep.policy] = capacity.get(rep.policy, 0.0) + (tracker.rate or 0.0)
        fed = [capacity[policy] / share for policy, share in shares.items() if share > 0 and policy in capacity]
        if len(fed) < sum(1 for share in shares.values() if share > 0):
            return None   # a policy that gets samples has no learner rate yet
        return min(fed) / state.desired

    def transport(self, now: float) -> Transport:
        """Actors' send queues and the buffers' CPU, from fresh metrics only (planner.stale_after_s)."""
        stale = self.cfg.planner.stale_after_s
        # Drops over the last interval alone: any at all is evidence, and an EWMA would never reach 0 again.
        drops = [r for r in (c.fresh(now, stale, recent=True) for c in self.dropped.values()) if r is not None]
        fills = {name: fill for name, (seen, fill) in self.queue_fill.items() if now - seen <= stale}
        busiest = max(fills, key=lambda n: fills[n], default="")
        cores = {name: r for name, c in self.buffer_cpu.items() if (r := c.fresh(now, stale)) is not None}
        return Transport(dropped_per_s=sum(drops), queue_fill=fills.get(busiest, 0.0), busiest_queue=busiest,
                         buffer_cores=cores)

    def policy_lag(self, now: float) -> float | None:
        """The mean of the learners' recent mean policy lags, from fresh metrics only (None = unknown)."""
        lags = [t.policy_lag for t in self.rates["learner"].values()
                if t.policy_lag is not None and not t.stale(now, self.cfg.planner.stale_after_s)]
        return sum(lags) / len(lags) if lags else None

    async def close(self) -> None:
        await self.stats.close()
