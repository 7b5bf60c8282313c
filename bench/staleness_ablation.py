"""Staleness ablation on CartPole-v1, after TianJi's Fig. 6(d), through the whole stack (`kuberl up`).

DQN: a fresh sample ratio (1:1, every transition is trained on once on average: replay_ratio 1)
against a stale one (1:8: replay_ratio 8), with the actor at the same speed.
PPO: max policy lag 0, 1 and 4 with stale fragments dropped, and lag 4 with V-trace correction.

    .venv/bin/pip install -e .[bench]
    .venv/bin/python -m bench.staleness_ablation [--seconds-dqn 90] [--seconds-ppo 30] [--out docs/staleness]

Writes <out>.png (mean return of the last 100 episodes against wall time, one panel per algorithm),
<out>.json (every run's curve and counters) and prints a Markdown table. Runs one after another, so
every run has the machine to itself.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

import yaml

from bench.up import ROOT, up


def variants() -> list[tuple[str, str, dict]]:
    dqn = yaml.safe_load((ROOT / "configs" / "cartpole_dqn.yaml").read_text())
    ppo = yaml.safe_load((ROOT / "configs" / "cartpole_ppo.yaml").read_text())
    out = []
    for name, ratio in (("DQN fresh 1:1", 1.0), ("DQN stale 1:8", 8.0)):
        out.append(("dqn", name, {**dqn, "dqn": {**dqn["dqn"], "replay_ratio": ratio}}))
    for name, lag, mode in (("PPO lag 0", 0, "drop"), ("PPO lag 1", 1, "drop"), ("PPO lag 4", 4, "drop"),
                            ("PPO lag 4 + V-trace", 4, "correct")):
        out.append(("ppo", name, {**ppo, "ppo": {**ppo["ppo"], "max_policy_lag": lag, "stale_fragments": mode}}))
    return out


def run(config: dict, seconds: float, workdir: Path) -> dict:
    data = {**config, "run": {"target_return": None, "max_env_steps": 10**9, "max_seconds": seconds,
                              "poll_interval_s": 0.5}}
    run_dir = up(data, workdir)
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    curve = [(float(r["wall_s"]), float(r["return_mean"]), int(r["env_steps"])) for r in rows if r["return_mean"]]
    return {"curve": curve, "summary": json.loads((run_dir / "summary.json").read_text()),
            "last": rows[-1] if rows else {}}


def first_time(curve, level: float) -> float | None:
    return next((t for t, ret, _ in curve if ret >= level), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds-dqn", type=float, default=90.0)
    p.add_argument("--seconds-ppo", type=float, default=30.0)
    p.add_argument("--out", default=str(ROOT / "docs" / "staleness"))
    args = p.parse_args(argv)

    results = []
    for algo, name, config in variants():
        with tempfile.TemporaryDirectory() as tmp:
            r = run(config, args.seconds_dqn if algo == "dqn" else args.seconds_ppo, Path(tmp))
        r.update(algo=algo, name=name)
        results.append(r)
        final = r["curve"][-1][1] if r["curve"] else float("nan")
        print(f"{name:22s} final mean return {final:6.1f} after {r['summary']['wall_s']:.0f} s, "
              f"{r['summary']['env_steps']:,} env steps", flush=True)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, algo in zip(axes, ("dqn", "ppo")):
        for r in (r for r in results if r["algo"] == algo):
            ax.plot([t for t, _, _ in r["curve"]], [ret for _, ret, _ in r["curve"]], label=r["name"])
        ax.set_title(f"CartPole-v1, {algo.upper()} (kuberl up, 2 cores)")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("mean return, last 100 episodes")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(f"{args.out}.png", dpi=110)
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1))

    print("\n| run | time to 195 (s) | time to 475 (s) | final mean return | env steps | stale samples dropped "
          "| stale fragments corrected |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        t195, t475 = first_time(r["curve"], 195), first_time(r["curve"], 475)
        final = r["curve"][-1][1] if r["curve"] else float("nan")
        fmt = lambda t: "-" if t is None else f"{t:.1f}"  # noqa: E731
        last = r["summary"]["last_stats"]
        dropped = sum(int(s.get(f"{role}/samples_dropped_stale_total", 0)) for s in last.values()
                      for role in ("buffer", "learner"))
        corrected = int(last.get("learner-0", {}).get("learner/fragments_corrected_total", 0))
        print(f"| {r['name']} | {fmt(t195)} | {fmt(t475)} | {final:.1f} | {r['summary']['env_steps']:,} | "
              f"{dropped:,} | {corrected:,} |")
    print(f"\nplot: {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
