"""The planner core: observe the run (observe.py), decide (decide.py), apply through a backend,
record every decision; manual overrides and the saturation ceilings are kept here. What calls `step`
every `planner.interval_s` is services/planner/loops.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from google.protobuf import json_format

from kuberl.v1 import planner_pb2 as ppb
from services import algorithms
from services.common.notify import Notifier
from services.common.stats import Metrics
from services.config import ExperimentConfig
from services.planner.backend import ROLES, Backend, Conflict, Refused
from services.planner.balance import Decision, Inputs, RoleBounds, RoleInputs, ScalingRules
from services.planner.decide import ScaleUpProbe, decide, judge_scale_up
from services.planner.observe import Observer, StatsSource
from services.planner.shards import SendTopology, ShardDecision, ShardKeeper, decide_shards, shard_bounds

log = logging.getLogger(__name__)
MAX_RECORDED = 1000
CONFLICT_RETRIES = 3
ACTIONS = {"hold": ppb.DECISION_ACTION_HOLD, "scale": ppb.DECISION_ACTION_SCALE,
           "suppressed": ppb.DECISION_ACTION_SUPPRESSED}
BOTTLENECKS = ("communication", "training", "sampling", "balanced", "unknown")
SHARDS = "buffer"   # the role name of buffer shards in overrides (SetReplicas)


def rules_from_config(cfg: ExperimentConfig) -> ScalingRules:
    """The planner's scaling rules, from the config's planner section. With external simulators
    (env.mode external) the actors are not scaled: each serves the simulators connected to it, and an
    actor added would serve none (simulators find actors by address; docs/planner.md), so they stay at
    topology.actors and only learners move."""
    p = cfg.planner

    def bounds(r):
        return RoleBounds(r.min, r.max, r.cost, r.max_step_up, r.max_step_down)

    actor = bounds(p.actor)
    if cfg.env.mode == "external":
        n = min(max(cfg.topology.actors, p.actor.min), p.actor.max)
        actor = RoleBounds(n, n, p.actor.cost, p.actor.max_step_up, p.actor.max_step_down)
    return ScalingRules(actor=actor, learner=bounds(p.learner), budget=p.budget, tolerance=p.tolerance,
                        replay_ratio=algorithms.get(cfg.algorithm).consumption_ratio(cfg),
                        cooldown_s=p.cooldown_s, scale_down_window_s=p.scale_down_window_s,
                        converge_timeout_s=p.converge_timeout_s, staleness_target=p.staleness_target,
                        measured_costs=p.costs == "measured", min_scale_gain=p.min_scale_gain,
                        saturation_hold_s=p.saturation_hold_s)


@dataclass
class OverrideState:
    replicas: int
    expires_unix_s: float


class Planner:
    def __init__(self, cfg: ExperimentConfig, backend: Backend, metrics: Metrics | None = None,
                 clock=time.monotonic, wall=time.time, journal: Path | None = None, stats: StatsSource | None = None,
                 send_topology: SendTopology | None = None):
        self.cfg, self.backend, self.clock, self.wall = cfg, backend, clock, wall
        self.journal = journal  # every recorded decision is appended here as one JSON line
        self.rules = rules_from_config(cfg)
        self.metrics = metrics or Metrics("planner")
        self.observer = Observer(cfg, backend, self.metrics, stats, clock)
        self.shards = ShardKeeper(cfg, backend, self.metrics, clock, wall, send_topology)
        self.paused, self.pause_reason = False, ""
        self.overrides: dict[str, OverrideState] = {}
        self.probes: dict[str, ScaleUpProbe] = {}        # applied scale-ups not judged yet
        self.ceilings: dict[str, tuple[int, float]] = {}  # role -> (saturation ceiling, monotonic expiry)
        self.learner_scale_ups: dict[str, tuple[float, int, int]] = {}  # see track_learner_scale_ups
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

    @property
    def policy_roles(self) -> tuple[str, ...]:
        """A run of several policies: each policy's learners as a role of their own, `learner/<policy>`,
        sized by the decisions with the actors the policies share, or set by hand (docs/planner.md)."""
        return tuple(role for role in self.cfg.learner_roles if role != "learner")

    def inputs(self) -> Inputs:
        now = self.clock()
        wall = self.wall()
        for role, o in list(self.overrides.items()):
            if o.expires_unix_s <= wall:
                log.info("override of %s (%d replicas) expired; the planner takes it back", role, o.replicas)
                del self.overrides[role]
        while self.proposals and now - self.proposals[0][0] > self.rules.scale_down_window_s:
            self.proposals.popleft()
        for role, (n, until) in list(self.ceilings.items()):
            if until <= now:
                log.info("saturation ceiling of %s (%d replicas) expired", role, n)
                del self.ceilings[role]
        obs = self.observer

        def role(r: str) -> RoleInputs:
            override = self.overrides.get(r)
            return obs.role_inputs(r, now, override.replicas if override else None)

        return Inputs(now=now, actor=role("actor"), learner=role("learner"),
                      learners={r: role(r) for r in self.policy_roles if r in obs.states},
                      paused=self.paused, last_change_at=self.last_change_at,
                      observing_since=self.observing_since, recent_proposals=tuple(self.proposals),
                      policy_lag=obs.policy_lag(now), ceilings=self._ceilings(),
                      learner_scale_ups=dict(self.learner_scale_ups), transport=obs.transport(now))

    def _ceilings(self) -> dict[str, int]:
        return {r: n for r, (n, _) in self.ceilings.items()}

    def _judge(self, inp: Inputs) -> bool:
        """Judge the scale-ups that have settled; True when a saturation ceiling was set."""
        changed = False
        for role, probe in list(self.probes.items()):
            verdict = judge_scale_up(self.rules, probe, inp)
            if not verdict.done:
                continue
            del self.probes[role]
            if verdict.reason:
                log.info("scale-up judged: %s", verdict.reason)
            if verdict.ceiling is not None:
                self.ceilings[role] = (verdict.ceiling, inp.now + self.rules.saturation_hold_s)
                self.metrics.inc("planner/saturations_total")
                changed = True
        return changed

    def track_learner_scale_ups(self, inp: Inputs) -> bool:
        """Follow the planner's last scale-up of each learner role (the learners, or with several policies
        each policy's) until its learners are all ready. If they are not converge_timeout_s after it, the
        group cannot form (decide() takes the count back): the role is held at the count before it for
        saturation_hold_s, so the planner does not ask again at once. Returns True when a hold was set now."""
        held_now = False
        for role, (applied_at, before, after) in list(self.learner_scale_ups.items()):
            if role not in inp.roles:
                del self.learner_scale_ups[role]
                continue
            ri = inp.role(role)
            if ri.desired != after or ri.ready >= after or ri.override is not None:
                del self.learner_scale_ups[role]   # converged, the count changed since, or a person holds it
                continue
            held = self.ceilings.get(role)
            if inp.now - applied_at < self.rules.converge_timeout_s or (held is not None and held[0] <= before):
                continue
            self.ceilings[role] = (before, inp.now + self.rules.saturation_hold_s)
            self.metrics.inc("planner/saturations_total")
            log.info("%s scale-up %d->%d: only %d ready after %.0f s; holding it at %d for %.0f s",
                     role, before, after, ri.ready, inp.now - applied_at, before, self.rules.saturation_hold_s)
            held_now = True
        return held_now

    def _probe(self, d: Decision, inp: Inputs) -> None:
        """Remember each role the planner just scaled up, to judge later what the new replicas added."""
        for role, n in d.changes.items():
            before, rate = d.current[role], inp.role(role).rate
            if n > before > 0 and rate and inp.role(role).override is None:
                self.probes[role] = ScaleUpProbe(role, before, n, before * rate, self.clock())
            else:
                self.probes.pop(role, None)

    # -- deciding and applying -------------------------------------------------------------------
    async def step(self, trigger: str = "interval", apply: bool = True) -> ppb.Decision:
        """Measure, decide and (unless `apply` is false) apply; records the decision unless previewing."""
        async with self.lock:
            error, applied, dry = "", False, not apply or self.backend.name == "dry-run"
            for attempt in range(CONFLICT_RETRIES + 1):
                await self.observer.measure()
                inp = self.inputs()
                if apply:  # a scale-up that did not pay, or whose learners never came up, caps its role
                    self._judge(inp)
                    self.track_learner_scale_ups(inp)
                    inp = replace(inp, ceilings=self._ceilings(), learner_scale_ups=dict(self.learner_scale_ups))
                d = decide(self.rules, inp)
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
                for r in inp.roles:
                    before, after = d.current[r], d.targets[r]
                    if r != "actor" and after > before and inp.role(r).override is None:
                        self.learner_scale_ups[r] = (self.last_change_at, before, after)
            if error:
                self.metrics.inc("planner/apply_errors_total")
            shards = await self._shard_step(d, inp, act=apply and not dry and self.backend.leader)
            msg = self.to_proto(d, inp, trigger=trigger, applied=applied, dry_run=dry, error=error, shards=shards)
            if apply:
                self.record(msg, d.action)
            return msg

    async def _shard_step(self, d: Decision, inp: Inputs, *, act: bool) -> ShardDecision:
        """The buffer shards' step of a decision (services/planner/shards.py); carried out when `act`."""
        keeper = self.shards
        if not keeper.started:
            await keeper.sync()
        cores = dict(inp.transport.buffer_cores) if inp.transport is not None else {}
        override = self.overrides.get(SHARDS)
        busy = keeper.busy()
        if not busy and override is None and keeper.changed_at is not None and inp.now - keeper.changed_at < self.rules.cooldown_s:
            busy = (f"buffer shards changed {inp.now - keeper.changed_at:.0f} s ago "
                    f"(planner.cooldown_s {self.rules.cooldown_s:.0f})")
        sd = decide_shards(keeper.active, shard_bounds(self.cfg), bottleneck=d.bottleneck.kind,
                           evidence=d.bottleneck.evidence, buffer_cores=cores, idle_for_s=keeper.watch_idle(cores),
                           window_s=self.rules.scale_down_window_s, busy=busy,
                           override=override.replicas if override else None)
        if sd.target != sd.current and self.paused and override is None:   # paused: overrides only, as for roles
            return replace(sd, target=sd.current, reason=f"paused; would go on: {sd.reason}")
        if sd.target == sd.current or not act:
            return sd
        try:
            await keeper.scale_to(sd.target)
        except Exception as err:  # noqa: BLE001 - recorded; the next decision tries again
            self.metrics.inc("planner/apply_errors_total")
            log.warning("changing the buffer shards to %d failed: %s", sd.target, err)
            return replace(sd, target=sd.current, reason=f"{sd.reason}; failed: {type(err).__name__}: {err}")
        return sd

    def record(self, msg: ppb.Decision, action: str) -> None:
        msg.id = self.next_id
        self.next_id += 1
        self.decisions.append(msg)
        self.metrics.inc(f"planner/decisions_{action}_total")
        for role in msg.roles:   # learner/<policy>: planner/policies/<policy>/learner_replicas, ...
            name = f"policies/{role.role.split('/', 1)[1]}/learner" if role.role in self.policy_roles else role.role
            self.metrics.set(f"planner/{name}_replicas", role.target if msg.applied else role.current)
            self.metrics.set(f"planner/{name}_rate_per_replica", role.rate_per_replica)
        if msg.ratio:
            self.metrics.set("planner/production_consumption_ratio", msg.ratio)
        if msg.HasField("buffer_samples_per_insert"):
            self.metrics.set("planner/buffer_samples_per_insert", msg.buffer_samples_per_insert)
        for kind in BOTTLENECKS:   # 1 for the bottleneck of the last decision, 0 for the others
            self.metrics.set(f"planner/bottleneck_{kind}", float(msg.bottleneck == kind))
        shards_moved = msg.buffer_shards_target != msg.buffer_shards
        level = logging.INFO if msg.action == ppb.DECISION_ACTION_SCALE or msg.error or shards_moved else logging.DEBUG
        log.log(level, "decision %d (%s, %s%s): %s%s", msg.id, action, "applied" if msg.applied else "not applied",
                f", error {msg.error}" if msg.error else "", msg.reason,
                f"; buffer shards {msg.buffer_shards} -> {msg.buffer_shards_target}: {msg.buffer_shards_reason}"
                if shards_moved else "")
        if self.journal is not None:
            with open(self.journal, "a") as f:
                f.write(json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True)) + "\n")
        self.recorded.notify()

    def to_proto(self, d: Decision, inp: Inputs, *, trigger: str, applied: bool, dry_run: bool,
                 error: str = "", shards: ShardDecision | None = None) -> ppb.Decision:
        roles = []
        # Several policies: the actors, the learners of all policies together (their rate: what the actors
        # can be fed at, per learner), then each policy's learners, the roles decided.
        shown = ("actor", "learner", *inp.learners) if inp.learners else inp.roles
        for r in shown:
            ri = inp.role(r)
            if r == "learner" and inp.learners:
                current, target, proposed = (sum(counts.get(p, 0) for p in inp.learners)
                                             for counts in (d.current, d.targets, d.proposed))
            else:
                current, target, proposed = d.current[r], d.targets[r], d.proposed[r]
            rd = ppb.RoleDecision(role=r, current=current, target=target, proposed=proposed,
                                  ready=ri.ready, reporting=ri.reporting, rate_per_replica=ri.rate or 0.0,
                                  stale=ri.stale, blocked=ri.blocked, cores_per_replica=ri.cores or 0.0,
                                  cost_per_replica=self.rules.replica_cost(r, inp))
            if ri.override is not None:
                rd.override = ri.override
            if r in inp.ceilings:
                rd.ceiling = inp.ceilings[r]
            roles.append(rd)
        return ppb.Decision(unix_s=self.wall(), action=ACTIONS[d.action], applied=applied, dry_run=dry_run,
                            reason=d.reason, roles=roles, production=d.production or 0.0,
                            consumption=d.consumption or 0.0, ratio=d.ratio or 0.0,
                            planned_throughput=d.planned_throughput or 0.0, replay_ratio=self.rules.replay_ratio,
                            policy_lag=inp.policy_lag, max_policy_lag=self.rules.staleness_target,
                            tolerance=self.rules.tolerance, budget=self.rules.budget, trigger=trigger,
                            error=error, backend=self.backend.name, bottleneck=d.bottleneck.kind,
                            bottleneck_evidence=d.bottleneck.evidence,
                            buffer_shards=shards.current if shards else self.shards.active,
                            buffer_shards_target=shards.target if shards else self.shards.active,
                            buffer_shards_reason=shards.reason if shards else "", **self.observer.buffer_view())

    def validate_replicas(self, role: str, replicas: int) -> None:
        if role == SHARDS:
            lo, hi = shard_bounds(self.cfg)
            if not lo <= replicas <= hi:
                raise ValueError(f"replicas: {replicas} buffer shards is outside planner.buffer.min..max ({lo}..{hi})"
                                 + ("; planner.buffer is unset, so the shards stay at topology.buffers"
                                    if self.cfg.planner.buffer is None else ""))
            return
        if role not in (*ROLES, *self.policy_roles):
            raise ValueError(f"role: {role!r} is not scalable; expected one of "
                             f"{', '.join((*ROLES, *self.policy_roles, SHARDS))}")
        if role == "learner" and role not in self.cfg.learner_roles:
            raise ValueError(f"role: learner is not scaled in a run of several policies "
                             f"({', '.join(self.cfg.policy_names)}): set one policy's learners, "
                             f"{' or '.join(self.policy_roles)}")
        b = self.rules.bounds(role.split("/", 1)[0])
        if not b.min <= replicas <= b.max:
            raise ValueError(f"replicas: {replicas} is outside planner.{role.split('/', 1)[0]}.min..max "
                             f"({b.min}..{b.max})")

    async def set_override(self, role: str, replicas: int, ttl_s: float) -> ppb.Decision:
        """Hold `role` at `replicas` until the override expires; applied at once (buffer shards: the first
        step towards it at once, the others at the decisions after it)."""
        self.validate_replicas(role, replicas)
        self.overrides[role] = OverrideState(replicas, self.wall() + ttl_s)
        if role == SHARDS:
            return await self.step("override")
        async with self.lock:
            for attempt in range(CONFLICT_RETRIES + 1):
                await self.observer.measure()
                inp = self.inputs()
                current = {r: inp.role(r).desired for r in inp.roles}
                targets = {**current, role: replicas}
                error, applied = "", False
                if not self.backend.leader:
                    error = "not the leader: another planner holds the lease"
                    break
                try:
                    await self.backend.apply({role: replicas}, dry_run=self.backend.name == "dry-run")
                    applied = self.backend.name != "dry-run"
                    break
                except Conflict as err:   # the count changed under us (another writer): read it again
                    self.metrics.inc("planner/conflicts_total")
                    error = f"{type(err).__name__}: {err}"
                    log.info("replica count changed under the override (%s); re-reading (attempt %d)", err, attempt + 1)
                except Exception as err:  # noqa: BLE001 - recorded; the decision loop retries the override
                    error = f"{type(err).__name__}: {err}"
                    break
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
        """Let the planner take `role` back."""
        if role not in (*ROLES, *self.policy_roles, SHARDS):
            raise ValueError(f"role: {role!r} is not scalable; expected one of "
                             f"{', '.join((*ROLES, *self.policy_roles, SHARDS))}")
        self.overrides.pop(role, None)

    def status(self) -> ppb.PlannerStatus:
        st = ppb.PlannerStatus(paused=self.paused, pause_reason=self.pause_reason, backend=self.backend.name,
                               leader=self.backend.leader)
        for role, o in self.overrides.items():
            st.overrides.add(role=role, replicas=o.replicas, expires_unix_s=o.expires_unix_s)
        if self.decisions:
            st.last_decision.CopyFrom(self.decisions[-1])
        for role, state in self.observer.states.items():
            if role not in ROLES:
                continue   # (learner/<policy>: its replicas are the learner role's, listed there)
            for rep in state.replicas:
                st.replicas.add(role=role, name=rep.name, address=rep.address, ready=rep.ready)
        for rep in self.observer.buffers:   # the buffer shards, as the backend lists them
            st.replicas.add(role="buffer", name=rep.name, address=rep.address, ready=rep.ready)
        return st

    async def close(self) -> None:
        self.closing = True
        self.recorded.notify()
        await self.observer.close()
        await self.shards.close()
