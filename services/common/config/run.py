"""The sections only the CLI reads (services/cli): `run` (when `kuberl up` stops and where it writes),
`tracking` (the sinks it feeds), `tune` (`kuberl tune`'s study) and `evaluation` (`kuberl eval`, and
`kuberl up` on the final checkpoint). No role process reads them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.settings import require


@dataclass(frozen=True)
class RunConfig:
    """When `kuberl up` stops and where it writes."""
    target_return: float | None = 475.0  # the run ends when the mean return over return_window episodes reaches it
    #                                      (475.0: CartPole's; null: never on the return)
    return_window: int = 100          # episodes over which the mean return is taken (target_return, tune)
    max_env_steps: int = 1_000_000    # step budget: the run ends after this many env steps, all actors together
    #                                   (default 1,000,000, whatever the return)
    max_seconds: float | None = None  # the run ends after this much wall time (default null: no time limit)
    run_dir: str = "runs"             # parent directory of run directories
    poll_interval_s: float = 1.0      # stats polling and progress period

    def __post_init__(self) -> None:
        require(self.return_window >= 1, "return_window", self.return_window, "must be >= 1")
        require(self.max_env_steps >= 1, "max_env_steps", self.max_env_steps, "must be >= 1")
        require(self.max_seconds is None or self.max_seconds > 0, "max_seconds", self.max_seconds, "must be > 0")
        require(self.poll_interval_s > 0, "poll_interval_s", self.poll_interval_s, "must be > 0")


WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class WandbTracking:
    """Weights & Biases (docs/tracking.md): `kuberl up` logs the run there as it trains."""
    enabled: bool = False             # log the run to Weights & Biases
    project: str = "kuberl"           # the W&B project
    entity: str | None = None         # your team or user; default: W&B's default entity
    mode: str = "online"              # offline: written under the run directory, `wandb sync` later
    group: str | None = None          # the W&B run group
    tags: tuple[str, ...] = ()        # the W&B run's tags

    def __post_init__(self) -> None:
        require(self.mode in WANDB_MODES, "mode", self.mode, f"must be one of {', '.join(WANDB_MODES)}")
        require(bool(self.project), "project", self.project, "must not be empty")


@dataclass(frozen=True)
class MlflowTracking:
    """MLflow (docs/tracking.md): `kuberl up` logs the run to a tracking server or a local database."""
    enabled: bool = False             # log the run to MLflow
    tracking_uri: str | None = None   # default: $MLFLOW_TRACKING_URI, else sqlite:///<run.run_dir>/mlflow.db
    experiment: str = "kuberl"        # the MLflow experiment

    def __post_init__(self) -> None:
        require(bool(self.experiment), "experiment", self.experiment, "must not be empty")


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment tracking sinks `kuberl up` feeds: the config, every progress scalar, episodes, the
    planner's decisions, the evaluation and, with `artifacts`, the final checkpoint and the policy
    exported to ONNX, and with `video` one episode of the final policy. A sink that fails is counted and
    logged once; it never stops training."""
    wandb: WandbTracking = field(default_factory=WandbTracking)  # Weights & Biases
    mlflow: MlflowTracking = field(default_factory=MlflowTracking)  # MLflow
    artifacts: bool = True            # log the final checkpoint and the policy exported to ONNX
    video: bool = True                # one episode of the final policy (deterministic), where the env renders


TUNE_TYPES = ("float", "int", "categorical")


@dataclass(frozen=True)
class TuneParam:
    """One hyper-parameter's range for `kuberl tune` (Optuna's suggest_float, suggest_int,
    suggest_categorical): `float` or `int` between `low` and `high` (log-uniform with `log`), or one of
    `choices`."""
    type: str = "float"               # float, int or categorical
    low: float | None = None          # float, int: the lowest value
    high: float | None = None         # float, int: the highest value
    log: bool = False                 # float, int: draw log-uniformly (needs low > 0)
    choices: tuple[int | float | str | bool, ...] = ()  # categorical: the values to choose from (two or more)

    def __post_init__(self) -> None:
        require(self.type in TUNE_TYPES, "type", self.type, f"must be one of {', '.join(TUNE_TYPES)}")
        if self.type == "categorical":
            require(len(self.choices) >= 2, "choices", list(self.choices), "a categorical needs two choices or more")
            require(self.low is None and self.high is None, "low", self.low, "a categorical takes choices, not a range")
            return
        require(not self.choices, "choices", list(self.choices), f"a {self.type} takes low and high, not choices")
        require(self.low is not None and self.high is not None and self.low < self.high, "low", self.low,
                f"needs low < high (high: {self.high})")
        require(not self.log or (self.low is not None and self.low > 0), "low", self.low, "log needs low > 0")
        if self.type == "int":
            require(float(self.low or 0).is_integer() and float(self.high or 0).is_integer(), "low", self.low,
                    f"an int range needs whole bounds (high: {self.high})")


TUNE_METRICS = ("return", "evaluation")
TUNE_PRUNERS = ("median", "none")
TUNE_SAMPLERS = ("tpe", "random")


@dataclass(frozen=True)
class TuneConfig:
    """`kuberl tune` (docs/tuning.md): an Optuna study over `space`, each trial a `kuberl up` run of
    this config with the trial's values; `kuberl up` itself ignores this section."""
    space: Mapping[str, TuneParam] = field(default_factory=dict, hash=False)  # dotted config key -> its range
    trials: int = 20                  # trials this invocation runs (a resumed study adds as many)
    parallel: int = 1                 # trials running at once (each a whole kuberl up run: mind the cores)
    metric: str = "return"            # "return": the training episodes' mean over run.return_window at the
    #                                   end; "evaluation": the final checkpoint's deterministic mean return
    pruner: str = "median"            # median: stop a trial whose return is below the median of earlier
    #                                   trials' at the same env steps; none: never
    prune_after_steps: int = 0        # no pruning before this many env steps
    prune_after_trials: int = 5       # nor before this many trials have completed (Optuna's n_startup_trials)
    report_every_steps: int = 0       # a trial's running return goes to the pruner this often (0: max_env_steps / 20)
    sampler: str = "tpe"              # Optuna's sampler: tpe or random
    seed: int = 0                     # the sampler's seed
    study: str | None = None          # default: <algorithm>-<env id>
    storage: str | None = None        # an Optuna storage URL; default sqlite:///<run.run_dir>/tune/<study>.db

    def __post_init__(self) -> None:
        require(self.trials >= 1, "trials", self.trials, "must be >= 1")
        require(self.parallel >= 1, "parallel", self.parallel, "must be >= 1")
        require(self.metric in TUNE_METRICS, "metric", self.metric, f"must be one of {', '.join(TUNE_METRICS)}")
        require(self.pruner in TUNE_PRUNERS, "pruner", self.pruner, f"must be one of {', '.join(TUNE_PRUNERS)}")
        require(self.sampler in TUNE_SAMPLERS, "sampler", self.sampler, f"must be one of {', '.join(TUNE_SAMPLERS)}")
        require(self.prune_after_steps >= 0, "prune_after_steps", self.prune_after_steps, "must be >= 0")
        require(self.prune_after_trials >= 0, "prune_after_trials", self.prune_after_trials, "must be >= 0")
        require(self.report_every_steps >= 0, "report_every_steps", self.report_every_steps, "must be >= 0")


@dataclass(frozen=True)
class EvalConfig:
    """How a trained policy is evaluated (docs/after-training.md): its deterministic actions (argmax,
    the Gaussian's mean) over whole episodes on env copies of their own, by `kuberl eval` and, on the
    final checkpoint, by `kuberl up` when training ends (into summary.json). Each copy runs a fixed
    share of the episodes, so short episodes are not over-represented (SB3's evaluate_policy)."""
    episodes: int = 10                # episodes per evaluation (`kuberl eval --episodes` overrides)
    num_envs: int = 5                 # env copies stepped in parallel (at most `episodes` are used)
    seed: int = 1_000_000             # copy i is seeded seed + i: apart from the actors' env.seed + 1000 * i
    after_training: bool = True       # `kuberl up` evaluates the final checkpoint; false: it does not
    max_seconds: float = 120.0        # `kuberl up`'s evaluation stops after this long and reports the
    #                                   episodes finished by then (0 = no limit); `kuberl eval` has none

    def __post_init__(self) -> None:
        require(self.episodes >= 1, "episodes", self.episodes, "must be >= 1")
        require(self.num_envs >= 1, "num_envs", self.num_envs, "must be >= 1")
        require(self.seed >= 0, "seed", self.seed, "must be >= 0 (gymnasium seeds are non-negative)")
        require(math.isfinite(self.max_seconds) and self.max_seconds >= 0, "max_seconds", self.max_seconds,
                "must be >= 0 (0 = no limit)")
