"""What every algorithm tells the services about itself (docs/architecture.md, "The algorithm seam").

An `Algorithm` is torch-free: the buffer and the planner read it. Its acting and learning parts
(`<package>.acting`, `<package>.learner`) import torch and are loaded on first use, by actors and
learners only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

from services.common.config import CommonConfig
from services.common.settings import require

if TYPE_CHECKING:
    import numpy as np

    from services.common.protocol.spaces import ActionSpace, EnvSpec
    from services.common.stats import Metrics


@dataclass(frozen=True)
class ReplayTable:
    """The buffer keeps transitions in a uniform replay ring and serves random batches, paced so that
    at most `replay_ratio` samples are served per sample inserted (0: unpaced)."""
    capacity: int
    learning_starts: int
    replay_ratio: float
    replay_ratio_tolerance: float
    n_step: int = 1       # rewards each stored transition sums (services/buffer/replay.py), discounted by gamma
    gamma: float = 1.0


class ReplaySettings(Protocol):
    """What `check_replay` reads of a replay algorithm's section."""

    @property
    def batch_size(self) -> int: ...

    @property
    def buffer_size(self) -> int: ...

    @property
    def learning_starts(self) -> int: ...

    @property
    def replay_ratio(self) -> float: ...

    @property
    def replay_ratio_tolerance(self) -> float: ...


def check_replay(section: ReplaySettings) -> None:
    """The replay settings DQN and SAC share: batch, capacity, warm-up and the pacing ratio."""
    require(section.batch_size >= 1, "batch_size", section.batch_size, "must be >= 1")
    require(section.buffer_size >= section.batch_size, "buffer_size", section.buffer_size,
            f"must hold at least one batch ({section.batch_size})")
    require(section.batch_size <= section.learning_starts <= section.buffer_size, "learning_starts",
            section.learning_starts, f"must be between batch_size ({section.batch_size}) and buffer_size "
                                     f"({section.buffer_size}), or the first batch could never be cut")
    require(section.replay_ratio >= 0, "replay_ratio", section.replay_ratio, "must be >= 0 (0 = unpaced)")
    require(0 < section.replay_ratio_tolerance < 1, "replay_ratio_tolerance", section.replay_ratio_tolerance,
            "must be in (0, 1)")


@dataclass(frozen=True)
class FifoTable:
    """The buffer keeps whole fragments first in, first out (on-policy data: each is served once) and
    drops, counted, any more than `max_policy_lag` versions behind when `stale_fragments` is "drop"."""
    capacity_steps: int
    max_policy_lag: int | None
    stale_fragments: str


@dataclass(frozen=True)
class Extras:
    """The float32 tensors an algorithm's fragments carry by name beyond the common fields
    (TrajectoryFragment.extras): `steps` one value per step, [T, N, ...]; `start` one per env at the
    fragment's first step, [N, ...] (a recurrent core's state, from which the learner replays it)."""
    steps: tuple[str, ...] = ()
    start: tuple[str, ...] = ()


SettingsT = TypeVar("SettingsT")


class Algorithm(Generic[SettingsT]):
    """One algorithm: subclass it in `services/algorithms/<name>/__init__.py` and add it to the registry
    (as `Algorithm[<its settings class>]`)."""
    name: ClassVar[str]        # the config's `algorithm` and the name of its config section
    # Its config section (`<package>/config.py`): a frozen dataclass of settings checked as they are
    # built (services/common/settings.py), with at least `rollout_steps` and `hidden_sizes`.
    settings: ClassVar[type]
    code: ClassVar[int]        # kuberl.v1.Algorithm, stamped on fragments and batch requests
    # Per-step float32 [T, N] tensors a fragment carries beyond the common ones (TrajectoryFragment
    # field names): what the actor records while acting and the learner needs, in every config
    # (`extras` adds those a config asks for).
    fragment_extras: ClassVar[tuple[str, ...]] = ()
    # The action spaces (services/common/protocol/spaces.py classes) it can act in and learn.
    action_spaces: ClassVar[tuple[type, ...]]
    takes_action_masks: ClassVar[bool] = False
    # The settings of its section a policy of several may set for itself (`policies.<name>.overrides`):
    # those only the policy's learners and its buffer table read. What the actor reads (the rollout
    # length it steps every policy by, the network it acts with, exploration) is the run's, and what the
    # planner balances (a replay ratio) too.
    per_policy: ClassVar[tuple[str, ...]] = ()

    def uses_masks(self, space: ActionSpace) -> bool:
        """Whether actions in `space` are masked under this algorithm: the space has mask columns
        (`mask_width`) and the algorithm takes masks. The one test the actor's rollout and sessions,
        `kuberl eval` and `kuberl export` make."""
        return bool(space.mask_width) and self.takes_action_masks

    def takes(self) -> str:
        """The actions it takes, in words, for messages (e.g. "Discrete actions")."""
        return " or ".join(k.__name__ for k in self.action_spaces) + " actions"

    def check_spec(self, spec: EnvSpec, action: str = "this env's action space", obs: str = "this env's observations") -> None:
        """ValueError naming the algorithm unless it can train on an env of this spec (a
        services.common.protocol.spaces.EnvSpec); `action` and `obs` say where the spec's spaces come from (a
        config key, an env id), e.g. "algorithm: dqn takes Discrete actions; env.action_space is
        Box([1], [-2, 2])". Checked at config load for declared spaces, by `kuberl up` before it starts
        anything, and by each part as it is built."""
        if not isinstance(spec.action, self.action_spaces):
            raise ValueError(f"algorithm: {self.name} takes {self.takes()}; {action} is {spec.action}")

    def extras(self, cfg: CommonConfig) -> Extras:
        """The extras this algorithm's fragments carry under `cfg`: what actors record and what the
        buffer and the learner require (and the only ones they take)."""
        return Extras(self.fragment_extras)

    def section(self, cfg: CommonConfig) -> SettingsT:
        """This algorithm's settings in `cfg` (its `settings` class; the YAML section `<name>:`)."""
        return cast(SettingsT, cfg.section(self.name))   # (services/config.py builds each section of its class)

    def table(self, cfg: CommonConfig) -> ReplayTable | FifoTable:
        """How the buffer keeps and serves this algorithm's fragments."""
        raise NotImplementedError

    def batch_size(self, cfg: CommonConfig) -> int:
        """Samples per batch a learner asks the buffer for."""
        raise NotImplementedError

    def consumption_ratio(self, cfg: CommonConfig) -> float:
        """Samples trained on per sample produced, which the planner balances production against."""
        return 1.0

    def _part(self, module: str, attr: str) -> Any:
        return getattr(importlib.import_module(f"{type(self).__module__}.{module}"), attr)

    def acting(self, cfg: CommonConfig, spec: EnvSpec, rng: np.random.Generator, metrics: Metrics) -> Any:
        """The actor's part (`<package>.acting.Acting`): `net`, the policy network the learner's weights
        load into, `act(obs, version, env_steps)` -> (actions, {fragment extra: [N] array}), and
        `state_size` (floats of recurrent state per env; 0: stateless). A stateful part's
        `act(..., state=[N, state_size])` returns the state after the step as a third value, and its
        fragments carry the state at their first step (`extras(cfg).start`); and
        `greedy()`, the network's deterministic policy as a module obs -> actions (no exploration; Box
        actions within bounds), which `kuberl eval` runs and `kuberl export` writes."""
        self.check_spec(spec)
        return self._part("acting", "Acting")(cfg, spec, rng, metrics)

    # `sync`: a services.algorithms.group.GroupSync, or None; not imported even for its type: this module is
    # torch-free, and import-linter counts type-only imports too.
    def learner(self, cfg: CommonConfig, spec: EnvSpec, metrics: Metrics, sync: object | None = None) -> Any:
        """The learner's part (`<package>.learner.Learner`): `decode(batch)` validates a TrainingBatch,
        `learn(data)` updates on it (None: nothing usable), `empty_update()` joins a group's update
        with nothing; `version`, `policy` (the module actors run), `state_dict`/`load_state_dict`."""
        self.check_spec(spec)
        return self._part("learner", "Learner")(self.section(cfg), spec, cfg.learner.device, sync, metrics)
