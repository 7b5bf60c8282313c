"""Inference batched across agents (docs/multi-agent.md): the actor asks the policy once per step for
every agent of every env copy. This measures actions per second of PPO's policy (64x64, one torch
thread) on simple_spread's observations with 1, 4 and 16 agents per env and 8 env copies, acting for
all the agents in one call (what the actor does) against one call per agent, in the same process and
invocation, arms interleaved over rounds; medians of the rounds and the ratio.

    .venv/bin/python -m bench.agents_batching --rounds 5 --json docs/agents_batching.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from services.actor.policy import Policy
from services.common.envs import make_vector_env, spec_of
from services.common.stats import Metrics
from services.config import config_from_dict

COPIES = 8


def setup(agents: int):
    cfg = config_from_dict({"algorithm": "ppo", "actor": {"torch_threads": 1}, "env": {
        "id": "pettingzoo:mpe2.simple_spread_v3", "num_envs": COPIES,
        "kwargs": {"N": agents, "max_cycles": 25, "continuous_actions": False}}})
    envs = make_vector_env(cfg.env)
    obs, _ = envs.reset(seed=0)
    envs.close()
    return Policy(cfg, spec_of(cfg.env), 0, Metrics("actor")), obs


def rate(policy: Policy, obs: np.ndarray, batched: bool, seconds: float) -> float:
    """Actions per second over about `seconds`."""
    actions, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if batched:
            policy.act(obs, 0, None, None)
        else:
            for i in range(len(obs)):
                policy.act(obs[i:i + 1], 0, None, None)
        actions += len(obs)
    return actions / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0, help="per arm and round")
    p.add_argument("--agents", default="1,4,16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    counts = [int(a) for a in args.agents.split(",")]
    setups = {a: setup(a) for a in counts}
    runs: dict[tuple[int, bool], list[float]] = {(a, b): [] for a in counts for b in (True, False)}
    for r in range(args.rounds):
        for a in counts:
            for batched in (True, False):
                runs[(a, batched)].append(rate(*setups[a], batched, args.seconds))
            print(f"round {r} agents {a:>2}: batched {runs[(a, True)][-1]:>10,.0f}/s  "
                  f"one call per agent {runs[(a, False)][-1]:>9,.0f}/s", flush=True)
    result: dict = {"env": "mpe2.simple_spread_v3", "copies": COPIES, "rounds": args.rounds, "torch": torch.__version__,
                    "per_agents": {}}
    for a in counts:
        batched, single = statistics.median(runs[(a, True)]), statistics.median(runs[(a, False)])
        result["per_agents"][str(a)] = {"actions_per_call": a * COPIES, "batched_actions_per_s": round(batched),
                                        "one_call_per_agent_actions_per_s": round(single),
                                        "ratio": round(batched / single, 2)}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
