"""The planner on and off, from the same imbalanced start: CartPole-v1 DQN with one actor capped at
`--actor-rate` env steps/s (configs/cartpole_dqn.yaml otherwise), run through `kuberl up` twice in
one invocation: `planner.enabled: false` (the topology stays at one actor) and `true` (the planner's
local backend adds or removes actor processes).

    .venv/bin/python -m bench.planner_balance [--seeds 3] [--target 195] [--max-seconds 300] [--json docs/planner.json]

Reports for both: wall time to the target mean return (training only, from when every service
served), env steps, learner samples/s and the achieved replay ratio (buffer samples served per sample
inserted) over the run, the final actor count, and the planner's applied decisions. The ratio printed
last is the median over seeds of time(off) / time(on): above 1 means the planner got there faster. A run that does not reach the
target by --max-seconds reports its budget, and the ratio is then a lower bound.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from bench.up import ROOT, up


def run(config: dict, planner: bool, workdir: Path) -> dict:
    data = {**config, "planner": {**config.get("planner", {}), "enabled": planner}}
    run_dir = up(data, workdir)
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))

    def series(key):
        return [float(r[key]) for r in rows if r[key] not in ("", "None")]

    smp = series("learner_samples_per_s")
    spi = series("buffer_samples_per_insert")
    decisions = [{"reason": d["reason"], "trigger": d["trigger"],
                  "actors": [r["current"] for r in d["roles"] if r["role"] == "actor"] +
                            [r["target"] for r in d["roles"] if r["role"] == "actor"]}
                 for d in summary["decisions"]]
    return {"planner": planner, "reached": summary["reason"] == "target_return", "seconds": summary["wall_s"],
            "env_steps": summary["env_steps"], "mean_return": summary["mean_return"],
            "learner_samples_per_s": statistics.mean(smp) if smp else None,
            "replay_ratio": spi[-1] if spi else None,
            "actors_final": int(series("actors")[-1]) if series("actors") else None,
            "decisions": decisions}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "cartpole_dqn.yaml"))
    p.add_argument("--target", type=float, default=195.0)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--actor-rate", type=float, default=150.0, help="env steps/s cap per actor (default 150)")
    p.add_argument("--max-actors", type=int, default=6)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1; the ratio reported is their median")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    raw = yaml.safe_load(Path(args.config).read_text())
    per_seed = []
    for seed in range(args.seeds):
        config = {**raw, "seed": seed, "env": {**raw.get("env", {}), "seed": seed},
                  "topology": {"actors": 1},
                  "actor": {**raw.get("actor", {}), "max_env_steps_per_s": args.actor_rate},
                  "run": {**raw.get("run", {}), "target_return": args.target, "return_window": args.window,
                          "max_seconds": args.max_seconds, "max_env_steps": 10_000_000, "poll_interval_s": 1.0},
                  "planner": {"interval_s": 2, "warmup_s": 4, "cooldown_s": 8, "scale_down_window_s": 60,
                              "tolerance": 0.2, "actor": {"max": args.max_actors}}}
        results = []
        for planner in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                r = run(config, planner, Path(tmp))
            results.append(r)
            print(f"seed {seed} planner {'on ' if planner else 'off'}: {'reached' if r['reached'] else 'NOT reached'} "
                  f"{args.target:g} in {r['seconds']:6.1f} s, {r['env_steps']:>8,} env steps, learner "
                  f"{r['learner_samples_per_s'] or 0:,.0f} samples/s, replay ratio {r['replay_ratio'] or 0:.1f} "
                  f"(target {raw['dqn']['replay_ratio']:g}), {r['actors_final']} actors at the end", flush=True)
            for d in r["decisions"]:
                print(f"    {d['trigger']}: actors {d['actors'][0]}->{d['actors'][1]}: {d['reason']}", flush=True)
        off, on = results
        per_seed.append({"seed": seed, "off": off, "on": on, "ratio": off["seconds"] / on["seconds"],
                         "samples_ratio": (on["learner_samples_per_s"] or 0) / max(off["learner_samples_per_s"] or 0, 1e-9),
                         "both_reached": off["reached"] and on["reached"]})
    ratio = statistics.median(r["ratio"] for r in per_seed)
    samples = statistics.median(r["samples_ratio"] for r in per_seed)
    note = "" if all(r["both_reached"] for r in per_seed) else " (some runs did not reach the target: see above)"
    print(f"\nmedian over {args.seeds} seed(s): time to {args.target:g} planner off / planner on = {ratio:.2f}{note}; "
          f"learner samples/s on / off = {samples:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "seeds": per_seed, "ratio": ratio,
                                               "samples_ratio": samples}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
