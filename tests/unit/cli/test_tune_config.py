"""The `tune` section (services/common/config/run.py, TuneConfig): ranges checked on load, naming the key."""

from __future__ import annotations

import pytest

from services.config import ConfigError, config_from_dict, dump_config, load_config


def test_a_space_loads_with_its_types_and_round_trips(tmp_path):
    cfg = config_from_dict({"tune": {"space": {
        "ppo.learning_rate": {"low": 1e-4, "high": "3e-3", "log": True},
        "ppo.num_epochs": {"type": "int", "low": 2, "high": 10},
        "ppo.gae_lambda": {"type": "categorical", "choices": [0.9, 0.95]},
        "env.id": {"type": "categorical", "choices": ["CartPole-v1", "Acrobot-v1"]},
        "ppo.normalize_rewards": {"type": "categorical", "choices": [True, False]},
        "ppo.batch_steps": {"type": "categorical", "choices": [256, 512]}}}})
    space = cfg.tune.space
    assert space["ppo.learning_rate"].high == 3e-3 and space["ppo.num_epochs"].type == "int"
    # choices keep their own types: ints stay ints, flags stay flags
    assert space["ppo.batch_steps"].choices == (256, 512) and all(type(c) is int for c in space["ppo.batch_steps"].choices)
    assert space["ppo.normalize_rewards"].choices == (True, False)
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").tune == cfg.tune


@pytest.mark.parametrize("tune, message", [
    ({"space": {"a": {"low": 2, "high": 1}}}, "tune.space.a.low: 2.0 is invalid: needs low < high"),
    ({"space": {"a": {"type": "categorical", "choices": [1]}}}, "tune.space.a.choices: [1] is invalid"),
    ({"space": {"a": {"type": "int", "low": 0.5, "high": 3}}}, "an int range needs whole bounds"),
    ({"space": {"a": {"low": 0, "high": 1, "log": True}}}, "log needs low > 0"),
    ({"space": {"a": {"type": "categorical", "choices": [[1], 2]}}}, "tune.space.a.choices[0]: must be int or float"),
    ({"space": {"a": {"type": "uniform"}}}, "tune.space.a.type"),
    ({"metric": "loss"}, "tune.metric"),
    ({"parallel": 0}, "tune.parallel"),
    ({"pruner": "hyperband"}, "tune.pruner"),
])
def test_a_bad_range_is_refused_naming_it(tune, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"tune": tune})
    assert message in str(err.value)
