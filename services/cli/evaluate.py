"""`kuberl eval RUN_DIR_OR_CHECKPOINT`: run a trained policy for whole episodes and report how it does.

The policy acts deterministically (`Acting.greedy`: argmax, the Gaussian's mean), or as actors act
with `--actions stochastic` (`--stochastic`: PPO samples, DQN is epsilon-greedy at the epsilon its
policy version implies, SAC samples its squashed Gaussian), or both, each result printed
(`--actions both`): the default where every agent of a PettingZoo env plays the run's policies, since
such a policy may rely on its randomness (`action_modes`); else deterministic. Episodes run on the run's env (the same preprocessing as the actors') in
`num_envs` copies stepped together; copy i is seeded `seed + i` and runs a fixed share of the episodes,
so the short episodes that finish first are not over-represented (SB3's evaluate_policy does the
same). The statistics are over episode returns as the env reports them (Atari: whole games,
unclipped) and episode lengths in env steps.

`--env ENV_ID` runs the episodes on another gymnasium env whose spaces are the policy's (`on_env`
checks them). That is how a policy trained on external simulators (env.mode: external) is evaluated
here; without it such a checkpoint is refused, pointing at `kuberl serve` and the simulator itself.

`--video FILE.mp4|FILE.gif` then records a few more episodes, one after another, on one more env copy
made with `render_mode="rgb_array"`, writing each frame as it is rendered through imageio (its ffmpeg
plugin for MP4, Pillow for GIF). An episode of L steps gives L frames: the first observation's and
one after every step but the last (the vector env has already reset when the last step returns).

`kuberl up` calls `evaluate_after_training` on the final checkpoint when training ends
(`evaluation` in the experiment config) and writes the result into summary.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from services.common.config import is_atari
from services.config import ExperimentConfig

log = logging.getLogger(__name__)
VIDEO_SUFFIXES = (".mp4", ".gif")
ACTIONS = ("deterministic", "stochastic", "both")   # --actions


class EvalError(ValueError):
    """An evaluation that cannot run as asked (e.g. a video of an env that does not render)."""


def stats(values: list[float]) -> dict[str, float | None]:
    """mean, std (population), min and max of `values`; None each when there are none."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}


class Progress:
    """A one-line progress bar on stderr, redrawn as episodes finish; silent when stderr is no terminal."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and sys.stderr.isatty()

    def step(self, ret: float) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"episodes, last return {ret:.1f}  ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()


def act_fn(trained, deterministic: bool, n: int = 1):
    """The policy acting on `n` slots (services/actor/seats.py `Learning`): the most likely actions
    (`deterministic`), or sampled as actors act, a recurrent policy's state per slot."""
    from services.actor.seats import Learning

    return Learning(trained.policy, n, greedy=deterministic)


def _stepper(trained: dict, envs, act: dict, seed: int):
    """The one stepping loop (services/actor/seats.py `Stepper`) over `envs`, each policy of `trained` (by
    group name) in its group's slots as `act` (by name: a `Learning`, or seats of one); the envs'
    `info["action_mask"]` applied where the env reports one and the algorithm takes masks, as the actor's
    rollout applies them."""
    from services import algorithms
    from services.actor.seats import Seats, Slots, Stepper
    from services.common.protocol.spaces import check_mask

    first = next(iter(trained))
    slots = Slots(envs, first, {name: t.spec.action for name, t in trained.items()})

    def mask_of(name: str, mask, n: int) -> np.ndarray:
        mask = np.asarray(mask, dtype=bool)
        check_mask(trained[name].spec.action, mask, (n,))
        return mask

    return Stepper(slots, {name: a if isinstance(a, Seats) else Seats(a) for name, a in act.items()},
                   {name: algorithms.get(t.cfg.algorithm).uses_masks(t.spec.action) for name, t in trained.items()},
                   mask_of, seed)


def _make_envs(env_cfg, n: int, render_mode: str | None = None, policies: dict | None = None):
    """The env copies to evaluate on (`policies`: a run's, whose agents go to them by group); EvalError
    naming env.id when they cannot be made here (e.g. the run's env is an external simulator)."""
    from services.common.envs import make_vector_env

    try:
        return make_vector_env(env_cfg, num_envs=n, render_mode=render_mode, policies=policies)
    except Exception as err:  # noqa: BLE001 - gymnasium raises its own errors for an env it cannot make
        lines = str(err).strip().splitlines()
        raise EvalError(f"env.id {env_cfg.id!r} cannot be made here ({type(err).__name__}"
                        f"{': ' + lines[0] if lines else ''})") from None


def describe_spec(spec) -> str:
    """An env spec's spaces for messages, e.g. `observations Box[3] float32, actions Box([1], [-2, 2])`."""
    from services.common.protocol.spaces import describe_observation

    return f"observations {describe_observation(spec)}, actions {spec.action}"


def _fits(env, policy) -> bool:
    """Whether an env of spec `env` gives the observations the policy of spec `policy` takes and takes
    its actions: the same observation shape and dtype (and Dict layout, where both have one), the same
    categorical elements (a Discrete(16) policy does not take a Discrete(64) env's observations) and the
    same action space, Box bounds compared as the float32 values actions are clipped to."""
    from services.common.protocol.spaces import Box

    if (env.obs_shape, env.obs_dtype, env.obs_categories) != (policy.obs_shape, policy.obs_dtype,
                                                               policy.obs_categories):
        return False
    if env.obs_keys is not None and policy.obs_keys is not None and env.obs_keys != policy.obs_keys:
        return False
    a, b = env.action, policy.action
    if isinstance(a, Box) and isinstance(b, Box):
        return (a.shape == b.shape and np.array_equal(a.low_array, b.low_array)
                and np.array_equal(a.high_array, b.high_array))
    return a == b


def on_env(trained, env_id: str):
    """`trained` to be evaluated on the gymnasium env `env_id` instead of its config's (`--env`): the
    way to evaluate a policy trained on external simulators here. The env keeps the run's
    `max_episode_steps` and Atari preprocessing. Blocking (makes the env once). EvalError naming --env
    unless the env can be made here and fits the policy's spaces (`_fits`)."""
    from services.common.config import ConfigError
    from services.common.envs import env_spec

    try:
        env_cfg = dataclasses.replace(trained.cfg.env, id=env_id, observation_shape=None, observation_dtype="float32",
                                      observation_keys=None, num_actions=None, action_space=None)
    except ConfigError as err:
        raise EvalError(f"--env {env_id}: {str(err).removeprefix('id: ')}") from None
    try:
        spec = env_spec(env_cfg)
    except Exception as err:  # noqa: BLE001 - gymnasium raises its own errors for an env it cannot make
        lines = str(err).strip().splitlines()
        raise EvalError(f"--env {env_id}: cannot be made here ({type(err).__name__}"
                        f"{': ' + lines[0] if lines else ''})") from None
    if not _fits(spec, trained.spec):
        raise EvalError(f"--env {env_id}: its spaces ({describe_spec(spec)}) are not the policy's "
                        f"({describe_spec(trained.spec)})")
    return dataclasses.replace(trained, cfg=dataclasses.replace(trained.cfg, env=env_cfg))


def external_refusal(trained, path: str) -> str:
    """Why `kuberl eval` without --env does not evaluate a policy trained on external simulators, and
    what does: `kuberl serve` with the simulator connected, or --env with a gymnasium env of its spaces."""
    env = trained.cfg.env
    example = f" (e.g. --env {env.id}, the env.id its spaces came from)" if env.declared_spec is None else ""
    return (f"{trained.checkpoint}: trained on external simulators (env.mode: external), whose env kuberl eval "
            f"cannot make: serve the policy with `kuberl serve {path}` and connect your simulator to it "
            f"(docs/after-training.md), or evaluate it here on a gymnasium env with its spaces "
            f"({describe_spec(trained.spec)}) with --env ENV_ID{example}")


class Tally:
    """Whole episodes of n slots (env copies, or agents' slots), slot i finishing `share[i]` of them: their
    returns and lengths in the order they finished; an episode past a slot's share is not counted."""

    def __init__(self, share: np.ndarray, on_episode=None):
        self.share, self.on_episode = share, on_episode
        self.done = np.zeros(len(share), np.int64)
        self.ret, self.length = np.zeros(len(share)), np.zeros(len(share), np.int64)
        self.returns: list[float] = []
        self.lengths: list[int] = []

    @staticmethod
    def shares(episodes: int, n: int) -> np.ndarray:
        """`episodes` among n slots: they sum to it, and no slot waits for another."""
        return np.array([(episodes + i) // n for i in range(n)])

    @property
    def finished(self) -> bool:
        return bool((self.done >= self.share).all())

    def step(self, rewards: np.ndarray, present, ended: np.ndarray) -> None:
        """One step: every slot's reward, whether it acted (`present`; True: all), whether its episode ended."""
        self.ret += rewards
        self.length += present
        for i in np.flatnonzero(ended):
            if self.done[i] < self.share[i]:
                self.returns.append(float(self.ret[i]))
                self.lengths.append(int(self.length[i]))
                if self.on_episode is not None:
                    self.on_episode(float(self.ret[i]))
            self.done[i] += 1
            self.ret[i], self.length[i] = 0.0, 0


def run_episodes(trained: dict, episodes: int, num_envs: int, seed: int, deterministic: bool = True, on_episode=None,
                 deadline: float | None = None, policies: dict | None = None) -> tuple[dict, object]:
    """Run `episodes` whole episodes on `min(num_envs, episodes)` env copies, each policy of `trained` (by
    name: the run's one, or each of a run's several, `policies` its agent patterns) playing its slots;
    returns each policy's `Tally` and the envs' agents by group. Slot i (env copies, or for a PettingZoo
    env every agent of every copy in the env's order) runs a fixed share of the episodes (`Tally.shares`),
    so the short ones that finish first are not over-represented. Blocking. With `deadline`
    (time.monotonic()), stops there with the episodes finished so far."""
    envs = _make_envs(next(iter(trained.values())).cfg.env, min(num_envs, episodes), policies=policies)
    try:
        groups = getattr(envs, "groups", None) if policies else None
        sizes = {g.name: len(g.obs) for g in groups} if groups else {next(iter(trained)): envs.num_envs}
        stepper = _stepper(trained, envs, {name: act_fn(t, deterministic, sizes[name]) for name, t in trained.items()},
                           seed)
        everyone = Tally.shares(episodes, envs.num_envs)
        if groups:   # every slot, copy by copy in the env's agent order: each policy's agents get theirs
            share = {g.name: np.zeros(len(g.obs), np.int64) for g in groups}
            order = [envs.slot(k, a) for k in range(len(envs.copies)) for a in envs.agents]
            for k, (g, i) in enumerate(order):
                share[g.name][i] = everyone[k]
        else:
            share = {next(iter(trained)): everyone}
        tallies = {name: Tally(share[name], on_episode) for name in trained}
        while not all(t.finished for t in tallies.values()) and (deadline is None or time.monotonic() < deadline):
            present = {name: True if p is None else p for name, p in stepper.present.items()}   # (slots acting now)
            acted = stepper.act(0)
            for name, s in stepper.step({name: a for name, (a, _) in acted.items()}).items():
                tallies[name].step(s.rewards, present[name], s.ended)
    finally:
        envs.close()
    return tallies, {g.name: g.agents for g in groups} if groups else {}


def record_video(trained, act, path: str | Path, episodes: int, seed: int, fps: float) -> dict:
    """Record `episodes` episodes one after another into `path` (.mp4 or .gif). Blocking. Returns their
    returns, lengths and the frames written (the sum of the lengths). Raises EvalError for another
    suffix or an env that does not render rgb_array frames."""
    import imageio.v2 as imageio

    path = Path(path)
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise EvalError(f"--video {path}: {path.suffix or 'no suffix'} is not a video format written here; "
                        f"use {' or '.join(VIDEO_SUFFIXES)}")
    env_cfg = trained.cfg.env
    if is_atari(env_cfg.id):  # ale-py's vector env does not render; gymnasium's ALE env does, same preprocessing
        env_cfg = dataclasses.replace(env_cfg, atari=dataclasses.replace(env_cfg.atari, backend="gymnasium"))
    # pygame (classic control's renderer) draws off-screen for rgb_array; without this SDL probes for a
    # display and prints complaints where there is none.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    if not is_atari(env_cfg.id):  # (ALE envs all render) asked before making it: an env may refuse the argument
        import gymnasium as gym

        probe = gym.make(env_cfg.id)
        modes = list(probe.metadata.get("render_modes") or [])
        probe.close()
        if "rgb_array" not in modes:
            raise EvalError(f"--video: env {env_cfg.id} does not render rgb_array frames "
                            f"(its render modes: {', '.join(modes) or 'none'})")
    envs = _make_envs(env_cfg, 1, render_mode="rgb_array")
    try:
        if path.suffix.lower() == ".gif":
            writer = imageio.get_writer(path, mode="I", duration=1000.0 / fps, loop=0)
        else:  # macro_block_size 1: keep the env's frame size (ffmpeg's default would rescale it)
            writer = imageio.get_writer(path, fps=fps, macro_block_size=1)
        returns, lengths, frames = [], [], 0
        with writer:
            stepper = _stepper({"": trained}, envs, {"": act}, seed)
            ret, length = 0.0, 0
            while len(returns) < episodes:
                writer.append_data(np.asarray(envs.envs[0].render()))
                frames += 1
                acted = stepper.act(0)
                s = stepper.step({"": acted[""][0]})[""]
                ret, length = ret + float(s.rewards[0]), length + 1
                if s.ended[0]:
                    returns.append(ret)
                    lengths.append(length)
                    ret, length = 0.0, 0
    finally:
        envs.close()
    return {"path": str(path), "episodes": episodes, "frames": frames, "fps": fps, "returns": returns,
            "lengths": lengths}


def evaluate(trained, episodes: int, num_envs: int, seed: int, deterministic: bool = True,
             progress: bool = False, deadline: float | None = None) -> dict:
    """Evaluate a loaded policy (services/cli/trained.py); the JSON-ready result. Blocking."""
    bar = Progress(episodes, "eval", progress)
    try:
        tallies, _ = run_episodes({"": trained}, episodes, num_envs, seed, deterministic, bar.step, deadline)
    finally:
        bar.close()
    returns, lengths = tallies[""].returns, tallies[""].lengths
    return {"checkpoint": str(trained.checkpoint), "algorithm": trained.cfg.algorithm, "env_id": trained.cfg.env.id,
            "policy_version": trained.version, "deterministic": deterministic, "episodes": len(returns),
            "episodes_asked": episodes, "num_envs": min(num_envs, episodes), "seed": seed,
            "return": stats(returns), "length": stats([float(n) for n in lengths]),
            "returns": returns, "lengths": lengths}


def evaluate_policies(trained: dict, episodes: int, num_envs: int, seed: int, deterministic: bool = True,
                      progress: bool = False, deadline: float | None = None) -> dict:
    """Evaluate every policy of a run of several (config `policies`) together, each playing its own
    agents as in training (the env's agents in a group per policy, each group with its spaces), for
    `episodes` agent lives on `min(num_envs, episodes)` env copies: each slot a fixed share of them, as
    `run_episodes` shares episodes among copies. The JSON-ready result, with each policy's returns under
    `policies`. Blocking."""
    cfg = next(iter(trained.values())).cfg
    bar = Progress(episodes, "eval", progress)
    try:
        tallies, agents = run_episodes(trained, episodes, num_envs, seed, deterministic, bar.step, deadline,
                                       policies={k: v.agents for k, v in cfg.policies.items()})
    finally:
        bar.close()
    results = {name: (t.returns, t.lengths) for name, t in tallies.items()}
    returns = [x for rets, _ in results.values() for x in rets]
    lengths = [x for _, lens in results.values() for x in lens]
    by_policy = {name: {"checkpoint": str(t.checkpoint), "policy_version": t.version,
                        "agents": agents[name],
                        "episodes": len(results[name][0]), "return": stats(results[name][0]),
                        "length": stats([float(x) for x in results[name][1]])} for name, t in trained.items()}
    return {"checkpoint": {name: str(t.checkpoint) for name, t in trained.items()}, "algorithm": cfg.algorithm,
            "env_id": cfg.env.id, "deterministic": deterministic, "episodes": len(returns),
            "episodes_asked": episodes, "num_envs": min(num_envs, episodes), "seed": seed,
            "return": stats(returns), "length": stats([float(x) for x in lengths]), "policies": by_policy,
            "returns": returns, "lengths": lengths}


def opponent(against: str, space, seed: int):
    """The player `--against` names (services/actor/seats.py): "random", the random player of self-play
    (uniform over the actions the mask allows, a Box uniform within its bounds; seeded), or
    "module:function", a function of one agent's observation, or of the observation and its action mask
    where it takes two arguments (a turn-based game's opponent must keep to its mask). EvalError naming
    --against otherwise."""
    from services.actor.seats import Scripted, Uniform
    from services.common.protocol.spaces import Box

    if against == "random":
        if isinstance(space, Box) and not space.bounded:
            raise EvalError("--against random: the action space is a Box without finite bounds, where no "
                            "uniform random player exists; name a module:function opponent")
        return Uniform(space, np.random.default_rng(seed))
    try:
        return Scripted(against, space)
    except ValueError as err:
        raise EvalError(f"--against {err}; give 'random' or module:function") from None


def play_against(trained, against: str, games: int, seed: int, deterministic: bool = True) -> dict:
    """`games` games of the policy's PettingZoo env with the policy on one agent, the first in the
    first game, the next in the next, and so on, and `against` (`opponent`) on the others. Each game
    is scored as self-play scores it (`game_score`, services/common/agents.py): a win when the policy's agent's
    return is above every other's, a loss when below any. Blocking."""
    from services.actor.seats import Against
    from services.common.agents import OUTCOMES, game_score, is_pettingzoo

    if not is_pettingzoo(trained.cfg.env.id):
        raise EvalError(f"--against plays agents against each other: env.id {trained.cfg.env.id!r} has one agent")
    other = opponent(against, trained.spec.action, seed)
    envs = _make_envs(trained.cfg.env, 1)
    agents = envs.num_envs
    results = {"wins": 0, "losses": 0, "draws": 0}
    try:
        seats = Against(act_fn(trained, deterministic, agents), other)
        stepper = _stepper({"": trained}, envs, {"": seats}, seed)
        returns = np.zeros(agents)
        for game in range(games):
            seats.mine = game % agents
            over = False
            while not over:
                s = stepper.step({"": stepper.act(0)[""][0]})[""]
                returns += s.rewards
                over = bool(s.over[0])
            results[OUTCOMES[game_score(returns, seats.mine)]] += 1
            returns[:] = 0.0
    finally:
        envs.close()
    return {"checkpoint": str(trained.checkpoint), "env_id": trained.cfg.env.id, "policy_version": trained.version,
            "against": against, "games": games, "deterministic": deterministic, "seed": seed, **results,
            "win_rate": results["wins"] / games}


def evaluate_after_training(cfg: ExperimentConfig, run_dir: str | Path) -> dict | None:
    """`kuberl up`'s evaluation of the run's final checkpoint (`evaluation` in the config): None when
    `evaluation.after_training` is off or the env is external simulators' (not one this process can
    make: `kuberl eval` it where it can), else `evaluate`'s result, or {"error": ...} when it could not
    run (it never fails the run). Blocking: at most about `evaluation.max_seconds` of episodes."""
    e = cfg.evaluation
    if not e.after_training or cfg.env.mode == "external":
        return None
    import torch

    from services.cli.trained import TrainedPolicyError, load_policies, load_trained

    torch.set_num_threads(cfg.actor.torch_threads)
    started = time.monotonic()
    try:
        if cfg.several_policies:   # every policy plays its agents
            result = evaluate_policies(load_policies(run_dir, seed=e.seed), e.episodes, e.num_envs, e.seed,
                                       deadline=started + e.max_seconds if e.max_seconds else None)
            result["wall_s"] = round(time.monotonic() - started, 3)
            return result
        trained = load_trained(run_dir, seed=e.seed)
        if cfg.selfplay.enabled:   # the policy on both sides scores 0 either way: games against random say more
            result = play_against(trained, "random", e.episodes, e.seed)
        else:
            result = evaluate(trained, e.episodes, e.num_envs, e.seed,
                              deadline=started + e.max_seconds if e.max_seconds else None)
    except Exception as err:  # noqa: BLE001 - torch, gymnasium, a renderer: the run's summary comes first
        log.warning("evaluation after training failed: %s", err)
        return {"error": f"{type(err).__name__}: {err}" if not isinstance(err, (TrainedPolicyError, EvalError))
                else str(err)}
    result["wall_s"] = round(time.monotonic() - started, 3)
    return result


def action_modes(choice: str | None, cfg: ExperimentConfig, against: bool = False) -> list[bool]:
    """The modes `--actions choice` evaluates, as `deterministic` flags, deterministic first. By default
    both where every agent of an env of more than one (a PettingZoo env) plays the run's policies:
    there a policy may rely on randomness its most likely action lacks (a pursuer that always takes the
    same path is dodged; measured: split simple_tag hunters caught 1.24 prey a game deterministically,
    1.95 sampled), so the deterministic score alone can understate it. Else (`against`: games against
    a fixed opponent, whose win rate is the measure) deterministic alone."""
    from services.common.agents import is_pettingzoo

    if choice is None:
        choice = "both" if is_pettingzoo(cfg.env.id) and not against else "deterministic"
    return {"deterministic": [True], "stochastic": [False], "both": [True, False]}[choice]


def joined(results: list[dict]) -> dict:
    """One result per mode of `action_modes` as one: the first, with the sampled one under `stochastic`."""
    return results[0] if len(results) == 1 else {**results[0], "stochastic": results[1]}


def _modes_text(modes: list[bool]) -> str:
    return ("deterministic and stochastic (sampled) actions, each evaluated" if len(modes) > 1
            else "deterministic actions" if modes[0] else "stochastic (sampled) actions")


def describe(result: dict) -> str:
    """The result as the lines `kuberl eval` prints (with `stochastic`: each mode's under its heading)."""
    if "stochastic" in result:
        plain = {k: v for k, v in result.items() if k != "stochastic"}
        return (f"deterministic actions (the most likely):\n{describe(plain)}\n"
                f"stochastic actions (sampled, as the actors act):\n{describe(result['stochastic'])}")
    if "against" in result:   # play_against's
        return (f"against {result['against']}: {result['wins']} wins, {result['losses']} losses, {result['draws']} "
                f"draws of {result['games']} games (win rate {result['win_rate']:.3f})")
    r, n = result["return"], result["length"]
    if not result["episodes"]:
        return "no episode finished"
    over = f"  over {result['episodes']:,} episode{'s' if result['episodes'] != 1 else ''}"
    lines = [f"return  mean {r['mean']:10.2f}  std {r['std']:8.2f}  min {r['min']:10.2f}  max {r['max']:10.2f}{over}",
             f"length  mean {n['mean']:10.1f}  std {n['std']:8.1f}  min {n['min']:10.0f}  max {n['max']:10.0f}"]
    for name, p in result.get("policies", {}).items():   # (a run of several policies: each its agents' lives)
        pr = p["return"]
        lines.append(f"policy {name} (version {p['policy_version']}, agents {', '.join(p['agents'])}): "
                     + (f"return mean {pr['mean']:.2f} std {pr['std']:.2f} over {p['episodes']} episodes"
                        if p["episodes"] else "no episode finished"))
    return "\n".join(lines)


def _main_policies(args: argparse.Namespace, trained: dict) -> int:
    """`kuberl eval` of a run of several policies: every policy plays its agents (`evaluate_policies`)."""
    refused = [flag for flag, value in (("--env", args.env), ("--against", args.against), ("--video", args.video))
               if value is not None]
    if refused:
        raise EvalError(f"{refused[0]}: a run of several policies ({', '.join(trained)}) is evaluated with every "
                        f"policy on its agents; {refused[0]} takes a run of one policy")
    first = next(iter(trained.values()))
    if first.cfg.env.mode == "external":   # its env is the simulators': nothing here steps it
        raise EvalError(f"{args.path}: a run of several policies ({', '.join(trained)}) trained on external "
                        f"simulators (env.mode: external), whose env kuberl eval cannot make: serve the policies "
                        f"with `kuberl serve {args.path}` and connect your simulator's sessions to them, one per "
                        f"policy (docs/after-training.md)")
    e = first.cfg.evaluation
    episodes = args.episodes or e.episodes
    modes = action_modes(args.actions, first.cfg)
    if not args.json:
        print(f"evaluating {len(trained)} policies ({', '.join(f'{n}: {t.checkpoint.name}' for n, t in trained.items())})"
              f" on {episodes} agent episodes, {_modes_text(modes)}", flush=True)
    result = joined([evaluate_policies(trained, episodes, args.num_envs or e.num_envs,
                                       e.seed if args.seed is None else args.seed, deterministic, progress=not args.json)
                     for deterministic in modes])
    print(json.dumps(result) if args.json else describe(result))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kuberl eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a `kuberl up` run directory (its newest checkpoint is used) or a ckpt-*.pt file")
    p.add_argument("--episodes", type=int, default=None, help="episodes to run (default: evaluation.episodes, 10)")
    p.add_argument("--num-envs", type=int, default=None,
                   help="env copies stepped in parallel (default: evaluation.num_envs, 5)")
    p.add_argument("--seed", type=int, default=None, help="copy i is seeded SEED + i (default: evaluation.seed)")
    p.add_argument("--actions", choices=ACTIONS, default=None,
                   help="deterministic (the most likely action), stochastic (sampled as the actors act; DQN: "
                        "epsilon-greedy) or both, each result printed (default: both for an env of more than one "
                        "agent, where a policy may rely on its randomness, but with --against; else "
                        "deterministic)")
    p.add_argument("--stochastic", dest="actions", action="store_const", const="stochastic",
                   help="the same as --actions stochastic")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object, nothing else on stdout "
                                                       "(with --actions both: the deterministic result, the sampled "
                                                       "one under 'stochastic')")
    p.add_argument("--video", default=None, metavar="FILE",
                   help="also record episodes into FILE (.mp4 or .gif) from the env's rgb_array rendering")
    p.add_argument("--video-episodes", type=int, default=3, help="episodes recorded into --video (default 3)")
    p.add_argument("--fps", type=float, default=30.0, help="frames per second of --video (default 30)")
    p.add_argument("--env", default=None, metavar="ENV_ID",
                   help="evaluate on this gymnasium env instead of the run's env.id; its observation and action "
                        "spaces must be the policy's. A policy trained on external simulators (env.mode: "
                        "external) is evaluated here only this way (or served to them: `kuberl serve`)")
    p.add_argument("--against", default=None, metavar="OPPONENT",
                   help="for an env with several agents: play --episodes games with the policy on one agent "
                        "(each in turn) against OPPONENT on the others, 'random' or module:function (a "
                        "function of an agent's observation returning its action), and report wins, losses, "
                        "draws and the win rate")
    args = p.parse_args(argv)
    for name in ("episodes", "num_envs", "video_episodes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"kuberl eval: --{name.replace('_', '-')} {getattr(args, name)}: must be >= 1", file=sys.stderr)
            return 2
    if not math.isfinite(args.fps) or args.fps <= 0:
        print(f"kuberl eval: --fps {args.fps}: must be > 0", file=sys.stderr)
        return 2
    if args.video is not None and Path(args.video).suffix.lower() not in VIDEO_SUFFIXES:
        print(f"kuberl eval: --video {args.video}: not a video format written here; use "
              f"{' or '.join(VIDEO_SUFFIXES)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s eval: %(message)s")
    import torch

    from services.cli.trained import TrainedPolicyError, load_policies, load_trained, policy_checkpoint_dirs

    torch.set_num_threads(1)
    try:
        if policy_checkpoint_dirs(args.path) is not None:   # a run of several policies: each plays its agents
            return _main_policies(args, load_policies(args.path))
        trained = load_trained(args.path)
        if args.env is not None:
            trained = on_env(trained, args.env)
        elif trained.cfg.env.mode == "external":  # its env is the simulators': nothing here steps it
            raise EvalError(external_refusal(trained, args.path))
        e = trained.cfg.evaluation
        episodes = args.episodes or e.episodes
        seed = e.seed if args.seed is None else args.seed
        modes = action_modes(args.actions, trained.cfg, against=args.against is not None)
        if args.against is not None:
            result = joined([play_against(trained, args.against, episodes, seed, deterministic)
                             for deterministic in modes])
            print(json.dumps(result) if args.json else
                  f"{trained.description} against {args.against}: {result['wins']} wins, {result['losses']} losses, "
                  f"{result['draws']} draws in {episodes} games (win rate {result['win_rate']:.2f})"
                  if len(modes) == 1 else f"{trained.description} against {args.against}\n{describe(result)}")
            return 0
        if not args.json:
            print(f"evaluating {trained.description} on {episodes} episodes, {_modes_text(modes)}", flush=True)
        result = joined([evaluate(trained, episodes, args.num_envs or e.num_envs, seed, deterministic, progress=True)
                         for deterministic in modes])
        result["video"] = None
        if args.video is not None:
            result["video"] = record_video(trained, act_fn(trained, modes[0]), args.video,
                                           args.video_episodes, seed + 10_000, args.fps)
    except (TrainedPolicyError, EvalError) as err:
        print(f"kuberl eval: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    print(describe(result))
    if (v := result["video"]) is not None:
        print(f"video: {v['path']}: {v['episodes']} episode{'s' if v['episodes'] != 1 else ''}, "
              f"{v['frames']} frames at {v['fps']:g} fps "
              f"(returns {', '.join(f'{x:g}' for x in v['returns'])})")
    return 0
