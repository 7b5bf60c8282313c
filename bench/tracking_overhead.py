"""What the tracking sinks cost (docs/tracking.md): the same CartPole PPO `kuberl up` run (two actors,
the planner off) with no sink,
with Weights & Biases (offline) and with MLflow (SQLite), alternated over rounds in one invocation;
env steps per second in steady state per arm (metrics.csv, from a fifth of the budget to the end:
a sink's own start-up is not in it), and each sink's ratio to no sink measured in the same rounds.

    .venv/bin/python -m bench.tracking_overhead --rounds 3 --steps 100000 --json docs/tracking_overhead.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("none", "wandb", "mlflow")


def run(arm: str, steps: int, workdir: Path, i: int) -> dict:
    tracking = {"artifacts": False}
    if arm == "wandb":
        tracking["wandb"] = {"enabled": True, "mode": "offline", "project": "kuberl-bench"}
    if arm == "mlflow":
        tracking["mlflow"] = {"enabled": True, "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}"}
    config = workdir / f"{arm}-{i}.yaml"
    config.write_text(yaml.safe_dump({
        # A fixed topology: the planner's scale-ups would land at different moments in different runs.
        "planner": {"enabled": False}, "topology": {"actors": 2},
        "run": {"target_return": None, "max_env_steps": steps, "run_dir": str(workdir)},
        "evaluation": {"after_training": False}, "tracking": tracking}))
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(config), "--name", f"{arm}-{i}",
                           "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    summary = json.loads((workdir / f"{arm}-{i}" / "summary.json").read_text())
    if done.returncode != 0 or summary.get("tracking", {}).get("errors"):
        raise SystemExit(f"{arm} run {i} failed: {done.stderr[-2000:]} {summary.get('tracking')}")
    # Steady state: from the first progress row past a fifth of the budget to the last one, so that
    # start-up (processes, and a sink's own start while the actors already step) is not in the rate.
    with open(workdir / f"{arm}-{i}" / "metrics.csv") as f:
        rows = [(float(r["wall_s"]), float(r["env_steps"])) for r in csv.DictReader(f)]
    (t0, s0), (t1, s1) = next(r for r in rows if r[1] >= steps / 5), rows[-1]
    return {"arm": arm, "round": i, "env_steps": summary["env_steps"], "wall_s": summary["wall_s"],
            "env_steps_per_s": (s1 - s0) / (t1 - t0), "episodes": summary["episodes_read"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kuberl-tracking-bench-") as tmp:
        for i in range(args.rounds):
            order = ARMS if i % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                r = run(arm, args.steps, Path(tmp), i)
                runs.append(r)
                print(f"round {i} {arm:6}: {r['env_steps_per_s']:8.0f} env steps/s ({r['env_steps']:,} in {r['wall_s']:.1f} s, "
                      f"{r['episodes']:,} episodes)", flush=True)
    out = {"rounds": args.rounds, "steps": args.steps, "runs": runs, "median_env_steps_per_s": {}, "ratio_to_none": {}}
    for arm in ARMS:
        out["median_env_steps_per_s"][arm] = statistics.median(r["env_steps_per_s"] for r in runs if r["arm"] == arm)
    for arm in ARMS[1:]:
        ratios = [a["env_steps_per_s"] / b["env_steps_per_s"] for a in runs if a["arm"] == arm
                  for b in runs if b["arm"] == "none" and b["round"] == a["round"]]
        out["ratio_to_none"][arm] = {"median": statistics.median(ratios), "per_round": ratios}
        print(f"{arm}: {statistics.median(ratios):.3f}x no sink's env steps/s (per round: "
              + ", ".join(f"{x:.3f}" for x in ratios) + ")")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
