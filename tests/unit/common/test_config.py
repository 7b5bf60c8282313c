"""services/common/config/ (the roles' sections) and services/config.py: loading, validating and dumping the
experiment config."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.algorithms.dqn.config import DQNConfig
from services.algorithms.ppo.config import PPOConfig
from services.common.config import ConfigError, EnvConfig
from services.config import ExperimentConfig, config_from_dict, dump_config, load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_defaults_are_ppo_on_cartpole():
    cfg = load_config(None)
    assert cfg == ExperimentConfig()
    assert cfg.algorithm == "ppo"
    assert cfg.env.id == "CartPole-v1"
    assert cfg.rollout_steps == cfg.section("ppo").rollout_steps
    assert cfg.hidden_sizes == cfg.section("ppo").hidden_sizes


def test_derived_properties_follow_algorithm():
    cfg = config_from_dict({"algorithm": "dqn", "dqn": {"rollout_steps": 7, "hidden_sizes": [5]}})
    assert cfg.rollout_steps == 7
    assert cfg.hidden_sizes == (5,)


def test_empty_mapping_and_none_give_defaults():
    assert config_from_dict({}) == ExperimentConfig()
    assert config_from_dict(None) == ExperimentConfig()


def test_to_dict_is_plain_data():
    d = ExperimentConfig().to_dict()
    assert d["ppo"]["hidden_sizes"] == [64, 64]
    assert isinstance(d["env"], dict)


def test_from_dict_round_trips_through_to_dict():
    cfg = config_from_dict({"algorithm": "dqn", "seed": 3, "env": {"num_envs": 2, "max_episode_steps": 50},
                            "dqn": {"hidden_sizes": [16, 8, 4], "tau": 0.5}, "run": {"max_seconds": 12.5}})
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
    assert again.section("dqn").hidden_sizes == (16, 8, 4)


def test_dump_then_load_gives_equal_config(tmp_path):
    cfg = config_from_dict({"algorithm": "dqn", "env": {"id": "Acrobot-v1"}, "dqn": {"learning_rate": 2.5e-4},
                            "run": {"target_return": None}})
    path = tmp_path / "resolved.yaml"
    dump_config(cfg, path)
    assert load_config(path) == cfg
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("name,algorithm", [("cartpole_ppo.yaml", "ppo"), ("cartpole_dqn.yaml", "dqn"),
                                            ("cartpole_external.yaml", "ppo")])
def test_example_configs_load(name, algorithm):
    cfg = load_config(CONFIGS / name)
    assert cfg.algorithm == algorithm
    assert cfg.env.id == "CartPole-v1"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    from services import algorithms
    cfg = load_config(path)
    named = [a for a in algorithms.REGISTRY if a in path.stem.split("_")]
    assert named in ([], [cfg.algorithm])  # pendulum_sac.yaml trains SAC, pong_ppo_cpu.yaml PPO, ...


def test_example_dqn_config_reads_lists_and_ints_as_their_field_types():
    cfg = load_config(CONFIGS / "cartpole_dqn.yaml")
    assert isinstance(cfg.section("dqn").hidden_sizes, tuple) and all(isinstance(h, int) for h in cfg.section("dqn").hidden_sizes)
    assert isinstance(cfg.actor.max_env_steps_per_s, float)  # written as an int in the YAML
    assert cfg.section("dqn").replay_ratio > 0  # the example is paced, as its comment says


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing but a comment\n")
    assert load_config(path) == ExperimentConfig()


def test_int_accepted_for_float_fields():
    cfg = config_from_dict({"ppo": {"learning_rate": 1, "ent_coef": 0}, "run": {"target_return": 475}})
    assert cfg.section("ppo").learning_rate == 1.0 and isinstance(cfg.section("ppo").learning_rate, float)
    assert isinstance(cfg.section("ppo").ent_coef, float)
    assert cfg.run.target_return == 475.0 and isinstance(cfg.run.target_return, float)


def test_optional_fields_accept_null():
    cfg = config_from_dict({"run": {"target_return": None, "max_seconds": None}, "env": {"max_episode_steps": None}})
    assert cfg.run.target_return is None
    assert cfg.env.max_episode_steps is None


# --- errors -------------------------------------------------------------------------------------

def error(data) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(f"{e.value.key}: ")
    return e.value


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_top_level_key():
    e = error({"algoritm": "ppo"})
    assert e.key == "algoritm"
    assert "unknown key" in str(e)
    assert "algorithm" in str(e)


def test_unknown_nested_key_lists_known_keys():
    e = error({"ppo": {"clip_coeff": 0.1}})
    assert e.key == "ppo.clip_coeff"
    assert "unknown key" in str(e)
    for known in ("clip_coef", "gae_lambda", "num_epochs"):
        assert known in str(e)


@pytest.mark.parametrize("data,key,match", [
    ({"ppo": {"learning_rate": "fast"}}, "ppo.learning_rate", "must be float, got str 'fast'"),
    ({"ppo": {"learning_rate": "1e3x"}}, "ppo.learning_rate", "must be float, got str"),
    ({"ppo": {"gamma": True}}, "ppo.gamma", "must be float, got bool"),
    ({"env": {"num_envs": True}}, "env.num_envs", "must be int, got bool True"),
    ({"env": {"num_envs": 2.0}}, "env.num_envs", "must be int, got float"),
    ({"env": {"id": 5}}, "env.id", "must be str, got int"),
    ({"ppo": {"norm_adv": "yes"}}, "ppo.norm_adv", "must be bool, got str"),
    ({"ppo": {"norm_adv": 1}}, "ppo.norm_adv", "must be bool, got int"),
    ({"dqn": {"hidden_sizes": ["a", "b"]}}, "dqn.hidden_sizes[0]", "must be int, got str 'a'"),
    ({"dqn": {"hidden_sizes": [64, 1.5]}}, "dqn.hidden_sizes[1]", "must be int, got float"),
    ({"dqn": {"hidden_sizes": 64}}, "dqn.hidden_sizes", "must be a list, got int"),
    ({"seed": "0"}, "seed", "must be int, got str"),
    ({"env": {"max_episode_steps": "100"}}, "env.max_episode_steps", "must be int"),
])
def test_wrong_types(data, key, match):
    e = error(data)
    assert e.key == key
    assert match in str(e)


@pytest.mark.parametrize("data,key,match", [
    ({"ppo": {"clip_coef": -1}}, "ppo.clip_coef", "-1.0 is invalid: must be > 0"),
    ({"env": {"num_envs": 0}}, "env.num_envs", "0 is invalid: must be 1..4096"),
    ({"env": {"id": ""}}, "env.id", "an env id is required"),
    ({"dqn": {"buffer_size": 100, "batch_size": 32, "learning_starts": 200}}, "dqn.learning_starts",
     "200 is invalid: must be between batch_size (32) and buffer_size (100)"),
    ({"dqn": {"buffer_size": 10, "batch_size": 32, "learning_starts": 10}}, "dqn.buffer_size",
     "must hold at least one batch"),
    ({"dqn": {"tau": 0}}, "dqn.tau", "must be in (0, 1]"),
    ({"ppo": {"gamma": 1.5}}, "ppo.gamma", "must be in [0, 1]"),
    ({"ppo": {"hidden_sizes": [64, 0]}}, "ppo.hidden_sizes", "positive width"),
    ({"ppo": {"batch_steps": 2, "num_minibatches": 4}}, "ppo.num_minibatches", "must be 1..batch_steps"),
    ({"topology": {"learners": 2}}, "topology.learners", "must lie within planner.learner.min..max (1..1)"),
    ({"topology": {"learners": 0}}, "topology.learners", "must be 1..64"),
    ({"planner": {"min_scale_gain": 1.5}}, "planner.min_scale_gain", "must be in [0, 1]"),
    ({"topology": {"buffers": 0}}, "topology.buffers", "must be 1..64"),
    ({"learner": {"device": "tpu"}}, "learner.device", "must be 'cpu', 'cuda', 'cuda:N' or 'auto'"),
    ({"algorithm": "a2c"}, "algorithm", "'a2c' is invalid: must be one of dqn, ppo"),
    ({"planner": {"staleness_target": -1}}, "planner.staleness_target", "must be >= 0 (0 = no staleness target)"),
    ({"planner": {"costs": "cores"}}, "planner.costs", "must be 'configured' or 'measured'"),
])
def test_impossible_values(data, key, match):
    e = error(data)
    assert e.key == key
    assert match in str(e)


def test_a_learner_group_fits_the_planner_bounds_or_runs_without_the_planner():
    assert config_from_dict({"topology": {"learners": 2}, "planner": {"learner": {"max": 2}}}).topology.learners == 2
    assert config_from_dict({"topology": {"learners": 3}, "planner": {"enabled": False}}).topology.learners == 3


def test_learner_groups_are_allowed_with_the_kubernetes_backend():
    """The learners are a StatefulSet there, whose size the planner sets within planner.learner."""
    cfg = config_from_dict({"planner": {"backend": "kubernetes", "learner": {"min": 1, "max": 4}}})
    assert (cfg.planner.learner.min, cfg.planner.learner.max) == (1, 4)
    assert cfg.planner.kubernetes.learner_statefulset == "kuberl-learner"


def test_a_replaced_key_names_its_replacement():
    """An old config naming the learner Deployment is told which key took its place, not just 'unknown'."""
    e = error({"planner": {"kubernetes": {"learner_deployment": "kuberl-learner"}}})
    assert e.key == "planner.kubernetes.learner_deployment"
    assert "no longer a key" in str(e) and "replaced by planner.kubernetes.learner_statefulset" in str(e)
    assert "StatefulSet" in str(e)


def test_max_policy_lag_is_ppos_bound_alone():
    """planner.max_policy_lag was the planner's staleness target for the learners' mean lag, a setting unlike
    ppo.max_policy_lag (a bound on each fragment, 0 = on-policy only): it is planner.staleness_target now."""
    e = error({"planner": {"max_policy_lag": 4}})
    assert e.key == "planner.max_policy_lag"
    assert "no longer a key: replaced by planner.staleness_target" in str(e) and "ppo.max_policy_lag" in str(e)
    cfg = config_from_dict({"planner": {"staleness_target": 4}, "ppo": {"max_policy_lag": 2}})
    assert (cfg.planner.staleness_target, cfg.section("ppo").max_policy_lag) == (4.0, 2)
    assert not hasattr(cfg.planner, "max_policy_lag")   # (the planner reads staleness_target)
    assert "max_policy_lag" not in cfg.to_dict()["planner"] and cfg.to_dict()["planner"]["staleness_target"] == 4.0


def test_yaml11_exponent_strings_are_numbers(tmp_path):
    """PyYAML reads `1e-3` (no dot) as a string; a float field takes it as the number it means."""
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  learning_rate: 1e-3\n  gamma: 9.9E-1\n")
    cfg = load_config(path)
    assert cfg.section("ppo").learning_rate == 1e-3 and cfg.section("ppo").gamma == 0.99


def test_empty_section_means_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env:\nppo:\n  num_epochs: 2\n")
    cfg = load_config(path)
    assert cfg.env == EnvConfig() and cfg.section("ppo").num_epochs == 2


@pytest.mark.parametrize("value,typename", [(3, "int"), ([1, 2], "list"), ("x", "str")])
def test_section_that_is_not_a_mapping(value, typename):
    e = error({"env": value})
    assert e.key == "env"
    assert f"must be a mapping of settings, got {typename}" in str(e)


@pytest.mark.parametrize("data", [[1, 2], "ppo", 3])
def test_top_level_must_be_a_mapping(data):
    e = error(data)
    assert e.key == "<root>"
    assert "must be a mapping" in str(e)


def test_yaml_top_level_list(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- algorithm: ppo\n- seed: 1\n")
    with pytest.raises(ConfigError, match="must be a mapping, got list") as e:
        load_config(path)
    assert e.value.key == "<root>"


def test_invalid_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("env: [1, 2\nppo: {\n")
    with pytest.raises(ConfigError, match="is not valid YAML") as e:
        load_config(path)
    assert e.value.key == "<file>"
    assert str(path) in str(e.value)


def test_error_from_yaml_file_names_nested_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm: dqn\ndqn:\n  gamma: 2\n")
    with pytest.raises(ConfigError, match="must be in") as e:
        load_config(path)
    assert e.value.key == "dqn.gamma"


def test_section_dataclasses_validate_when_built_directly():
    with pytest.raises(ConfigError, match="must be > 0") as e:
        PPOConfig(clip_coef=0)
    assert e.value.key == "clip_coef"
    with pytest.raises(ConfigError) as e:
        DQNConfig(learning_starts=10, batch_size=20, buffer_size=100)
    assert e.value.key == "learning_starts"


# -- declared spaces (env.mode: external) ------------------------------------------------------------
def external(**env):
    return config_from_dict({"env": {"mode": "external", **env}})


def test_declared_action_spaces_of_every_kind():
    from services.common.protocol.spaces import Box, Discrete, MultiDiscrete

    assert external(observation_shape=[3], num_actions=4).env.declared_action_space == Discrete(4)
    cfg = external(observation_shape=[3], action_space={"type": "multi_discrete", "nvec": [3, 2]})
    assert cfg.env.declared_action_space == MultiDiscrete((3, 2))
    cfg = external(observation_keys={"pos": [2], "vel": [1]},
                   action_space={"type": "box", "shape": [2], "low": [-1.0], "high": [1, 2]})
    assert cfg.env.declared_action_space == Box.of((2,), -1.0, [1.0, 2.0])
    assert cfg.env.observation_keys == {"pos": (2,), "vel": (1,)}
    assert config_from_dict(cfg.to_dict()) == cfg  # round trip through plain data
    unbounded = external(observation_shape=[3], action_space={"type": "box", "shape": [1]})
    assert not unbounded.env.declared_action_space.bounded


@pytest.mark.parametrize("env, key, match", [
    ({"observation_shape": [3], "num_actions": 2, "action_space": {"type": "discrete", "n": 2}},
     "env.num_actions", "not both"),
    ({"observation_shape": [3]}, "env.action_space", "together"),   # names what is missing
    ({"action_space": {"type": "discrete", "n": 2}}, "env.observation_shape", "together"),
    ({"observation_shape": [3], "observation_keys": {"a": [3]}, "num_actions": 2}, "env.observation_keys", "not both"),
    ({"observation_shape": [3], "action_space": {"type": "cube"}}, "env.action_space.type", "discrete, multi"),
    ({"observation_shape": [3], "action_space": {"type": "discrete"}}, "env.action_space.n", "n >= 1"),
    ({"observation_shape": [3], "action_space": {"type": "discrete", "n": 2, "shape": [1]}},
     "env.action_space.shape", "not a setting of a discrete space"),
    ({"observation_shape": [3], "action_space": {"type": "box", "shape": [2], "low": [0, 0, 0]}},
     "env.action_space.shape", "one per element"),
    ({"observation_shape": [3], "action_space": {"type": "box", "shape": [1], "low": [1], "high": [0]}},
     "env.action_space.shape", "low <= high"),
    ({"observation_shape": [3], "action_space": {"type": "multi_discrete", "nvec": [0]}},
     "env.action_space.nvec", "each of at least 1"),
    ({"observation_keys": {"a": [0]}, "num_actions": 2}, "env.observation_keys.a", "every dimension"),
    ({"observation_keys": {"a": [1]}, "observation_dtype": "uint8", "num_actions": 2}, "env.observation_dtype",
     "flattened into float32"),
    ({"observation_keys": [1], "num_actions": 2}, "env.observation_keys", "must be a mapping"),
])
def test_bad_declared_spaces_name_the_key(env, key, match):
    with pytest.raises(ConfigError, match=match) as err:
        external(**env)
    assert err.value.key == key


SAC_TAKES = "sac takes Box actions with bounds finite in float32 with low < high"


@pytest.mark.parametrize("algorithm, env, message", [
    ("sac", {"num_actions": 3}, f"{SAC_TAKES}; env.num_actions is Discrete(3)"),
    ("sac", {"action_space": {"type": "discrete", "n": 3}}, f"{SAC_TAKES}; env.action_space is Discrete(3)"),
    ("sac", {"action_space": {"type": "multi_discrete", "nvec": [3, 2]}},
     f"{SAC_TAKES}; env.action_space is MultiDiscrete([3, 2])"),
    ("sac", {"action_space": {"type": "box", "shape": [2]}}, f"{SAC_TAKES}; env.action_space is Box([2], [-inf, inf])"),
    ("sac", {"action_space": {"type": "box", "shape": [1], "low": [-1.0]}},
     f"{SAC_TAKES}; env.action_space is Box([1], [-1, inf])"),
    ("sac", {"action_space": {"type": "box", "shape": [1], "low": [-3.4e38], "high": [3.4e38]}},  # width > float32
     f"{SAC_TAKES}; env.action_space is Box([1], [-3.4e+38, 3.4e+38])"),
    ("dqn", {"action_space": {"type": "box", "shape": [1], "low": [-2.0], "high": [2.0]}},
     "dqn takes Discrete actions; env.action_space is Box([1], [-2, 2])"),
    ("dqn", {"action_space": {"type": "multi_discrete", "nvec": [3, 2]}},
     "dqn takes Discrete actions; env.action_space is MultiDiscrete([3, 2])"),
])
def test_declared_spaces_the_algorithm_cannot_train_on_are_refused_on_load(algorithm, env, message):
    """Refused as the config is built, naming the algorithm and the key that declares the space: no
    process starts to crash on them (issue 25)."""
    with pytest.raises(ConfigError) as err:
        config_from_dict({"algorithm": algorithm, "env": {"mode": "external", "observation_shape": [3], **env}})
    assert err.value.key == "algorithm"
    assert str(err.value) == f"algorithm: {message}"


def test_declared_frames_are_refused_for_sac_naming_the_observation_keys():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"algorithm": "sac", "env": {
            "mode": "external", "observation_shape": [4, 84, 84], "observation_dtype": "uint8",
            "action_space": {"type": "box", "shape": [1], "low": [-1.0], "high": [1.0]}}})
    assert err.value.key == "algorithm"
    assert str(err.value) == ("algorithm: sac takes flat observations; the declared observations "
                              "(env.observation_shape, env.observation_dtype) are uint8 frames [4, 84, 84]")


@pytest.mark.parametrize("algorithm, env", [
    ("sac", {"action_space": {"type": "box", "shape": [2], "low": [-1.0], "high": [1.0, 2.0]}}),
    ("dqn", {"num_actions": 3}),
    ("dqn", {"action_space": {"type": "discrete", "n": 3}}),
    ("ppo", {"num_actions": 3}),
    ("ppo", {"action_space": {"type": "multi_discrete", "nvec": [3, 2]}}),
    ("ppo", {"action_space": {"type": "box", "shape": [2]}}),    # PPO's Gaussian needs no bounds
])
def test_declared_spaces_the_algorithm_takes_load(algorithm, env):
    cfg = config_from_dict({"algorithm": algorithm, "env": {"mode": "external", "observation_shape": [3], **env}})
    assert cfg.env.declared_spec.obs_shape == (3,)
    assert cfg.env.declared_spec.action == cfg.env.declared_action_space


def test_an_external_yaml_declaring_a_discrete_space_for_sac_is_refused_in_one_line(tmp_path):
    path = tmp_path / "sim.yaml"
    path.write_text("algorithm: sac\nenv:\n  id: my-sim\n  mode: external\n  observation_shape: [3]\n"
                    "  action_space: {type: discrete, n: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"algorithm: {SAC_TAKES}; env.action_space is Discrete(3)"


def test_declared_observation_keys_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match="rank <= 8") as err:
        external(observation_keys={"a": [1] * 9}, num_actions=2)
    assert err.value.key == "env.observation_keys"
