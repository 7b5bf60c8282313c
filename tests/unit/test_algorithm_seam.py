"""The algorithm seam (docs/architecture.md, "The algorithm seam"): every registered algorithm has all
its parts, and no service outside services/algorithms branches on an algorithm's name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kuberl.v1 import common_pb2 as pb
from services import algorithms
from services.algorithms.base import FifoTable, ReplayTable
from services.common.protocol.fragments import MAX_EXTRA_NAME
from services.common.models.nets import env_spec
from services.common.settings import require
from services.config import ConfigError, config_from_dict
from services.common.protocol.spaces import Discrete
from services.common.stats import Metrics

SERVICES = Path(__file__).resolve().parents[2] / "services"


@pytest.mark.parametrize("name", sorted(algorithms.REGISTRY))
def test_every_algorithm_has_every_part(name):
    algo = algorithms.get(name)
    assert algorithms.BY_CODE[algo.code] is algo and algo.code != pb.ALGORITHM_UNSPECIFIED
    env_id = "CartPole-v1" if Discrete in algo.action_spaces else "Pendulum-v1"  # an env it takes
    cfg = config_from_dict({"algorithm": name, "env": {"id": env_id}})
    assert algo.section(cfg) is cfg.section(name) and isinstance(algo.section(cfg), algo.settings)
    assert algo.code == getattr(pb, f"ALGORITHM_{name.upper()}")   # the wire's name is the config's
    table, section = algo.table(cfg), algo.section(cfg)
    assert isinstance(table, (ReplayTable, FifoTable))
    # Replay serves each sample replay_ratio times on average; on-policy FIFO data is trained on once.
    replay = isinstance(table, ReplayTable)
    assert algo.batch_size(cfg) == (section.batch_size if replay else section.batch_steps)
    assert algo.consumption_ratio(cfg) == (section.replay_ratio if replay else 1.0)
    # Its extras travel by name in the fragment's `extras` map: the protocol names no algorithm's field.
    fields = {f.name for f in pb.TrajectoryFragment.DESCRIPTOR.fields}
    assert not set(algo.fragment_extras) & fields and all(0 < len(n) <= MAX_EXTRA_NAME for n in algo.fragment_extras)

    spec = env_spec(env_id)
    acting = algo.acting(cfg, spec, np.random.default_rng(0), Metrics("actor"))
    import torch

    actions, extras = acting.act(torch.zeros((3, *spec.obs_shape)), None, 0)
    assert actions.shape == (3, *spec.action.shape) and actions.dtype == spec.action.dtype
    assert set(extras) == set(algo.fragment_extras)
    assert all(v.shape == (3,) for v in extras.values())
    learner = algo.learner(cfg, spec, Metrics("learner"))
    # The actor's network takes the learner's weights as they are published.
    acting.net.load_state_dict(learner.policy.state_dict(), strict=True)
    assert learner.version == 0


class _Unbounded:
    """A gymnasium env whose Box action has no bounds (as many custom envs declare theirs)."""
    ID = "kuberl-test/UnboundedBox-v0"

    @classmethod
    def register(cls) -> str:
        import gymnasium as gym

        class UnboundedEnv(gym.Env):
            observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
            action_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)

        if cls.ID not in gym.registry:
            gym.register(cls.ID, entry_point=UnboundedEnv)
        return cls.ID


@pytest.mark.parametrize("name, env_id, space", [
    ("sac", "CartPole-v1", "Discrete(2)"),
    ("sac", "kuberl_envs:MaskedChoice-v0", "MultiDiscrete([4, 3])"),
    ("sac", _Unbounded.ID, "Box([2], [-inf, inf])"),
    ("dqn", "Pendulum-v1", "Box([1], [-2, 2])"),
    ("dqn", "kuberl_envs:MaskedChoice-v0", "MultiDiscrete([4, 3])"),
])
def test_an_env_ids_spaces_the_algorithm_cannot_train_on_are_refused_before_anything_starts(name, env_id, space):
    """What `kuberl up` asks before it starts a process (services/cli/up.py: checked_spec): the config names an env
    whose spaces the algorithm does not take; the one-line refusal names both and the space."""
    from services.common.config import ConfigError
    from services.cli.up import checked_spec

    _Unbounded.register()
    cfg = config_from_dict({"algorithm": name, "env": {"id": env_id}})  # loads: its spaces are the env's
    with pytest.raises(ConfigError) as err:
        checked_spec(cfg)
    assert err.value.key == "algorithm"
    takes = {"sac": "Box actions with bounds finite in float32 with low < high", "dqn": "Discrete actions"}[name]
    assert str(err.value) == f"algorithm: {name} takes {takes}; env.id {env_id}'s action space is {space}"
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(algorithms.REGISTRY))
def test_an_env_the_algorithm_takes_passes_the_check(name):
    from services.cli.up import checked_spec

    env_id = "CartPole-v1" if Discrete in algorithms.get(name).action_spaces else "Pendulum-v1"
    assert checked_spec(config_from_dict({"algorithm": name, "env": {"id": env_id}})) == env_spec(env_id)


def test_an_env_that_cannot_be_made_is_refused_naming_env_id():
    from services.common.config import ConfigError
    from services.cli.up import checked_spec

    with pytest.raises(ConfigError, match="'NoSuchEnv-v0' cannot be made here") as err:
        checked_spec(config_from_dict({"env": {"id": "NoSuchEnv-v0"}}))
    assert err.value.key == "env.id"


def test_unknown_names_and_codes_are_refused_clearly():
    with pytest.raises(ValueError, match="algorithm: 'a2c' is not one of dqn, ppo, sac"):
        algorithms.get("a2c")
    assert algorithms.name_of(99) == "99"


def _literal_names(tree: ast.AST) -> list[tuple[int, str]]:
    names = set(algorithms.REGISTRY)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_services_ask_the_algorithm_not_its_name():
    """An algorithm's name appears as a string only in its own package and as the config's default."""
    found = []
    for path in sorted(SERVICES.rglob("*.py")):
        rel = path.relative_to(SERVICES).as_posix()
        if rel.startswith("algorithms/"):
            continue
        hits = _literal_names(ast.parse(path.read_text(), rel))
        if rel == "common/config/common.py":
            hits = [h for h in hits if h[1] != "ppo"]  # `algorithm: str = "ppo"`, the default
            assert len(_literal_names(ast.parse(path.read_text()))) == 1
        found += [f"services/{rel}:{line}: {value!r}" for line, value in hits]
    assert not found, "\n".join(found)


@dataclasses.dataclass(frozen=True)
class _ToySettings:
    rollout_steps: int = 4
    hidden_sizes: tuple[int, ...] = (8,)
    batch_size: int = 16

    def __post_init__(self):
        require(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")


class _Toy(algorithms.Algorithm):
    name = "toy"
    settings = _ToySettings
    code = 99
    action_spaces = (Discrete,)


def test_a_registered_algorithm_gets_its_config_section(monkeypatch):
    """Adding an algorithm is its package and its registry line: the experiment config gives every
    registered algorithm a section named after it (loaded, checked, defaulted and dumped), with no
    change to services/config.py or services/common."""
    monkeypatch.setitem(algorithms.REGISTRY, "toy", _Toy())
    cfg = config_from_dict({"algorithm": "toy", "toy": {"batch_size": 32}})
    assert cfg.section("toy") == _ToySettings(batch_size=32) and cfg.rollout_steps == 4
    assert cfg.section("ppo") == config_from_dict({}).section("ppo")   # the others at their defaults
    assert cfg.to_dict()["toy"] == {"rollout_steps": 4, "hidden_sizes": [8], "batch_size": 32}
    assert config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"^toy\.batch_size: 0 is invalid"):
        config_from_dict({"toy": {"batch_size": 0}})
    with pytest.raises(ConfigError, match=r"^toy\.width: unknown key"):
        config_from_dict({"toy": {"width": 3}})
    assert cfg.with_section(_ToySettings(batch_size=8)).section("toy").batch_size == 8
    monkeypatch.delitem(algorithms.REGISTRY, "toy")
    with pytest.raises(ConfigError, match=r"^toy: unknown key"):
        config_from_dict({"toy": {}})
