"""On-policy pacing (actor.fragments_per_version): an actor that has cut that many fragments with
the weights it holds waits for newer ones, never longer than actor.pace_timeout_s, and is stoppable."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

from services.actor.rollout import Rollout
from services.config import ConfigError, config_from_dict
from services.common.models.nets import to_numpy
from services.common.stats import Metrics

CFG = {"env": {"id": "CartPole-v1", "num_envs": 2}, "ppo": {"rollout_steps": 4, "batch_steps": 16,
                                                           "hidden_sizes": [8], "num_minibatches": 2}}


def rollout(**actor) -> Rollout:
    r = Rollout(config_from_dict({**CFG, "actor": actor}), "actor-p", 0, Metrics("actor"))
    r.policy.offer_weights(1, to_numpy(r.policy.net))
    return r


class Waits:
    """The pacing waits a rollout enters, counted by the policy version it holds (wrapped around
    `policy.newer_weights.wait`, the one call the rollout blocks in for newer weights, which it polls
    every 0.1 s): a test knows the actor is held, instead of sleeping and guessing."""

    def __init__(self, monkeypatch, r: Rollout):
        self.entered: collections.Counter[int | None] = collections.Counter()
        self._changed = threading.Condition()
        wait = r.policy.newer_weights.wait

        def counted(timeout=None):
            with self._changed:
                self.entered[r.policy.version] += 1
                self._changed.notify_all()
            return wait(timeout)

        monkeypatch.setattr(r.policy.newer_weights, "wait", counted)

    def until(self, version: int, count: int = 1) -> None:
        """Block until `count` waits were entered holding `version` (an upper bound of 60 s)."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.entered[version] >= count, timeout=60), self.entered


def test_the_actor_waits_for_new_weights_after_its_quota_and_steps_on_with_them(monkeypatch):
    r = rollout(fragments_per_version=2, pace_timeout_s=600)
    waits = Waits(monkeypatch, r)
    assert [r.collect().seq, r.collect().seq] == [0, 1]  # the quota of version 1, cut without a wait
    assert sum(waits.entered.values()) == 0
    third: list = []
    worker = threading.Thread(target=lambda: third.append(r.collect()))
    worker.start()
    # A second wait entered: the first ran out with nothing newer, and the wait goes on.
    waits.until(version=1, count=2)
    assert worker.is_alive() and not third  # held: nothing stepped
    assert r.metrics.counters["actor/env_steps_total"] == 2 * 4 * 2
    # counted while it goes on: the planner reads it mid-wait (services/planner/core.py)
    assert r.metrics.counters["actor/pace_wait_seconds_total"] > 0
    r.policy.offer_weights(2, to_numpy(r.policy.net))
    worker.join(timeout=60)
    assert not worker.is_alive() and third[0].seq == 2 and r.policy_version == 2
    assert r.metrics.counters["actor/env_steps_total"] == 3 * 4 * 2
    assert r.metrics.counters["actor/pace_timeouts_total"] == 0
    assert r.metrics.counters["actor/pace_wait_seconds_total"] > 0
    r.close()


def test_each_version_gets_exactly_its_quota_of_fragments(monkeypatch):
    """The fragment cut right after a wait is the new version's first, not a free one: with a quota of
    2, every version cuts exactly 2 fragments (3 would leave the FIFO a fragment per version to evict)."""
    r = rollout(fragments_per_version=2, pace_timeout_s=600)
    waits = Waits(monkeypatch, r)
    stop, versions = threading.Event(), []

    def work():
        while not stop.is_set():
            if r.collect(stop) is not None:
                versions.append(r.policy_version)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        for version in (2, 3, 4, 5):
            # Held with the last version's weights: whatever it cut with them is in `versions` (the
            # wait is in the next collect), and it cuts nothing more until new weights come.
            waits.until(version=version - 1)
            assert versions == [v for v in range(1, version) for _ in range(2)]
            r.policy.offer_weights(version, to_numpy(r.policy.net))
    finally:
        stop.set()
        worker.join(timeout=60)
    r.close()


def test_a_wait_ends_at_the_timeout_counted_and_at_stop():
    r = rollout(fragments_per_version=2, pace_timeout_s=0.2)
    r.collect()
    r.collect()
    assert r.collect().seq == 2  # waited 0.2 s for weights that never came, then stepped on
    assert r.metrics.counters["actor/pace_timeouts_total"] == 1 and r.policy_version == 1
    stop = threading.Event()
    stop.set()
    r.cfg = config_from_dict({**CFG, "actor": {"fragments_per_version": 2, "pace_timeout_s": 600}})
    assert r.collect(stop) is None  # stopping: no wait, no step
    assert r.metrics.counters["actor/pace_timeouts_total"] == 1
    r.close()


def test_unpaced_actors_never_wait(monkeypatch):
    r = rollout()
    waits = Waits(monkeypatch, r)
    assert [r.collect().seq for _ in range(5)] == [0, 1, 2, 3, 4]
    assert sum(waits.entered.values()) == 0
    assert r.metrics.counters["actor/pace_wait_seconds_total"] == 0
    r.close()


@pytest.mark.parametrize("data, match", [
    ({"actor": {"fragments_per_version": 1}}, "fewer than the learner's batch of 16"),
    ({"algorithm": "dqn", "actor": {"fragments_per_version": 4}}, "replay ratio"),
    ({"actor": {"fragments_per_version": -1}}, "must be >= 0"),
])
def test_pacing_that_cannot_work_is_refused(data, match):
    with pytest.raises(ConfigError, match=match) as err:
        config_from_dict({**CFG, **data, "env": {**CFG["env"], **data.get("env", {})}})
    assert err.value.key == "actor.fragments_per_version"


# -- external sessions: the replies wait --------------------------------------------------------------
async def test_sessions_replies_wait_for_new_weights_once_the_quota_is_cut(monkeypatch):
    import asyncio

    from kuberl.v1 import actor_pb2
    from services.actor.inference import BatchedInference
    from services.actor.policy import Policy
    from services.actor.sessions import SessionHub
    from services.common.envs import spec_of
    from services.common.protocol.tensors import encode

    cfg = config_from_dict({**CFG, "env": {"id": "CartPole-v1", "mode": "external"},
                            "actor": {"fragments_per_version": 1, "pace_timeout_s": 600}})
    spec, metrics = spec_of(cfg.env), Metrics("actor")
    policy = Policy(cfg, spec, 0, metrics)
    policy.offer_weights(1, to_numpy(policy.net))
    hub = SessionHub(cfg, spec, "actor-p", metrics, lambda msg: None)
    inference = BatchedInference(policy, hub, metrics)
    # The replies' wait for newer weights polls, counting each poll with `pace.held`: the first call
    # means the inference loop is held, with every reply that came in before it.
    held_polls = asyncio.Event()
    held = inference.pace.held

    def counted(seconds: float) -> None:
        held_polls.set()
        held(seconds)

    monkeypatch.setattr(inference.pace, "held", counted)
    serving = asyncio.create_task(inference.run())
    hello = actor_pb2.EnvHello(session_id="s", num_envs=2)
    hello.observation_space.box.shape[:] = (4,)
    hello.observation_space.box.dtype = 7
    hello.action_space.discrete.n = 2
    session, _ = hub.open(hello)

    async def step(k: int):
        msg = actor_pb2.EnvStep(step_id=k, observations=encode(np.zeros((2, 4), np.float32)))
        if k:
            for name, value in (("rewards", np.zeros(2, np.float32)), ("terminated", np.zeros(2, bool)),
                                ("truncated", np.zeros(2, bool))):
                getattr(msg, name).CopyFrom(encode(value))
        obs = hub.observe(session, msg)
        actions, extras, version, _ = await inference.act(obs)
        hub.record_actions(session, actions, extras, version)
        return version

    try:
        for k in range(cfg.rollout_steps):
            assert await step(k) == 1
        # Step T completes the first fragment (T = 4 transitions): the quota of version 1 is cut, and
        # the reply to that step waits for newer weights.
        assert not held_polls.is_set()
        reply = asyncio.create_task(step(cfg.rollout_steps))
        polled = asyncio.create_task(held_polls.wait())
        await asyncio.wait({reply, polled}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        polled.cancel()
        assert held_polls.is_set() and hub.seq == 1 and not reply.done()
        policy.offer_weights(2, to_numpy(policy.net))
        assert await asyncio.wait_for(reply, 60) == 2
        assert metrics.counters["actor/pace_timeouts_total"] == 0
    finally:
        serving.cancel()
