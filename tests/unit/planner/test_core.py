"""The planner core's bookkeeping: manual overrides (applied at once, held while they last, given back on
expiry) and conflicts (re-read and decided again).

The backend here is an in-memory one: these tests are about the core (the real local and Kubernetes
backends, a real 409 included, are exercised in tests/integration)."""

from __future__ import annotations

import pytest

from kuberl.v1 import common_pb2 as pb
from kuberl.v1 import planner_pb2 as ppb
from services.config import config_from_dict
from services.planner.backend import ApplyResult, Conflict, Replica, RoleState
from services.planner.core import Planner
from services.planner.observe import COUNTERS
from tests.helpers import TINY_PPO


class MemoryBackend:
    name, leader = "memory", True

    def __init__(self, actors: int):
        self.desired = {"actor": actors, "learner": 1}
        self.applied: list[dict[str, int]] = []
        self.conflicts = 0      # the next this many applies fail as if someone else changed the count

    async def start(self) -> None:
        pass

    async def observe(self) -> dict[str, RoleState]:
        return {role: RoleState(desired=n) for role, n in self.desired.items()}

    async def buffers(self) -> list[Replica]:
        return []

    async def apply(self, targets: dict[str, int], *, dry_run: bool = False) -> ApplyResult:
        if self.conflicts:
            self.conflicts -= 1
            raise Conflict("the object has been modified; please apply your changes to the latest version")
        if not dry_run:
            self.desired.update(targets)
            self.applied.append(dict(targets))
        return ApplyResult(applied=dict(targets), dry_run=dry_run)

    async def close(self) -> None:
        pass


async def test_an_override_applies_at_once_even_paused_then_expires_and_the_planner_takes_the_role_back():
    cfg = config_from_dict({**TINY_PPO, "planner": {"actor": {"max": 4}}})
    backend, wall = MemoryBackend(actors=1), [1000.0]
    planner = Planner(cfg, backend, wall=lambda: wall[0])
    planner.paused = True  # pause holds the automatic loop, not a person's explicit command
    d = await planner.set_override("actor", 3, ttl_s=60)
    assert d.applied and d.trigger == "override" and backend.desired["actor"] == 3
    assert [(o.role, o.replicas, o.expires_unix_s) for o in planner.status().overrides] == [("actor", 3, 1060.0)]

    wall[0] = 1059.0  # still held: the periodic decision keeps the override's count
    d = await planner.step()
    assert {r.role: r.target for r in d.roles}["actor"] == 3 and backend.applied == [{"actor": 3}]

    wall[0] = 1061.0  # expired: gone from the status; no rates, so nothing is decided on missing data
    planner.paused = False
    d = await planner.step()
    assert not planner.status().overrides
    assert d.action == ppb.DECISION_ACTION_SUPPRESSED and "no usable metrics" in d.reason
    assert backend.applied == [{"actor": 3}] and backend.desired["actor"] == 3
    await planner.close()


async def test_a_conflict_is_re_read_and_decided_again_and_an_override_that_failed_is_retried():
    from services.planner.core import CONFLICT_RETRIES

    cfg = config_from_dict({**TINY_PPO, "planner": {"actor": {"max": 4}}})
    backend = MemoryBackend(actors=1)
    planner = Planner(cfg, backend)
    backend.conflicts = 2   # another writer moved the count twice: the override reads it again and applies
    d = await planner.set_override("actor", 3, ttl_s=60)
    assert d.applied and not d.error and backend.desired["actor"] == 3 and backend.applied == [{"actor": 3}]
    assert planner.metrics.counters["planner/conflicts_total"] == 2
    backend.conflicts = CONFLICT_RETRIES + 2   # more than it retries: recorded, not applied
    d = await planner.set_override("actor", 2, ttl_s=60)
    assert not d.applied and "Conflict" in d.error and backend.desired["actor"] == 3
    d = await planner.step()      # the decision loop: conflicts once more, re-reads, then applies the override
    assert d.applied and not d.error and backend.desired["actor"] == 2 and backend.applied == [{"actor": 3}, {"actor": 2}]
    assert planner.metrics.counters["planner/conflicts_total"] == 2 + (CONFLICT_RETRIES + 1) + 1
    await planner.close()


class SaturatedBackend(MemoryBackend):
    """Replicas that share one bottleneck: the actors together produce `actor_total` samples/s however
    many run (cores on one machine); the learner consumes `learner_rate`."""

    def __init__(self, actors: int, actor_total: float, learner_rate: float):
        super().__init__(actors)
        self.actor_total, self.learner_rate = actor_total, learner_rate

    async def observe(self) -> dict[str, RoleState]:
        return {role: RoleState(desired=n, replicas=[Replica(f"{role}-{i}", f"fake:{role}-{i}") for i in range(n)])
                for role, n in self.desired.items()}


class FedStats:
    """GetStats answered from the model in SaturatedBackend instead of over gRPC."""

    def __init__(self, backend: SaturatedBackend, clock):
        self.backend, self.clock = backend, clock
        self.counts: dict[str, tuple[float, float]] = {}   # replica name -> (time, count)

    async def get_stats(self, role, name, address, request):
        b, now = self.backend, self.clock()
        if role == "buffer":
            return None
        rate = b.learner_rate if role == "learner" else b.actor_total / b.desired["actor"]
        t0, c0 = self.counts.get(name, (now, 0.0))
        count = c0 + rate * (now - t0) + (1.0 if name not in self.counts else 0.0)
        self.counts[name] = (now, count)
        count_key, held_key = COUNTERS[role]
        return pb.GetStatsResponse(metrics={count_key: count, held_key: 0.0})

    async def forget(self, live):
        pass

    async def close(self):
        pass


async def test_a_scale_up_that_adds_nothing_sets_a_ceiling_and_the_planner_returns_to_the_count_that_paid():
    cfg = config_from_dict({**TINY_PPO, "planner": {
        "interval_s": 2, "warmup_s": 2, "cooldown_s": 6, "rate_halflife_s": 1, "scale_down_window_s": 10,
        "tolerance": 0.15, "saturation_hold_s": 120, "actor": {"max": 8}}})
    backend, clock = SaturatedBackend(actors=1, actor_total=100.0, learner_rate=600.0), [0.0]
    planner = Planner(cfg, backend, clock=lambda: clock[0], stats=FedStats(backend, lambda: clock[0]))
    seen = []
    for _ in range(80):
        clock[0] += 1.0
        if int(clock[0]) % 2:
            await planner.observer.measure()
            continue
        d = await planner.step()
        seen.append((clock[0], backend.desired["actor"], d))
    counts = [n for _, n, _ in seen]
    assert 3 in counts, "the run is actor-bound (100 vs 600 samples/s): the planner first scales up"
    assert counts[-1] == 1, f"the extra actors added nothing, so the planner went back to one: {counts}"
    assert planner.metrics.counters["planner/saturations_total"] == 1
    last = seen[-1][2]
    assert {r.role: r.ceiling for r in last.roles if r.HasField("ceiling")} == {"actor": 1}
    assert last.action == ppb.DECISION_ACTION_HOLD and "actor saturates above 1" in last.reason
    # it never climbed past the first scale-up: the ceiling held every later decision
    assert max(counts) == 3
    await planner.close()


async def test_learners_that_never_come_up_after_a_scale_up_are_taken_back_and_held_there():
    """A learner group forms only once every learner runs: when the planner's learner scale-up still has
    a learner not ready converge_timeout_s later, the count goes back and is held for saturation_hold_s."""
    cfg = config_from_dict({**TINY_PPO, "planner": {"learner": {"max": 4}, "converge_timeout_s": 120,
                                                    "saturation_hold_s": 300}})
    backend = NotReadyLearners(actors=1)
    backend.desired["learner"] = 2
    now = [1000.0]
    planner = Planner(cfg, backend, clock=lambda: now[0])
    planner.learner_scale_ups = {"learner": (1000.0, 1, 2)}   # as applying the planner's own scale-up 1 -> 2 leaves it
    planner.last_change_at = 1000.0

    now[0] = 1060.0   # still converging: left alone
    d = await planner.step()
    assert not d.applied and backend.desired["learner"] == 2
    now[0] = 1121.0   # one learner still not ready: taken back, and held
    d = await planner.step()
    assert d.applied and backend.applied == [{"learner": 1}] and "learner 2->1: only 1 of 2 learners ready" in d.reason
    assert planner.ceilings["learner"] == (1, 1121.0 + 300)
    now[0] = 1130.0   # the count changed: nothing followed any more
    await planner.step()
    assert planner.learner_scale_ups == {} and backend.applied == [{"learner": 1}]
    await planner.close()


async def test_a_learner_override_ends_the_follow_up_of_the_planners_scale_up():
    cfg = config_from_dict({**TINY_PPO, "planner": {"learner": {"max": 4}, "converge_timeout_s": 120}})
    backend = NotReadyLearners(actors=1)
    backend.desired["learner"] = 2
    now = [1000.0]
    planner = Planner(cfg, backend, clock=lambda: now[0], wall=lambda: now[0])
    planner.learner_scale_ups = {"learner": (1000.0, 1, 2)}
    await planner.set_override("learner", 2, ttl_s=3600)   # a person holds the learners at 2
    now[0] = 1200.0
    d = await planner.step()
    assert backend.desired["learner"] == 2 and "learner" not in planner.ceilings and planner.learner_scale_ups == {}
    assert "only 1 of 2 learners ready" not in d.reason
    await planner.close()


class NotReadyLearners(MemoryBackend):
    """Learner 0 serves, every other learner stays not ready (e.g. unschedulable)."""

    async def observe(self) -> dict[str, RoleState]:
        states = await super().observe()
        states["learner"] = RoleState(desired=self.desired["learner"], replicas=[
            Replica(name=f"learner-{i}", address="127.0.0.1:9" if i == 0 else "", ready=i == 0) for i in range(self.desired["learner"])])
        return states


def test_external_simulators_fix_the_actors_and_leave_the_learners_to_the_planner():
    """env.mode external: an actor added would serve no simulator (they find actors by address), so
    the actors stay at topology.actors within the planner's bounds; the learners keep theirs."""
    from services.planner.core import rules_from_config

    base = {**TINY_PPO, "planner": {"actor": {"min": 1, "max": 8}, "learner": {"min": 1, "max": 3}}}
    local = rules_from_config(config_from_dict({**base, "topology": {"actors": 2}}))
    assert (local.actor.min, local.actor.max) == (1, 8)
    external = rules_from_config(config_from_dict({**base, "topology": {"actors": 2},
                                                   "env": {"id": "CartPole-v1", "mode": "external"}}))
    assert (external.actor.min, external.actor.max) == (2, 2)
    assert (external.learner.min, external.learner.max) == (1, 3)


class WireBackend(MemoryBackend):
    """Replicas and one buffer shard, all answering GetStats from a model (ModelStats)."""

    async def observe(self) -> dict[str, RoleState]:
        return {role: RoleState(desired=n, replicas=[Replica(f"{role}-{i}", f"fake:{role}-{i}") for i in range(n)])
                for role, n in self.desired.items()}

    async def buffers(self) -> list[Replica]:
        return [Replica("buffer-0", "fake:buffer-0")]


class ModelStats:
    """GetStats answered from counters that grow at set rates: each actor 100 env steps/s, the learner
    400 samples/s, the buffer's process `buffer_cores` CPU seconds per second, and each actor drops
    `drop_rate` samples/s."""

    def __init__(self, clock):
        self.clock = clock
        self.buffer_cores, self.drop_rate = 0.3, 0.0
        self.totals: dict[str, dict[str, float]] = {}
        self.read_at: dict[str, float] = {}

    async def get_stats(self, role, name, address, request):
        now = self.clock()
        dt = now - self.read_at.get(name, now)
        self.read_at[name] = now
        per_s = {"actor": {"actor/env_steps_total": 100.0, "actor/pace_wait_seconds_total": 0.0,
                           "actor/samples_dropped_total": self.drop_rate, "actor/push_queue_fill": 0.0},
                 "learner": {"learner/samples_total": 400.0, "learner/starved_seconds_total": 0.0},
                 "buffer": {"buffer/cpu_seconds_total": self.buffer_cores}}[role]
        totals = self.totals.setdefault(name, {k: 1.0 if k.endswith("steps_total") or k.endswith("samples_total")
                                               else 0.0 for k in per_s})
        for k, rate in per_s.items():
            if k != "actor/push_queue_fill":
                totals[k] += rate * dt
        return pb.GetStatsResponse(metrics=totals)

    async def forget(self, live):
        pass

    async def close(self):
        pass


async def test_the_planner_reads_transport_from_stats_and_adds_no_actors_while_the_buffer_is_the_bottleneck():
    cfg = config_from_dict({**TINY_PPO, "planner": {
        "interval_s": 1, "warmup_s": 2, "cooldown_s": 3, "rate_halflife_s": 1, "tolerance": 0.15,
        "actor": {"max": 8}}})
    backend, clock = WireBackend(actors=1), [0.0]
    stats = ModelStats(lambda: clock[0])
    planner = Planner(cfg, backend, clock=lambda: clock[0], stats=stats)
    stats.buffer_cores = 0.98          # the one shard's process is at a full core
    for _ in range(8):
        clock[0] += 1.0
        d = await planner.step()
    assert backend.desired["actor"] == 1, "the buffer cannot take more: no actor was added"
    assert d.bottleneck == "communication" and "buffer-0 uses 0.98 CPU cores" in d.bottleneck_evidence
    assert "actor not scaled up" in d.reason
    assert planner.metrics.gauges["planner/bottleneck_communication"] == 1.0
    stats.drop_rate = 50.0              # and the actors start dropping from their send queues
    clock[0] += 1.0
    await planner.step()
    clock[0] += 1.0
    d = await planner.step()
    assert d.bottleneck == "communication" and "actors dropped" in d.bottleneck_evidence
    stats.buffer_cores, stats.drop_rate = 0.3, 0.0   # the transport clears: sample-bound, actors are added
    for _ in range(12):
        clock[0] += 1.0
        d = await planner.step()
        if d.applied:
            break
    assert d.applied and backend.desired["actor"] > 1 and d.bottleneck == "sampling", d.reason
    assert planner.metrics.gauges["planner/bottleneck_sampling"] == 1.0
    assert planner.metrics.gauges["planner/bottleneck_communication"] == 0.0
    await planner.close()


class FixedStats:
    """Every actor answers the same metrics: its counters, and what `gauges` holds."""

    def __init__(self, gauges: dict[str, float]):
        self.gauges = gauges

    async def get_stats(self, role, name, address, request):
        return pb.GetStatsResponse(role=role, metrics={"actor/env_steps_total": 1.0, "actor/pace_wait_seconds_total": 0.0,
                                                       "learner/samples_total": 1.0, "learner/starved_seconds_total": 0.0,
                                                       **self.gauges})

    async def forget(self, addresses):
        pass

    async def close(self):
        pass


async def test_an_actor_of_several_policies_is_judged_by_its_fullest_send_queue():
    """Each policy's send queue reports under `actor/policies/<policy>/` (services/common/stats.py
    `Metrics.scoped`); the planner's communication evidence is the fullest of them."""
    cfg = config_from_dict(TINY_PPO)
    stats = FixedStats({"actor/policies/lead/push_queue_fill": 0.2, "actor/policies/team/push_queue_fill": 0.9,
                        "actor/policies/team/push_queue_fragments": 30.0})
    planner = Planner(cfg, WireBackend(actors=1), clock=lambda: 1.0, stats=stats)
    await planner.observer.measure()
    transport = planner.observer.transport(1.0)
    assert (transport.busiest_queue, transport.queue_fill) == ("actor-0", 0.9)
    await planner.close()


class PoliciesBackend(MemoryBackend):
    """Actors, and a learner group per policy of two (red, blue), as the local backend runs a run of
    several policies: the learner role (all of them) is not scaled, each policy's, learner/<policy>, is;
    one buffer shard."""

    def __init__(self, actors: int):
        super().__init__(actors)
        del self.desired["learner"]
        self.desired.update({"learner/red": 1, "learner/blue": 1})

    async def observe(self) -> dict[str, RoleState]:
        groups = {p: RoleState(desired=self.desired[f"learner/{p}"], replicas=[
                      Replica(f"learner-{p}-{rank}", f"fake:{p}-{rank}", policy=p) for rank in range(self.desired[f"learner/{p}"])])
                  for p in ("red", "blue")}
        return {"actor": RoleState(desired=self.desired["actor"], replicas=[
                    Replica(f"actor-{i}", f"fake:actor-{i}") for i in range(self.desired["actor"])]),
                "learner": RoleState(desired=sum(g.desired for g in groups.values()),
                                     replicas=[r for g in groups.values() for r in g.replicas], blocked="several policies"),
                **{f"learner/{p}": g for p, g in groups.items()}}

    async def apply(self, targets: dict[str, int], *, dry_run: bool = False) -> ApplyResult:
        assert "learner" not in targets, "the learner role of several policies is not scaled as a whole"
        return await super().apply(targets, dry_run=dry_run)

    async def buffers(self) -> list[Replica]:
        return [Replica("buffer-0", "fake:buffer-0")]


class PoliciesStats:
    """Each actor makes 100 agent samples/s, 3 of 4 for red's agents; red's learner can take 300
    samples/s, blue's 60: blue's learners are the tightest (60 / (1/4) = 240 samples/s of the actors'
    output, against red's 300 / (3/4) = 400)."""

    def __init__(self, backend: PoliciesBackend, clock):
        self.backend, self.clock = backend, clock

    async def get_stats(self, role, name, address, request):
        t = self.clock()
        actors = self.backend.desired["actor"]
        per_s = {"actor": {"actor/env_steps_total": 100.0, "actor/pace_wait_seconds_total": 0.0},
                 "learner": {"learner/samples_total": 300.0 if "red" in name else 60.0,
                             "learner/starved_seconds_total": 0.0},
                 "buffer": {"buffer/policies/red/samples_received_total": 75.0 * actors,
                            "buffer/policies/blue/samples_received_total": 25.0 * actors}}[role]
        return pb.GetStatsResponse(metrics={k: 1.0 + v * t for k, v in per_s.items()})

    async def forget(self, live):
        pass

    async def close(self):
        pass


async def test_several_policies_scale_the_actors_to_what_the_tightest_policys_learners_take():
    """The actors feed every policy; the learners of each policy take only that policy's share. The
    balance is kept against the policy that can take least of the actors' output (blue: 240 samples/s),
    with each policy's learners at planner.learner.max (1 here) and the plan made around them."""
    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": "pettingzoo:mpe2.simple_spread_v3"},
                            "policies": {"red": {"agents": ["agent_0"]}, "blue": {"agents": ["agent_*"]}},
                            "planner": {"interval_s": 1, "warmup_s": 2, "cooldown_s": 3, "rate_halflife_s": 1,
                                        "tolerance": 0.1, "actor": {"max": 8}}})
    backend, clock = PoliciesBackend(actors=1), [0.0]
    planner = Planner(cfg, backend, clock=lambda: clock[0], stats=PoliciesStats(backend, lambda: clock[0]))
    for _ in range(8):
        clock[0] += 1.0
        d = await planner.step()
        if d.applied:
            break
    assert d.applied and backend.applied[0] == {"actor": 3}, d.reason
    assert d.consumption == pytest.approx(240.0) and d.production == pytest.approx(100.0)
    assert "policy blue's learners taking its share (the tightest)" in d.reason
    roles = {r.role: r for r in d.roles}
    assert [(r, roles[r].current, roles[r].target) for r in ("learner", "learner/red", "learner/blue")] == [
        ("learner", 2, 2), ("learner/red", 1, 1), ("learner/blue", 1, 1)]
    assert roles["learner/blue"].rate_per_replica == pytest.approx(60.0)
    # Two more actors make 300 samples/s: blue's learners still take only 240; no further actor pays.
    for _ in range(12):
        clock[0] += 1.0
        d = await planner.step()
    assert backend.applied == [{"actor": 3}], d.reason
    assert "production/consumption 1.25" in d.reason and "already the best plan within the bounds" in d.reason
    await planner.close()


async def test_several_policies_learners_are_sized_with_the_actors_where_the_feed_is_tightest():
    """planner.learner.max 3: each policy's learners are planned with the actors. An actor makes 100
    samples/s; red takes 3/4 of them and a red learner 300 samples/s (400 of the actors' output), blue
    takes 1/4 and a blue learner 60 (240). At 8 actors (800 samples/s) the plan is the fewest learners
    of each policy that take it, with blue held by its bound: red 2 (800), blue 3 (720). The counts move
    by the step bounds (+2), each policy's group on its own, and stop in the band at 7 actors (700/720)."""
    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": "pettingzoo:mpe2.simple_spread_v3"},
                            "policies": {"red": {"agents": ["agent_0"]}, "blue": {"agents": ["agent_*"]}},
                            "planner": {"interval_s": 1, "warmup_s": 2, "cooldown_s": 3, "rate_halflife_s": 1,
                                        "tolerance": 0.1, "actor": {"max": 8}, "learner": {"max": 3}}})
    backend, clock = PoliciesBackend(actors=1), [0.0]
    planner = Planner(cfg, backend, clock=lambda: clock[0], stats=PoliciesStats(backend, lambda: clock[0]))
    scaled = []
    for _ in range(80):
        clock[0] += 1.0
        d = await planner.step()
        if d.applied:
            scaled.append(d)
    assert backend.desired == {"actor": 7, "learner/red": 2, "learner/blue": 3}, [d.reason for d in scaled]
    assert len(scaled) == 3 and d.reason.startswith("in band: production/consumption 0.97")
    first = {r.role: r for r in scaled[0].roles}
    assert (first["actor"].target, first["learner/red"].target, first["learner/blue"].target) == (3, 2, 3)
    assert (first["actor"].proposed, first["learner/red"].proposed, first["learner/blue"].proposed) == (8, 2, 3)
    assert "learner/blue 1->3 (scale up)" in scaled[0].reason and "actor 1->3 (scale up; step-bounded" in scaled[0].reason
    assert backend.applied[0] == {"actor": 3, "learner/red": 2, "learner/blue": 3}
    assert all(set(a) <= {"actor", "learner/red", "learner/blue"} for a in backend.applied)   # never `learner`
    assert planner.metrics.gauges["planner/policies/blue/learner_replicas"] == 3
    assert planner.metrics.gauges["planner/policies/blue/learner_rate_per_replica"] == pytest.approx(60.0)
    assert d.planned_throughput == pytest.approx(720.0) and d.consumption == pytest.approx(720.0)
    assert {r.role: r.proposed for r in d.roles} == {"actor": 8, "learner": 5, "learner/red": 2, "learner/blue": 3}
    await planner.close()


class BlueNotReady(PoliciesBackend):
    """Blue's learners beyond rank 0 stay not ready (unschedulable)."""

    async def observe(self) -> dict[str, RoleState]:
        states = await super().observe()
        blue = [Replica(r.name, r.address if r.name.endswith("-0") else "", ready=r.name.endswith("-0"), policy="blue")
                for r in states["learner/blue"].replicas]
        states["learner/blue"] = RoleState(desired=len(blue), replicas=blue)
        return states


async def test_one_policys_learners_that_never_come_up_are_taken_back_alone_and_held_there():
    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": "pettingzoo:mpe2.simple_spread_v3"},
                            "policies": {"red": {"agents": ["agent_0"]}, "blue": {"agents": ["agent_*"]}},
                            "planner": {"learner": {"max": 3}, "converge_timeout_s": 120, "saturation_hold_s": 300}})
    backend, now = BlueNotReady(actors=1), [1000.0]
    backend.desired["learner/blue"] = 2
    planner = Planner(cfg, backend, clock=lambda: now[0])
    planner.learner_scale_ups = {"learner/blue": (1000.0, 1, 2)}   # as applying the planner's own scale-up leaves it
    planner.last_change_at = 1000.0
    now[0] = 1121.0
    d = await planner.step()
    assert d.applied and backend.applied == [{"learner/blue": 1}], d.reason
    assert "learner/blue 2->1: only 1 of 2 learners ready" in d.reason
    assert planner.ceilings == {"learner/blue": (1, 1121.0 + 300)}
    now[0] = 1130.0
    await planner.step()
    assert planner.learner_scale_ups == {} and backend.desired["learner/red"] == 1
    await planner.close()


async def test_one_policys_learners_are_set_by_hand_and_held_there():
    """`kuberl scale learner/<policy> N` in a run of several policies: applied at once to that policy's
    group alone, within planner.learner's bounds, shown in every decision and the status, set back
    when its count moves under the override, and left where it is once the override is cleared."""
    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": "pettingzoo:mpe2.simple_spread_v3"},
                            "policies": {"red": {"agents": ["agent_0"]}, "blue": {"agents": ["agent_*"]}},
                            "planner": {"learner": {"max": 3}}})
    backend, wall = PoliciesBackend(actors=1), [1000.0]
    planner = Planner(cfg, backend, wall=lambda: wall[0])
    for role, n, problem in (("learner/green", 2, "not scalable; expected one of actor, learner, learner/red, "
                                                  "learner/blue, buffer"),
                             ("learner", 2, "not scaled in a run of several policies (red, blue): set one "
                                            "policy's learners, learner/red or learner/blue"),
                             ("learner/blue", 4, "replicas: 4 is outside planner.learner.min..max (1..3)")):
        with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            planner.validate_replicas(role, n)
    d = await planner.set_override("learner/blue", 2, ttl_s=60)
    assert d.applied and backend.applied == [{"learner/blue": 2}] and backend.desired["learner/red"] == 1
    roles = {r.role: r for r in d.roles}
    assert (roles["learner/blue"].current, roles["learner/blue"].target, roles["learner/blue"].override) == (1, 2, 2)
    assert (roles["learner/red"].current, roles["learner/red"].target, roles["learner/red"].HasField("override")) == (1, 1, False)
    assert [(o.role, o.replicas) for o in planner.status().overrides] == [("learner/blue", 2)]
    await planner.observer.measure()
    assert sorted(r.name for r in planner.status().replicas if r.role == "learner") == [
        "learner-blue-0", "learner-blue-1", "learner-red-0"]   # (each once, under the learner role)

    backend.desired["learner/blue"] = 1   # set back under the override (kubectl scale, a helm upgrade)
    d = await planner.step()
    assert backend.applied[-1] == {"learner/blue": 2} and "manual override {'learner/blue': 2}" in d.reason
    assert planner.metrics.gauges["planner/policies/blue/learner_replicas"] == 2

    planner.clear_override("learner/blue")
    backend.desired["learner/blue"] = 1
    d = await planner.step()
    assert backend.applied[-1] == {"learner/blue": 2} and {r.role: r.target for r in d.roles}["learner/blue"] == 1
    await planner.close()
