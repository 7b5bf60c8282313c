"""The planner's decision: a pure function of measured rates, current replicas and the scaling rules
(`ScalingRules`: bounds, budget, tolerance, cooldowns; not a trained policy). No I/O.

The balance model and its math are services/planner/balance.py (`solve`, `plan`).

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

`judge_scale_up` checks every scale-up once it has converged against what the balance model
predicted (services/planner/balance.py says why it can fail).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from services.planner.balance import Bottleneck, Decision, Inputs, ScalingRules, bottleneck, plan

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
