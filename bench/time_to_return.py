"""Wall time to a mean return (default 300 over the last 100 episodes) on CartPole-v1 (or any env with
Discrete, MultiDiscrete or Box actions, e.g. --config configs/pendulum_ppo.yaml --target -300), PPO or
SAC (--config configs/pendulum_sac.yaml): `kuberl up` (buffer, learner and actor processes, gRPC
between them) against a plain single-process loop with the same hyper-parameters and the same learner
code, measured in the same run. The SAC loop takes replay_ratio / batch_size updates per env step
(the ratio the buffer paces kuberl's learner to) from the buffer's own replay ring.

    .venv/bin/python -m bench.time_to_return [--config configs/cartpole_ppo.yaml] [--seeds 3]

Both are timed from the launch of a fresh process (interpreter start-up and imports included), and
kuberl also from the moment every service was serving (training only). Prints one row per seed and
the ratios kuberl / single-process of the median times (below 1 means kuberl is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
import yaml

from bench.up import ROOT, up


def single_process(cfg, target: float, window: int, max_steps: int) -> dict:
    return (single_process_sac if cfg.algorithm == "sac" else single_process_ppo)(cfg, target, window, max_steps)


def single_process_sac(cfg, target: float, window: int, max_steps: int) -> dict:
    """CleanRL-style loop: step a vector env with the policy (uniform until the first update), insert
    each step into a replay ring, take replay_ratio / batch_size updates per env step once
    learning_starts transitions are in."""
    started = time.monotonic()
    import gymnasium as gym
    import torch

    from kuberl.v1 import common_pb2 as pb
    from services.algorithms.sac.learner import SAC
    from services.buffer.replay import ReplayRing
    from services.common.protocol.fragments import Fragment
    from services.common.models.nets import env_spec

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    spec, c, n = env_spec(cfg.env.id), cfg.section("sac"), cfg.env.num_envs
    envs = gym.make_vec(cfg.env.id, num_envs=n, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    sac, ring, rng = SAC(c, spec), ReplayRing(c.buffer_size, seed=cfg.seed), np.random.default_rng(cfg.seed)
    obs, _ = envs.reset(seed=cfg.env.seed)
    returns, ep_ret, steps, credit = deque(maxlen=window), np.zeros(n), 0, 0.0
    per_step = c.replay_ratio / c.batch_size
    while steps < max_steps:
        if sac.version == 0:
            act = rng.uniform(spec.action.low_array, spec.action.high_array, (n, *spec.action.shape)).astype(np.float32)
        else:
            with torch.inference_mode():
                act = sac.actor.sample(torch.from_numpy(obs))[0].numpy()
        nxt, r, term, trunc, info = envs.step(act)
        done = np.flatnonzero(term | trunc)
        ring.add(Fragment(actor_id="single", seq=steps, policy_version=sac.version, incarnation=0,
                          algorithm=pb.ALGORITHM_SAC, env_ids=tuple(range(n)), obs=np.stack([obs, nxt]),
                          actions=act[None], rewards=r[None].astype(np.float32), terminated=term[None],
                          truncated=trunc[None], final_obs=np.array([info["final_obs"][i] for i in done],
                                                                     np.float32).reshape(-1, *spec.obs_shape),
                          final_index=done.astype(np.int64)))
        ep_ret += r
        for i in done:
            returns.append(ep_ret[i])
            ep_ret[i] = 0
        obs, steps = nxt, steps + n
        if len(returns) == window and np.mean(returns) >= target:
            return {"seconds": time.monotonic() - started, "env_steps": steps, "reached": True}
        if ring.size >= c.learning_starts:
            credit += per_step * n
            while credit >= 1:
                credit -= 1
                sac.update({k: v for k, v in ring.sample(c.batch_size).items() if k != "policy_version"})
    return {"seconds": time.monotonic() - started, "env_steps": steps, "reached": False}


def single_process_ppo(cfg, target: float, window: int, max_steps: int) -> dict:
    """CleanRL-style loop: step a vector env with the policy, update PPO on each full rollout."""
    started = time.monotonic()
    import gymnasium as gym
    import torch

    from kuberl.v1 import common_pb2 as pb
    from services.common.protocol.fragments import Fragment
    from services.common.models.nets import env_spec
    from services.common.protocol.spaces import Box
    from services.algorithms.ppo.learner import PPO

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    spec = env_spec(cfg.env.id)
    n, T = cfg.env.num_envs, cfg.section("ppo").rollout_steps
    envs = gym.make_vec(cfg.env.id, num_envs=n, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    ppo = PPO(cfg.section("ppo"), spec)
    obs, _ = envs.reset(seed=cfg.env.seed)
    returns, ep_ret, steps = deque(maxlen=window), np.zeros(n), 0
    while steps < max_steps:
        o = np.empty((T + 1, n, *spec.obs_shape), np.float32)
        a = np.empty((T, n, *spec.action.shape), spec.action.dtype)
        r, lp = np.empty((T, n), np.float32), np.empty((T, n), np.float32)
        term, trunc = np.empty((T, n), bool), np.empty((T, n), bool)
        fin_obs, fin_idx = [], []
        o[0] = obs
        for t in range(T):
            with torch.inference_mode():
                dist = ppo.net.dist(torch.from_numpy(obs))
                act = dist.sample()
                a[t], lp[t] = act.numpy(), dist.log_prob(act).numpy()
            obs, r[t], term[t], trunc[t], info = envs.step(spec.action.clip(a[t]) if isinstance(spec.action, Box) else a[t])
            ep_ret += r[t]
            for i in np.flatnonzero(term[t] | trunc[t]):
                fin_obs.append(info["final_obs"][i])
                fin_idx.append(t * n + i)
                returns.append(ep_ret[i])
                ep_ret[i] = 0
            o[t + 1] = obs
        steps += T * n
        if len(returns) == window and np.mean(returns) >= target:
            return {"seconds": time.monotonic() - started, "env_steps": steps, "reached": True}
        frag = Fragment(actor_id="single", seq=0, policy_version=ppo.version, incarnation=0, algorithm=pb.ALGORITHM_PPO,
                        env_ids=tuple(range(n)), obs=o, actions=a, rewards=r, terminated=term, truncated=trunc,
                        final_obs=np.array(fin_obs, np.float32).reshape(-1, *spec.obs_shape),
                        final_index=np.array(fin_idx, np.int64), extras={"behaviour_logprob": lp})
        ppo.update([frag])
    return {"seconds": time.monotonic() - started, "env_steps": steps, "reached": False}


def single_process_timed(config: dict, target: float, window: int, max_steps: int) -> dict:
    """Run `single_process` in a fresh interpreter, timed from its launch as `kuberl up` is."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "bench.time_to_return", "--single-process-only",
                          json.dumps(config), "--target", str(target), "--window", str(window),
                          "--max-steps", str(max_steps)], cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["seconds"] = time.monotonic() - started
    return result


def kuberl_up(config: dict, target: float, window: int, max_steps: int, workdir: Path) -> dict:
    data = {**config, "run": {**config.get("run", {}), "target_return": target, "return_window": window,
                              "max_env_steps": max_steps, "poll_interval_s": 0.25}}
    started = time.monotonic()
    run_dir = up(data, workdir)
    total = time.monotonic() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seconds": total, "training_seconds": summary["wall_s"], "env_steps": summary["env_steps"],
            "reached": summary["reason"] == "target_return"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "cartpole_ppo.yaml"))
    p.add_argument("--target", type=float, default=300.0)
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--single-process-only", metavar="CONFIG_JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    from services.config import config_from_dict

    if args.single_process_only:  # the child of single_process_timed
        cfg = config_from_dict(json.loads(args.single_process_only))
        print(json.dumps(single_process(cfg, args.target, args.window, args.max_steps)))
        return 0

    raw = yaml.safe_load(Path(args.config).read_text())
    rows = []
    for seed in range(args.seeds):
        cfg_dict = {**raw, "seed": seed, "env": {**raw.get("env", {}), "seed": seed}}
        cfg = config_from_dict(cfg_dict)
        single = single_process_timed(cfg_dict, args.target, args.window, args.max_steps)
        with tempfile.TemporaryDirectory() as tmp:
            up = kuberl_up(cfg_dict, args.target, args.window, args.max_steps, Path(tmp))
        rows.append({"seed": seed, "single": single, "kuberl": up})
        print(f"seed {seed}: single-process {single['seconds']:6.1f} s ({single['env_steps']:>8,} steps)"
              f" | kuberl up {up['seconds']:6.1f} s total, {up['training_seconds']:6.1f} s training"
              f" ({up['env_steps']:>8,} steps)" + ("" if single["reached"] and up["reached"] else "  [target NOT reached]"),
              flush=True)
    med = {k: statistics.median(r[src][key] for r in rows) for k, src, key in (
        ("single", "single", "seconds"), ("total", "kuberl", "seconds"), ("training", "kuberl", "training_seconds"))}
    print(f"\nmedian time to mean return {args.target:g} (last {args.window} episodes), {args.seeds} seeds:")
    print(f"  single-process {raw.get('algorithm', 'ppo').upper():10} {med['single']:6.1f} s")
    print(f"  kuberl up, total          {med['total']:6.1f} s   ratio {med['total'] / med['single']:.2f}")
    print(f"  kuberl up, training only  {med['training']:6.1f} s   ratio {med['training'] / med['single']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
