"""EnvSession for every space: simulators (kuberl_client.serve_gym_env in a thread) with Box actions,
and with a Dict observation, MultiDiscrete actions and per-step masks, train through a buffer, a
learner and an external-mode actor in one event loop; a hello declaring another space is refused.

The masked task (kuberl_envs MaskedChoice-v0) ends an episode early, with reward -5, at the first
disallowed action. Every one of its episodes lasting the full 16 steps, from the first (random)
policy on, is the proof that the simulator's masks reach the policy at every step.
"""

from __future__ import annotations

import asyncio

import gymnasium as gym
import numpy as np
import pytest

import kuberl_envs
from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl_client import Box, EnvSessionClient, SessionError
from kuberl_client.gym import serve_gym_env
from services.config import config_from_dict
from tests.helpers import TINY_PPO
from tests.integration.test_pipeline import _stats, stack

WAIT_S = 180.0  # upper bound for anything to happen on a loaded 2-core machine
ENVS = 4


async def _wait_for(address: str, stub, name: str, value: float) -> dict:
    """The stats of `address` once `name` has reached `value` (polled, at most WAIT_S)."""
    async with asyncio.timeout(WAIT_S):
        while (s := await _stats(address, stub)).get(name, 0) < value:
            await asyncio.sleep(0.1)
    return s


def _vector(make) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv([make] * ENVS, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


class _DictChoice(gym.ObservationWrapper):
    """MaskedChoice with its observation split into a Dict: each choice's one-hot target."""

    def __init__(self):
        super().__init__(kuberl_envs.MaskedChoice())
        n0, n1 = kuberl_envs.MaskedChoice.NVEC
        self.observation_space = gym.spaces.Dict({"second": gym.spaces.Box(0, 1, (n1,), np.float32),
                                                  "first": gym.spaces.Box(0, 1, (n0,), np.float32)})

    def observation(self, obs):
        n0 = kuberl_envs.MaskedChoice.NVEC[0]
        return {"first": obs[:n0], "second": obs[n0:]}


CASES = {
    # Box actions: the policy's spaces from gymnasium's Pendulum-v1 (Box[3], Box[1] in [-2, 2]).
    "box": ({"id": "Pendulum-v1", "mode": "external"}, lambda: gym.make("Pendulum-v1")),
    # Declared spaces: a Dict observation (flattened, keys sorted), MultiDiscrete actions, masks.
    "dict-multidiscrete-masked": ({"id": "dict-choice", "mode": "external",
                                   "observation_keys": {"first": [4], "second": [3]},
                                   "action_space": {"type": "multi_discrete", "nvec": [4, 3]}}, _DictChoice),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_simulator_of_every_space_trains_and_gets_new_weights(tmp_path, case):
    env_cfg, make = CASES[case]
    cfg = config_from_dict({**TINY_PPO, "env": env_cfg, "actor": {**TINY_PPO["actor"], "queue_fragments": 8192}})
    envs = _vector(make)
    async with stack(cfg, tmp_path / "ckpt", actor_id="actor-spaces") as (buffer, learner, actor):
        result = await asyncio.to_thread(serve_gym_env, envs, actor, session_id=case, max_steps=300, seed=1,
                                         timeout_s=WAIT_S)
        a = await _wait_for(actor, actor_pb2_grpc.ActorStub, "actor/policy_version", 2)
        # Every step reaches the buffer, the last fragment (flushed when the session closed) included.
        b = await _wait_for(buffer, buffer_pb2_grpc.BufferStub, "buffer/samples_received_total", 300 * ENVS)
        lrn = await _stats(learner, learner_pb2_grpc.LearnerStub)
    envs.close()
    assert result["env_steps"] == 300 * ENVS and result["episodes"] > 0
    assert a["actor/env_steps_total"] == 300 * ENVS and a["actor/sessions_refused_total"] == 0
    assert b["buffer/fragments_invalid_total"] == 0 and lrn["learner/batches_invalid_total"] == 0
    assert b["buffer/samples_received_total"] == 300 * ENVS  # and not more
    assert lrn["learner/updates_total"] >= 2 and a["actor/policy_version"] >= 2
    if case == "box":
        assert all(length == 200 for length in result["lengths"])  # Pendulum's time limit; actions were valid
    else:
        # No disallowed action was ever taken: no episode ended early (with -5).
        assert result["lengths"] and all(length == kuberl_envs.MaskedChoice.LENGTH for length in result["lengths"])
        assert min(result["returns"]) >= 0


@pytest.mark.parametrize("space, text", [
    (Box.of((1,), -1.0, 1.0), "action_space: expected Box([1], [-2, 2]), got Box([1], [-1, 1])"),
    (Box.of((2,), -2.0, 2.0), "action_space: expected Box([1], [-2, 2]), got Box([2], [-2, 2])"),
])
async def test_a_hello_with_another_action_space_is_refused(tmp_path, space, text):
    cfg = config_from_dict({**TINY_PPO, "env": {"id": "Pendulum-v1", "mode": "external"}})

    def session(actor: str) -> None:
        with EnvSessionClient(actor, session_id="wrong", obs_shape=(3,), action_space=space, num_envs=1,
                              timeout_s=WAIT_S) as client:
            client.hello()

    async with stack(cfg, tmp_path / "ckpt") as (_, _, actor):
        with pytest.raises(SessionError) as err:
            await asyncio.to_thread(session, actor)
        a = await _stats(actor, actor_pb2_grpc.ActorStub)
    assert err.value.code == "INVALID_ARGUMENT" and err.value.details == text
    assert a["actor/sessions_refused_total"] == 1
