"""Exploration across replicas: DQN epsilon follows the run's progress (an actor the planner adds late does
not start random), and replicas without an index step differently seeded envs."""

import numpy as np
import pytest

from services.actor.policy import Policy
from services.algorithms.dqn.acting import epsilon_at, run_env_steps
from services.config import config_from_dict
from services.common.models.nets import env_spec
from services.common.stats import Metrics

CFG = config_from_dict({"algorithm": "dqn", "dqn": {"batch_size": 32, "learning_starts": 1000, "replay_ratio": 8.0,
                                                     "exploration_steps": 10000, "start_epsilon": 1.0,
                                                     "end_epsilon": 0.05, "hidden_sizes": [8]}})


def test_run_env_steps_from_the_policy_version():
    assert run_env_steps(None, 1000, 32, 8.0) == 0
    assert run_env_steps(0, 1000, 32, 8.0) == 0
    assert run_env_steps(1000, 1000, 32, 8.0) == 1000 + 1000 * 4   # 4 samples inserted per gradient step
    assert run_env_steps(1000, 1000, 32, 0.0) == 1000               # unpaced: only that learning started


def test_a_late_actor_explores_as_little_as_the_run_and_an_early_one_as_its_own_steps():
    policy = Policy(CFG, env_spec("CartPole-v1"), seed=0, metrics=Metrics("actor"))
    obs = np.zeros((4096, 4), np.float32)
    net_action = policy.net(__import__("torch").from_numpy(obs[:1])).argmax(1).item()

    def explored(env_steps):
        actions, _, _ = policy.act(obs, env_steps=env_steps)
        return policy.metrics.gauges["actor/epsilon"], float(np.mean(actions != net_action))

    eps, _ = explored(0)
    assert eps == 1.0                                    # no weights yet: the configured start
    policy.offer_weights(5000, {k: v.numpy() for k, v in policy.net.state_dict().items()})
    policy.swap()
    eps, frac = explored(0)                              # a new actor in a run 21,000 steps in
    assert eps == pytest.approx(epsilon_at(21000, 1.0, 0.05, 10000)) == 0.05
    assert frac < 0.1                                    # ~eps/2 of actions differ from the greedy one
    eps, _ = explored(50000)                             # its own steps count when larger
    assert eps == 0.05


def test_actors_without_an_index_get_distinct_stable_seeds():
    from services.actor.main import parse_args, seed_index

    assert parse_args([]).actor_index is None
    assert seed_index("actor-a", 3) == 3
    assert seed_index("pod-x-1-abc", None) == seed_index("pod-x-1-abc", None)
    assert len({seed_index(f"kuberl-actor-7d9f-{i}", None) for i in range(50)}) == 50
