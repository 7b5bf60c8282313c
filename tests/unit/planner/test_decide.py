"""Decision tables for the planner's pure decision module."""

import dataclasses
import itertools
import math
import random

import pytest

from services.planner.balance import Inputs, RoleBounds, RoleInputs, ScalingRules, plan, solve
from services.planner.decide import ScaleUpProbe, decide, judge_scale_up

RULES = ScalingRules(actor=RoleBounds(min=1, max=8, max_step_up=2, max_step_down=1),
                     learner=RoleBounds(min=1, max=1),
                     tolerance=0.15, replay_ratio=1.0, cooldown_s=20, scale_down_window_s=60)
# Several learners and a budget of 6 cores: the budget, not the bounds, limits the plan.
BUDGETED = ScalingRules(actor=RoleBounds(min=1, max=8, max_step_up=2, max_step_down=1),
                        learner=RoleBounds(min=1, max=4, max_step_up=2, max_step_down=1),
                        budget=6, tolerance=0.15, cooldown_s=20, scale_down_window_s=60)
LONG_AGO = -1000.0


def inputs(na, nl, a, l, **kw):
    role_kw = {k: kw.pop(k) for k in list(kw) if k.startswith(("actor_", "learner_"))}
    actor = RoleInputs(desired=na, rate=a, **{k[6:]: v for k, v in role_kw.items() if k.startswith("actor_")})
    learner = RoleInputs(desired=nl, rate=l, **{k[8:]: v for k, v in role_kw.items() if k.startswith("learner_")})
    kw.setdefault("observing_since", LONG_AGO)
    return Inputs(now=0.0, actor=actor, learner=learner, **kw)


def _naive_plan(rules: ScalingRules, a: float, feeds: dict[str, float]) -> tuple[float, float]:
    """Every combination of counts within the bounds and budget: the best throughput, and the least cost
    among the plans within 1% of it."""
    roles = ["actor", *feeds]
    plans = []
    for counts in itertools.product(*(range(rules.bounds(r).min, rules.bounds(r).max + 1) for r in roles)):
        n = dict(zip(roles, counts))
        if rules.fits(n):
            fed = min((n[r] * c for r, c in feeds.items() if not math.isinf(c)), default=math.inf)
            plans.append((min(n["actor"] * a, fed), rules.cost(n)))
    best = max(t for t, _ in plans)
    return best, min(c for t, c in plans if t >= 0.99 * best)


@pytest.mark.parametrize("seed", range(40))
def test_plan_of_several_policies_matches_every_combination_tried(seed):
    """Several policies' learners sized with the actors: plan() finds the best throughput at the least
    cost that trying every combination of counts finds, over random rates, shares, bounds and budgets
    (a policy with no samples, math.inf, stays at its minimum)."""
    rng = random.Random(seed)
    learner = RoleBounds(min=rng.randint(1, 2), max=rng.randint(2, 4), cost=rng.choice([1.0, 2.0]))
    actor = RoleBounds(min=1, max=rng.randint(2, 8), cost=rng.choice([0.5, 1.0]))
    feeds = {f"learner/p{i}": rng.choice([math.inf, *(rng.uniform(20, 400) for _ in range(6))])
             for i in range(rng.randint(1, 3))}
    floor = actor.min * actor.cost + len(feeds) * learner.min * learner.cost
    rules = ScalingRules(actor=actor, learner=learner, budget=rng.choice([0.0, floor + rng.randint(0, 6)]))
    counts, thr = plan(rules, 100.0, feeds)
    best, cheapest = _naive_plan(rules, 100.0, feeds)
    assert set(counts) == {"actor", *feeds} and rules.fits(counts)
    assert thr >= 0.99 * best and rules.cost(counts) == pytest.approx(cheapest), (counts, thr, best)
    fed = min((counts[r] * c for r, c in feeds.items() if not math.isinf(c)), default=math.inf)
    assert thr == pytest.approx(min(counts["actor"] * 100.0, fed))
    assert all(counts[r] == learner.min for r, c in feeds.items() if math.isinf(c))


@pytest.mark.parametrize("rules,a,l,R,expect", [
    (RULES, 100, 400, 1.0, {"actor": 4, "learner": 1}),      # one learner: as many actors as it can consume
    (RULES, 100, 1600, 4.0, {"actor": 4, "learner": 1}),     # DQN: a learner consumes l/R fresh samples/s
    (RULES, 100, 5000, 1.0, {"actor": 8, "learner": 1}),     # actor max reached
    (BUDGETED, 100, 200, 1.0, {"actor": 4, "learner": 2}),    # 4 + 2 = 6 cores: 400 samples/s
    (BUDGETED, 100, 800, 1.0, {"actor": 5, "learner": 1}),    # a second learner would buy nothing
])
def test_solve_maximises_min_rate_then_cheapest(rules, a, l, R, expect):
    rules = ScalingRules(actor=rules.actor, learner=rules.learner, budget=rules.budget, replay_ratio=R)
    counts, thr = solve(rules, a, l)
    assert counts == expect
    assert thr == pytest.approx(min(counts["actor"] * a, counts["learner"] * l / R))


def test_solve_respects_budget():
    rules = ScalingRules(actor=RoleBounds(min=1, max=8, cost=1.0), learner=RoleBounds(min=1, max=4, cost=2.0), budget=6)
    counts, thr = solve(rules, 100, 1000)
    assert counts == {"actor": 4, "learner": 1}   # 4*1 + 1*2 = 6: more actors would break the budget
    assert rules.cost(counts) <= 6 and thr == 400


def test_balanced_holds():
    d = decide(RULES, inputs(4, 1, 100, 420))
    assert d.action == "hold" and d.targets == d.current and "in band" in d.reason
    assert d.ratio == pytest.approx(400 / 420)


def test_actor_bound_scales_up_at_once_with_a_bounded_step():
    d = decide(RULES, inputs(1, 1, 100, 600))
    assert d.action == "scale"
    assert d.proposed == {"actor": 6, "learner": 1}
    assert d.targets == {"actor": 3, "learner": 1}     # +2 per decision
    assert "step-bounded" in d.reason and d.ratio == pytest.approx(100 / 600)


STALENESS = ScalingRules(actor=RULES.actor, learner=RULES.learner, tolerance=0.15, staleness_target=4.0,
                         cooldown_s=20, scale_down_window_s=60)


@pytest.mark.parametrize("lag,scales", [(None, True), (2.0, True), (4.0, True), (9.5, False)])
def test_staleness_target_holds_actor_scale_ups_while_the_lag_is_above_it(lag, scales):
    d = decide(STALENESS, inputs(1, 1, 100, 600, policy_lag=lag))
    assert d.proposed == {"actor": 6, "learner": 1}
    if scales:
        assert d.action == "scale" and d.targets["actor"] == 3
    else:
        assert d.action == "suppressed" and d.targets == d.current
        assert "policy lag 9.5 is above the staleness target 4" in d.reason


def test_staleness_target_never_holds_a_scale_down():
    d = decide(STALENESS, inputs(6, 1, 100, 300, policy_lag=50.0))
    assert d.action == "scale" and d.targets["actor"] == 5


def test_measured_costs_fit_more_light_actors_into_a_core_budget():
    # Budget 3 cores; configured costs (1 per replica) allow 2 actors next to the learner. Measured, the
    # actors (rate-capped) use 0.2 cores each and the learner 1.0: 8 actors fit in 2.6 cores.
    configured = ScalingRules(actor=RoleBounds(min=1, max=8, max_step_up=8), learner=RoleBounds(max=1), budget=3.0)
    measured = ScalingRules(actor=RoleBounds(min=1, max=8, max_step_up=8), learner=RoleBounds(max=1), budget=3.0,
                            measured_costs=True)
    inp = inputs(1, 1, 100, 1000, actor_cores=0.2, learner_cores=1.0)
    assert decide(configured, inp).targets["actor"] == 2
    d = decide(measured, inp)
    assert d.targets["actor"] == 8 and measured.cost(d.targets, inp) == pytest.approx(2.6)
    # Until a role's cost is measured, its configured cost stands in.
    assert decide(measured, inputs(1, 1, 100, 1000, learner_cores=1.0)).targets["actor"] == 2


def test_learner_bound_adds_learners_and_sheds_actors_within_the_budget():
    d = decide(BUDGETED, inputs(5, 1, 100, 200))
    assert d.proposed == {"actor": 4, "learner": 2}
    assert d.action == "scale" and d.targets == {"actor": 4, "learner": 2}
    assert BUDGETED.cost(d.targets) <= 6


def test_scale_up_is_cut_back_to_the_budget_when_a_scale_down_is_held():
    # The learner should grow and the actors shrink, but the actors' scale-down is held by the window:
    # the learner's growth is cut so the total stays within 6.
    d = decide(BUDGETED, inputs(5, 1, 100, 200, observing_since=-10.0))
    assert d.targets["actor"] == 5 and BUDGETED.cost(d.targets) <= 6 and "budget" in d.reason


def test_budget_bound_caps_scale_up():
    rules = ScalingRules(actor=RoleBounds(min=1, max=8, max_step_up=8), learner=RoleBounds(min=1, max=1), budget=4)
    d = decide(rules, inputs(1, 1, 100, 1000))
    assert d.targets == {"actor": 3, "learner": 1}
    assert rules.cost(d.targets) <= 4


def test_at_bounds_holds_and_says_so():
    rules = ScalingRules(actor=RoleBounds(min=1, max=2), learner=RoleBounds(min=1, max=1))
    d = decide(rules, inputs(2, 1, 100, 1000))
    assert d.action == "hold" and "already the best plan" in d.reason


def test_missing_metrics_suppress_everything():
    d = decide(RULES, inputs(1, 1, 100, None))
    assert d.action == "suppressed" and "learner" in d.reason and d.targets == d.current
    d = decide(RULES, inputs(1, 1, 0.0, 500))
    assert d.action == "suppressed" and "actor" in d.reason


def test_noisy_metrics_within_band_do_nothing():
    for l in (360, 400, 450, 470):   # production 400 against +-15%
        assert decide(RULES, inputs(4, 1, 100, l)).action == "hold"


def test_stale_metrics_never_scale_down_but_may_scale_up():
    down = decide(RULES, inputs(8, 1, 100, 400, learner_stale=True))
    assert down.targets["actor"] == 8 and "stale" in down.reason
    up = decide(RULES, inputs(1, 1, 100, 400, actor_stale=True))
    assert up.targets["actor"] == 3 and up.action == "scale"


def test_scale_down_waits_for_the_window_and_takes_its_largest_proposal():
    young = decide(RULES, inputs(8, 1, 100, 400, observing_since=-10.0))
    assert young.targets["actor"] == 8 and "window" in young.reason
    held = decide(RULES, inputs(8, 1, 100, 400, recent_proposals=((-30.0, {"actor": 8, "learner": 1}),)))
    assert held.targets["actor"] == 8 and "proposed within" in held.reason
    old = decide(RULES, inputs(8, 1, 100, 400, recent_proposals=((-90.0, {"actor": 8, "learner": 1}),
                                                                  (-20.0, {"actor": 6, "learner": 1}))))
    assert old.action == "scale" and old.targets["actor"] == 7    # one step down toward max(4, 6) = 6


def test_cooldown_suppresses_and_names_the_time_left():
    d = decide(RULES, inputs(1, 1, 100, 600, last_change_at=-5.0))
    assert d.action == "suppressed" and "cooldown" in d.reason and "15 s" in d.reason
    assert d.proposed == {"actor": 6, "learner": 1}
    assert decide(RULES, inputs(1, 1, 100, 600, last_change_at=-25.0)).action == "scale"


def test_no_stacking_on_an_unconverged_change():
    d = decide(RULES, inputs(3, 1, 100, 600, actor_ready=2, actor_reporting=1, last_change_at=-50.0))
    assert d.action == "suppressed" and "not converged" in d.reason and "actor 1/3" in d.reason
    # after converge_timeout_s the stuck change no longer blocks
    late = decide(RULES, inputs(3, 1, 100, 600, actor_ready=2, actor_reporting=1, last_change_at=-500.0))
    assert late.action == "scale"


def test_pause_suppresses_but_records_the_plan():
    d = decide(RULES, inputs(1, 1, 100, 600, paused=True))
    assert d.action == "suppressed" and "paused" in d.reason and d.proposed["actor"] == 6


def test_blocked_role_is_left_alone():
    d = decide(RULES, inputs(1, 1, 100, 600, actor_blocked="HPA kuberl-actor targets it"))
    assert d.targets["actor"] == 1 and "HPA" in d.reason and d.action == "suppressed"


def test_the_other_role_is_planned_around_a_blocked_ones_count():
    """Three learners the backend will not scale (outside the planner's 1..1): the actors are planned to
    feed all three (600 samples/s: 6 actors), not the one learner the bounds would allow."""
    d = decide(RULES, inputs(1, 3, 100, 200, learner_blocked="several policies"))
    assert d.proposed == {"actor": 6, "learner": 1} and d.targets == {"actor": 3, "learner": 3}, d.reason
    assert "learner left at 3: several policies" in d.reason
    assert d.planned_throughput == pytest.approx(600)


def test_override_wins_even_without_rates():
    d = decide(RULES, inputs(1, 1, None, None, actor_override=5))
    assert d.action == "scale" and d.targets["actor"] == 5 and "override" in d.reason
    d = decide(RULES, inputs(6, 1, 100, 600, actor_override=2))
    assert d.targets["actor"] == 2


def test_never_outside_bounds():
    for na in range(1, 9):
        for a in (1.0, 10.0, 100.0, 1e4):
            for l in (1.0, 100.0, 1e5):
                d = decide(RULES, inputs(na, 1, a, l))
                for r in ("actor", "learner"):
                    b = RULES.bounds(r)
                    assert b.min <= d.targets[r] <= b.max
                    assert abs(d.targets[r] - d.current[r]) <= max(b.max_step_up, b.max_step_down)
                assert not math.isnan(d.ratio)


# -- saturation: a scale-up is judged by what it added ------------------------------------------------
PROBE = ScaleUpProbe("actor", before=1, after=3, total_before=100.0, applied_at=0.0)


def judged_at(now, rate, reporting=3, desired=3):
    return Inputs(now=now, actor=RoleInputs(desired=desired, reporting=reporting, rate=rate),
                  learner=RoleInputs(desired=1, rate=600.0))


@pytest.mark.parametrize("now,rate,reporting,desired,done,ceiling", [
    (10, 90, 3, 3, False, None),    # inside the cooldown: too early to judge
    (25, 90, 2, 3, False, None),    # a new replica has no warmed-up rate yet
    (25, 90, 3, 3, True, None),     # 270 samples/s: 85% of the predicted +200 -> it paid
    (25, 50, 3, 3, True, 2),        # 150: 25% of the gain, worth half a replica -> no more than 2
    (25, 40, 3, 3, True, 1),        # 120: worth 0.2 of a replica -> back to 1
    (25, 30, 3, 3, True, 1),        # 90: less than before -> back to 1
    (25, 30, 3, 5, True, None),     # the count changed since: nothing to judge
    (200, 30, 2, 3, True, None),    # never converged within converge_timeout_s: given up
])
def test_a_scale_up_that_did_not_pay_sets_a_saturation_ceiling(now, rate, reporting, desired, done, ceiling):
    v = judge_scale_up(RULES, PROBE, judged_at(now, rate, reporting, desired))
    assert (v.done, v.ceiling) == (done, ceiling), v.reason
    if ceiling is not None:
        assert f"saturates above {ceiling}" in v.reason and "of the predicted gain" in v.reason


def test_a_saturation_ceiling_caps_the_plan_and_the_hold_names_it():
    d = decide(RULES, inputs(3, 1, 50, 600, ceilings={"actor": 3}))
    assert d.proposed == {"actor": 3, "learner": 1} and d.action == "hold"
    assert "actor saturates above 3" in d.reason
    # below the ceiling the role still grows to it
    d = decide(RULES, inputs(1, 1, 50, 600, ceilings={"actor": 2}))
    assert d.action == "scale" and d.targets == {"actor": 2, "learner": 1}


def test_a_ceiling_below_the_current_count_scales_down_through_the_window():
    d = decide(RULES, inputs(3, 1, 30, 600, ceilings={"actor": 1}))
    assert d.proposed["actor"] == 1 and d.action == "scale" and d.targets["actor"] == 2   # one step down
    held = decide(RULES, inputs(3, 1, 30, 600, ceilings={"actor": 1}, recent_proposals=((-10.0, {"actor": 3}),)))
    assert held.action == "suppressed" and "3 was proposed" in held.reason


# -- learners that never come up hold up the whole group ----------------------------------------------
GROUPS = ScalingRules(actor=RULES.actor, learner=RoleBounds(min=1, max=4), tolerance=0.15, cooldown_s=20,
                      scale_down_window_s=60, converge_timeout_s=120)


def scaled_up(inp: Inputs, scale_up: tuple[float, int, int]) -> Inputs:
    return dataclasses.replace(inp, learner_scale_ups={"learner": scale_up})


def test_a_learner_scale_up_still_not_ready_after_the_converge_timeout_is_taken_back():
    # The planner raised the learners 1 -> 2 200 s ago and one is still not ready (unschedulable): the
    # group cannot form, so the learners report no rate; the count goes back to 1 without waiting for rates.
    d = decide(GROUPS, scaled_up(inputs(4, 2, 100, None, learner_ready=1), (-200.0, 1, 2)))
    assert d.action == "scale" and d.targets == {"actor": 4, "learner": 1}
    assert "only 1 of 2 learners ready 200 s after the scale-up" in d.reason
    # No learner ready at all (rank 0 restarting while it waits for the group): the same.
    d = decide(GROUPS, scaled_up(inputs(4, 2, 100, None, learner_ready=0), (-200.0, 1, 2)))
    assert d.targets["learner"] == 1
    # Within converge_timeout_s it is only a change in flight.
    d = decide(GROUPS, scaled_up(inputs(4, 2, 100, 400, learner_ready=1, learner_reporting=1, last_change_at=-60.0),
                                 (-60.0, 1, 2)))
    assert d.action == "suppressed" and "not converged" in d.reason
    # Unready learners without a scale-up of the planner's behind them (a rolling update, a pod
    # restarting long after the last change) are not taken back; nor under an override, a pause or a block.
    d = decide(GROUPS, inputs(4, 2, 100, 400, learner_ready=1, last_change_at=-500.0))
    assert d.targets["learner"] == 2, d.reason
    for kw in ({"learner_override": 2}, {"paused": True}, {"learner_blocked": "paused by hand"}):
        d = decide(GROUPS, scaled_up(inputs(4, 2, 100, None, learner_ready=1, **kw), (-200.0, 1, 2)))
        assert d.targets["learner"] == 2, (kw, d.reason)


def test_a_scale_up_whose_replicas_never_served_holds_the_role_where_it_was():
    probe = ScaleUpProbe("learner", before=1, after=2, total_before=400.0, applied_at=0.0)
    inp = Inputs(now=200.0, actor=RoleInputs(desired=4, rate=100.0),
                 learner=RoleInputs(desired=2, ready=1, reporting=1, rate=None))
    v = judge_scale_up(GROUPS, probe, inp)
    assert (v.done, v.ceiling) == (True, 1) and "only 1 ready after 120 s" in v.reason


# -- the three bottlenecks (TianJi: sample-, train-, communication-intensive) --------------------------

from services.planner.balance import BUFFER_BUSY_CORES, QUEUE_BACKLOG, Transport, bottleneck  # noqa: E402


@pytest.mark.parametrize("ratio,transport,kind,says", [
    # Recorded rate tables: production/consumption alone, with clean transport.
    (1.0, Transport(buffer_cores={"buffer-0": 0.4}), "balanced", "production/consumption 1.00"),
    (2.5, Transport(buffer_cores={"buffer-0": 0.4}), "training", "learners are saturated"),
    (0.3, Transport(), "sampling", "learners could consume more"),
    (None, None, "unknown", "no usable"),
    # Data stuck between actors and buffers wins over any ratio: the ratio then measures capacity only.
    (0.3, Transport(dropped_per_s=1200.0), "communication", "dropped 1,200 samples/s"),
    (2.5, Transport(buffer_cores={"buffer-0": 0.5, "buffer-1": 0.97}), "communication", "buffer-1 uses 0.97"),
    (None, Transport(queue_fill=0.8, busiest_queue="actor-3"), "communication", "actor-3's send queue is 80% full"),
    # Just below each threshold is not communication-bound.
    (1.0, Transport(buffer_cores={"b": BUFFER_BUSY_CORES - 0.01}, queue_fill=QUEUE_BACKLOG - 0.01), "balanced", ""),
])
def test_the_bottleneck_is_named_with_the_measurement_that_shows_it(ratio, transport, kind, says):
    neck = bottleneck(RULES, ratio, transport)
    assert neck.kind == kind and says in neck.evidence


def test_a_communication_bound_run_adds_no_actors_and_says_why():
    # Actors could feed 4x what one learner consumes... but their data does not reach the buffer.
    stuck = inputs(1, 1, 100, 400, transport=Transport(buffer_cores={"buffer-0": 0.99}))
    d = decide(RULES, stuck)
    assert d.action == "suppressed" and d.targets == {"actor": 1, "learner": 1}
    assert d.bottleneck.kind == "communication"
    assert "actor not scaled up to 4: the actors' data does not reach the buffers" in d.reason
    assert "bottleneck: communication (buffer-0 uses 0.99 CPU cores" in d.reason
    free = decide(RULES, inputs(1, 1, 100, 400, transport=Transport(buffer_cores={"buffer-0": 0.3})))
    assert free.action == "scale" and free.targets["actor"] == 3 and free.bottleneck.kind == "sampling"
    assert "bottleneck: sampling" in free.reason


def _policies_inputs(blue: RoleInputs, **kw) -> Inputs:
    """Two policies: 2 actors of 100 samples/s; red takes 3/4 of the samples, a red learner 300/s."""
    return Inputs(now=0.0, actor=RoleInputs(desired=2, rate=100.0), learner=RoleInputs(desired=2, blocked="several"),
                  observing_since=LONG_AGO, learners={"learner/red": RoleInputs(desired=1, rate=300.0, share=0.75),
                                                      "learner/blue": blue}, **kw)


def test_several_policies_are_not_decided_before_each_policys_share_of_the_samples_is_measured():
    d = decide(BUDGETED, _policies_inputs(RoleInputs(desired=1, rate=60.0)))
    assert d.action == "suppressed" and set(d.current) == {"actor", "learner/red", "learner/blue"}
    assert "no usable metrics for learner/blue's share of the samples" in d.reason


def test_a_policys_learners_the_backend_will_not_scale_are_planned_around():
    """Blue's learners (1/4 of the samples, 60/s each: 240 of the actors' output) cannot be scaled (an
    HPA targets them): the actors are planned to what one blue learner takes, red's learners to match."""
    rules = ScalingRules(actor=RoleBounds(min=1, max=8, max_step_up=4), learner=RoleBounds(min=1, max=4, max_step_up=2),
                         tolerance=0.1)
    d = decide(rules, _policies_inputs(RoleInputs(desired=1, rate=60.0, share=0.25, blocked="an HPA targets it")))
    assert d.consumption == pytest.approx(240.0) and d.ratio == pytest.approx(200 / 240)
    assert d.proposed == {"actor": 3, "learner/red": 1, "learner/blue": 4}   # blue: what the best plan (8 actors) gives it
    assert d.action == "scale" and d.targets == {"actor": 3, "learner/red": 1, "learner/blue": 1}
    assert "learner/blue left at 1: an HPA targets it" in d.reason


def test_one_policys_learner_scale_up_still_not_ready_is_taken_back_alone():
    """Each policy's learners are a group of their own: blue's scale-up 1 -> 2 with one learner still not
    ready 200 s later (converge_timeout_s 120) goes back to 1; red's learners and the actors stay."""
    inp = dataclasses.replace(_policies_inputs(RoleInputs(desired=2, ready=1, reporting=1, rate=None)),
                              learners={"learner/red": RoleInputs(desired=2, rate=300.0, share=0.75),
                                        "learner/blue": RoleInputs(desired=2, ready=1, reporting=1, rate=None)},
                              learner_scale_ups={"learner/blue": (-200.0, 1, 2), "learner/red": (-200.0, 1, 2)})
    d = decide(GROUPS, inp)
    assert d.action == "scale" and d.targets == {"actor": 2, "learner/red": 2, "learner/blue": 1}
    assert d.reason.startswith("learner/blue 2->1: only 1 of 2 learners ready 200 s after the scale-up")
    held = dataclasses.replace(inp, learners={**inp.learners, "learner/blue": dataclasses.replace(
        inp.learners["learner/blue"], override=2)})
    assert decide(GROUPS, held).targets["learner/blue"] == 2   # a person holds blue's learners: left there


def test_a_policy_that_gets_no_samples_needs_no_learner_rate_and_is_planned_at_its_minimum():
    """Blue's agents have not come yet (its share 0, its learners starved: no rate): the actors are
    planned with red's learners alone (8 actors, 800 samples/s: 2 red learners), blue's at planner.learner.min."""
    rules = ScalingRules(actor=RoleBounds(min=1, max=8, max_step_up=4), learner=RoleBounds(min=1, max=4), tolerance=0.1)
    d = decide(rules, _policies_inputs(RoleInputs(desired=2, rate=None, share=0.0)))
    assert d.consumption == pytest.approx(400.0) and d.proposed == {"actor": 8, "learner/red": 2, "learner/blue": 1}


def test_a_budget_below_every_roles_minimum_is_refused_naming_them():
    from services.config import ConfigError, config_from_dict

    cfg = {"algorithm": "ppo", "env": {"id": "CartPole-v1"},
           "planner": {"budget": 2.5, "actor": {"min": 1, "cost": 1.0}, "learner": {"min": 1, "cost": 2.0}}}
    with pytest.raises(ConfigError, match=r"^planner.budget: 2.5 is invalid: cannot fit the minimum replicas of every "
                                          r"role: 3 \(planner.actor.min and planner.learner.min, at their cost\)"):
        config_from_dict(cfg)
    assert config_from_dict({**cfg, "planner": {**cfg["planner"], "budget": 3.0}}).planner.budget == 3.0
