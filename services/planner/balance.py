"""The planner's balance model: what it knows of a run (`Inputs`: each role's rates and counts, the
transport, the overrides), its scaling rules (`ScalingRules`: bounds, budget, tolerance, cooldowns; not a
trained policy), what it decides (`Decision`), and the throughput math (`solve`, `plan`). No I/O.

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

The balance model assumes a replica's rate does not depend on how many run. Where they share a
bottleneck (cores on one machine, a node's network, the buffer) that fails: more replicas, each slower,
the same total. `judge_scale_up` checks every scale-up once it has converged: if the role's measured
total rate rose by less than `min_scale_gain` of what the model predicted, the role gets a saturation
ceiling (the count that paid, held for `saturation_hold_s`), which `solve` treats as its max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
