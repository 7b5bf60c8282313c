"""Several policies in one run (config `policies`): the mapping of agents to policies, each policy's
share of a rollout (its slots, weights, version and fragment seqs), and the config's refusals."""

from __future__ import annotations

import pytest

from services.actor.rollout import Rollout
from services.common.agents import map_agents
from services.common.net.policy import learner_addresses
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.stats import Metrics
from services.config import ConfigError, config_from_dict
from tests.helpers import TINY_PPO
from tests.unit.actor.test_agents import COPIES, RELAY, collect_all, logged, steps_of
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


def test_each_policy_plays_its_slots_with_its_own_weights_version_and_seqs():
    rollout = Rollout(config(), "ma", 0, Metrics("actor"))
    try:
        first, rest = rollout.policies["first"], rollout.policies["rest"]
        assert first.net is not rest.net
        # Each policy its own weights: `first` always picks action 2, `rest` action 0 (relay's actions: 3).
        for policy, version, preferred in ((first, 3, 2), (rest, 7, 0)):
            policy.offer_weights(version, weights_preferring(rollout, preferred))
        msgs = collect_all(rollout, 6)
        ref = logged(rollout.envs)
    finally:
        rollout.close()
    frags = {name: [decode_fragment(RawFragment(m.payload)) for m in msgs if m.policy == name]
             for name in ("first", "rest")}
    assert len(msgs) == len(frags["first"]) + len(frags["rest"])
    slots_a = {k * 3 for k in range(COPIES)}   # agent a of each copy
    for name, version, action, slots in (("first", 3, 2, slots_a), ("rest", 7, 0, set(range(COPIES * 3)) - slots_a)):
        assert [f.seq for f in frags[name]] == list(range(len(frags[name])))   # each table sees its own seqs
        assert all(f.policy_version == version for f in frags[name])
        got = steps_of(frags[name])
        assert set(got) == slots
        for slot in slots:   # every step of its agents, as the env logged it, and nothing of the others
            assert got[slot] == ref[slot], f"{name}: slot {slot}"
            assert {step[1] for step in got[slot]} == {action}
    assert rollout.metrics.gauges["actor/policies/first/policy_version"] == 3
    assert rollout.metrics.gauges["actor/policies/rest/policy_version"] == 7
    policies = {ep.policy for ep in rollout.episodes.episodes}
    assert policies == {"first", "rest"}
    assert "actor/policies/first/episode_return_mean" in rollout.metrics.snapshot()


@pytest.mark.parametrize("more,problem", [
    ({"env": {"id": "CartPole-v1"}}, r"policies: \['first', 'rest'\] is invalid: .* envs of several agents"),
    ({"planner": {"enabled": True}}, r"planner.enabled: True is invalid: .*does not yet balance the learners"),
    ({"selfplay": {"enabled": True}}, r"selfplay.enabled: True is invalid: .*without self-play so far"),
    ({"policies": {"Red": {"agents": ["a"]}}}, r"policies.Red: 'Red' is not a policy name"),
    ({"policies": {"red": {"agents": []}}}, r"policies.red.agents: \[\] is invalid: name the agents"),
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


def test_an_agent_no_policy_plays_is_refused_at_start():
    with pytest.raises(ValueError, match=r"agent 'b' of pettingzoo:kuberl_envs.relay matches no policy's agents"):
        Rollout(config({"first": {"agents": ["a"]}, "third": {"agents": ["c"]}}), "ma", 0, Metrics("actor"))
