"""A learning curve from one `kuberl up` run: episode return against env frames and wall time, as
JSON and PNG (e.g. Pong, issue "Pong learned, and measured").

    .venv/bin/python -m bench.learning_curve --config configs/pong_ppo.yaml --max-seconds 3600 \
        --out docs/pong_ppo_curve

runs the config until its target return, its step budget or `--max-seconds` (whichever first), then
reads the run directory's episodes.csv (one row per episode) and writes OUT.json (every episode,
the mean of the last `run.return_window` after each, the summary and the machine) and OUT.png (both
axes). Env frames are env steps times the Atari frameskip (1 for other envs), the unit of the Atari
literature (CleanRL's ppo_atari_envpool: about 10M frames to ~20 on Pong). `--run-dir` keeps the run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def read_episodes(run: Path, window: int) -> list[dict]:
    """episodes.csv of a run, with the windowed mean return after each episode."""
    with open(run / "episodes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    recent: deque[float] = deque(maxlen=window)
    out = []
    for r in rows:
        recent.append(float(r["return"]))
        out.append({"wall_s": float(r["wall_s"]), "env_steps": int(r["env_steps"]), "return": float(r["return"]),
                    "length": int(r["length"]), "policy_version": int(r["policy_version"]),
                    "mean_return": sum(recent) / len(recent)})
    return out


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def plot(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = curve["episodes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, label in ((axes[0], "frames", "env frames"), (axes[1], "wall_s", "wall time (s)")):
        x = [e[key] for e in eps]
        ax.plot(x, [e["return"] for e in eps], ".", ms=3, alpha=0.35, label="episode return")
        ax.plot(x, [e["mean_return"] for e in eps], "-", lw=2, label=f"mean of last {curve['return_window']}")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("return")
    axes[0].legend(loc="lower right")
    fig.suptitle(f"{curve['algorithm']} on {curve['env']} ({curve['device']}): {curve['summary']['reason']} "
                 f"after {curve['summary']['env_steps'] * curve['frameskip']:,} frames")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--max-seconds", type=float, default=None, help="stop the run after this much wall time")
    p.add_argument("--out", required=True, help="path prefix of the .json and .png written")
    p.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    args = p.parse_args(argv)

    from services.common.config import is_atari
    from services.config import config_from_dict

    raw = yaml.safe_load(Path(args.config).read_text())
    if args.max_seconds is not None:
        raw = {**raw, "run": {**raw.get("run", {}), "max_seconds": args.max_seconds}}
    cfg = config_from_dict(raw)  # refuses a bad config before anything starts
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.run_dir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        path = root / "curve.yaml"
        path.write_text(yaml.safe_dump(raw))
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(root),
                               "--name", "run"], cwd=ROOT)
        run = root / "run"
        summary = json.loads((run / "summary.json").read_text())
        episodes = read_episodes(run, cfg.run.return_window)
    from services.common.models.nets import resolve_device

    device = resolve_device(cfg.learner.device).type  # what the run's learner, on this machine, resolved
    frameskip = cfg.env.atari.frameskip if is_atari(cfg.env.id) else 1
    for e in episodes:
        e["frames"] = e["env_steps"] * frameskip
    curve = {"config": args.config, "algorithm": cfg.algorithm, "env": cfg.env.id, "frameskip": frameskip,
             "return_window": cfg.run.return_window, "target_return": cfg.run.target_return,
             "max_seconds": args.max_seconds, "seconds_from_launch": round(time.monotonic() - started, 1),
             "date": time.strftime("%Y-%m-%d"), "device": device, "machine": machine(),
             "summary": {k: summary[k] for k in ("reason", "env_steps", "episodes", "mean_return", "wall_s",
                                                 "samples_lost", "policy_version", "exit_codes")},
             "episodes": episodes}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(curve, indent=1) + "\n")
    plot(curve, out.with_suffix(".png"))
    full = episodes[cfg.run.return_window - 1:]  # where the window holds return_window episodes
    best = max((e["mean_return"] for e in full), default=None)
    print(f"{summary['reason']}: {summary['env_steps'] * frameskip:,} frames, {len(episodes):,} episodes, "
          f"best mean of {cfg.run.return_window} {best}, {summary['wall_s']:.0f} s; wrote {out.with_suffix('.json')} and "
          f"{out.with_suffix('.png')}", flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
