"""The actor's stepping loop against the same loop at another commit, in one invocation.

    .venv/bin/python -m bench.actor_loop --ref fd371bd [--rounds 5] [--seconds 8] [--json docs/actor_loop.json]

Env steps (agent steps for a PettingZoo env) per second of `Rollout.collect` alone, in one process with one
torch thread, no gRPC: the fragments are cut and encoded as an actor cuts them and dropped. Each config of
`CONFIGS` runs in a fresh subprocess per arm and round, once with this working tree's services/ and once
with `--ref`'s (a `git worktree` checked out under a temporary directory), the arms alternating so that the
machine's load falls on both alike. Reports each arm's median of the rounds and their ratio (this tree
over the ref): how much a change to the loop (services/actor/rollout.py, seats.py, selfplay.py) costs.
The policy holds random weights (version 1); what is measured is stepping, acting and cutting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {   # name -> config file under configs/
    "cartpole_ppo": "cartpole_ppo.yaml",
    "simple_spread_ppo": "simple_spread_ppo.yaml",
    "simple_spread_two_policies_ppo": "simple_spread_two_policies_ppo.yaml",
    "tron_selfplay_ppo": "tron_selfplay_ppo.yaml",
    "pong_ppo": "pong_ppo.yaml",
}

CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from services.actor.rollout import Rollout
from services.common.models.nets import to_numpy
from services.common.stats import Metrics
from services.config import load_config
torch.set_num_threads(1)
cfg = load_config(sys.argv[2])
rollout = Rollout(cfg, "bench", 0, Metrics("actor"))
for policy in rollout.policies.values():
    policy.offer_weights(1, to_numpy(policy.net))
seconds = float(sys.argv[3])
try:
    for _ in range(3):   # warm up
        rollout.collect()
    start, steps0 = time.perf_counter(), rollout.env_steps
    while time.perf_counter() - start < seconds:
        rollout.collect()
    print(json.dumps({"steps_per_s": (rollout.env_steps - steps0) / (time.perf_counter() - start)}))
finally:
    rollout.close()
"""


def run_arm(source: Path, config: str, seconds: float) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(source), str(ROOT / "configs" / config), str(seconds)],
                         cwd=source, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["steps_per_s"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", required=True, help="the commit to compare with (e.g. the one before a change)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=8.0, help="stepping per arm and round")
    p.add_argument("--configs", default=",".join(CONFIGS), help="of " + ", ".join(CONFIGS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: {', '.join(unknown)} not among {', '.join(CONFIGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", str(ref), args.ref], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            runs: dict[str, dict[str, list[float]]] = {n: {"here": [], "ref": []} for n in names}
            for r in range(args.rounds):
                for n in names:
                    for arm, source in (("here", ROOT), ("ref", ref)) if r % 2 == 0 else (("ref", ref), ("here", ROOT)):
                        runs[n][arm].append(run_arm(source, CONFIGS[n], args.seconds))
                    print(f"round {r} {n}: here {runs[n]['here'][-1]:>9,.0f}/s  ref {runs[n]['ref'][-1]:>9,.0f}/s",
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref)], cwd=ROOT, check=False,
                           capture_output=True)
    result: dict = {"ref": args.ref, "rounds": args.rounds, "seconds": args.seconds, "configs": {}}
    for n in names:
        here, ref_rate = statistics.median(runs[n]["here"]), statistics.median(runs[n]["ref"])
        result["configs"][n] = {"here_steps_per_s": round(here), "ref_steps_per_s": round(ref_rate),
                                "ratio": round(here / ref_rate, 3), "here": [round(x) for x in runs[n]["here"]],
                                "ref": [round(x) for x in runs[n]["ref"]]}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
