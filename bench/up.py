"""One `kuberl up` run for the benchmarks: the config written into `workdir`, the launcher in a fresh
interpreter (quiet), and the run directory returned for the caller to read (summary.json, metrics.csv,
episodes.csv)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def up(config: dict, workdir: Path, *, check: bool = True) -> Path:
    """Run `kuberl up` on `config` to its end. `check`: a non-zero exit raises CalledProcessError;
    otherwise only a run that wrote no summary.json raises (RuntimeError, with the launcher's stderr),
    so a run that ended "failed" can still be read."""
    path = workdir / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(workdir),
                           "--name", "run", "--quiet"], cwd=ROOT, check=check, capture_output=True, text=True)
    run = workdir / "run"
    if not (run / "summary.json").exists():
        raise RuntimeError(f"kuberl up wrote no summary ({proc.returncode}): {proc.stderr[-2000:]}")
    return run
