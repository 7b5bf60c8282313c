"""The buffer's two-sided rate limiter (services/buffer/limiter.py, docs/rate-limiter.md): each
sentence of the contract, checked on random insert and sample sequences against plain counts."""

from __future__ import annotations

import random

import pytest

from services.buffer.limiter import RateLimiter


def replay(ratio=4.0, warmup=64, batch=32, prefetch=2) -> RateLimiter:
    return RateLimiter(ratio=ratio, warmup=warmup, batch_size=batch, prefetch=prefetch)


def run(lim: RateLimiter, fragment: int, steps: int, seed: int, learners: int = 1, p_actor: float = 0.5,
        capacity: int | None = None):
    """Actors and learners take turns at random, each doing what the limiter lets it do: an actor
    starts a fragment only below the insert limit, a learner takes a batch only when it may sample.
    Returns the counts after every turn and how often each side was held."""
    rng = random.Random(seed)
    inserted = served = held_fifo = 0
    history, held = [], {"actor": 0, "learner": 0, "both": 0}
    for _ in range(steps):
        limit = lim.insert_limit(inserted, held_fifo, served, learners, fragment)
        actor_may = limit is None or inserted < limit
        if lim.fifo:
            learner_may = held_fifo >= lim.batch_size
        else:
            learner_may = inserted >= max(lim.warmup, lim.batch_size) and lim.can_sample(inserted, served)
        held["both"] += not actor_may and not learner_may
        if rng.random() < p_actor:
            if actor_may:
                inserted += fragment
                held_fifo += fragment
            else:
                held["actor"] += 1
        elif learner_may:
            take = lim.batch_size if not lim.fifo else fragment * -(-lim.batch_size // fragment)
            served += take
            held_fifo -= take if lim.fifo else 0
        else:
            held["learner"] += 1
        history.append((inserted, served, held_fifo))
    return history, held


@pytest.mark.parametrize("seed", range(6))
def test_replay_sides_never_wait_on_each_other_and_hold_the_ratio(seed):
    rng = random.Random(seed)
    ratio = rng.choice([0.5, 1.0, 4.0, 8.0, 32.0, 256.0])
    batch, warmup, fragment = rng.choice([8, 32, 256]), rng.choice([256, 1000]), rng.choice([1, 8, 64])
    lim = replay(ratio, warmup, batch)
    history, held = run(lim, fragment, 20_000, seed, p_actor=rng.choice([0.05, 0.5, 0.95]))
    assert held["both"] == 0  # whenever one side is held, the other may go on
    slack = lim.slack(1, fragment)
    for inserted, served, _ in history:
        # sample side: never more than the ratio allows after the warm-up
        assert served <= ratio * max(0, inserted - warmup)
        # insert side: never more than a fragment past the limit
        assert inserted <= warmup + served / ratio + slack + 1 + fragment
    inserted, served, _ = history[-1]
    produced = inserted - warmup
    # both sides busy for long: the ratio held is the target, short of it by at most the slack
    assert served / produced <= ratio
    assert served / produced >= ratio * (1 - (slack + fragment + batch / ratio) / produced)
    if produced > 20 * (slack + fragment):
        assert served / produced >= ratio * 0.9


def test_the_warm_up_is_not_production():
    lim = replay(ratio=256.0, warmup=5000, batch=256)
    # At the end of the warm-up a learner gets nothing yet (Reverb subtracts min_size too): without the
    # subtraction it could take 256 x 5000 samples' worth of updates on random warm-up data.
    assert not lim.can_sample(5000, 0)
    assert lim.can_sample(5001, 0)            # one new sample: one update of 256
    assert not lim.can_sample(5001, 256)
    assert lim.can_sample(5010, 9 * 256)      # ten new samples: ten updates
    assert not lim.can_sample(5010, 10 * 256)


def test_actors_are_never_held_during_the_warm_up():
    lim = replay(ratio=8.0, warmup=1000, batch=128)
    assert lim.insert_limit(0, 0, 0, 1, 64) > 1000
    history, held = run(lim, 64, 200, seed=1, p_actor=1.0)  # no learner at all
    inserted = history[-1][0]
    assert inserted >= 1000 + lim.slack(1, 64)  # the whole warm-up and the slack went in unheld
    assert held["actor"] == 200 - inserted // 64  # and then the actor was held


def test_the_slack_fills_every_learner_prefetch_queue():
    lim = replay(ratio=4.0, warmup=0, batch=32, prefetch=2)
    for learners in (1, 3):
        limit = lim.insert_limit(0, 0, 0, learners, fragment=0)
        # at the limit, the samples inserted allow learners x (prefetch + 1) batches
        assert int(4.0 * limit) // 32 == learners * 3
    assert lim.insert_limit(0, 0, 0, 0, 0) == lim.insert_limit(0, 0, 0, 1, 0)  # none reported yet: one assumed


def test_an_unpaced_replay_limits_neither_side():
    lim = replay(ratio=0.0)
    assert lim.insert_limit(10**9, 0, 0, 1, 64) is None
    assert lim.can_sample(64, 10**12)


@pytest.mark.parametrize("seed", range(4))
def test_fifo_serves_what_is_stepped_and_never_overflows(seed):
    batch, fragment = random.Random(seed).choice([(512, 64), (2048, 256), (100, 30)])
    lim = RateLimiter(ratio=1.0, warmup=0, batch_size=batch, prefetch=2, fifo=True)
    history, held = run(lim, fragment, 20_000, seed, p_actor=0.8)
    assert held["both"] == 0
    bound = lim.slack(1, fragment) + fragment  # one actor: at most one fragment past the limit
    assert max(h for _, _, h in history) <= bound
    inserted, served, waiting = history[-1]
    assert inserted - served == waiting < bound  # what was stepped was served, but for one batch's worth
    # with a FIFO of `bound` steps, nothing would ever have been evicted
    assert lim.insert_limit(inserted, waiting, served, 1, fragment) == served + lim.slack(1, fragment)


@pytest.mark.parametrize("learners", [2, 3, 5])
def test_fifo_a_learner_without_a_batch_is_never_left_waiting_on_held_actors(learners):
    """A group trains only once every member holds a batch. However many batches the others hold in
    flight (at most prefetch + 1 each: the Store's cap), while one member has none and fewer than B
    steps wait, the actors are not held."""
    batch, fragment, prefetch = 512, 64, 2
    lim = RateLimiter(ratio=1.0, warmup=0, batch_size=batch, prefetch=prefetch, fifo=True)
    in_flight = (learners - 1) * (prefetch + 1) * batch   # the others, each at its cap
    for waiting in (0, batch - 1):
        inserted = 10**6
        limit = lim.insert_limit(inserted, waiting + in_flight, 0, learners, fragment)
        assert inserted < limit
    # and one learner alone is held close: one batch ahead plus a fragment
    assert lim.insert_limit(10**6, batch + fragment, 0, 1, fragment) == 10**6
