"""docs/config.md and `kuberl config` (services/cli/config_ref.py): every key of the experiment config has
its one-line meaning (the comment on its field's line), the reference is current, and the commented YAML
loads back into the config it prints."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services import algorithms
from services.cli import config_ref
from services.cli.main import main as kuberl
from services.config import ExperimentConfig, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[3]
# Fields whose line has no comment yet, in a file outside the config package (services/common/net/tls.py):
# listed so the reference says so rather than the test failing; a field that gains its comment must leave.
NOT_YET_SAID: set[str] = set()


def _fields(cls: type) -> int:
    """The settings fields under `cls`, counted as the YAML file has them: a nested section's own and its
    fields' (a section of a mapping or an optional one counted once)."""
    hints = typing.get_type_hints(cls)
    count = 0
    for f in dataclasses.fields(cls):
        if f.name in config_ref.NOT_KEYS:
            continue
        count += 1
        tp = hints[f.name]
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (dict, Mapping):
            args = args[1:]
        for inner in [tp, *args]:
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                count += _fields(inner)
    return count


def test_every_key_of_every_section_is_listed():
    keys = config_ref.keys()
    fields = _fields(ExperimentConfig) + sum(1 + _fields(a.settings) for a in algorithms.REGISTRY.values())
    assert len(keys) == fields == len({k.path for k in keys})
    top = [k.path for k in keys if "." not in k.path]
    assert top == list(ExperimentConfig().to_dict())


def test_every_key_has_its_meaning():
    unsaid = {k.path for k in config_ref.keys() if not k.meaning}
    assert unsaid <= NOT_YET_SAID, (
        f"{', '.join(sorted(unsaid - NOT_YET_SAID))}: a settings field needs its one-line meaning, a comment on "
        f"its line (`name: type = default  # meaning`), then `make config-docs`")
    assert unsaid == NOT_YET_SAID, f"{', '.join(sorted(NOT_YET_SAID - unsaid))} now said: take them out of NOT_YET_SAID"


def test_reference_is_current():
    assert (ROOT / config_ref.REFERENCE).read_text() == config_ref.markdown(), (
        f"{config_ref.REFERENCE} is out of date with the settings dataclasses: run `{config_ref.REGENERATE}`")


def test_reference_says_the_run_budget_and_ppo_switches():
    keys = {k.path: k for k in config_ref.keys()}
    assert keys["run.max_env_steps"].default == 1_000_000 and "run ends" in keys["run.max_env_steps"].meaning
    assert keys["run.max_seconds"].default is None and "run ends" in keys["run.max_seconds"].meaning
    assert keys["env.num_envs"].default == 8 and keys["env.num_envs"].allowed == "1..4096"
    assert "PYTHONPATH=." in keys["env.id"].meaning
    assert keys["ppo.stale_fragments"].allowed == "drop | correct"
    assert keys["ppo.max_policy_lag"].allowed == "null or >= 0"
    assert keys["algorithm"].allowed == " | ".join(algorithms.REGISTRY)
    assert keys["env.action_space.type"].default is config_ref.REQUIRED
    assert keys["planner.learner.max"].default == 1 and keys["planner.actor.max"].default == 8


# Every shape a key takes: nested sections, an optional section set, mappings of sections and of values.
SHAPES = {"algorithm": "sac", "env": {"id": "CartPole-v1", "mode": "external", "observation_shape": [4],
                                      "action_space": {"type": "box", "shape": [2], "low": [-1.0], "high": [1.0]}},
          "planner": {"buffer": {"min": 1, "max": 4}, "learner": {"max": 2}},
          "tune": {"space": {"ppo.learning_rate": {"low": 1e-4, "high": 1e-2, "log": True},
                             "ppo.num_epochs": {"type": "categorical", "choices": [4, 10]}}},
          "tracking": {"wandb": {"tags": ["a", "b"]}}, "sac": {"hidden_sizes": [32]}}


@pytest.mark.parametrize("cfg", [None, ROOT / "configs/simple_spread_two_policies_ppo.yaml", SHAPES],
                         ids=["defaults", "policies", "shapes"])
def test_commented_yaml_loads_back(cfg):
    cfg = config_from_dict(cfg) if isinstance(cfg, dict) else load_config(cfg)
    text = config_ref.commented_yaml(cfg)
    assert yaml.safe_load(text) == cfg.to_dict()
    assert config_from_dict(yaml.safe_load(text)) == cfg


def test_kuberl_config_prints_the_defaults_and_the_reference(capsys):
    assert kuberl(["config", "--defaults"]) == 0
    out = capsys.readouterr().out
    assert out == config_ref.commented_yaml(ExperimentConfig())
    assert "# step budget: the run ends after this many env steps" in out
    assert kuberl(["config", "--reference"]) == 0
    assert capsys.readouterr().out == config_ref.markdown()


def test_kuberl_config_refuses_a_bad_config_in_one_line(tmp_path, capsys):
    (bad := tmp_path / "bad.yaml").write_text("run: {max_env_steps: 0}\n")
    assert kuberl(["config", str(bad)]) == 2
    assert capsys.readouterr().err == "kuberl config: run.max_env_steps: 0 is invalid: must be >= 1\n"


@dataclass(frozen=True)
class _Example:
    # Why a (a block above the field: not its meaning).
    a: int = 1                        # a's meaning
    #                                   continued
    b: str = "x"
    # Why c.
    c: float = 0.5                    # c's meaning
    d: int | None = None              # d: null or >= 0

    def __post_init__(self) -> None:
        from services.common.settings import require
        require(self.a in (1, 2), "a", self.a, "must be 1 or 2")
        require(self.d is None or self.d >= 0, "d", self.d, "must be >= 0")
        require(0 < self.c <= 1 and bool(self.b), "c", self.c, "must be in (0, 1]")


def test_a_meaning_is_the_comment_on_its_line_and_its_continuation():
    assert config_ref.meaning(_Example, "a") == "a's meaning continued"
    assert config_ref.meaning(_Example, "b") == ""
    assert config_ref.meaning(_Example, "c") == "c's meaning"
    assert config_ref.limits(_Example) == {"a": "1 | 2", "d": "null or >= 0", "c": "0 < c <= 1"}
