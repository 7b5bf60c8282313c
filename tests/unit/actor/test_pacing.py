"""On-policy pacing (actor.fragments_per_version): an actor that has cut that many fragments with
the weights it holds waits for newer ones, never longer than actor.pace_timeout_s, and is stoppable."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from services.actor.rollout import Rollout
from services.common.config import ConfigError, config_from_dict
from services.common.nets import to_numpy
from services.common.stats import Metrics

CFG = {"env": {"id": "CartPole-v1", "num_envs": 2}, "ppo": {"rollout_steps": 4, "batch_steps": 16,
                                                           "hidden_sizes": [8], "num_minibatches": 2}}


def rollout(**actor) -> Rollout:
    r = Rollout(config_from_dict({**CFG, "actor": actor}), "actor-p", 0, Metrics("actor"))
    r.policy.offer_weights(1, to_numpy(r.policy.net))
    return r


def test_the_actor_waits_for_new_weights_after_its_quota_and_steps_on_with_them():
    r = rollout(fragments_per_version=2, pace_timeout_s=600)
    assert r.collect() is not None and r.collect() is not None  # the quota of version 1
    third: list = []
    worker = threading.Thread(target=lambda: third.append(r.collect()))
    worker.start()
    worker.join(timeout=0.5)
    assert worker.is_alive() and not third  # held: nothing stepped
    # counted while it goes on: the planner reads it mid-wait (services/planner/core.py)
    deadline = time.monotonic() + 30
    while r.metrics.counters["actor/pace_wait_seconds_total"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.is_alive() and r.metrics.counters["actor/pace_wait_seconds_total"] > 0
    assert r.metrics.counters["actor/env_steps_total"] == 2 * 4 * 2
    r.policy.offer_weights(2, to_numpy(r.policy.net))
    worker.join(timeout=60)
    assert not worker.is_alive() and third[0] is not None and r.policy_version == 2
    assert r.metrics.counters["actor/pace_timeouts_total"] == 0
    assert r.metrics.counters["actor/pace_wait_seconds_total"] > 0
    r.close()


def test_each_version_gets_exactly_its_quota_of_fragments():
    """The fragment cut right after a wait is the new version's first, not a free one: with a quota of
    2, every version cuts exactly 2 fragments (3 would leave the FIFO a fragment per version to evict)."""
    r = rollout(fragments_per_version=2, pace_timeout_s=600)
    stop, versions = threading.Event(), []

    def work():
        while not stop.is_set():
            if r.collect(stop) is not None:
                versions.append(r.policy_version)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        for version in (2, 3, 4, 5):
            deadline = time.monotonic() + 60
            while len(versions) < 2 * (version - 1) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # an actor that is not held cuts another fragment meanwhile
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
    assert r.collect() is not None  # waited 0.2 s for weights that never came, then stepped on
    assert r.metrics.counters["actor/pace_timeouts_total"] == 1 and r.policy_version == 1
    stop = threading.Event()
    stop.set()
    r.cfg = config_from_dict({**CFG, "actor": {"fragments_per_version": 2, "pace_timeout_s": 600}})
    assert r.collect(stop) is None  # stopping: no wait, no step
    assert r.metrics.counters["actor/pace_timeouts_total"] == 1
    r.close()


def test_unpaced_actors_never_wait():
    r = rollout()
    for _ in range(5):
        assert r.collect() is not None
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
async def test_sessions_replies_wait_for_new_weights_once_the_quota_is_cut():
    import asyncio

    from kuberl.v1 import actor_pb2
    from services.actor.inference import BatchedInference
    from services.actor.policy import Policy
    from services.actor.sessions import SessionHub
    from services.common.envs import spec_of
    from services.common.tensors import encode

    cfg = config_from_dict({**CFG, "env": {"id": "CartPole-v1", "mode": "external"},
                            "actor": {"fragments_per_version": 1, "pace_timeout_s": 600}})
    spec, metrics = spec_of(cfg.env), Metrics("actor")
    policy = Policy(cfg, spec, 0, metrics)
    policy.offer_weights(1, to_numpy(policy.net))
    hub = SessionHub(cfg, spec, "actor-p", metrics, lambda msg: None)
    inference = BatchedInference(policy, hub, metrics)
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
        actions, extras, version = await inference.act(obs)
        hub.record_actions(session, actions, extras, version)
        return version

    try:
        for k in range(cfg.rollout_steps):
            assert await step(k) == 1
        # Step T completes the first fragment (T = 4 transitions): the quota of version 1 is cut, and
        # the reply to that step waits for newer weights.
        held = asyncio.create_task(step(cfg.rollout_steps))
        await asyncio.sleep(0.3)
        assert hub.seq == 1 and not held.done()
        policy.offer_weights(2, to_numpy(policy.net))
        assert await asyncio.wait_for(held, 60) == 2
        assert metrics.counters["actor/pace_timeouts_total"] == 0
    finally:
        serving.cancel()
