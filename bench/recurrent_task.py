"""Memory on a task that needs it (docs/recurrent.md): `kuberl up` with PPO's defaults on CartPole
with the velocities hidden (kuberl_envs:CartPoleNoVelocity-v1, 8 envs, one actor), feed-forward
against an LSTM and a GRU core (`ppo.recurrent`, nothing else changed), seeds interleaved in one
invocation. Per run: env steps until the mean return of 100 consecutive episodes first reached each
threshold, the best such mean within the budget, and the run's learner throughput.

    .venv/bin/python -m bench.recurrent_task --seeds 2 --steps 300000 --json docs/recurrent_task.json
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = "kuberl_envs:CartPoleNoVelocity-v1"
# arm -> ppo settings beside the defaults
ARMS = {"feed-forward": {}, "lstm": {"recurrent": "lstm"}, "gru": {"recurrent": "gru"},
        "lstm-separate-critic": {"recurrent": "lstm", "critic_core": "separate"}}
THRESHOLDS = (100, 200, 300, 400, 475)
WINDOW = 100


def run(ppo: dict, seed: int, steps: int, workdir: Path, name: str) -> dict:
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "algorithm": "ppo", "seed": seed, "env": {"id": ENV, "num_envs": 8}, "ppo": ppo,
        "topology": {"actors": 1}, "evaluation": {"after_training": False},
        "run": {"target_return": None, "max_env_steps": steps, "return_window": WINDOW}}))
    proc = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(workdir),
                           "--name", name, "--quiet"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: kuberl up exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(workdir / name / "episodes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    returns = [float(r["return"]) for r in rows]
    at = [float(r["env_steps"]) for r in rows]
    means = [(at[i - 1], sum(returns[i - WINDOW:i]) / WINDOW) for i in range(WINDOW, len(returns) + 1)]
    summary = json.loads((workdir / name / "summary.json").read_text())
    learner = summary["last_stats"].get("learner-0", {})
    return {"seed": seed, "env_steps": summary["env_steps"], "seconds": summary.get("seconds"),
            "best_mean": max((m for _, m in means), default=None),
            "steps_to": {str(t): next((s for s, m in means if m >= t), None) for t in THRESHOLDS},
            "samples_lost": summary["samples_lost"]["total"],
            "learner_samples_total": learner.get("learner/samples_total")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=300_000)
    p.add_argument("--arms", default="feed-forward,lstm,gru", help=f"comma-separated, from: {', '.join(ARMS)}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    result: dict = {"env": ENV, "steps": args.steps, "window": WINDOW, "arms": {arm: [] for arm in arms}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for arm in arms:
                r = run(ARMS[arm], seed, args.steps, Path(tmp), f"{arm}-{seed}")
                result["arms"][arm].append(r)
                print(f"seed {seed} {arm:>12}: best mean {r['best_mean']:.1f}, steps to "
                      + ", ".join(f"{t}: {s if s is None else f'{s:,.0f}'}" for t, s in r["steps_to"].items()),
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
