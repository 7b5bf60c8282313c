"""The rate limiter keeps the balance when nothing else can (docs/rate-limiter.md): an uncapped actor,
or an uncapped simulator over EnvSession, beside a learner slowed on purpose, holds the configured
replay ratio within its band and drops nothing. Asserted on counts, never on wall time: the learner's
sleep only makes it the slower side on any machine; if a loaded machine made the actor the slower
side instead, the ratio would be held by the buffer's pacing of the learner, and the asserts on
holding (which prove the actor side worked) are the only ones that need the actor to be faster.
"""

from __future__ import annotations

import copy
import re
import threading

import gymnasium as gym
import pytest

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc
from kuberl_client.gym import serve_gym_env
from tests.helpers import TINY_DQN, Service, stats, wait_for, write_config

TARGET, TOLERANCE, BATCH = 4.0, 0.1, 16
UPDATES = 250   # updates to watch: the slack (a few dozen samples) is then a few percent of production
WAIT_S = 240.0

# The learner sleeps 30 ms before each update: at most ~33 updates/s, which at ratio 4 and batch 16
# needs ~130 env steps/s, far below what an uncapped CartPole actor steps.
SLOW_LEARNER = ("import sys, time, runpy; import services.algorithms.checks as c; f = c.TransitionLearner.learn; "
                "c.TransitionLearner.learn = lambda self, data: (time.sleep(0.03), f(self, data))[1]; "
                "sys.argv[0] = 'learner'; runpy.run_module('services.learner', run_name='__main__')")


def _config(tmp, external: bool = False):
    data = copy.deepcopy(TINY_DQN)
    data["dqn"].update({"batch_size": BATCH, "learning_starts": 64, "buffer_size": 4096, "replay_ratio": TARGET,
                        "replay_ratio_tolerance": TOLERANCE})
    assert "max_env_steps_per_s" not in data["actor"]  # uncapped
    if external:
        data["env"] = {"id": "CartPole-v1", "mode": "external"}
    return write_config(tmp / "c.yaml", data)


def _stack(tmp_path, config):
    """Buffer, slowed learner and actor, started in order; all killed if one does not start."""
    procs = [Service("buffer", tmp_path, config)]
    try:
        b = procs[0].wait_ready()
        procs.append(Service("learner", tmp_path, config, "--buffer", b, "--checkpoint-dir", str(tmp_path / "ck"),
                             python_args=("-c", SLOW_LEARNER), module=False))
        learner = procs[-1].wait_ready(timeout=WAIT_S)
        procs.append(Service("actor", tmp_path, config, "--buffer", b, "--learner", learner))
        procs[-1].wait_ready(timeout=WAIT_S)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs


def _check_balance(buffer: str) -> dict:
    wait_for(lambda: stats(buffer, buffer_pb2_grpc.BufferStub)["buffer/samples_served_total"] >= UPDATES * BATCH,
             timeout=WAIT_S, what=f"{UPDATES} updates")
    s = stats(buffer, buffer_pb2_grpc.BufferStub)
    produced = s["buffer/samples_received_total"] - 64  # after the warm-up
    ratio = s["buffer/samples_served_total"] / produced
    assert TARGET * (1 - TOLERANCE) <= ratio <= TARGET * (1 + TOLERANCE), s
    assert s["buffer/samples_per_insert"] == pytest.approx(ratio)  # the gauge counts from the warm-up's end too
    assert s["buffer/replay_ratio_in_band"] == 1.0
    return s


def _tally(actor: Service) -> tuple[int, int, int, int]:
    t = re.search(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, (\d+) rejected",
                  actor.output())
    assert t, actor.output()[-2000:]
    return tuple(int(t.group(i)) for i in range(1, 5))


def test_an_uncapped_actor_is_held_to_the_replay_ratio_and_drops_nothing(tmp_path):
    procs = _stack(tmp_path, _config(tmp_path))
    buffer, actor = procs[0], procs[2]
    try:
        _check_balance(buffer.address)
        a = stats(actor.address, actor_pb2_grpc.ActorStub)
        assert a["actor/limiter_waits_total"] > 0 and a["actor/limiter_wait_seconds_total"] > 0
        assert a["actor/pace_wait_seconds_total"] >= a["actor/limiter_wait_seconds_total"]
        assert a["actor/fragments_dropped_total"] == 0
        assert actor.terminate() == 0, actor.output()
        final = stats(buffer.address, buffer_pb2_grpc.BufferStub)
    finally:
        for p in procs[::-1]:
            p.terminate()
    cut, acked, dropped, rejected = _tally(actor)
    assert dropped == 0 and rejected == 0
    assert cut == acked == final["buffer/fragments_received_total"]


def test_an_uncapped_simulator_is_held_to_the_replay_ratio_and_drops_nothing(tmp_path):
    procs = _stack(tmp_path, _config(tmp_path, external=True))
    buffer, actor = procs[0], procs[2]
    stop, results = threading.Event(), []
    env = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync",
                       vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})

    def simulate():
        results.append(serve_gym_env(env, actor.address, session_id="sim", stop=stop, seed=3, timeout_s=WAIT_S,
                                     reconnect_s=None))

    sim = threading.Thread(target=simulate, name="simulator")
    sim.start()
    try:
        _check_balance(buffer.address)
        a = stats(actor.address, actor_pb2_grpc.ActorStub)
        assert a["actor/limiter_waits_total"] > 0 and a["actor/limiter_wait_seconds_total"] > 0
        stop.set()
        sim.join(timeout=WAIT_S)
        assert not sim.is_alive() and results
        assert results[0]["held_s"] > 0  # the simulator's own view: its replies were held
        assert actor.terminate() == 0, actor.output()
        final = stats(buffer.address, buffer_pb2_grpc.BufferStub)
    finally:
        stop.set()
        sim.join(timeout=WAIT_S)
        env.close()
        for p in procs[::-1]:
            p.terminate()
    cut, acked, dropped, rejected = _tally(actor)
    assert dropped == 0 and rejected == 0
    assert cut == acked == final["buffer/fragments_received_total"]
