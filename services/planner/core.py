"""The planner core: measure each replica's rates (rates.py), decide (decide.py), apply through a
backend, record every decision."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from google.protobuf import json_format

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from kuberl.v1 import planner_pb2 as ppb
from services import algorithms
from services.common.tokens import AuthError, bearer_metadata, read_client_token
from services.config import ExperimentConfig
from services.common.notify import Notifier
from services.common.shards import combined_samples_per_insert
from services.common.stats import Metrics
from services.common.tls import TlsError, open_channel
from services.planner.backend import ROLES, Backend, Conflict, Refused, RoleState
from services.planner.decide import (Decision, Inputs, Policy, RoleBounds, RoleInputs, ScaleUpProbe, Transport, decide,
                                     judge_scale_up)
from services.planner.rates import CounterRate, ReplicaRate

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 3.0
MAX_RECORDED = 1000
CONFLICT_RETRIES = 3
ACTIONS = {"hold": ppb.DECISION_ACTION_HOLD, "scale": ppb.DECISION_ACTION_SCALE,
           "suppressed": ppb.DECISION_ACTION_SUPPRESSED}
COUNTERS = {"actor": ("actor/env_steps_total", "actor/pace_wait_seconds_total"),
            "learner": ("learner/samples_total", "learner/starved_seconds_total")}
LAG_KEY = "learner/policy_lag_mean"
BOTTLENECKS = ("communication", "training", "sampling", "balanced", "unknown")
# What the planner records from each buffer's GetStats: key -> (Decision field, how buffers combine).
# The replay ratio combines as served over produced, summed over the shards (services/common/shards.py).
BUFFER_KEYS = {"buffer/samples_per_insert": ("buffer_samples_per_insert", "ratio"),
               "buffer/samples_received_per_s": ("buffer_samples_received_per_s", "sum"),
               "buffer/size_samples": ("buffer_size_samples", "sum")}
BUFFER_READ = (*BUFFER_KEYS, "buffer/samples_produced")


def policy_from_config(cfg: ExperimentConfig) -> Policy:
    """The decision policy. With external simulators (env.mode external) the actors are not scaled:
    each serves the simulators connected to it, and an actor added would serve none (simulators find
    actors by address; docs/planner.md), so they stay at topology.actors and only learners move."""
    p = cfg.planner

    def bounds(r):
        return RoleBounds(r.min, r.max, r.cost, r.max_step_up, r.max_step_down)

    actor = bounds(p.actor)
    if cfg.env.mode == "external":
        n = min(max(cfg.topology.actors, p.actor.min), p.actor.max)
        actor = RoleBounds(n, n, p.actor.cost, p.actor.max_step_up, p.actor.max_step_down)
    return Policy(actor=actor, learner=bounds(p.learner), budget=p.budget, tolerance=p.tolerance,
                  replay_ratio=algorithms.get(cfg.algorithm).consumption_ratio(cfg),
                  cooldown_s=p.cooldown_s, scale_down_window_s=p.scale_down_window_s,
                  converge_timeout_s=p.converge_timeout_s, max_policy_lag=p.max_policy_lag,
                  measured_costs=p.costs == "measured", min_scale_gain=p.min_scale_gain,
                  saturation_hold_s=p.saturation_hold_s)


@dataclass
class OverrideState:
    replicas: int
    expires_unix_s: float


class Planner:
    def __init__(self, cfg: ExperimentConfig, backend: Backend, metrics: Metrics | None = None,
                 clock=time.monotonic, wall=time.time, journal: Path | None = None):
        self.cfg, self.backend, self.clock, self.wall = cfg, backend, clock, wall
        self.journal = journal  # every recorded decision is appended here as one JSON line
        self.policy = policy_from_config(cfg)
        self.metrics = metrics or Metrics("planner")
        self.rates: dict[str, dict[str, ReplicaRate]] = {r: {} for r in ROLES}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.buffer_stats: dict[str, tuple[float, dict[str, float]]] = {}  # buffer name -> (when read, metrics)
        # Transport (the communication bottleneck): per actor its dropped samples/s and send-queue fill,
        # per buffer shard its CPU cores.
        self.dropped: dict[str, CounterRate] = {}
        self.queue_fill: dict[str, tuple[float, float]] = {}   # actor -> (when read, share of its bound)
        self.buffer_cpu: dict[str, CounterRate] = {}
        self.states: dict[str, RoleState] = {}
        self.paused, self.pause_reason = False, ""
        self.overrides: dict[str, OverrideState] = {}
        self.probes: dict[str, ScaleUpProbe] = {}        # applied scale-ups not judged yet
        self.ceilings: dict[str, tuple[int, float]] = {}  # role -> (saturation ceiling, monotonic expiry)
        self.learner_scale_up: tuple[float, int, int] | None = None  # see track_learner_scale_up
        self.last_change_at: float | None = None
        self.observing_since = clock()
        self.proposals: deque[tuple[float, dict[str, int]]] = deque()
        self.decisions: deque[ppb.Decision] = deque(maxlen=MAX_RECORDED)
        self.next_id = 1
        self.recorded = Notifier()
        self.closing = False
        self.lock = asyncio.Lock()  # one decision at a time (loop, Apply, SetReplicas)
        for action in ACTIONS:
            self.metrics.inc(f"planner/decisions_{action}_total", 0)
        self.metrics.inc("planner/apply_errors_total", 0)
        self.metrics.inc("planner/conflicts_total", 0)
        self.metrics.inc("planner/stats_errors_total", 0)
        self.metrics.inc("planner/saturations_total", 0)

    # -- measuring -------------------------------------------------------------------------------
    def _stub(self, role: str, address: str):
        ch = self.channels.get(address)
        if ch is None:
            ch = self.channels[address] = open_channel(address, self.cfg.tls, aio=True)
        return {"actor": actor_pb2_grpc.ActorStub, "learner": learner_pb2_grpc.LearnerStub,
                "buffer": buffer_pb2_grpc.BufferStub}[role](ch)

    async def _get_stats(self, role: str, name: str, address: str, request: pb.GetStatsRequest):
        """The GetStats of `role` replica `name`, or None (counted) when it cannot be read."""
        try:
            # The role's own token (auth.client_token_file), read at every call so that a rotated one is
            # sent; needed by roles with auth.protect_reads.
            token_file = self.cfg.auth.client_token_file
            token = read_client_token(token_file, "auth.client_token_file") if token_file else None
            return await self._stub(role, address).GetStats(
                request, timeout=STATS_TIMEOUT_S, metadata=bearer_metadata(token, self.cfg.tls.enabled) or None)
        except grpc.RpcError as err:
            log.debug("stats from %s %s (%s) failed: %s", role, name, address, err.code().name)
        except (AuthError, TlsError) as err:  # this planner's own certificate or token files: tried next time
            log.warning("stats from %s %s (%s) not read: %s", role, name, address, err)
        self.metrics.inc("planner/stats_errors_total")
        return None

    async def _read_buffer(self, name: str, address: str) -> None:
        resp = await self._get_stats("buffer", name, address, pb.GetStatsRequest())
        if resp is None:
            return
        now = self.clock()
        self.buffer_stats[name] = (now, {k: resp.metrics[k] for k in BUFFER_READ if k in resp.metrics})
        if (cpu := resp.metrics.get("buffer/cpu_seconds_total")) is not None:
            self.buffer_cpu.setdefault(name, CounterRate(self.cfg.planner.rate_halflife_s)).update(now, cpu)

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

    async def _read(self, role: str, name: str, address: str, tracker: ReplicaRate) -> None:
        resp = await self._get_stats(role, name, address, pb.GetStatsRequest(episodes_after=2**63))
        if resp is None:
            return
        count_key, busy_key = COUNTERS[role]
        m = resp.metrics
        if count_key not in m or (busy_key is not None and busy_key not in m):
            return
        tracker.update(self.clock(), m[count_key], m[busy_key] if busy_key else None,
                       m.get(f"{role}/cpu_seconds_total"))
        if LAG_KEY in m:
            tracker.policy_lag = m[LAG_KEY]
        if role == "actor":
            now = self.clock()
            if (dropped := m.get("actor/samples_dropped_total")) is not None:
                self.dropped.setdefault(name, CounterRate(self.cfg.planner.rate_halflife_s)).update(now, dropped)
            if (queued := m.get("actor/push_queue_fragments")) is not None:
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
        for gone in set(self.buffer_stats) - {b.name for b in buffers}:
            del self.buffer_stats[gone]
            self.buffer_cpu.pop(gone, None)
        reads += [self._read_buffer(b.name, b.address) for b in buffers if b.ready and b.address]
        await asyncio.gather(*reads)
        live = {rep.address for s in self.states.values() for rep in s.replicas} | {b.address for b in buffers}
        for addr in set(self.channels) - live:
            await self.channels.pop(addr).close()
        return self.states

    def role_inputs(self, role: str, now: float) -> RoleInputs:
        state = self.states[role]
        p = self.cfg.planner
        trackers = [self.rates[role][r.name] for r in state.replicas if r.name in self.rates[role]]
        usable = [t for t in trackers if t.usable(now, p.stale_after_s)]
        stale = len(trackers) < state.desired or any(t.stale(now, p.stale_after_s) for t in trackers)
        override = self.overrides.get(role)
        cores = [t.cores for t in usable if t.cores is not None]
        return RoleInputs(desired=state.desired, ready=state.ready, reporting=len(usable),
                          rate=(sum(t.rate for t in usable) / len(usable)) if usable else None,
                          cores=(sum(cores) / len(cores)) if cores else None,
                          stale=stale, blocked=state.blocked,
                          override=override.replicas if override else None)

    def inputs(self) -> Inputs:
        now = self.clock()
        wall = self.wall()
        for role, o in list(self.overrides.items()):
            if o.expires_unix_s <= wall:
                log.info("override of %s (%d replicas) expired; the planner takes it back", role, o.replicas)
                del self.overrides[role]
        while self.proposals and now - self.proposals[0][0] > self.policy.scale_down_window_s:
            self.proposals.popleft()
        for role, (n, until) in list(self.ceilings.items()):
            if until <= now:
                log.info("saturation ceiling of %s (%d replicas) expired", role, n)
                del self.ceilings[role]
        return Inputs(now=now, actor=self.role_inputs("actor", now), learner=self.role_inputs("learner", now),
                      paused=self.paused, last_change_at=self.last_change_at,
                      observing_since=self.observing_since, recent_proposals=tuple(self.proposals),
                      policy_lag=self.policy_lag(now), ceilings=self._ceilings(),
                      learner_scale_up=self.learner_scale_up, transport=self.transport(now))

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

    def _ceilings(self) -> dict[str, int]:
        return {r: n for r, (n, _) in self.ceilings.items()}

    def _judge(self, inp: Inputs) -> bool:
        """Judge the scale-ups that have settled; True when a saturation ceiling was set."""
        changed = False
        for role, probe in list(self.probes.items()):
            verdict = judge_scale_up(self.policy, probe, inp)
            if not verdict.done:
                continue
            del self.probes[role]
            if verdict.reason:
                log.info("scale-up judged: %s", verdict.reason)
            if verdict.ceiling is not None:
                self.ceilings[role] = (verdict.ceiling, inp.now + self.policy.saturation_hold_s)
                self.metrics.inc("planner/saturations_total")
                changed = True
        return changed

    def track_learner_scale_up(self, inp: Inputs) -> bool:
        """Follow the planner's last learner scale-up until its learners are all ready. If they are not
        converge_timeout_s after it, the group cannot form (decide() takes the count back): the learners
        are held at the count before it for saturation_hold_s, so the planner does not ask again at
        once. Returns True when that hold was set now."""
        if self.learner_scale_up is None:
            return False
        applied_at, before, after = self.learner_scale_up
        li = inp.learner
        if li.desired != after or li.ready >= after:
            self.learner_scale_up = None   # converged, or the count changed since
            return False
        if li.override is not None:   # a person holds the learners: their count, not the planner's
            self.learner_scale_up = None
            return False
        held = self.ceilings.get("learner")
        if inp.now - applied_at < self.policy.converge_timeout_s or (held is not None and held[0] <= before):
            return False
        self.ceilings["learner"] = (before, inp.now + self.policy.saturation_hold_s)
        self.metrics.inc("planner/saturations_total")
        log.info("learner scale-up %d->%d: only %d ready after %.0f s; holding the learners at %d for %.0f s",
                 before, after, li.ready, inp.now - applied_at, before, self.policy.saturation_hold_s)
        return True

    def _probe(self, d: Decision, inp: Inputs) -> None:
        """Remember each role the planner just scaled up, to judge later what the new replicas added."""
        for role, n in d.changes.items():
            before, rate = d.current[role], inp.role(role).rate
            if n > before > 0 and rate and inp.role(role).override is None:
                self.probes[role] = ScaleUpProbe(role, before, n, before * rate, self.clock())
            else:
                self.probes.pop(role, None)

    def policy_lag(self, now: float) -> float | None:
        """The mean of the learners' recent mean policy lags, from fresh metrics only (None = unknown)."""
        lags = [t.policy_lag for t in self.rates["learner"].values()
                if t.policy_lag is not None and not t.stale(now, self.cfg.planner.stale_after_s)]
        return sum(lags) / len(lags) if lags else None

    # -- deciding and applying -------------------------------------------------------------------
    async def step(self, trigger: str = "interval", apply: bool = True) -> ppb.Decision:
        """Measure, decide and (unless `apply` is false) apply; records the decision unless previewing."""
        async with self.lock:
            error, applied, dry = "", False, not apply or self.backend.name == "dry-run"
            for attempt in range(CONFLICT_RETRIES + 1):
                await self.measure()
                inp = self.inputs()
                if apply:  # a scale-up that did not pay, or whose learners never came up, caps its role
                    self._judge(inp)
                    self.track_learner_scale_up(inp)
                    inp = replace(inp, ceilings=self._ceilings(), learner_scale_up=self.learner_scale_up)
                d = decide(self.policy, inp)
                if d.action != "scale":
                    break
                if not self.backend.leader:
                    d = Decision("suppressed", f"not the leader: another planner holds the lease; {d.reason}",
                                 d.current, d.current, d.proposed, d.production, d.consumption, d.ratio,
                                 d.planned_throughput)
                    break
                try:
                    await self.backend.apply(d.changes, dry_run=dry)
                    applied, error = not dry, ""
                    break
                except Conflict as err:
                    self.metrics.inc("planner/conflicts_total")
                    error = f"conflict: {err}"
                    log.info("replica count changed under us (%s); re-reading (attempt %d)", err, attempt + 1)
                    continue
                except Refused as err:
                    error = f"refused: {err}"
                    break
                except Exception as err:  # a backend error must not end the planner: record it, retry later
                    error = f"{type(err).__name__}: {err}"
                    log.warning("applying %s failed: %s", d.changes, error)
                    break
            if apply:
                self.proposals.append((inp.now, d.proposed))
            if applied:
                self.last_change_at = self.clock()
                self._probe(d, inp)
                before, after = d.current["learner"], d.targets["learner"]
                if after > before and inp.learner.override is None:
                    self.learner_scale_up = (self.last_change_at, before, after)
            if error:
                self.metrics.inc("planner/apply_errors_total")
            msg = self.to_proto(d, inp, trigger=trigger, applied=applied, dry_run=dry, error=error)
            if apply:
                self.record(msg, d.action)
            return msg

    def record(self, msg: ppb.Decision, action: str) -> None:
        msg.id = self.next_id
        self.next_id += 1
        self.decisions.append(msg)
        self.metrics.inc(f"planner/decisions_{action}_total")
        for role in msg.roles:
            self.metrics.set(f"planner/{role.role}_replicas", role.target if msg.applied else role.current)
            self.metrics.set(f"planner/{role.role}_rate_per_replica", role.rate_per_replica)
        if msg.ratio:
            self.metrics.set("planner/production_consumption_ratio", msg.ratio)
        if msg.HasField("buffer_samples_per_insert"):
            self.metrics.set("planner/buffer_samples_per_insert", msg.buffer_samples_per_insert)
        for kind in BOTTLENECKS:   # 1 for the bottleneck of the last decision, 0 for the others
            self.metrics.set(f"planner/bottleneck_{kind}", float(msg.bottleneck == kind))
        level = logging.INFO if msg.action == ppb.DECISION_ACTION_SCALE or msg.error else logging.DEBUG
        log.log(level, "decision %d (%s, %s%s): %s", msg.id, action, "applied" if msg.applied else "not applied",
                f", error {msg.error}" if msg.error else "", msg.reason)
        if self.journal is not None:
            with open(self.journal, "a") as f:
                f.write(json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True)) + "\n")
        self.recorded.notify()

    def to_proto(self, d: Decision, inp: Inputs, *, trigger: str, applied: bool, dry_run: bool,
                 error: str = "") -> ppb.Decision:
        roles = []
        for r in ROLES:
            ri = inp.role(r)
            rd = ppb.RoleDecision(role=r, current=d.current[r], target=d.targets[r], proposed=d.proposed[r],
                                  ready=ri.ready, reporting=ri.reporting, rate_per_replica=ri.rate or 0.0,
                                  stale=ri.stale, blocked=ri.blocked, cores_per_replica=ri.cores or 0.0,
                                  cost_per_replica=self.policy.replica_cost(r, inp))
            if ri.override is not None:
                rd.override = ri.override
            if r in inp.ceilings:
                rd.ceiling = inp.ceilings[r]
            roles.append(rd)
        return ppb.Decision(unix_s=self.wall(), action=ACTIONS[d.action], applied=applied, dry_run=dry_run,
                            reason=d.reason, roles=roles, production=d.production or 0.0,
                            consumption=d.consumption or 0.0, ratio=d.ratio or 0.0,
                            planned_throughput=d.planned_throughput or 0.0, replay_ratio=self.policy.replay_ratio,
                            policy_lag=inp.policy_lag, max_policy_lag=self.policy.max_policy_lag,
                            tolerance=self.policy.tolerance, budget=self.policy.budget, trigger=trigger,
                            error=error, backend=self.backend.name, bottleneck=d.bottleneck.kind,
                            bottleneck_evidence=d.bottleneck.evidence, **self.buffer_view())

    def validate_replicas(self, role: str, replicas: int) -> None:
        if role not in ROLES:
            raise ValueError(f"role: {role!r} is not scalable; expected one of {', '.join(ROLES)}")
        b = self.policy.bounds(role)
        if not b.min <= replicas <= b.max:
            raise ValueError(f"replicas: {replicas} is outside planner.{role}.min..max ({b.min}..{b.max})")

    async def set_override(self, role: str, replicas: int, ttl_s: float) -> ppb.Decision:
        """Hold `role` at `replicas` until the override expires; applied at once."""
        self.validate_replicas(role, replicas)
        self.overrides[role] = OverrideState(replicas, self.wall() + ttl_s)
        async with self.lock:
            await self.measure()
            inp = self.inputs()
            current = {r: inp.role(r).desired for r in ROLES}
            targets = {**current, role: replicas}
            error, applied = "", False
            if not self.backend.leader:
                error = "not the leader: another planner holds the lease"
            else:
                try:
                    await self.backend.apply({role: replicas}, dry_run=self.backend.name == "dry-run")
                    applied = self.backend.name != "dry-run"
                except (Conflict, Refused, Exception) as err:  # recorded; the decision loop retries the override
                    error = f"{type(err).__name__}: {err}"
            if applied:
                self.last_change_at = self.clock()
                self.probes.pop(role, None)
            d = Decision("scale" if targets != current else "hold",
                         f"manual override: {role} set to {replicas} for {ttl_s:.0f} s", current, targets, targets)
            msg = self.to_proto(d, inp, trigger="override", applied=applied,
                                dry_run=self.backend.name == "dry-run", error=error)
            self.record(msg, d.action)
            return msg

    def clear_override(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role: {role!r} is not scalable; expected one of {', '.join(ROLES)}")
        self.overrides.pop(role, None)

    def status(self) -> ppb.PlannerStatus:
        st = ppb.PlannerStatus(paused=self.paused, pause_reason=self.pause_reason, backend=self.backend.name,
                               leader=self.backend.leader)
        for role, o in self.overrides.items():
            st.overrides.add(role=role, replicas=o.replicas, expires_unix_s=o.expires_unix_s)
        if self.decisions:
            st.last_decision.CopyFrom(self.decisions[-1])
        for role, state in self.states.items():
            for rep in state.replicas:
                st.replicas.add(role=role, name=rep.name, address=rep.address, ready=rep.ready)
        return st

    async def run_forever(self) -> None:
        """Decide every `planner.interval_s`; measuring in between keeps the EWMAs smooth."""
        interval = self.cfg.planner.interval_s
        tick = min(1.0, interval)
        next_decision = self.clock() + interval
        while True:
            await asyncio.sleep(tick)
            if self.clock() >= next_decision:
                next_decision = self.clock() + interval
                await self.step("interval")
            else:
                async with self.lock:
                    await self.measure()

    async def close(self) -> None:
        self.closing = True
        self.recorded.notify()
        for ch in self.channels.values():
            await ch.close()
        self.channels.clear()
