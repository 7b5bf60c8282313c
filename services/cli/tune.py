"""`kuberl tune CONFIG`: a hyper-parameter search with Optuna (docs/tuning.md).

CONFIG's `tune` section names the search space (dotted config keys and their ranges), the number of
trials, how many run at once, the metric and the pruner. Each trial is a whole `kuberl up` run of
CONFIG with the trial's values, in `<run.run_dir>/tune/<study>/trial-<n>/`. While it trains, its
episodes (episodes.csv) give the running mean return over `run.return_window` episodes, reported to
the pruner every `tune.report_every_steps` env steps; a trial the pruner stops is interrupted (Ctrl-C:
its processes stop cleanly) and recorded as pruned. A trial whose run fails, or ends with no
episodes, is recorded as failed, and the study goes on. The study is kept in an Optuna storage
(SQLite beside the trials by default), so running the command again adds trials to the same study.
At the end the best trial's config is written to `best.yaml` and a table of every trial is printed.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import logging
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.config import ConfigError, ExperimentConfig, config_from_dict, dump_config, load_config

log = logging.getLogger("kuberl.tune")
POLL_S = 0.5
STOP_TIMEOUT_S = 180.0   # a pruned trial's `kuberl up` stops every process cleanly within this


def check_space(cfg: ExperimentConfig) -> None:
    """ConfigError naming `tune.space.<key>` unless every key is a setting of the config (a scalar leaf)."""
    data = cfg.to_dict()
    if not cfg.tune.space:
        raise ConfigError("tune.space", "is empty: name at least one setting to search (docs/tuning.md)")
    for key in cfg.tune.space:
        node: Any = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"tune.space.{key}", "is not a setting of this config (a dotted key such as "
                                                       f"{cfg.algorithm}.learning_rate)")
            node = node[part]
        if isinstance(node, (dict, list)) or key.startswith("tune."):
            raise ConfigError(f"tune.space.{key}", "is not a single setting (a number, a string or a flag)")


def with_values(base: dict, values: dict[str, Any]) -> dict:
    """`base` (plain config data) with each dotted key of `values` set."""
    out = copy.deepcopy(base)
    for key, value in values.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def suggest(trial, space) -> dict[str, Any]:
    """The trial's value for every key of the space (Optuna's suggest_* per its type)."""
    out: dict[str, Any] = {}
    for key, p in space.items():
        if p.type == "categorical":
            out[key] = trial.suggest_categorical(key, list(p.choices))
        elif p.type == "int":
            out[key] = trial.suggest_int(key, int(p.low), int(p.high), log=p.log)
        else:
            out[key] = trial.suggest_float(key, p.low, p.high, log=p.log)
    return out


@dataclass
class Running:
    """One trial's `kuberl up` process, and what has been read of its episodes."""
    trial: Any                      # optuna.trial.Trial
    values: dict[str, Any]
    dir: Path
    proc: subprocess.Popen[bytes]
    log: Any                        # the run's stdout and stderr, open while it runs
    started: float
    window: int
    every: int
    next_report: int
    returns: deque[float] = field(default_factory=deque)
    env_steps: int = 0
    read: int = 0                   # bytes of episodes.csv read
    pruned: bool = False

    def follow(self) -> list[tuple[int, float]]:
        """Read new episodes; the (env steps, running mean return) at each report point passed since."""
        path = self.dir / "episodes.csv"
        try:
            with open(path, newline="") as f:
                f.seek(self.read)
                data = f.read()
        except OSError:
            return []
        end = data.rfind("\n") + 1   # a row still being written waits for the next read
        self.read += len(data[:end].encode())
        points = []
        for row in csv.reader(data[:end].splitlines()):
            if not row or row[0] == "wall_s":
                continue
            steps, ret = int(row[1]), float(row[2])
            while steps >= self.next_report and self.returns:
                points.append((self.next_report, sum(self.returns) / len(self.returns)))
                self.next_report += self.every
            self.returns.append(ret)
            if len(self.returns) > self.window:
                self.returns.popleft()
            self.env_steps = steps
        return points


def _objective(cfg: ExperimentConfig, summary: dict) -> float | None:
    if cfg.tune.metric == "evaluation":
        evaluation = summary.get("evaluation") or {}
        return (evaluation.get("return") or {}).get("mean")
    value = summary.get("mean_return")
    return None if value is None else float(value)


def run_study(config_path: str | Path, *, trials: int | None = None, parallel: int | None = None,
              enqueue: Sequence[dict[str, Any]] = (), out=print) -> dict:
    """Run the study of CONFIG's `tune` section (`trials`, `parallel` override it); `enqueue`: values to
    try first (Optuna's enqueue_trial). Returns a summary: the study, its storage, every trial of this
    invocation and the best one. ConfigError when the config or its space is wrong."""
    import optuna
    from optuna.trial import TrialState

    cfg = load_config(config_path)
    check_space(cfg)
    t = cfg.tune
    trials = trials or t.trials
    parallel = parallel or t.parallel
    study_name = t.study or f"{cfg.algorithm}-{cfg.env.id}".replace("/", "-")
    root = (Path(cfg.run.run_dir) / "tune" / study_name).resolve()
    root.mkdir(parents=True, exist_ok=True)
    storage = t.storage or f"sqlite:///{root / (study_name + '.db')}"
    sampler = (optuna.samplers.TPESampler(seed=t.seed) if t.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=t.seed))
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=t.prune_after_trials, n_warmup_steps=t.prune_after_steps)
              if t.pruner == "median" else optuna.pruners.NopPruner())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner,
                                direction="maximize", load_if_exists=True)
    for values in enqueue:
        study.enqueue_trial(values)
    base = cfg.to_dict()
    base.pop("tune")
    every = t.report_every_steps or max(1, cfg.run.max_env_steps // 20)
    out(f"study {study_name} ({storage}): {trials} trials, {parallel} at once, maximising the "
        f"{'final evaluation' if t.metric == 'evaluation' else f'training return over {cfg.run.return_window} episodes'}"
        f"; trials in {root}")

    started, running, done = 0, [], []
    try:
        while started < trials or running:
            while started < trials and len(running) < parallel:
                running.append(_start(study, t, base, root, every, cfg.run.return_window))
                started += 1
            time.sleep(POLL_S)
            for r in list(running):
                for step, value in r.follow():
                    r.trial.report(value, step)
                    if not r.pruned and r.trial.should_prune():
                        r.pruned = True
                        out(f"trial {r.trial.number}: pruned at {step:,} env steps (return {value:.1f})")
                        r.proc.send_signal(signal.SIGINT)
                if r.proc.poll() is None:
                    continue
                running.remove(r)
                done.append(_finish(study, cfg, r, TrialState, out))
    except KeyboardInterrupt:
        out("interrupted: stopping the running trials")
        for r in running:
            r.proc.send_signal(signal.SIGINT)
        for r in running:
            _wait(r.proc)
            r.log.close()
            study.tell(r.trial, state=TrialState.FAIL)
        raise
    best = None
    try:
        best = study.best_trial
    except ValueError:   # no trial completed
        pass
    summary = {"study": study_name, "storage": storage, "dir": str(root), "trials": done,
               "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params}}
    out(table(done))
    if best is not None:
        path = root / "best.yaml"
        dump_config(config_from_dict(with_values(base, best.params)), path)
        summary["best"]["config"] = str(path)
        out(f"best: trial {best.number}, {best.value:.2f} ({_fmt_params(best.params)}); its config: {path}")
    else:
        out("no trial completed: no best config")
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _start(study, t, base: dict, root: Path, every: int, window: int) -> Running:
    trial = study.ask()
    values = suggest(trial, t.space)
    path = root / f"trial-{trial.number}"
    path.mkdir(parents=True, exist_ok=True)
    data = with_values(base, values)
    data.setdefault("run", {})["run_dir"] = str(root)
    config = path.parent / f"trial-{trial.number}.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    # The planner's default API port goes to whichever run claims it first; the others take a free one.
    log_file = open(root / f"trial-{trial.number}.log", "wb")  # noqa: SIM115 (closed when the trial ends)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(root),
                             "--name", path.name, "--quiet"], stdout=log_file, stderr=subprocess.STDOUT)
    return Running(trial, values, path, proc, log_file, time.monotonic(), window, every, every)


def _wait(proc: subprocess.Popen[bytes]) -> int | None:
    try:
        return proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _finish(study, cfg: ExperimentConfig, r: Running, TrialState, out) -> dict:
    code = _wait(r.proc)
    r.log.close()
    seconds = round(time.monotonic() - r.started, 1)
    try:
        summary = json.loads((r.dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    row = {"number": r.trial.number, "params": r.values, "env_steps": summary.get("env_steps", r.env_steps),
           "seconds": seconds, "value": None, "state": "", "run_dir": str(r.dir)}
    if r.pruned:
        study.tell(r.trial, state=TrialState.PRUNED)
        row["state"] = "pruned"
        return row
    value = _objective(cfg, summary) if code == 0 and summary.get("reason") != "failed" else None
    if value is None:
        why = ((summary.get("error") or f"kuberl up exited with code {code}: {_last_line(r.log.name)}")
               if code != 0 or not summary else f"no {cfg.tune.metric} to judge it by (no episode finished)")
        study.tell(r.trial, state=TrialState.FAIL)
        row.update(state="failed", error=why)
        out(f"trial {r.trial.number}: failed: {why} (log: {r.dir.parent / f'trial-{r.trial.number}.log'})")
        return row
    study.tell(r.trial, value)
    row.update(state="complete", value=value)
    out(f"trial {r.trial.number}: {value:.2f} after {row['env_steps']:,} env steps, {seconds:.0f} s "
        f"({_fmt_params(r.values)})")
    return row


def _last_line(path: str) -> str:
    try:
        lines = [s for s in Path(path).read_text(errors="replace").splitlines() if s.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][-300:] if lines else "(empty log)"


def _fmt_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def table(rows: list[dict]) -> str:
    """The trials of this invocation, best first (then pruned, then failed)."""
    order = {"complete": 0, "pruned": 1, "failed": 2}
    rows = sorted(rows, key=lambda r: (order.get(r["state"], 3), -(r["value"] or 0.0), r["number"]))
    lines = [f"{'trial':>5}  {'state':<9} {'value':>9} {'env steps':>10} {'seconds':>8}  params"]
    for r in rows:
        value = f"{r['value']:.2f}" if r["value"] is not None else "-"
        lines.append(f"{r['number']:>5}  {r['state']:<9} {value:>9} {r['env_steps']:>10,} {r['seconds']:>8.0f}  "
                     f"{_fmt_params(r['params'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kuberl tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="experiment YAML with a `tune` section (its search space)")
    p.add_argument("--trials", type=int, default=None, help="trials to run now (default: tune.trials)")
    p.add_argument("--parallel", type=int, default=None, help="trials at once (default: tune.parallel)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s tune: %(message)s")
    try:
        import optuna  # noqa: F401
    except ImportError:
        print("kuberl tune: needs Optuna: pip install 'kuberl[tune]'", file=sys.stderr)
        return 2
    for flag, value in (("--trials", args.trials), ("--parallel", args.parallel)):
        if value is not None and value < 1:
            print(f"kuberl tune: {flag} {value}: must be >= 1", file=sys.stderr)
            return 2
    try:
        summary = run_study(args.config, trials=args.trials, parallel=args.parallel, out=lambda s: print(s, flush=True))
    except (ConfigError, OSError) as err:
        print(f"kuberl tune: {args.config}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0 if summary["best"] is not None else 1

