"""A trained policy read back from disk, for `kuberl eval`, `kuberl export` and `kuberl serve`: from a `kuberl up` run
directory (its newest checkpoint) or from one learner checkpoint file.

The config the policy was trained with comes from the checkpoint itself (the learner writes the
resolved config into every checkpoint), else from the run directory's config.yaml; the spaces the
policy was built for come from the checkpoint too (the learner writes them beside the config), so
reading a policy makes no env: its module need not be importable here (`kuberl serve`, `kuberl
export`); only `kuberl eval`, which steps it, makes it. The weights reach
the policy network the way they reach an actor: the algorithm's learner part loads the checkpoint (as
a restarted learner does) and its `policy` is handed to the actor's `Policy` as published weights, so
what is evaluated or exported is exactly what actors would run. Nothing here writes to the run
directory: a learner may still be writing checkpoints into it.

Every failure to find or read a policy is a `TrainedPolicyError` whose one-line message names the path
and what is wrong with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from services import algorithms
from services.actor.policy import Policy
from services.config import ConfigError, ExperimentConfig, config_from_dict, load_config
from services.common.models.nets import EnvSpec, policy_spec, to_numpy
from services.common.protocol.spaces import spec_from_dict
from services.common.stats import Metrics
from services.common.net.policy import DEFAULT as DEFAULT_POLICY
from services.learner import checkpoint


class TrainedPolicyError(ValueError):
    """A path that holds no usable trained policy; the message names the path and why."""


@dataclass
class Trained:
    """A checkpoint's policy, loaded into the actor's `Policy` (its `acting` part holds the network)."""
    cfg: ExperimentConfig
    checkpoint: Path
    version: int
    spec: EnvSpec
    policy: Policy
    name: str = DEFAULT_POLICY   # the policy it is (of a run's several, config `policies`; else `default`)

    def greedy(self) -> torch.nn.Module:
        """The deterministic policy (`Acting.greedy`), in eval mode: obs [B, ...] -> actions [B, ...]."""
        return self.policy.acting.greedy().eval()

    @property
    def takes_masks(self) -> bool:
        """Whether the policy can apply action masks (`Algorithm.uses_masks` of its action space); it
        applies them where its env reports them."""
        return algorithms.get(self.cfg.algorithm).uses_masks(self.spec.action)

    @property
    def description(self) -> str:
        """e.g. `ckpt-000000000042.pt (ppo on CartPole-v1, policy version 42)`, for messages."""
        return f"{self.checkpoint.name} ({self.cfg.algorithm} on {self.cfg.env.id}, policy version {self.version})"


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: a file as it is; a run directory's (or a checkpoints directory's)
    newest `ckpt-*.pt`. Raises TrainedPolicyError when there is none."""
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        found = checkpoint.latest(p / "checkpoints") or checkpoint.latest(p)
        if found is None and (dirs := policy_checkpoint_dirs(p)):
            raise TrainedPolicyError(f"{p}: a run of several policies ({', '.join(dirs)}): name one policy's "
                                     f"checkpoints, e.g. {next(iter(dirs.values()))}")
        if found is None:
            raise TrainedPolicyError(f"{p}: not a run directory with checkpoints: no checkpoints/ckpt-*.pt "
                                     "(nor ckpt-*.pt) in it")
        return found
    raise TrainedPolicyError(f"{p}: no such run directory or checkpoint file")


def policy_checkpoint_dirs(path: str | Path) -> dict[str, Path] | None:
    """A run of several policies (config `policies`) keeps each policy's checkpoints in
    checkpoints/<policy>/: those directories by policy name, for a run directory (or its checkpoints
    directory) laid out so; None for any other path."""
    p = Path(path)
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not p.is_dir() or checkpoint.latest(root) is not None:
        return None
    found = {d.name: d for d in sorted(root.iterdir()) if d.is_dir() and checkpoint.latest(d) is not None}
    return found or None


def load_policies(path: str | Path, seed: int = 0, *, greedy: bool = False,
                  metrics: Metrics | None = None) -> dict[str, Trained]:
    """Every policy of a run of several (`policy_checkpoint_dirs`), each its newest checkpoint, in the
    config's order (`greedy`, `metrics`: as `load_trained`). TrainedPolicyError naming the path when one
    of the run's policies has none."""
    dirs = policy_checkpoint_dirs(path) or {}
    trained = {name: load_trained(d, seed, greedy=greedy, metrics=metrics) for name, d in dirs.items()}
    names = next(iter(trained.values())).cfg.policy_names if trained else ()
    missing = [name for name in names if name not in trained]
    if not trained or missing:
        raise TrainedPolicyError(f"{path}: no checkpoint of polic{'ies' if len(missing) > 1 else 'y'} "
                                 f"{', '.join(missing) or '?'} (checkpoints/<policy>/ckpt-*.pt)")
    return {name: trained[name] for name in names}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _config(ckpt: Path, state: dict) -> ExperimentConfig:
    """The checkpoint's own config, else the run directory's config.yaml (the checkpoint's grandparent
    in a run directory: <run>/checkpoints/ckpt-*.pt)."""
    if state.get("config") is not None:
        try:
            return config_from_dict(state["config"])
        except ConfigError as err:
            raise TrainedPolicyError(f"{ckpt}: the config it holds is not valid here: {err}") from None
    for candidate in (ckpt.parent.parent / "config.yaml", ckpt.parent / "config.yaml"):
        if candidate.is_file():
            try:
                return load_config(candidate)
            except (ConfigError, OSError) as err:
                raise TrainedPolicyError(f"{candidate}: {err}") from None
    raise TrainedPolicyError(f"{ckpt}: the checkpoint holds no config and no config.yaml is beside it "
                             "or in its run directory")


def _spec(ckpt: Path, state: dict, cfg: ExperimentConfig, name: str) -> EnvSpec:
    """The spaces the checkpoint's policy was built for: those it holds (the learner writes them), else
    (a checkpoint written before they were) its env's, made here once."""
    if state.get("spaces") is not None:
        try:
            return spec_from_dict(state["spaces"])
        except ValueError as err:
            raise TrainedPolicyError(f"{ckpt}: its spaces: {err}") from None
    try:
        return policy_spec(cfg, name)
    except Exception as err:  # noqa: BLE001 - gymnasium raises its own errors for an env it cannot make
        raise TrainedPolicyError(f"{ckpt}: holds no spaces (written by an older kuberl), and env.id "
                                 f"{cfg.env.id!r} of its config, whose spaces they are, cannot be made here "
                                 f"({_first_line(err)})") from None


def load_trained(path: str | Path, seed: int = 0, *, greedy: bool = False, metrics: Metrics | None = None) -> Trained:
    """Read the policy at `path` (a run directory or a checkpoint file) onto the CPU, from the checkpoint
    alone: its config, spaces and weights; the env is not made (but for a checkpoint that holds no
    spaces: `_spec`). Blocking (disk). Raises TrainedPolicyError naming what is wrong.
    `greedy`: the `Policy` acts deterministically (`Policy.act`); `metrics`: the actor metrics it
    reports into (default: its own)."""
    ckpt = find_checkpoint(path)
    try:
        state = checkpoint.load(ckpt)
    except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a file that is not a checkpoint
        raise TrainedPolicyError(f"{ckpt}: not a kuberl learner checkpoint ({_first_line(err)})") from None
    cfg = _config(ckpt, state)
    # Of a run of several policies: the policy it holds (its checkpoints' directory is named after it).
    name = state.get("policy") or (ckpt.parent.name if ckpt.parent.name in cfg.policies else cfg.policy_names[0])
    if name not in cfg.policy_names:
        raise TrainedPolicyError(f"{ckpt}: holds policy {name!r}, which its config does not name")
    spec = _spec(ckpt, state, cfg, name)
    algorithm = algorithms.get(cfg.algorithm)
    # The learner part on the CPU whatever device it trained on: checkpoints hold CPU tensors.
    on_cpu = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, device="cpu"))
    learner = algorithm.learner(on_cpu, spec, Metrics("learner"))
    try:
        learner.load_state_dict(state["algo"])
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        raise TrainedPolicyError(f"{ckpt}: its state does not fit the {cfg.algorithm} network of its config "
                                 f"({_first_line(err)})") from None
    policy = Policy(cfg, spec, seed, metrics or Metrics("actor"), greedy=greedy, name=cfg.tag(name))
    policy.offer_weights(learner.version, to_numpy(learner.policy))
    policy.swap()
    return Trained(cfg, ckpt, learner.version, spec, policy, name)
