"""Several policies in one run (config `policies`): the mapping of agents to policies, each policy's
share of a rollout (its slots, weights, version and fragment seqs), and the config's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from services.actor.rollout import Rollout
from services.common.agents import map_agents
from services.common.net.policy import learner_addresses
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.stats import Metrics
from services.config import ConfigError, config_from_dict
from tests.helpers import TINY_PPO
from tests.unit.actor.test_agents import COPIES, RELAY, collect_all, steps_of
from tests.unit.actor.test_selfplay import weights_preferring

pytest.importorskip("pettingzoo", reason="PettingZoo is in the actor extra")

TWO = {"first": {"agents": ["a"]}, "rest": {"agents": ["*"]}}   # relay's agents: a, b, c


def config(policies=TWO, **more):
    return config_from_dict({**TINY_PPO, "env": {"id": RELAY, "num_envs": COPIES}, "planner": {"enabled": False},
                             "ppo": {**TINY_PPO["ppo"], "rollout_steps": 5}, "policies": policies, **more})


def test_agents_go_to_the_first_policy_whose_pattern_matches():
    agents = ["red_0", "red_1", "blue_0", "blue_1", "referee"]
    assert map_agents({"red": ["red_*"], "blue": ["blue_[01]", "referee"]}, agents, "default") == {
        "red": [0, 1], "blue": [2, 3, 4]}
    assert map_agents({"one": ["red_0"], "all": ["*"]}, agents, "default") == {"one": [0], "all": [1, 2, 3, 4]}
    assert map_agents({}, agents, "default") == {"default": [0, 1, 2, 3, 4]}   # parameter sharing
    with pytest.raises(ValueError, match=r"agent 'referee' of env.id x matches no policy's agents \(red: \['red_\*'\]; "):
        map_agents({"red": ["red_*"], "blue": ["blue_*"]}, agents, "default", "env.id x")
    with pytest.raises(ValueError, match=r"policies.blue.agents: \['red_1'\] match none of"):
        map_agents({"red": ["red_*"], "blue": ["red_1"], "rest": ["*"]}, agents, "default")


def logged_by_policy(envs) -> dict[str, dict[int, list[tuple]]]:
    """Each policy's slots' steps as the env copies logged them (`logged`, per group of a grouped env)."""
    out: dict[str, dict[int, list[tuple]]] = {}
    for k, env in enumerate(envs.copies):
        for agent, _, obs, action, reward, term, trunc, after in env.log:
            g, n = envs.slot(k, agent)
            out.setdefault(g.name, {}).setdefault(n, []).append(
                (obs.tolist(), action, reward, term, trunc, after.tolist()))
    return out


def test_each_policy_plays_its_slots_with_its_own_weights_version_and_seqs():
    rollout = Rollout(config(), "ma", 0, Metrics("actor"))
    try:
        first, rest = rollout.policies["first"], rollout.policies["rest"]
        assert first.net is not rest.net
        # Each policy its own weights: `first` always picks action 2, `rest` action 0 (relay's actions: 3).
        for policy, version, preferred in ((first, 3, 2), (rest, 7, 0)):
            policy.offer_weights(version, weights_preferring(rollout, preferred))
        msgs = collect_all(rollout, 6)
        ref = logged_by_policy(rollout.envs)
    finally:
        rollout.close()
    frags = {name: [decode_fragment(RawFragment(m.payload)) for m in msgs if m.policy == name]
             for name in ("first", "rest")}
    assert len(msgs) == len(frags["first"]) + len(frags["rest"])
    # Each policy's slots are its agents' of every copy: `first` a's (COPIES), `rest` b's and c's.
    for name, version, action, slots in (("first", 3, 2, COPIES), ("rest", 7, 0, 2 * COPIES)):
        assert [f.seq for f in frags[name]] == list(range(len(frags[name])))   # each table sees its own seqs
        assert all(f.policy_version == version for f in frags[name])
        got = steps_of(frags[name])
        assert sorted(got) == sorted(ref[name]) == list(range(slots))
        for slot in ref[name]:   # every step of its agents, as the env logged it, and nothing of the others
            assert got[slot] == ref[name][slot], f"{name}: slot {slot}"
            assert {step[1] for step in got[slot]} == {action}
    assert rollout.metrics.gauges["actor/policies/first/policy_version"] == 3
    assert rollout.metrics.gauges["actor/policies/rest/policy_version"] == 7
    total = sum(len(steps) for by_slot in ref.values() for steps in by_slot.values())
    assert rollout.metrics.counters["actor/env_steps_total"] == total
    policies = {ep.policy for ep in rollout.episodes.episodes}
    assert policies == {"first", "rest"}
    assert "actor/policies/first/episode_return_mean" in rollout.metrics.snapshot()


@pytest.mark.parametrize("more,problem", [
    ({"env": {"id": "CartPole-v1"}}, r"policies: \['first', 'rest'\] is invalid: .* envs of several agents"),
    ({"env": {"id": RELAY, "num_actions": 2, "observation_shape": [3]}},
     r"env.observation_shape: \(3,\) is invalid: declared spaces are for env.mode: external"),
    ({"policies": {"first": {"agents": ["a"], "num_actions": 2, "observation_shape": [3]}, "rest": {"agents": ["*"]}}},
     r"policies.first.observation_shape: \(3,\) is invalid: a policy declares its spaces for env.mode: external"),
    ({"policies": {"Red": {"agents": ["a"]}}}, r"policies.Red: 'Red' is not a policy name"),
    ({"policies": {"red": {"agents": []}, "blue": {"agents": ["b"]}}}, r"policies.red.agents: \[\] is invalid: name the agents"),
    ({"policies": {"red": {"agents": ["a"]}}}, r"policies: \['red'\] is invalid: name two or more policies"),
    ({"planner": {"enabled": False, "budget": 2.5}},   # 1 actor + 1 learner each of 2 policies
     r"planner.budget: 2.5 is invalid: cannot fit the minimum replicas of every role: 3 \(planner.actor.min and "
     r"for each of the 2 policies, planner.learner.min, at their cost\)"),
])
def test_a_policies_config_is_checked_naming_the_key(more, problem):
    cfg = {**TINY_PPO, "env": {"id": RELAY}, "planner": {"enabled": False}, "policies": TWO, **more}
    with pytest.raises(ConfigError, match=problem):
        config_from_dict(cfg)


def test_a_learner_is_told_which_policy_it_trains():
    cfg = config()
    assert cfg.policy_names == ("first", "rest") and cfg.policy("rest") == "rest"
    with pytest.raises(ConfigError, match=r"--policy: this run trains several policies \(first, rest\): name"):
        cfg.policy(None)
    with pytest.raises(ConfigError, match=r"--policy: 'blue' is not one of this run's policies \(first, rest\)"):
        cfg.policy("blue")
    assert config_from_dict(TINY_PPO).policy(None) == "default"


def test_an_actor_is_given_a_learner_per_policy():
    assert learner_addresses("h:1", ("default",)) == {"default": "h:1"}
    assert learner_addresses("rest=h:2, first=h:1", ("first", "rest")) == {"rest": "h:2", "first": "h:1"}
    for text, problem in (("h:1", "give policy=host:port for each"), ("first=h:1", "this run's policies are first, rest"),
                          ("first=h:1,first=h:2", "names a policy twice"), ("first=,rest=h:2", "is not policy=host:port")):
        with pytest.raises(ValueError, match=problem):
            learner_addresses(text, ("first", "rest"))


def test_a_policy_trains_with_its_own_settings_where_only_its_learners_and_table_read_them(tmp_path):
    """policies.<name>.overrides: a policy's own learning rate, entropy and batch; its learner's Trainer and
    its buffer table take them (`for_policy`), the other policy the run's; a setting the actor or the
    planner reads for every policy (rollout_steps) is refused naming the key."""
    from services.buffer.store import Store
    from services.learner.loops import batch_request
    from services.learner.trainer import Trainer

    cfg = config({"first": {"agents": ["a"], "overrides": {"learning_rate": 1e-4, "ent_coef": 0.05, "batch_steps": 10}},
                  "rest": {"agents": ["*"]}})
    first, rest = cfg.for_policy("first"), cfg.for_policy("rest")
    assert (first.section("ppo").learning_rate, first.section("ppo").ent_coef) == (1e-4, 0.05)
    assert rest.section("ppo") == cfg.section("ppo") and rest.section("ppo").batch_steps != 10
    assert first.tag("first") == "first" and first.policies["first"].overrides == {}   # (applied once)
    assert batch_request(first, "l").batch_size == 10 and Store(first, Metrics("buffer")).limiter.batch_size == 10
    trainer = Trainer(first, Metrics("learner"), tmp_path, policy="first")
    assert {g["lr"] for g in trainer.algo.optimizer.param_groups} == {1e-4}
    for bad, problem in (({"rollout_steps": 3}, r"policies.first.overrides.rollout_steps: 3 is invalid: a policy "
                          r"sets only its own training settings \(learning_rate, .*ppo.rollout_steps is the run's"),
                         ({"ent_coef": "high"}, r"policies.first.overrides.ent_coef: must be float, got str"),
                         ({"learning_rate": -1.0}, r"policies.first.overrides.learning_rate")):
        with pytest.raises(ConfigError, match=problem):
            config({"first": {"agents": ["a"], "overrides": bad}, "rest": {"agents": ["*"]}})


def test_an_agent_no_policy_plays_is_refused_at_start():
    with pytest.raises(ValueError, match=r"agent 'b' of pettingzoo:kuberl_envs.relay matches no policy's agents"):
        Rollout(config({"first": {"agents": ["a"]}, "third": {"agents": ["c"]}}), "ma", 0, Metrics("actor"))


class Uneven:
    """relay whose agent c sees 4 numbers and has 2 actions (a and b: 3 and 3): two agent groups."""

    @staticmethod
    def parallel_env(**kwargs):
        from gymnasium import spaces

        from kuberl_envs.relay import Relay

        class UnevenRelay(Relay):
            def observation_space(self, agent):
                return spaces.Box(-np.inf, np.inf, (4 if agent == "c" else 3,), np.float32)

            def action_space(self, agent):
                return spaces.Discrete(2 if agent == "c" else 3)

            def _obs(self, agent):
                obs = super()._obs(agent)
                return np.append(obs, 7.0).astype(np.float32) if agent == "c" else obs

        return UnevenRelay(**kwargs)


@pytest.fixture
def uneven(monkeypatch):
    import sys
    import types

    module = types.ModuleType("uneven_relay")
    module.parallel_env = Uneven.parallel_env
    monkeypatch.setitem(sys.modules, "uneven_relay", module)
    return config_from_dict({**TINY_PPO, "env": {"id": "pettingzoo:uneven_relay", "num_envs": COPIES},
                             "planner": {"enabled": False}, "ppo": {**TINY_PPO["ppo"], "rollout_steps": 5},
                             "policies": {"ab": {"agents": ["a", "b"]}, "c": {"agents": ["c"]}}})


def test_agent_groups_with_spaces_of_their_own_train_each_on_its_own(uneven, tmp_path):
    """Groups whose spaces differ: each policy's network, fragments and learner take its own spaces."""
    from services.buffer.store import Store
    from services.common.envs import policy_specs
    from services.learner.trainer import Trainer

    specs = policy_specs(uneven)
    assert (specs["ab"].obs_shape, specs["ab"].action.n) == ((3,), 3)
    assert (specs["c"].obs_shape, specs["c"].action.n) == ((4,), 2)
    rollout = Rollout(uneven, "ma", 0, Metrics("actor"))
    try:
        msgs = collect_all(rollout, 8)
        ref = logged_by_policy(rollout.envs)
    finally:
        rollout.close()
    for name, width in (("ab", 3), ("c", 4)):
        frags = [decode_fragment(RawFragment(m.payload)) for m in msgs if m.policy == name]
        assert frags and all(f.obs.shape[2:] == (width,) for f in frags)
        got = steps_of(frags)
        assert got == {slot: ref[name][slot] for slot in got} and sorted(got) == sorted(ref[name])
        # Its learner, built for its spaces, trains on its table's batches.
        cfg = uneven
        store = Store(cfg, Metrics("buffer"))
        for m in msgs:
            if m.policy == name:
                store.insert(RawFragment(m.payload))
        trainer = Trainer(cfg, Metrics("learner"), tmp_path / name, policy=name)
        assert trainer.spec == specs[name]
        batch = store.next_batch(8, "learner")
        assert batch is not None
        trainer.train(batch)
        assert trainer.version == 1 and trainer.metrics.counters["learner/batches_invalid_total"] == 0


def test_agents_of_one_policy_must_still_share_their_spaces(uneven):
    import dataclasses

    from services.common.config import PolicyConfig
    from services.common.envs import policy_specs

    mixed = dataclasses.replace(uneven, policies={"ac": PolicyConfig(("a", "c")), "b": PolicyConfig(("b",))})
    with pytest.raises(ValueError, match=r"policies.ac.agents: pettingzoo:uneven_relay: agent 'c' has observation space "
                                         r"Box.*they are policy 'ac''s agents"):
        policy_specs(mixed)


def test_a_learner_does_not_resume_another_policys_checkpoint(tmp_path):
    from services.learner.trainer import Trainer

    cfg = config()
    first = Trainer(cfg, Metrics("learner"), tmp_path, policy="first")
    first.algo.version = 5
    assert first.checkpoint() is not None
    # The same directory given to the other policy's learner (same spaces): refused, it starts afresh.
    rest = Trainer(cfg, Metrics("learner"), tmp_path, policy="rest")
    assert rest.version == 0
    assert Trainer(cfg, Metrics("learner"), tmp_path, policy="first").version == 5


def test_a_non_finite_observation_stops_the_actor_naming_the_policy(monkeypatch):
    """Bad data never reaches a fragment: as with one policy (finite.py), named by the policy's slots."""
    import sys
    import types

    from kuberl_envs.relay import Relay
    from services.actor.finite import BadEnvStep

    class NanRelay(Relay):
        def _obs(self, agent):
            obs = super()._obs(agent)
            return np.full_like(obs, np.nan) if agent == "c" and self.t == 4 else obs

    module = types.ModuleType("nan_relay")
    module.parallel_env = lambda **kw: NanRelay(**kw)
    monkeypatch.setitem(sys.modules, "nan_relay", module)
    cfg = config_from_dict({**TINY_PPO, "env": {"id": "pettingzoo:nan_relay", "num_envs": COPIES},
                            "planner": {"enabled": False}, "ppo": {**TINY_PPO["ppo"], "rollout_steps": 5},
                            "policies": {"ab": {"agents": ["a", "b"]}, "c": {"agents": ["c"]}}})
    rollout = Rollout(cfg, "ma", 0, Metrics("actor"))
    try:
        with pytest.raises(BadEnvStep, match=r"env.id: pettingzoo:nan_relay \(policy c's agents\) returned"):
            collect_all(rollout, 2)
        assert rollout.metrics.counters["actor/steps_refused_nonfinite_total"] == 1
        assert rollout.metrics.counters["actor/fragments_total"] == 0   # nothing of that window was cut
    finally:
        rollout.close()


def test_recurrent_policies_each_keep_a_state_per_slot_and_their_learners_train_on_it(tmp_path):
    """ppo.recurrent with several policies (a team's LSTM each): every policy keeps a state per slot of
    its agents, moved by its own network, zeroed where an agent's episode ends; each fragment starts
    from its slots' state at the window's start (a run starting later, an agent's new life, from zeros),
    and each policy's learner trains on its table's sequences."""
    from services.common.models.nets import to_numpy

    T = 5   # relay's episodes are 7 steps: windows start mid-life, b's and c's lives cross their edges
    cfg = config(ppo={**TINY_PPO["ppo"], "rollout_steps": T, "recurrent": "gru", "recurrent_size": 4})
    rollout = Rollout(cfg, "ma", 0, Metrics("actor"))
    windows = []   # (each policy's state at the window's start, the window's fragments)
    try:
        for version, policy in enumerate(rollout.policies.values(), 1):
            policy.offer_weights(version, to_numpy(policy.net))
        for _ in range(4):
            starts = {g.name: g.seats.learning.state.copy() for g in rollout.groups}
            windows.append((starts, collect_all(rollout, 1)))
    finally:
        rollout.close()
    assert {name: state.shape for name, state in windows[0][0].items()} == {"first": (COPIES, 4), "rest": (2 * COPIES, 4)}
    moved = {"first": 0, "rest": 0}
    for starts, msgs in windows:
        for m in msgs:
            f = decode_fragment(RawFragment(m.payload), extras=("behaviour_logprob",), start_extras=("core_state",))
            state, want = f.extras["core_state"], starts[m.policy][list(f.env_ids)]
            assert state.shape == (len(f.env_ids), 4)
            if f.num_steps == T:   # slots that acted through the window: from its start's state
                np.testing.assert_allclose(state, want, rtol=1e-6)
            for row, start in zip(state, want):   # (a shorter run: from it, or a new life's zeros)
                assert np.allclose(row, start, rtol=1e-6) or not row.any()
            moved[m.policy] += int(np.abs(state).sum() > 0)
    assert moved["first"] and moved["rest"], moved   # each policy's state moves, and is carried over windows
    for name in ("first", "rest"):
        train_once(cfg, name, [m for _, msgs in windows for m in msgs if m.policy == name], tmp_path)


def train_once(cfg, name: str, msgs, tmp_path) -> None:
    """Policy `name`'s table (a buffer Store) takes its fragments `msgs`, and its learner's Trainer one batch."""
    from services.buffer.store import Store
    from services.learner.trainer import Trainer

    store = Store(cfg, Metrics("buffer"))
    for m in msgs:
        store.insert(RawFragment(m.payload))
    trainer = Trainer(cfg, Metrics("learner"), tmp_path / name, policy=name)
    batch = store.next_batch(4, "learner")
    assert batch is not None
    trainer.train(batch)
    assert trainer.version == 1 and trainer.metrics.counters["learner/batches_invalid_total"] == 0


class Paddles:
    """Two agents, `left` and `right`, each seeing the last 4 of its own 84x84 grey uint8 frames (Atari's
    layout: [4, 84, 84]) of a ball crossing the screen and both paddles; a paddle level with the ball
    scores 1. Episodes of 8 steps (truncated)."""
    metadata = {"name": "paddles_v0"}
    possible_agents = ["left", "right"]

    def __init__(self):
        from gymnasium import spaces
        self.obs_space, self.act_space = spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(3)
        self.agents: list[str] = []

    def observation_space(self, agent):
        return self.obs_space

    def action_space(self, agent):
        return self.act_space

    def close(self):
        pass

    def _frame(self, agent: str) -> np.ndarray:
        frame = np.zeros((84, 84), np.uint8)
        frame[self.ball - 2:self.ball + 2, 10 + 8 * self.t:14 + 8 * self.t] = 255
        for k, who in enumerate(self.possible_agents):
            frame[self.paddle[who] - 6:self.paddle[who] + 6, 2 + 78 * k:4 + 78 * k] = 128 if who == agent else 64
        return frame if agent == "left" else frame[:, ::-1]

    def _observe(self) -> dict:
        for agent in self.agents:
            self.stack[agent] = np.concatenate([self.stack[agent][1:], self._frame(agent)[None]])
        return {a: self.stack[a].copy() for a in self.agents}

    def reset(self, seed=None, options=None):
        rng = np.random.default_rng(seed)
        self.t, self.ball, self.agents = 0, int(rng.integers(10, 74)), list(self.possible_agents)
        self.paddle = {a: 42 for a in self.agents}
        self.stack = {a: np.zeros((4, 84, 84), np.uint8) for a in self.agents}
        return self._observe(), {a: {} for a in self.agents}

    def step(self, actions):
        for a, move in actions.items():
            self.paddle[a] = int(np.clip(self.paddle[a] + 4 * (int(move) - 1), 8, 76))
        self.t += 1
        rewards = {a: float(abs(self.paddle[a] - self.ball) < 6) for a in self.agents}
        obs, done = self._observe(), self.t == 8
        out = (obs, rewards, {a: False for a in obs}, {a: done for a in obs}, {a: {} for a in obs})
        if done:
            self.agents = []
        return out


def test_frame_stacked_envs_of_several_agents_train_a_cnn_per_policy(tmp_path, monkeypatch):
    """Atari's frames with several policies, where an env of several agents provides them (PettingZoo's
    own Atari envs need multi_agent_ale_py and ROMs fetched at run time, which kuberl never does): each
    policy's fragments carry its agents' stacked frames as uint8, and each policy's learner trains its
    Nature CNN on them. (About 5 s: two CNN updates on CPU.)"""
    import sys
    import types

    from services.common.models.nets import is_image

    module = types.ModuleType("paddles")
    module.parallel_env = lambda **kw: Paddles()
    monkeypatch.setitem(sys.modules, "paddles", module)
    T = 4
    cfg = config_from_dict({**TINY_PPO, "env": {"id": "pettingzoo:paddles", "num_envs": 2},
                            "planner": {"enabled": False}, "ppo": {**TINY_PPO["ppo"], "rollout_steps": T},
                            "policies": {"left": {"agents": ["left"]}, "right": {"agents": ["right"]}}})
    rollout = Rollout(cfg, "frames", 0, Metrics("actor"))
    try:
        assert all(is_image(g.spec) for g in rollout.groups)
        msgs = collect_all(rollout, 3)
    finally:
        rollout.close()
    for name in ("left", "right"):
        mine = [m for m in msgs if m.policy == name]
        assert len(mine) == 3
        f = decode_fragment(RawFragment(mine[0].payload), extras=("behaviour_logprob",))
        assert f.obs.dtype == np.uint8 and f.obs.shape == (T + 1, 2, 4, 84, 84) and f.obs.any()   # (+ the next obs)
        train_once(cfg, name, mine, tmp_path)
