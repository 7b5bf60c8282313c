"""Several agents per env (services/common/agents.py and the rollout's `split_runs`): every step an
agent took is in exactly one fragment, as the env logged it, also for agents that join and leave in
the middle of a fragment; and those fragments go through the buffer to a learner.

The env is kuberl_envs.relay: `a` plays whole episodes, `b` terminates after 3 steps, `c` joins after
2 and leaves after 5 without terminating; its `log` is the naive reference, per agent life."""

from __future__ import annotations

import numpy as np
import pytest

from services.actor.rollout import Rollout
from services.actor.windows import split_runs
from services.buffer.store import Store
from services.common.agents import ParallelVectorEnv, make_parallel
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.stats import Metrics
from services.config import config_from_dict
from services.learner.trainer import Trainer
from tests.helpers import TINY_DQN, TINY_PPO

pytest.importorskip("pettingzoo", reason="PettingZoo is in the actor extra")

RELAY = "pettingzoo:kuberl_envs.relay"
COPIES = 2


def config(algorithm: str, T: int):
    base = TINY_PPO if algorithm == "ppo" else TINY_DQN
    return config_from_dict({**base, "env": {"id": RELAY, "num_envs": COPIES},
                             algorithm: {**base[algorithm], "rollout_steps": T}})


def steps_of(fragments) -> dict[int, list[tuple]]:
    """Each slot's steps, in order, read back out of the fragments: (obs, action, reward, terminated,
    truncated, the observation after it: the true last one where its episode or life ended)."""
    out: dict[int, list[tuple]] = {}
    for f in fragments:
        ends = {int(i): k for k, i in enumerate(f.final_index)}
        width = len(f.env_ids)
        for c, slot in enumerate(f.env_ids):
            for u in range(f.num_steps):
                k = ends.get(u * width + c)
                after = f.obs[u + 1, c] if k is None else f.final_obs[k]
                out.setdefault(int(slot), []).append((f.obs[u, c].tolist(), int(f.actions[u, c]), float(f.rewards[u, c]),
                                                      bool(f.terminated[u, c]), bool(f.truncated[u, c]), after.tolist()))
    return out


def logged(envs: ParallelVectorEnv) -> dict[int, list[tuple]]:
    """The same, as each env copy logged its agents' steps."""
    out: dict[int, list[tuple]] = {}
    for k, env in enumerate(envs.copies):
        for agent, _, obs, action, reward, term, trunc, after in env.log:
            out.setdefault(k * envs.slots + envs.agents.index(agent), []).append(
                (obs.tolist(), action, reward, term, trunc, after.tolist()))
    return out


def collect_all(rollout: Rollout, windows: int) -> list:
    """`windows` windows of steps, every fragment of each (the later ones come out of the next calls)."""
    msgs = []
    for _ in range(windows):
        msgs.append(rollout.collect())
        while rollout._pending:
            msgs.append(rollout.collect())
    return msgs


@pytest.mark.parametrize("T", [4, 7, 16])
def test_every_agent_step_is_in_one_fragment_as_the_env_logged_it(T):
    rollout = Rollout(config("ppo", T), "ma", 0, Metrics("actor"))
    try:
        msgs = collect_all(rollout, 6)
        frags = [decode_fragment(RawFragment(m.payload)) for m in msgs]
        ref = logged(rollout.envs)
    finally:
        rollout.close()
    assert [f.seq for f in frags] == list(range(len(frags)))
    got = steps_of(frags)
    assert sorted(got) == sorted(ref) == list(range(COPIES * 3))
    for slot in ref:
        assert got[slot] == ref[slot], f"slot {slot}"
    total = sum(len(s) for s in ref.values())
    assert sum(f.num_steps * len(f.env_ids) for f in frags) == total
    assert rollout.metrics.counters["actor/env_steps_total"] == total
    assert rollout.metrics.counters["actor/fragments_total"] == len(frags)
    # Agents come and go inside windows (c joins after 2 steps of each 7-step episode): some fragments
    # are narrower or shorter than the window.
    assert any(len(f.env_ids) < COPIES * 3 or f.num_steps < T for f in frags)
    # Episodes per agent life: a and b and c end in every episode of each copy.
    assert rollout.metrics.counters["actor/episodes_total"] == sum(1 for s in ref.values() for x in s if x[3] or x[4])


def test_split_runs_against_a_naive_reference():
    rng = np.random.default_rng(7)
    for _ in range(200):
        T, N = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        present = rng.random((T, N)) < rng.random()
        naive = set()
        for n in range(N):
            start = None
            for u in range(T + 1):
                on = u < T and present[u, n]
                if on and start is None:
                    start = u
                if not on and start is not None:
                    naive.add((start, u, n))
                    start = None
        groups = split_runs(present)
        assert {(a, b, int(n)) for a, b, cols in groups for n in cols} == naive
        assert len({(a, b) for a, b, _ in groups}) == len(groups)   # one fragment per span
        full = [g for g in groups if (g[0], g[1]) == (0, T)]
        assert not full or groups[0] is full[0]                      # the whole-window fragment first


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_the_fragments_go_through_the_buffer_to_a_learner(tmp_path, algorithm):
    cfg = config(algorithm, 4)
    rollout = Rollout(cfg, "ma", 0, Metrics("actor"))
    try:
        msgs = collect_all(rollout, 12)
    finally:
        rollout.close()
    store = Store(cfg, Metrics("buffer"))
    for m in msgs:
        store.insert(RawFragment(m.payload))
    assert store.metrics.counters["buffer/fragments_received_total"] == len(msgs)
    trainer = Trainer(cfg, Metrics("learner"), tmp_path / "ckpt")
    batch = store.next_batch(16, "learner")
    assert batch is not None
    trainer.train(batch)
    assert trainer.version == 1 and trainer.metrics.counters["learner/batches_invalid_total"] == 0


def test_agents_of_one_policy_must_share_their_spaces():
    from gymnasium import spaces

    from kuberl_envs.relay import Relay

    class Uneven(Relay):
        def observation_space(self, agent):
            return spaces.Box(-1.0, 1.0, (4 if agent == "c" else 3,), np.float32)

    with pytest.raises(ValueError, match=r"agent 'c' has observation space Box.*the agents share one policy"):
        ParallelVectorEnv(Uneven, 1, "uneven")
    with pytest.raises(ValueError, match=r"env.id: 'pettingzoo:no_such_module_here': module"):
        make_parallel("pettingzoo:no_such_module_here")



def test_a_turn_based_env_with_no_discrete_actions_is_refused_with_the_reason(monkeypatch):
    import sys
    import types

    from gymnasium import spaces

    class Steering:   # an AEC env that is not parallelizable, whose agents act in a Box
        metadata = {"name": "steering_v0"}
        possible_agents = ["a", "b"]

        def action_space(self, agent):
            return spaces.Box(-1.0, 1.0, (1,), np.float32)

        def observation_space(self, agent):
            return spaces.Box(-1.0, 1.0, (2,), np.float32)

        def close(self):
            pass

    steering = types.ModuleType("steering_game")
    steering.env = lambda **kw: Steering()
    monkeypatch.setitem(sys.modules, "steering_game", steering)
    with pytest.raises(ValueError, match=r"env.id: 'pettingzoo:steering_game' is turn-based, and agent 'a' acts in "
                                         r"Box.*turn-based games take Discrete actions"):
        make_parallel("pettingzoo:steering_game")()


def test_an_aec_env_that_can_step_in_parallel_is_wrapped(monkeypatch):
    import sys
    import types

    from mpe2 import simple_spread_v3

    aec_only = types.ModuleType("aec_only_spread")
    aec_only.env = simple_spread_v3.env   # (AEC, with is_parallelizable in its metadata)
    monkeypatch.setitem(sys.modules, "aec_only_spread", aec_only)
    envs = ParallelVectorEnv(make_parallel("pettingzoo:aec_only_spread", {"N": 2, "max_cycles": 3}), 1)
    obs, info = envs.reset(seed=0)
    assert obs.shape == (2, 12) and info["present"].all()
    for _ in range(3):
        obs, r, term, trunc, info = envs.step(np.zeros(2, np.int64))
    assert trunc.all() and info["present"].all()   # max_cycles: cut short together, and the copy reset
    envs.close()


@pytest.mark.parametrize("env,problem", [
    ({"id": RELAY, "max_episode_steps": 10}, r"env.max_episode_steps: 10 is invalid: PettingZoo envs take their own limit"),
    ({"id": RELAY, "mode": "external"}, r"env.mode: 'external' is invalid: PettingZoo envs are local envs"),
    ({"id": "pettingzoo:not a module"}, r"env.id: 'pettingzoo:not a module' is invalid: PettingZoo ids are"),
    ({"id": RELAY, "kwargs": {"length": [1]}}, r"env.kwargs.length: must be int or float or str or bool"),
])
def test_a_pettingzoo_env_config_is_checked_naming_the_key(env, problem):
    from services.config import ConfigError
    with pytest.raises(ConfigError, match=problem):
        config_from_dict({**TINY_PPO, "env": env})


def test_env_kwargs_reach_the_env():
    rollout = Rollout(config_from_dict({**TINY_PPO, "env": {"id": RELAY, "num_envs": 1, "kwargs": {"length": 4}}}),
                      "ma", 0, Metrics("actor"))
    try:
        assert rollout.envs.copies[0].length == 4 and rollout.envs.num_envs == 3
    finally:
        rollout.close()


def test_a_worker_stopped_between_a_windows_fragments_hands_on_every_one_it_cut():
    """A window cut into several fragments is handed out over several calls: a stop in between must not
    leave the rest unsent (they were counted as cut)."""
    import threading

    from services.actor.loops import RolloutWorker

    rollout = Rollout(config("ppo", 7), "ma", 0, Metrics("actor"))
    got, done, ended = [], threading.Event(), []

    def on_fragment(msg):
        got.append(msg)
        if len(got) == 1:
            worker.stop_event.set()   # stop after the first fragment of the first window

    worker = RolloutWorker(rollout, on_fragment, lambda exc: (ended.append(exc), done.set()))
    rollout.policy.have_weights.set()   # (acting with its initial weights)
    worker.start()
    assert done.wait(30) and ended == [None]
    rollout.close()
    assert len(got) == rollout.metrics.counters["actor/fragments_total"] > 1
    assert [RawFragment(m.payload).seq for m in got] == list(range(len(got)))
