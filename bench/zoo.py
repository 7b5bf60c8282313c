"""kuberl against Stable-Baselines3 with rl-baselines3-zoo's hyper-parameters, side by side in one run.

For each task (an env and an algorithm) and seed, three runs, one after the other:
- `sb3`: Stable-Baselines3 with the zoo's hyper-parameters for that env (rl_zoo3/hyperparams/<algo>.yml,
  read from the installed rl_zoo3 package), in a fresh interpreter with one torch thread;
- `defaults`: `kuberl up` with nothing but the algorithm and the env id (every other key at its
  default: one config per algorithm, never per task);
- `tuned`: `kuberl up` with the zoo's hyper-parameters translated to kuberl's keys (`translate`).

Each run goes to the zoo's step budget for the task (or stops at the target with --stop-at-target) and
records every finished training episode (env steps, return, wall seconds since training started). The
same function reads both: env steps and seconds at which the mean return over the task's window of
episodes first reached the target, and that mean at the budget.

    python3 -m venv .venv-zoo && .venv-zoo/bin/pip install -e ".[zoo]"   # SB3, rl_zoo3, Box2D, MuJoCo
    .venv-zoo/bin/python -m bench.zoo [--tasks cartpole-dqn,pendulum-sac] [--seeds 1] [--json docs/zoo.json]

(a venv of its own: rl_zoo3 and the planner's kubernetes client want python-dateutil on either side of 3)

kuberl's env-step count is read when its launcher reads the episode (every `poll_interval_s`, 0.25 s
here), so it can be a few hundred steps late; SB3's is exact.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.up import ROOT, up


@dataclass(frozen=True)
class Task:
    name: str
    env_id: str
    algo: str               # dqn, ppo or sac
    target: float           # mean return over `window` episodes that counts as solved
    window: int
    budget: int | None = None  # env steps; None = the zoo's n_timesteps
    # A task that needs memory: PPO with an LSTM (`ppo.recurrent: lstm` in every kuberl run, the
    # defaults' too: it is the switch the task needs, not a tuning), against sb3-contrib's RecurrentPPO
    # with the zoo's `ppo_lstm` hyper-parameters for `zoo_key`.
    memory: bool = False
    zoo_key: str | None = None

    @property
    def zoo_env(self) -> str:
        """The key in the zoo's file: the same env, v4 for the MuJoCo tasks gymnasium now ships as v5."""
        return self.zoo_key or self.env_id.replace("-v5", "-v4")

    @property
    def zoo_algo(self) -> str:
        """The zoo's file (rl_zoo3/hyperparams/<zoo_algo>.yml)."""
        return "ppo_lstm" if self.memory else self.algo


# Targets: gymnasium's reward_threshold where the env has one (CartPole 475, Acrobot -100, LunarLander
# 200); Pendulum has none, -200 is where its swing-up is solved in the zoo's and CleanRL's reports;
# Hopper's 3800 is beyond SAC's usual 1M-step score, so 2500 here (the zoo's SAC logs reach ~2600-3400).
TASKS = {t.name: t for t in (
    Task("cartpole-ppo", "CartPole-v1", "ppo", 475, 100),
    Task("cartpole-dqn", "CartPole-v1", "dqn", 475, 100),
    Task("acrobot-dqn", "Acrobot-v1", "dqn", -100, 100),
    Task("acrobot-ppo", "Acrobot-v1", "ppo", -100, 100, budget=300_000),
    Task("pendulum-sac", "Pendulum-v1", "sac", -200, 10),
    Task("lunarlander-dqn", "LunarLander-v3", "dqn", 200, 50),
    Task("lunarlander-ppo", "LunarLander-v3", "ppo", 200, 50),
    Task("hopper-sac", "Hopper-v5", "sac", 2500, 10),
    # CartPole with the velocities hidden: kuberl_envs' CartPoleNoVelocity-v1 shows the observations of
    # sb3-contrib's CartPoleNoVel-v1 (x and theta, the same bounds); CartPole's threshold, 475.
    Task("cartpolenovel-ppo-lstm", "kuberl_envs:CartPoleNoVelocity-v1", "ppo", 475, 100, memory=True,
         zoo_key="CartPoleNoVel-v1"),
)}
FAST = ("cartpole-ppo", "cartpole-dqn", "acrobot-ppo", "acrobot-dqn", "pendulum-sac")


def zoo_hyperparams(task: Task) -> dict:
    """The zoo's entry for the task, as written (schedules and policy_kwargs still strings)."""
    from importlib.resources import files

    table = yaml.safe_load(files("rl_zoo3").joinpath("hyperparams", f"{task.zoo_algo}.yml").read_text())
    if task.zoo_env not in table:
        raise KeyError(f"rl-zoo3 has no {task.zoo_algo} hyper-parameters for {task.zoo_env}")
    return dict(table[task.zoo_env])


def budget(task: Task, hp: dict) -> int:
    return int(task.budget or float(hp["n_timesteps"]))


def _initial(value) -> float:
    """A zoo learning rate or clip range: a number, or 'lin_X' (linear from X to 0), read as X."""
    return float(value[4:]) if isinstance(value, str) and value.startswith("lin_") else float(value)


def _linear(value) -> bool:
    return isinstance(value, str) and value.startswith("lin_")


def _policy_kwargs(hp: dict) -> dict:
    if "policy_kwargs" not in hp:
        return {}
    import torch.nn as nn

    return eval(hp["policy_kwargs"], {"dict": dict, "nn": nn})  # the zoo's own format: a Python expression


def _hidden(hp: dict, default: tuple[int, ...]) -> list[int]:
    arch = _policy_kwargs(hp).get("net_arch", default)
    return list(arch["pi"] if isinstance(arch, dict) else arch)


def _normalize(value) -> dict:
    """The zoo's `normalize` (True, or VecNormalize's options as a string) as PPO's two switches."""
    options = eval(value, {"dict": dict}) if isinstance(value, str) else {} if value else None
    if options is None:
        return {"normalize_observations": False, "normalize_rewards": False}
    return {"normalize_observations": bool(options.get("norm_obs", True)),
            "normalize_rewards": bool(options.get("norm_reward", True))}


def translate(task: Task, hp: dict) -> dict:
    """The zoo's hyper-parameters as kuberl config sections (env, the algorithm's; for PPO also actor
    and planner, SB3's synchronous loop). What kuberl has no key for is left out and listed in
    `untranslated`. PPO's linear schedules become ppo.anneal_updates (and anneal_clip); any other
    linear schedule runs at its initial value and is listed."""
    n_envs = int(hp.get("n_envs", 1))
    extra: dict[str, dict] = {}
    if task.algo == "dqn":
        train_freq, grad_steps = int(hp.get("train_freq", 4)), int(hp.get("gradient_steps", 1))
        updates_per_step = (1.0 if grad_steps == -1 else grad_steps / train_freq)
        batch = int(hp.get("batch_size", 32))
        section = {"learning_rate": _initial(hp.get("learning_rate", 1e-4)), "batch_size": batch,
                   "buffer_size": int(hp.get("buffer_size", 1_000_000)), "gamma": float(hp.get("gamma", 0.99)),
                   "learning_starts": max(int(hp.get("learning_starts", 100)), batch),
                   "n_step": int(hp.get("n_steps", 1)),   # SB3's one-step returns unless the zoo says
                   "double_dqn": False,                   # SB3's DQN is the Nature DQN's target
                   # SB3 counts the target interval in env steps and trains in bursts of gradient_steps every
                   # train_freq steps, so its target stays fixed through a burst; kuberl counts updates.
                   "target_update_interval": max(1, round(max(int(hp.get("target_update_interval", 10_000)), train_freq)
                                                          * updates_per_step)),
                   "replay_ratio": batch * updates_per_step,
                   "exploration_steps": max(1, int(float(hp.get("exploration_fraction", 0.1)) * float(hp["n_timesteps"]))),
                   "end_epsilon": float(hp.get("exploration_final_eps", 0.05)),
                   "hidden_sizes": _hidden(hp, (64, 64))}
    elif task.algo == "ppo":
        n_steps = int(hp.get("n_steps", 2048))
        batch_steps = n_steps * n_envs
        section = {"rollout_steps": n_steps, "batch_steps": batch_steps,
                   "num_minibatches": max(1, batch_steps // int(hp.get("batch_size", 64))),
                   "num_epochs": int(hp.get("n_epochs", 10)), "learning_rate": _initial(hp.get("learning_rate", 3e-4)),
                   "gamma": float(hp.get("gamma", 0.99)), "gae_lambda": float(hp.get("gae_lambda", 0.95)),
                   "clip_coef": _initial(hp.get("clip_range", 0.2)), "clip_vloss": False,
                   # SB3's value loss is vf_coef x the mean squared error, kuberl's (CleanRL's) vf_coef x half of
                   # it; kept as written: SB3's weight (2 x vf_coef here) took kuberl longer on Acrobot (6 seeds,
                   # docs/benchmarks.md) and CartPole (seeds 0 and 1, paced: 92,672 and not reached in 100k)
                   "ent_coef": float(hp.get("ent_coef", 0.0)), "vf_coef": float(hp.get("vf_coef", 0.5)),
                   "max_grad_norm": float(hp.get("max_grad_norm", 0.5)),
                   **_normalize(hp.get("normalize", False)),
                   "hidden_sizes": _hidden(hp, (64, 64))}
        if _linear(hp.get("learning_rate")):  # SB3 anneals over n_timesteps env steps: that many batches
            section["anneal_updates"] = math.ceil(float(hp["n_timesteps"]) / batch_steps)
            section["anneal_clip"] = _linear(hp.get("clip_range"))
        # SB3 steps its n_envs envs n_steps with one policy, then trains on them: synchronous, policy lag 0.
        # kuberl's actor otherwise steps its next fragment while the learner trains (lag 1), and the
        # planner may add actors (more envs than n_envs, more lag): one actor of n_envs envs, held after
        # each fragment (a whole batch) until the learner's next weights (on-policy pacing).
        extra = {"actor": {"fragments_per_version": 1}, "planner": {"enabled": False}}
        if task.memory:
            section.update(recurrent="lstm", recurrent_size=int(_policy_kwargs(hp).get("lstm_hidden_size", 256)))
    else:
        train_freq, grad_steps = int(hp.get("train_freq", 1)), int(hp.get("gradient_steps", 1))
        batch = int(hp.get("batch_size", 256))
        lr = _initial(hp.get("learning_rate", 3e-4))
        section = {"policy_lr": lr, "q_lr": lr, "batch_size": batch, "buffer_size": int(hp.get("buffer_size", 1_000_000)),
                   "learning_starts": max(int(hp.get("learning_starts", 100)), batch),
                   "gamma": float(hp.get("gamma", 0.99)), "tau": float(hp.get("tau", 0.005)),
                   "replay_ratio": batch * (train_freq if grad_steps == -1 else grad_steps) / train_freq,
                   "hidden_sizes": _hidden(hp, (256, 256))}
    annealed = {"learning_rate", "clip_range"} if task.algo == "ppo" and _linear(hp.get("learning_rate")) else set()
    untranslated = sorted(k for k in hp if k in ("use_sde", "sde_sample_freq", "env_wrapper", "frame_stack")
                          or (k == "normalize" and task.algo != "ppo")
                          or (_linear(hp[k]) and k not in annealed))
    if task.memory:   # kuberl's core is one LSTM shared by both heads after a tanh MLP torso, orthogonal init
        untranslated += [f"policy_kwargs.{k}" for k in ("enable_critic_lstm", "activation_fn", "ortho_init")
                         if k in _policy_kwargs(hp)]
    return {"env": {"num_envs": n_envs}, task.algo: section, **extra, "untranslated": untranslated}


# -- reading a run -----------------------------------------------------------------------------------
def outcome(episodes: list[tuple[int, float, float]], task: Task, steps: int) -> dict:
    """From (env_steps, return, wall_s) per finished episode, in order: when the mean over the last
    `window` episodes first reached the target, and that mean at the end of the run."""
    last: deque[float] = deque(maxlen=task.window)
    hit = None
    for env_steps, ret, wall in episodes:
        last.append(ret)
        if hit is None and len(last) == task.window and statistics.fmean(last) >= task.target:
            hit = {"env_steps": env_steps, "seconds": round(wall, 1)}
    return {"reached": hit is not None, "steps_to_target": hit and hit["env_steps"],
            "seconds_to_target": hit and hit["seconds"], "env_steps": steps, "episodes": len(episodes),
            "final_mean": round(statistics.fmean(last), 1) if last else None}


# -- Stable-Baselines3 -------------------------------------------------------------------------------
def sb3_child(task: Task, seed: int, stop_at_target: bool, steps: int | None = None) -> dict:
    """Train SB3 with the zoo's hyper-parameters, for `steps` env steps (default: the task's budget);
    runs in a fresh interpreter (`--sb3-child`)."""
    import stable_baselines3
    import torch
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    torch.set_num_threads(1)
    hp = zoo_hyperparams(task)
    steps = steps or budget(task, hp)
    for unsupported in ("env_wrapper", "frame_stack"):
        if unsupported in hp:
            raise SystemExit(f"{task.name}: the zoo's {unsupported} is not reproduced here")
    normalize = hp.pop("normalize", False)
    kwargs = {k: v for k, v in hp.items() if k not in ("n_timesteps", "policy", "n_envs", "policy_kwargs")}
    for key in ("learning_rate", "clip_range"):
        if isinstance(kwargs.get(key), str) and kwargs[key].startswith("lin_"):
            start = _initial(kwargs[key])
            kwargs[key] = lambda progress, start=start: progress * start
    env = make_vec_env(task.env_id, n_envs=int(hp.get("n_envs", 1)), seed=seed)
    if normalize:
        options = eval(normalize, {"dict": dict}) if isinstance(normalize, str) else {}
        env = VecNormalize(env, gamma=float(hp.get("gamma", 0.99)), **options)
    if task.memory:
        import sb3_contrib

        algorithm = sb3_contrib.RecurrentPPO
    else:
        algorithm = getattr(stable_baselines3, task.algo.upper())
    model = algorithm(hp["policy"], env, seed=seed, device="cpu", verbose=0, policy_kwargs=_policy_kwargs(hp), **kwargs)
    episodes: list[tuple[int, float, float]] = []
    started = time.monotonic()

    class Record(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    episodes.append((self.num_timesteps, float(info["episode"]["r"]), time.monotonic() - started))
            return not (stop_at_target and outcome(episodes[-task.window:], task, 0)["reached"])

    model.learn(steps, callback=Record())
    return outcome(episodes, task, int(model.num_timesteps)) | {"wall_s": round(time.monotonic() - started, 1)}


def sb3(task: Task, seed: int, stop_at_target: bool, steps: int) -> dict:
    cmd = [sys.executable, "-m", "bench.zoo", "--sb3-child", task.name, "--seed", str(seed), "--budget", str(steps)]
    out = subprocess.run(cmd + (["--stop-at-target"] if stop_at_target else []), cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- kuberl ------------------------------------------------------------------------------------------
def kuberl(task: Task, config: dict, seed: int, steps: int, stop_at_target: bool, max_seconds: float) -> dict:
    import csv

    data = {"algorithm": task.algo, "seed": seed, **config,
            "env": {**config.get("env", {}), "id": task.env_id, "seed": seed},
            "run": {"target_return": task.target if stop_at_target else None, "return_window": task.window,
                    "max_env_steps": steps, "max_seconds": max_seconds, "poll_interval_s": 0.25},
            "evaluation": {"after_training": False}}
    with tempfile.TemporaryDirectory() as tmp:
        run = up(data, Path(tmp), check=False)
        summary = json.loads((run / "summary.json").read_text())
        with open(run / "episodes.csv") as f:
            episodes = [(int(r["env_steps"]), float(r["return"]), float(r["wall_s"])) for r in csv.DictReader(f)]
    spi = summary["last_stats"].get("buffer-0", {}).get("buffer/samples_per_insert")
    return outcome(episodes, task, summary["env_steps"]) | {
        "wall_s": summary["wall_s"], "reason": summary["reason"], "error": summary["error"],
        "samples_lost": summary["samples_lost"]["total"],
        "replay_ratio_held": round(spi, 2) if spi is not None else None}


# -- the table ---------------------------------------------------------------------------------------
def _cell(r: dict) -> str:
    if not r["reached"]:
        return f"not reached ({r['env_steps']:,} steps)"
    return f"{r['steps_to_target']:,} / {r['seconds_to_target']:.0f} s"


def table(rows: list[dict]) -> str:
    """Markdown: per task, the median over seeds of each run kind."""
    out = ["| task | target (window) | zoo budget | run | steps / seconds to target | mean at budget | "
           "steps vs SB3 |", "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["task"] for r in rows):
        group = [r for r in rows if r["task"] == name]
        task = TASKS[name]
        for kind in ("sb3", "defaults", "tuned"):
            runs = [r[kind] for r in group if kind in r]
            if not runs:
                continue
            reached = [r for r in runs if r["reached"]]
            steps = statistics.median(r["steps_to_target"] for r in reached) if len(reached) == len(runs) else None
            ref = [r["sb3"]["steps_to_target"] for r in group if "sb3" in r and r["sb3"]["reached"]]
            vs = (f"{steps / statistics.median(ref):.2f}x" if steps and ref and len(ref) == len(group) else "-")
            cells = "; ".join(_cell(r) for r in runs)
            finals = [r["final_mean"] for r in runs if r["final_mean"] is not None]
            cut = f" (cut from {group[0]['zoo_budget']:,})" if "zoo_budget" in group[0] else ""
            out.append(f"| {name} | {task.target:g} ({task.window}) | {group[0]['budget']:,}{cut} | {kind} | {cells} | "
                       f"{statistics.median(finals):.1f} | {vs if kind != 'sb3' else ''} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(FAST), help=f"comma-separated, from: {', '.join(TASKS)}")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--runs", default="sb3,defaults,tuned")
    p.add_argument("--stop-at-target", action="store_true", help="end each run when it reaches the target")
    p.add_argument("--max-seconds", type=float, default=1800.0, help="wall limit of each kuberl run")
    p.add_argument("--json", default=None, help="write every run here (and read back runs already in it)")
    p.add_argument("--budget", type=int, default=None,
                   help="env steps of every run, in place of the zoo's budget (a task too long for the machine: "
                        "its rows compare the mean return at this budget, and SB3's linear schedules, if any, "
                        "anneal over it)")
    p.add_argument("--sb3-child", metavar="TASK", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sb3_child:  # the child of sb3()
        print(json.dumps(sb3_child(TASKS[args.sb3_child], args.seed, args.stop_at_target, args.budget)))
        return 0

    kinds = args.runs.split(",")
    rows = json.loads(Path(args.json).read_text())["rows"] if args.json and Path(args.json).exists() else []
    for name in args.tasks.split(","):
        task = TASKS[name]
        hp = zoo_hyperparams(task)
        steps = args.budget or budget(task, hp)
        tuned = translate(task, hp)
        for seed in range(args.seeds):
            row = {"task": name, "seed": seed, "budget": steps, "zoo": hp, "untranslated": tuned["untranslated"]}
            if args.budget:
                row["zoo_budget"] = budget(task, hp)
            if "sb3" in kinds:
                row["sb3"] = sb3(task, seed, args.stop_at_target, steps)
            if "defaults" in kinds:
                memory = {"ppo": {"recurrent": "lstm"}} if task.memory else {}
                row["defaults"] = kuberl(task, memory, seed, steps, args.stop_at_target, args.max_seconds)
            if "tuned" in kinds:
                config = {k: v for k, v in tuned.items() if k != "untranslated"}
                row["tuned"] = kuberl(task, config, seed, steps, args.stop_at_target, args.max_seconds)
                row["tuned_config"] = config
            print(json.dumps({k: v for k, v in row.items() if k not in ("zoo", "tuned_config")}), flush=True)
            rows = [r for r in rows if (r["task"], r["seed"]) != (name, seed)] + [row]
            if args.json:
                Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
