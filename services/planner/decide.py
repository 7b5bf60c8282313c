"""The planner's decision: a pure function of measured rates, current replicas and the scaling rules
(`ScalingRules`: bounds, budget, tolerance, cooldowns; not a trained policy). No I/O.

Balance (docs/architecture.md section 4, TianJi eqs. 2-4): an actor produces `a` samples/s, a learner
can consume `l` samples/s when it never waits, and the algorithm wants each produced sample consumed
`R` times (DQN: the replay ratio; PPO: 1). With n_A actors and n_L learners the run moves

    min(n_A * a, n_L * l / R)   fresh samples per second,

and production/consumption = (n_A * a) / (n_L * l / R) is 1 at balance. `solve` picks the counts that
maximise that rate within per-role bounds and the budget (sum of n * cost); among counts within 1% of
the best it takes the cheapest, then the best balanced.

A run of several policies (config `policies`) has a learner role per policy, `learner/<p>`, each with its
own bounds (planner.learner's), rate l_p and share s_p of the actors' samples (what its buffer table
receives). An actor holds while any policy's table is behind, so the actors can be fed only as fast as
the tightest policy takes its share:

    min(n_A * a, min_p n_p * l_p / (R * s_p))   fresh samples per second,

and `plan` sizes every policy's learners with the actors: for each actor count, the learners are raised
one at a time where the feed is tightest until they take what the actors make (or a bound or the budget
stops them), which is the cheapest way to each throughput when learners cost the same. One policy is the
case p = "learner", s = 1.

`decide` wraps the solve in the rules that keep a controller from flapping: act only outside the
tolerance band; scale up at once, but down only to the largest target proposed over a trailing window;
move each role by a bounded step; wait a cooldown (longer than warm-up) after a change; never stack a
change on one that has not converged; never scale down on stale or missing metrics. Every call returns
a Decision that says what it would set and why, including when it does nothing.

`decide` is a chain of guards, asked in this order; the first that returns a Decision makes it:

1. take-back: a learner scale-up whose learners are not all ready converge_timeout_s later is undone
   (the group cannot form without them);
2. no usable metrics: suppressed while a role has no rate (or a policy no share); overrides still apply;
3. paused: suppressed, saying what it would aim for;
4. converge: suppressed while the last change's replicas are not all serving and reporting;
5. cooldown: suppressed until cooldown_s after the last change;
6. changed: "scale" when a role's target differs from its count now. Each role's target
   (`_step_role`): its manual override as it is; its count now where the backend will not scale it,
   inside the band, or at the proposal; else up at once by at most max_step_up (no actors while their
   data is stuck on its way to the buffers, nor while the policy lag is above the staleness target),
   or down slowly by at most max_step_down (never on stale metrics, nor before a whole
   scale_down_window_s was observed, and only to the largest target proposed over that window: the
   hysteresis); then scale-ups are cut until the targets fit the budget;
7. band: "hold" inside the tolerance band;
8. held back: outside the band, every move held back: suppressed, saying why;
9. otherwise "hold": the counts now are already the best plan within the bounds and budget.

Guards 1-2 need no rates, 3-5 the solve, 6-9 every role's step: each stage is worked out once, when
the first guard that needs it is asked.

The balance model assumes a replica's rate does not depend on how many run. Where they share a
bottleneck (cores on one machine, a node's network, the buffer) that fails: more replicas, each slower,
the same total. `judge_scale_up` checks every scale-up once it has converged: if the role's measured
total rate rose by less than `min_scale_gain` of what the model predicted, the role gets a saturation
ceiling (the count that paid, held for `saturation_hold_s`), which `solve` treats as its max.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

ROLES = ("actor", "learner")
NEAR_BEST = 0.99   # throughputs within 1% of the best count as equal; the cheaper plan wins


@dataclass(frozen=True)
class RoleBounds:
    min: int = 1
    max: int = 8
    cost: float = 1.0
    max_step_up: int = 2
    max_step_down: int = 1


@dataclass(frozen=True)
class ScalingRules:
    actor: RoleBounds = field(default_factory=RoleBounds)
    learner: RoleBounds = field(default_factory=lambda: RoleBounds(max=1))
    budget: float = 0.0              # 0: only the per-role bounds
    tolerance: float = 0.15          # band around production/consumption = 1
    replay_ratio: float = 1.0        # R: consumptions wanted per produced sample
    cooldown_s: float = 20.0
    scale_down_window_s: float = 60.0
    converge_timeout_s: float = 120.0
    staleness_target: float = 0.0    # the mean policy lag above which no actor is added (0 = none)
    measured_costs: bool = False     # a replica costs the CPU cores it was measured to use (else bounds' cost)
    min_scale_gain: float = 0.5      # a scale-up must realise this share of its predicted gain (0 = not checked)
    saturation_hold_s: float = 300.0  # how long a saturation ceiling lasts

    def bounds(self, role: str) -> RoleBounds:
        return self.actor if role == "actor" else self.learner

    def max_count(self, role: str, inp: Inputs | None = None) -> int:
        """The role's max bound, lowered to its saturation ceiling while one is in force."""
        ceiling = inp.ceilings.get(role) if inp is not None else None
        b = self.bounds(role)
        return b.max if ceiling is None else max(b.min, min(b.max, ceiling))

    def replica_cost(self, role: str, inp: Inputs | None = None) -> float:
        """What one replica of `role` costs against the budget: its measured cores (measured_costs, once
        known), else the configured cost."""
        measured = inp.role(role).cores if inp is not None and self.measured_costs else None
        return measured if measured is not None and measured > 0 else self.bounds(role).cost

    def cost(self, counts: dict[str, int], inp: Inputs | None = None) -> float:
        return sum(n * self.replica_cost(r, inp) for r, n in counts.items())

    def fits(self, counts: dict[str, int], inp: Inputs | None = None) -> bool:
        return self.budget <= 0 or self.cost(counts, inp) <= self.budget + 1e-9


@dataclass(frozen=True)
class RoleInputs:
    """What the planner knows about one role at decision time."""
    desired: int                 # replica count set now
    ready: int = -1              # replicas serving (-1: same as desired)
    reporting: int = -1          # replicas with warmed-up, fresh metrics (-1: same as desired)
    rate: float | None = None    # EWMA samples/s per replica (actor: produced; learner: consumable); None = unknown
    stale: bool = False          # some replica's metrics are stale or missing
    blocked: str = ""            # the backend will not scale this role, and why
    override: int | None = None  # a manual replica count in force
    cores: float | None = None   # EWMA CPU cores per replica (measured cost); None = unknown
    share: float | None = None   # learner/<policy>: the policy's share of the actors' samples (None = unknown)

    def __post_init__(self):
        if self.ready < 0:
            object.__setattr__(self, "ready", self.desired)
        if self.reporting < 0:
            object.__setattr__(self, "reporting", self.desired)


# Communication-intensive (TianJi's third bottleneck): data made by actors does not reach the buffers.
BUFFER_BUSY_CORES = 0.9   # a shard's process this busy has no room left on its one event loop
QUEUE_BACKLOG = 0.5       # an actor's send queue this full (of its bound) is not being drained


@dataclass(frozen=True)
class Transport:
    """What says whether data is stuck between actors and buffers, from fresh metrics only."""
    dropped_per_s: float = 0.0     # samples/s dropped from actors' send queues, all actors together
    queue_fill: float = 0.0        # the fullest actor send queue, as a share of its bound
    busiest_queue: str = ""        # the actor with that queue
    buffer_cores: dict[str, float] = field(default_factory=dict)   # buffer shard -> CPU cores its process uses


@dataclass(frozen=True)
class Bottleneck:
    """What limits the run now, and the measurement that shows it (named in every decision):
    "communication" (actors' data does not reach the buffers), "training" (learners saturated: actors
    produce more than they consume), "sampling" (learners would consume more than actors produce),
    "balanced", or "unknown" (no usable rates)."""
    kind: str
    evidence: str


def bottleneck(rules: ScalingRules, ratio: float | None, transport: Transport | None) -> Bottleneck:
    """Classify the run (TianJi: sample-, train- or communication-intensive). Transport comes first: when
    data is stuck on its way to the buffers, production/consumption measures the actors' capacity, not
    what learners can be given, and more actors only add to the backlog."""
    t = transport or Transport()
    if t.dropped_per_s > 0:
        return Bottleneck("communication", f"actors dropped {t.dropped_per_s:,.0f} samples/s from full send queues")
    busy = {name: cores for name, cores in t.buffer_cores.items() if cores >= BUFFER_BUSY_CORES}
    if busy:
        name = max(busy, key=lambda n: busy[n])
        return Bottleneck("communication", f"{name} uses {busy[name]:.2f} CPU cores (its event loop has no room: "
                                           f"{BUFFER_BUSY_CORES:g} and above)")
    if t.queue_fill >= QUEUE_BACKLOG:
        return Bottleneck("communication", f"{t.busiest_queue or 'an actor'}'s send queue is {t.queue_fill:.0%} "
                                           f"full ({QUEUE_BACKLOG:.0%} and above: the buffer is not taking it)")
    if ratio is None:
        return Bottleneck("unknown", "no usable actor or learner rates")
    if ratio > 1 + rules.tolerance:
        return Bottleneck("training", f"production/consumption {ratio:.2f}: the learners are saturated")
    if ratio < 1 - rules.tolerance:
        return Bottleneck("sampling", f"production/consumption {ratio:.2f}: the learners could consume more")
    return Bottleneck("balanced", f"production/consumption {ratio:.2f}")


@dataclass(frozen=True)
class Inputs:
    now: float
    actor: RoleInputs
    learner: RoleInputs
    paused: bool = False
    last_change_at: float | None = None       # when the last change was applied
    observing_since: float = -math.inf         # when the planner started observing (for the down window)
    # Targets proposed by earlier decisions: (time, {role: n}); the down window reads these.
    recent_proposals: tuple[tuple[float, dict[str, int]], ...] = ()
    policy_lag: float | None = None            # learners' recent mean policy lag, versions (None = unknown)
    ceilings: dict[str, int] = field(default_factory=dict)  # saturation ceilings in force: role -> max count
    # The planner's last scale-up of each learner role (learner, or learner/<policy>) while it has not
    # converged: role -> (applied at, count before, count after).
    learner_scale_ups: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    transport: Transport | None = None          # actor send queues and buffer CPU (None = unknown)
    # A run of several policies: each policy's learners, learner/<policy> -> its inputs (rate per replica,
    # share of the samples). Then these are the learner roles decided, and `learner` (all of them) is not.
    learners: dict[str, RoleInputs] = field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles decided: the actors and the learners, or with several policies each policy's learners."""
        return ("actor", *self.learners) if self.learners else ROLES

    def role(self, role: str) -> RoleInputs:
        if role in self.learners:
            return self.learners[role]
        return self.actor if role == "actor" else self.learner


@dataclass(frozen=True)
class Decision:
    action: str                   # "scale" (change targets), "hold" (nothing to do) or "suppressed" (should, must not)
    reason: str
    current: dict[str, int]
    targets: dict[str, int]       # what to set now (== current unless action == "scale")
    proposed: dict[str, int]      # the unconstrained-by-hysteresis optimum (== current when unknown)
    production: float | None = None    # samples/s the current counts produce
    consumption: float | None = None   # fresh samples/s the current counts can consume (learner rate / R)
    ratio: float | None = None         # production / consumption
    planned_throughput: float | None = None  # min(production, consumption) at `proposed`
    bottleneck: Bottleneck = field(default_factory=lambda: Bottleneck("unknown", ""))

    @property
    def changes(self) -> dict[str, int]:
        return {r: n for r, n in self.targets.items() if n != self.current[r]}


def solve(rules: ScalingRules, actor_rate: float, learner_rate: float,
          inp: Inputs | None = None, fixed: dict[str, int] | None = None) -> tuple[dict[str, int], float]:
    """The (n_actors, n_learners) maximising min(n_A*a, n_L*l/R) within bounds and budget (replica
    costs measured in `inp` where the rules say so); the roles in `fixed` at their counts there."""
    return plan(rules, actor_rate, {"learner": learner_rate / rules.replay_ratio}, inp, fixed)


def plan(rules: ScalingRules, actor_rate: float, feeds: dict[str, float], inp: Inputs | None = None,
         fixed: dict[str, int] | None = None) -> tuple[dict[str, int], float]:
    """The actor and learner counts maximising min(n_A*a, min_r n_r*feeds[r]) within bounds and budget,
    where feeds[r] is the samples/s of the actors' output one replica of learner role r can take
    (l / R, or with several policies l_p / (R * s_p); math.inf for a policy that gets no samples, which
    then stays at its minimum). Among plans within 1% of the best throughput: the cheapest, then the best
    balanced. The roles in `fixed` stay at their counts there."""
    a, fixed = actor_rate, fixed or {}

    def lo(role: str) -> int:
        return fixed.get(role, rules.bounds(role).min)

    def hi(role: str) -> int:
        return fixed.get(role, rules.max_count(role, inp))

    def taken(n: dict[str, int]) -> float:   # what the learners can take of the actors' output
        return min((n[r] * c for r, c in feeds.items() if not math.isinf(c)), default=math.inf)

    plans = []
    for na in range(lo("actor"), hi("actor") + 1):
        n = {r: lo(r) for r in feeds}
        while rules.fits({"actor": na, **n}, inp):
            fed = taken(n)
            thr = min(na * a, fed)
            imbalance = 0.0 if math.isinf(fed) else abs(math.log(max(na * a, 1e-12) / max(fed, 1e-12)))
            plans.append((thr, rules.cost({"actor": na, **n}, inp), imbalance, {"actor": na, **n}))
            if fed >= na * a:
                break   # more learners would take nothing more
            tightest = min((r for r in feeds if not math.isinf(feeds[r])), key=lambda r: n[r] * feeds[r])
            if n[tightest] >= hi(tightest):
                break   # the tightest is at its bound: no more learners raise the throughput
            n[tightest] += 1
    if not plans:  # config validation guarantees the minimums fit; guard anyway
        counts = {"actor": lo("actor"), **{r: lo(r) for r in feeds}}
        return counts, min(counts["actor"] * a, taken(counts))
    best = max(p[0] for p in plans)
    near = [p for p in plans if p[0] >= NEAR_BEST * best]
    thr, _, _, counts = min(near, key=lambda p: (p[1], p[2]))
    return counts, thr


# -- decide: the guards ------------------------------------------------------------------------------
# What a decision knows comes in three stages, each worked out once and only when a guard needs it:
# _Seen (the counts and overrides, which roles have usable rates), _Solved (the rates and the plan),
# _Stepped (each role's move). A guard reads one stage and returns a Decision, or None to pass.


@dataclass(frozen=True)
class _Seen:
    """Before any rate is used: the roles' counts now, the manual overrides in force, and the roles
    without usable metrics."""
    rules: ScalingRules
    inp: Inputs
    current: dict[str, int]      # role -> replica count set now
    overrides: dict[str, int]    # role -> manual count in force (its bounds were checked when it was set)
    idle: frozenset[str]         # several policies: learner roles whose policy gets no samples (yet)
    missing: tuple[str, ...]     # what has no usable rate (or, several policies, share) to decide on

    @property
    def roles(self) -> tuple[str, ...]:
        return self.inp.roles

    def out(self, action: str, reason: str, targets: dict[str, int] | None = None) -> Decision:
        """A decision made without rates: it proposes the counts now."""
        neck = bottleneck(self.rules, None, self.inp.transport)
        return Decision(action, _with_bottleneck(reason, neck), self.current, dict(targets or self.current),
                        dict(self.current), bottleneck=neck)


@dataclass(frozen=True)
class _Solved(_Seen):
    """The measured balance at the counts now, and the plan the solve proposes."""
    proposed: dict[str, int]     # the best plan (a blocked role at what it would be given; the others around it)
    production: float            # samples/s the current counts produce
    consumption: float           # samples/s of it the current learners can take (the tightest policy's)
    ratio: float                 # production / consumption
    planned_throughput: float    # at `proposed`
    band: str                    # the ratio and the tolerance band, as every reason from here says them
    in_band: bool
    neck: Bottleneck             # what limits the run now (at `ratio`)
    tightest: str                # several policies: the learner role that takes least of the actors' output

    def out(self, action: str, reason: str, targets: dict[str, int] | None = None) -> Decision:
        """A decision with the rates and the plan, naming the bottleneck (and the tightest policy)."""
        reason = _with_bottleneck(reason, self.neck)
        if self.tightest:
            reason = (f"{reason}; consumption: what the actors can be fed at, policy "
                      f"{self.tightest.split('/', 1)[1]}'s learners taking its share (the tightest)")
        return Decision(action, reason, self.current, dict(targets or self.current), dict(self.proposed),
                        self.production, self.consumption, self.ratio, self.planned_throughput, self.neck)


@dataclass(frozen=True)
class _Stepped(_Solved):
    """Each role moved towards `proposed` by its rules (_step), within the budget."""
    targets: dict[str, int]
    notes: tuple[str, ...]       # why each role moved, or did not

    @property
    def ceilings(self) -> str:
        """The saturation ceilings in force, as the reasons from here end with them."""
        return "".join(f"; {r} saturates above {n}" for r, n in sorted(self.inp.ceilings.items()))


def _with_bottleneck(reason: str, neck: Bottleneck) -> str:
    return f"{reason}; bottleneck: {neck.kind} ({neck.evidence})" if neck.evidence else reason


def _see(rules: ScalingRules, inp: Inputs) -> _Seen:
    roles = inp.roles
    learners = [r for r in roles if r != "actor"]
    # Several policies: a policy's share of the samples is measured too; one that gets none (its agents
    # have not come yet) needs no learner rate, and its learners are planned at their minimum.
    idle = frozenset(r for r in learners if inp.learners and inp.role(r).share == 0)
    missing = [r for r in roles if r not in idle and ((rate := inp.role(r).rate) is None or rate <= 0)]
    if inp.learners:
        missing += [f"{r}'s share of the samples" for r in learners if inp.role(r).share is None]
    return _Seen(rules, inp, current={r: inp.role(r).desired for r in roles},
                 overrides={r: n for r in roles if (n := inp.role(r).override) is not None},
                 idle=idle, missing=tuple(missing))


def _take_back(s: _Seen) -> Decision | None:
    """Learners train as one group, which forms only once every learner runs: a learner scale-up of the
    planner's whose learners are still not all ready converge_timeout_s later (a pod that cannot be
    scheduled or fails to start) holds up the whole group, so it is taken back to the count before it
    (the removed pods are the ones it added: a StatefulSet removes the highest ordinals). The planner
    core holds the learners there for saturation_hold_s (Planner.track_learner_scale_ups). With several
    policies each policy's learners are a group of their own, taken back alone. Overrides go with it."""
    inp, back, said = s.inp, {}, []
    for r, (applied_at, before, after) in inp.learner_scale_ups.items():
        ri = inp.role(r) if r in s.roles else None
        if ri is None or r in s.overrides or ri.blocked or inp.paused:
            continue
        if s.current[r] == after and ri.ready < after and inp.now - applied_at >= s.rules.converge_timeout_s:
            back[r] = before
            said.append(f"{r} {after}->{before}: only {ri.ready} of {after} learners ready "
                        f"{inp.now - applied_at:.0f} s after the scale-up (converge_timeout_s "
                        f"{s.rules.converge_timeout_s:.0f}); the learner group cannot form without them")
    return s.out("scale", "; ".join(said), {**s.current, **s.overrides, **back}) if back else None


def _no_usable_metrics(s: _Seen) -> Decision | None:
    """Nothing is decided on missing rates; manual overrides are applied all the same."""
    if s.inp.actor.rate is not None and not s.missing:
        return None
    targets = {**s.current, **s.overrides}
    if s.overrides and targets != s.current:
        return s.out("scale", f"manual override {s.overrides}; no usable rates for {', '.join(s.missing)}", targets)
    return s.out("suppressed", f"no usable metrics for {', '.join(s.missing)} (no warmed-up replica has reported a "
                               "rate): nothing is decided on missing data")


def _solve(s: _Seen) -> _Solved:
    rules, inp = s.rules, s.inp
    a = inp.actor.rate or 0.0   # positive here: _no_usable_metrics passes only then
    # What one replica of each learner role can take of the actors' output, samples/s.
    feeds = {r: math.inf if r in s.idle else
             (inp.role(r).rate or 0.0) / rules.replay_ratio / (inp.role(r).share or 1.0)
             for r in s.roles if r != "actor"}
    fed = {r: s.current[r] * c for r, c in feeds.items() if not math.isinf(c)}
    production = s.current["actor"] * a
    consumption = min(fed.values()) if fed else math.inf
    ratio = production / consumption if consumption > 0 else math.inf
    proposed, thr = plan(rules, a, feeds, inp)
    # A role the backend will not scale stays where it is: the others are planned around its count
    # (`proposed` still says what the blocked role would be given).
    if fixed := {r: s.current[r] for r in s.roles if inp.role(r).blocked}:
        around, thr = plan(rules, a, feeds, inp, fixed)
        proposed = {r: proposed[r] if r in fixed else around[r] for r in s.roles}
    return _Solved(**vars(s), proposed=proposed, production=production, consumption=consumption, ratio=ratio,
                   planned_throughput=thr,
                   band=f"production/consumption {ratio:.2f} (band {1 - rules.tolerance:.2f}..{1 + rules.tolerance:.2f})",
                   in_band=abs(ratio - 1.0) <= rules.tolerance, neck=bottleneck(rules, ratio, inp.transport),
                   tightest=min(fed, key=lambda r: fed[r]) if inp.learners and fed else "")


def _paused(s: _Solved) -> Decision | None:
    return s.out("suppressed", f"paused; would aim for {s.proposed} at {s.band}") if s.inp.paused else None


def _not_converged(s: _Solved) -> Decision | None:
    """A change in flight is judged only once every new replica serves and has warmed-up metrics."""
    inp = s.inp
    if inp.last_change_at is not None and inp.now - inp.last_change_at < s.rules.converge_timeout_s:
        pending = [f"{r} {inp.role(r).reporting}/{s.current[r]} reporting" for r in s.roles
                   if inp.role(r).ready != s.current[r] or inp.role(r).reporting < s.current[r]]
        if pending:
            return s.out("suppressed", f"previous change has not converged ({', '.join(pending)}); "
                                       "not stacking another on it")
    return None


def _cooling_down(s: _Solved) -> Decision | None:
    inp = s.inp
    if inp.last_change_at is not None and inp.now - inp.last_change_at < s.rules.cooldown_s:
        left = s.rules.cooldown_s - (inp.now - inp.last_change_at)
        return s.out("suppressed", f"cooldown: {left:.0f} s left after the last change; {s.band}")
    return None


def _step(s: _Solved) -> _Stepped:
    """Every role's target (_step_role), then the scale-ups cut, largest first, until the targets fit
    the budget: scale-ups held back elsewhere (a blocked or stale role) must not break it."""
    targets, notes = dict(s.current), []
    for r in s.roles:
        targets[r], note = _step_role(s, r)
        if note:
            notes.append(note)
    while not s.rules.fits(targets, s.inp):
        grown = [r for r in s.roles if targets[r] > s.current[r] and r not in s.overrides]
        if not grown:
            break
        r = max(grown, key=lambda r: targets[r] - s.current[r])
        targets[r] -= 1
        notes.append(f"{r} reduced to {targets[r]} to stay within the budget {s.rules.budget:g}")
    return _Stepped(**vars(s), targets=targets, notes=tuple(notes))


def _step_role(s: _Solved, r: str) -> tuple[int, str | None]:
    """One role's target and the note on it: a manual override as it is; a blocked role where it is;
    nothing in the band or at the proposal; else a step towards the proposal."""
    cur, want = s.current[r], s.proposed[r]
    if r in s.overrides:
        n = s.overrides[r]
        return n, (f"{r} {cur}->{n} (manual override)" if n != cur else None)
    if blocked := s.inp.role(r).blocked:
        return cur, (f"{r} left at {cur}: {blocked}" if want != cur else None)
    if s.in_band or want == cur:
        return cur, None
    return _step_up(s, r) if want > cur else _step_down(s, r)


def _step_up(s: _Solved, r: str) -> tuple[int, str]:
    """At once, by at most max_step_up; no actors added while their data does not reach the buffers
    (more actors only add to it) or while the learners' policy lag is above the staleness target (more
    actors mean older samples; docs/architecture.md section 4)."""
    rules, lag, cur, want = s.rules, s.inp.policy_lag, s.current[r], s.proposed[r]
    if r == "actor" and s.neck.kind == "communication":
        return cur, (f"actor not scaled up to {want}: the actors' data does not reach the buffers "
                     "(more buffer shards, topology.buffers, would take it)")
    if r == "actor" and rules.staleness_target > 0 and lag is not None and lag > rules.staleness_target:
        return cur, (f"actor not scaled up to {want}: policy lag {lag:.1f} is above the "
                     f"staleness target {rules.staleness_target:g}")
    step = min(want, cur + rules.bounds(r).max_step_up)
    return step, f"{r} {cur}->{step} (scale up{'; step-bounded, aiming for ' + str(want) if step < want else ''})"


def _step_down(s: _Solved, r: str) -> tuple[int, str]:
    """Slowly: never on stale or missing metrics, nor before the planner has observed a whole
    scale_down_window_s; then only to the largest target proposed over that window (hysteresis), by at
    most max_step_down."""
    rules, inp, cur, want = s.rules, s.inp, s.current[r], s.proposed[r]
    if stale := [x for x in s.roles if inp.role(x).stale]:
        return cur, f"{r} not scaled down to {want}: stale or missing metrics from {', '.join(stale)}"
    if inp.now - inp.observing_since < rules.scale_down_window_s:
        return cur, (f"{r} not scaled down to {want}: observed for less than the "
                     f"{rules.scale_down_window_s:.0f} s scale-down window")
    window = [p[r] for t, p in inp.recent_proposals if inp.now - t <= rules.scale_down_window_s and r in p]
    floor = max([want, *window])
    if floor >= cur:
        return cur, (f"{r} not scaled down to {want}: {floor} was proposed within the last "
                     f"{rules.scale_down_window_s:.0f} s")
    step = max(floor, cur - rules.bounds(r).max_step_down)
    return step, f"{r} {cur}->{step} (scale down; lowest target held over the window: {floor})"


def _changed(s: _Stepped) -> Decision | None:
    return s.out("scale", f"{s.band}: " + "; ".join(s.notes) + s.ceilings, s.targets) if s.targets != s.current else None


def _in_band(s: _Stepped) -> Decision | None:
    return s.out("hold", f"in band: {s.band}") if s.in_band else None


def _held_back(s: _Stepped) -> Decision | None:
    """Outside the band, but every move was held back: say why."""
    return s.out("suppressed", f"{s.band}: " + "; ".join(s.notes) + s.ceilings) if s.notes else None


def _already_best(s: _Stepped) -> Decision:
    """Outside the band with nothing to move: the counts now are the best plan within bounds and budget."""
    return s.out("hold", f"{s.band}, but {s.proposed} is already the best plan within the bounds and budget"
                         f"{s.ceilings}")


_G = TypeVar("_G", bound=_Seen)


def _first(state: _G, guards: tuple[Callable[[_G], Decision | None], ...]) -> Decision | None:
    return next((d for guard in guards if (d := guard(state)) is not None), None)


def decide(rules: ScalingRules, inp: Inputs) -> Decision:
    """What to set now and why: the first decision of the guards, in the order the module docstring
    lists them. Each stage of what is known is worked out once, when the next guard needs it."""
    seen = _see(rules, inp)
    if (d := _first(seen, (_take_back, _no_usable_metrics))) is not None:
        return d
    solved = _solve(seen)
    if (d := _first(solved, (_paused, _not_converged, _cooling_down))) is not None:
        return d
    stepped = _step(solved)
    return _first(stepped, (_changed, _in_band, _held_back)) or _already_best(stepped)


@dataclass(frozen=True)
class ScaleUpProbe:
    """A scale-up the planner applied, to be judged by what it really added."""
    role: str
    before: int          # replicas before
    after: int           # replicas after
    total_before: float  # the role's total rate before (replicas x per-replica rate), samples/s
    applied_at: float


@dataclass(frozen=True)
class Verdict:
    done: bool               # the probe is settled (judged or given up); False: judge it later
    ceiling: int | None      # a saturation ceiling to set, or None
    reason: str = ""


def judge_scale_up(rules: ScalingRules, probe: ScaleUpProbe, inp: Inputs) -> Verdict:
    """Did the scale-up pay? Judged once every new replica reports warmed-up rates and the cooldown
    has passed (the old replicas' EWMAs then mostly reflect the new load). If the total rate rose by
    less than `min_scale_gain` of the predicted (after/before - 1) x total, the role saturates: its
    ceiling is `before` plus the replicas the realised gain was worth at the old per-replica rate."""
    ri = inp.role(probe.role)
    if ri.desired != probe.after:
        return Verdict(True, None, "the count changed again before the scale-up could be judged")
    if inp.now - probe.applied_at > rules.converge_timeout_s:
        if ri.ready < probe.after:   # its new replicas never served: no more of them for a while
            return Verdict(True, max(probe.before, ri.ready),
                           f"{probe.role} {probe.before}->{probe.after}: only {ri.ready} ready after "
                           f"{rules.converge_timeout_s:.0f} s; {probe.role} held at {max(probe.before, ri.ready)} "
                           f"for {rules.saturation_hold_s:.0f} s")
        return Verdict(True, None, "the scale-up did not converge in time to be judged")
    if inp.now - probe.applied_at < rules.cooldown_s or ri.reporting < probe.after or ri.rate is None:
        return Verdict(False, None)
    total = probe.after * ri.rate
    predicted = probe.total_before * (probe.after / probe.before - 1.0) if probe.before else 0.0
    if predicted <= 0 or rules.min_scale_gain <= 0:
        return Verdict(True, None)
    gain = (total - probe.total_before) / predicted
    said = (f"{probe.role} {probe.before}->{probe.after} moved its total rate from {probe.total_before:,.0f} to "
            f"{total:,.0f} samples/s, {gain:.0%} of the predicted gain")
    if gain >= rules.min_scale_gain:
        return Verdict(True, None, said)
    # The replicas the gain was worth, at the old per-replica rate: keep that many more than before.
    worth = (total - probe.total_before) / (probe.total_before / probe.before)
    ceiling = min(probe.after, probe.before + max(0, math.floor(worth + 0.5)))
    return Verdict(True, ceiling, f"{said} (below {rules.min_scale_gain:.0%}): {probe.role} saturates above "
                                  f"{ceiling} for {rules.saturation_hold_s:.0f} s")
