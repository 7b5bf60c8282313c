"""`kuberl up [CONFIG]`: a whole training run on this machine, every role a local process.

Starts the buffer shards and the planner on free loopback ports; the planner's local backend starts the
learners and `topology.actors` actors and rescales them as it measures their rates (with
`planner.enabled: false`, `kuberl up` starts a fixed topology itself); services/cli/fleet.py holds the
processes. It polls every process's stats, shows progress and
the planner's decisions, and stops at the target return, the step budget or Ctrl-C. The run directory
holds the resolved config, metrics.csv (one row per poll), episodes.csv (one row per finished episode:
the learning curve), TensorBoard scalars (tb/), checkpoints/, one log per process (logs/), the
planner's decisions.jsonl, summary.json, and prometheus-targets.json (every process's metrics endpoint,
for a Prometheus's file_sd_configs). When training ends (target return, step or time budget), the
final checkpoint is evaluated deterministically (config `evaluation`, `kuberl eval`) and the result goes
into summary.json as `evaluation`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import re
import signal
import sys
import time
from pathlib import Path

import grpc

from kuberl.v1 import common_pb2 as pb
from services.cli.fleet import PLANNER_PORT, Fleet, Member, check_ports
from services.cli.progress import CSV_COLUMNS, EPISODE_COLUMNS, HeldShare, progress_line
from services.cli.tally import Tally, fmt_losses, fmt_return
from services.cli.tracking import Tracker
from services.config import ConfigError, ExperimentConfig, check_algorithm_takes, dump_config, load_config
from services.common.net.tokens import AuthError
from services.common.service.runtime import add_tls_arguments, with_tls_flags
from services.common.net.shards import combined_samples_per_insert
from services.common.net.tls import TlsError, check_role

log = logging.getLogger("kuberl.up")
SELFPLAY_COLUMNS = ["selfplay_elo", "selfplay_win_rate", "selfplay_random_win_rate"]   # (selfplay.enabled: the actors' mean)


def selfplay_columns(cfg: ExperimentConfig) -> list[str]:
    """metrics.csv's self-play columns (none without self-play): SELFPLAY_COLUMNS, then the win rate
    against each fixed player (selfplay.fixed_players); in a league, each policy's, as policies/<name>/..."""
    if not cfg.selfplay.enabled:
        return []
    columns = SELFPLAY_COLUMNS + [f"selfplay_fixed/{name}_win_rate" for name in cfg.selfplay.fixed_players]
    if len(cfg.policy_names) > 1:   # a league (services/actor/league.py): each policy's, under its name
        return [f"policies/{name}/{column}" for name in cfg.policy_names for column in columns]
    return columns


def policy_columns(cfg: ExperimentConfig) -> list[str]:
    """metrics.csv's columns of a run of several policies: each one's mean return and version."""
    return [f"{column}_{name}" for name in cfg.policies for column in ("return_mean", "policy_version")]


def _new_dir(root: Path, name: str) -> Path:
    """`root/name`, or `root/name-2`, `-3`... if taken: runs started in the same second never share a
    directory (their logs, ready files and checkpoints would mix)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        path = root / (name if i == 1 else f"{name}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory name like {root / name}")


class LocalRun:
    """A run on this machine: its processes (a Fleet, services/cli/fleet.py) polled for progress,
    run totals, the CSVs and TensorBoard, the stop condition and the summary."""

    def __init__(self, cfg: ExperimentConfig, fleet: Fleet, progress: bool = True):
        self.cfg, self.fleet, self.dir, self.progress = cfg, fleet, fleet.dir, progress
        self.tally = Tally(cfg.run.return_window)  # run totals across processes and their restarts
        self.returns = self.tally.returns
        self.episodes = 0
        self.env_steps = 0
        self.started = time.monotonic()
        self.held = HeldShare()
        self.tb = None
        self.tracker: Tracker | None = None   # W&B / MLflow (config `tracking`), while `run` runs
        self.episode_rows: csv.writer | None = None  # episodes.csv, while `run` has it open
        self.training = False   # `run` is training (not stopping, evaluating or done): a SIGTERM stops it

    @classmethod
    def create(cls, cfg: ExperimentConfig, root: str | Path, name: str | None = None, progress: bool = True,
               actor_port: int = 50053, planner_port: int | None = None) -> LocalRun:
        """A new run directory under `root` (named `name`, or by time, algorithm and env) holding the
        resolved config, and the run's processes (not started yet)."""
        check_ports(cfg, actor_port, planner_port)
        env = re.sub(r"[^A-Za-z0-9]+", "-", cfg.env.id).strip("-").lower()
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.algorithm}-{env}"
        path = Path(root) / name if name else _new_dir(Path(root), stamp)
        for sub in ("logs", "checkpoints", "tb", "ready"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, path / "config.yaml")
        return cls(cfg, Fleet(cfg, path, actor_port, planner_port), progress)

    def poll(self) -> None:
        """Read every process's stats and every episode finished since the last poll (page by page),
        and update the run totals: summed over all processes the run had, across their restarts
        (services/cli/tally.py)."""
        if self.fleet.planned:
            self.fleet.sync_planned()
        new_eps: list[pb.Episode] = []
        for p in self.fleet.members:
            if p.stub is None:  # not connected yet
                continue

            def fetch(after: int, p: Member = p) -> pb.GetStatsResponse:
                return p.stub.GetStats(pb.GetStatsRequest(episodes_after=after), timeout=5.0)
            try:
                resp = self.tally.read(p.name, fetch, new_eps)
            except grpc.RpcError as err:
                log.debug("stats from %s failed: %s", p.name, err.code().name)
                # Nothing vouches for a silent process's production: its rates count as 0.
                p.stats = {k: 0.0 if k.endswith("_per_s") else v for k, v in p.stats.items()}
                continue
            p.stats = dict(resp.metrics)
        self.env_steps = int(self.tally.total("actor/env_steps_total"))
        self.episodes = int(self.tally.total("actor/episodes_total"))  # exact, whether or not every return was read
        wall = round(time.monotonic() - self.started, 3)
        finished = self.tally.record(new_eps)
        for ep in finished:
            self.tb.add_scalar("charts/episodic_return", ep.episode_return, self.env_steps)
            if ep.policy:   # (a run of several policies: each its own curve too)
                self.tb.add_scalar(f"charts/episodic_return/{ep.policy}", ep.episode_return, self.env_steps)
            self.tb.add_scalar("charts/episodic_length", ep.length, self.env_steps)
            if self.episode_rows is not None:  # env_steps and wall_s: the run's when the episode was read
                self.episode_rows.writerow([wall, self.env_steps, ep.episode_return, ep.length, ep.policy_version,
                                            *([ep.policy] if self.cfg.several_policies else [])])
        if self.tracker is not None and finished:
            self.tracker.episodes([(ep.episode_return, ep.length) for ep in finished], self.env_steps)

    def _sum(self, role: str, name: str) -> float:
        return float(sum(p.stats.get(name, 0.0) for p in self.fleet.role(role)))

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def row(self) -> dict:
        # (Several policies: no one learner speaks for the run; each policy's version has its own column.)
        learner = self.fleet.role("learner")[0].stats if self.fleet.role("learner") and not self.cfg.several_policies \
            else {}
        buffers = [m.stats for m in self.fleet.role("buffer")]
        buffer = buffers[0] if buffers else {}
        planner = self.fleet.role("planner")[0].stats if self.fleet.role("planner") else {}
        tally = self.tally
        losses = tally.losses()
        return {
            "wall_s": round(time.monotonic() - self.started, 3), "env_steps": self.env_steps,
            "episodes": self.episodes, "episodes_skipped": tally.episodes_skipped, "return_mean": self.mean_return,
            "actor_env_steps_per_s": self._sum("actor", "actor/env_steps_per_s"),
            "actor_fragments_dropped_total": tally.total("actor/fragments_dropped_total"),
            "actor_fragments_rejected_total": tally.total("actor/fragments_rejected_total"),
            "samples_lost_total": sum(losses.values()),
            **{f"samples_lost_{r}": v for r, v in losses.items()},
            "buffer_size_samples": self._sum("buffer", "buffer/size_samples") if buffers else None,
            "buffer_samples_per_insert": combined_samples_per_insert(buffers),
            "learner_updates_per_s": learner.get("learner/updates_per_s"),
            "learner_samples_per_s": self._sum("learner", "learner/samples_per_s") if self.fleet.role("learner") else None,
            "learner_policy_version": learner.get("learner/policy_version"),
            "learner_policy_lag_mean": learner.get("learner/policy_lag_mean"),
            "replay_ratio_target": buffer.get("buffer/replay_ratio_target"),
            "actors_held_share": self.held.update(time.monotonic(), self.tally.total("actor/pace_wait_seconds_total"),
                                                  len(self.fleet.role("actor"))),
            "actors": len(self.fleet.role("actor")),
            "learners": len(self.fleet.role("learner")),
            "planner_ratio": planner.get("planner/production_consumption_ratio"),
            "process_restarts": sum(self.fleet.restarts.values()),
            **(self._selfplay() if self.cfg.selfplay.enabled else {}),
            **self._policies(),
        }

    def _policies(self) -> dict[str, float | None]:
        """A run of several policies: each one's mean return (its agents' last episodes) and version."""
        return {f"{column}_{name}": value for name, p in self.policies_summary().items()
                for column, value in (("return_mean", p["mean_return"]), ("policy_version", p["policy_version"]))}

    def _selfplay(self) -> dict:
        """Self-play's Elo and win rate against the pool (and against the random player and each fixed
        player), each the mean over the actors reporting it."""
        out: dict = {}
        for key in selfplay_columns(self.cfg):
            name = "actor/" + key
            values = [a.stats[name] for a in self.fleet.role("actor") if name in a.stats]
            out[key] = sum(values) / len(values) if values else None
        return out

    def _final_stats(self, role: str) -> None:
        """Read `role`'s counters once more, into the run totals too (they are final now)."""
        for m in self.fleet.role(role):
            try:
                resp = m.stub.GetStats(pb.GetStatsRequest(episodes_after=self.tally.cursor(m.name)), timeout=5.0)
                m.stats = dict(resp.metrics)
                self.tally.observe_response(m.name, resp)
            except (grpc.RpcError, AttributeError) as err:  # AttributeError: never connected
                log.warning("final stats of %s could not be read: %s", m.name, err)

    def stop_reason(self) -> str | None:
        run = self.cfg.run
        if self.policy_targets:   # every policy with a target, over its own agents' last episodes
            summary = self.policies_summary(versions=False)
            if all(summary[name]["return_window"] == run.return_window and summary[name]["mean_return"] >= target
                   for name, target in self.policy_targets.items()):
                return "target_return"
        elif (run.target_return is not None and len(self.returns) == run.return_window
                and self.mean_return >= run.target_return):
            return "target_return"
        if self.env_steps >= run.max_env_steps:
            return "max_env_steps"
        if run.max_seconds is not None and time.monotonic() - self.started >= run.max_seconds:
            return "max_seconds"
        return None

    @property
    def policy_targets(self) -> dict[str, float]:
        """Each policy's return target (config `policies.<name>.target_return`), of those that have one:
        where any has, these are the run's, in place of run.target_return."""
        return {name: p.target_return for name, p in self.cfg.policies.items() if p.target_return is not None}

    def policies_summary(self, versions: bool = True) -> dict[str, dict]:
        """A run of several policies: each policy's mean return over its agents' last `run.return_window`
        episodes, its target (null: none) and version (as its rank-0 learner last said)."""
        last = {name: stats for name, (role, stats) in self.fleet.last_stats().items() if role == "learner"} \
            if versions else {}
        out = {}
        for name, policy in self.cfg.policies.items():
            returns = self.tally.policy_returns.get(name, ())
            out[name] = {"policy_version": last.get(f"learner-{name}-0", {}).get("learner/policy_version"),
                         "mean_return": sum(returns) / len(returns) if returns else None, "return_window": len(returns),
                         "target_return": policy.target_return}
        return out

    def evaluate(self, reason: str) -> dict | None:
        """The final checkpoint's deterministic evaluation (config `evaluation`, services/cli/evaluate.py),
        printed and returned for summary.json; None when it is off or training did not end normally
        (interrupted, terminated or failed: no one waits for it then)."""
        if not self.cfg.evaluation.after_training or reason in ("interrupted", "terminated", "failed"):
            return None
        if self.cfg.env.mode == "external":  # (evaluate_after_training skips it too)
            print("not evaluated: the env is the external simulators' (env.mode: external); evaluate the policy "
                  "with `kuberl serve` and your simulator, or `kuberl eval --env ENV_ID` (docs/after-training.md)",
                  flush=True)
            return None
        from services.cli.evaluate import describe, evaluate_after_training

        e = self.cfg.evaluation
        what = f"{e.episodes} games against a uniform random player" if self.cfg.selfplay.enabled else \
            f"{e.episodes} episodes"
        print(f"evaluating the final checkpoint: {what}, deterministic actions "
              f"(evaluation.after_training: false turns this off)", flush=True)
        try:
            result = evaluate_after_training(self.cfg, self.dir)
        except KeyboardInterrupt:  # the run itself is over: its summary is still written
            print("evaluation interrupted", flush=True)
            return {"error": "interrupted"}
        if result is not None and "error" in result:
            print(f"evaluation failed: {result['error']}", flush=True)
        elif result is not None:
            partial = (f" (stopped at evaluation.max_seconds: {result['episodes']} of {e.episodes} episodes)"
                       if result.get("episodes", e.episodes) < e.episodes else "")
            ckpt = result["checkpoint"]   # (a run of several policies: each policy's)
            which = (", ".join(f"{n}: {Path(c).name}" for n, c in ckpt.items()) if isinstance(ckpt, dict)
                     else Path(ckpt).name)
            print(f"evaluation of {which}{partial}:\n{describe(result)}", flush=True)
        return result

    def run(self) -> dict:
        reason, error = "interrupted", None
        files = contextlib.ExitStack()  # closed whatever happens, after every process has stopped
        try:
            self.training = True   # (SIGTERM now stops the run as Ctrl-C does: _stop_on_signals)
            csv_file = files.enter_context(open(self.dir / "metrics.csv", "w", newline=""))
            writer = csv.DictWriter(csv_file, fieldnames=CSV_COLUMNS + selfplay_columns(self.cfg) + policy_columns(self.cfg))
            writer.writeheader()
            episodes_file = files.enter_context(open(self.dir / "episodes.csv", "w", newline=""))
            self.episode_rows = csv.writer(episodes_file)
            self.episode_rows.writerow(EPISODE_COLUMNS + (["policy"] if self.cfg.several_policies else []))
            self.fleet.start_all()
            from tensorboardX import SummaryWriter  # a 1 s import: paid while the services start

            self.tb = SummaryWriter(str(self.dir / "tb"))
            self.fleet.wait_all_ready()
            self.fleet.write_targets()
            if self.cfg.tracking.wandb.enabled or self.cfg.tracking.mlflow.enabled:
                self.tracker = Tracker(self.cfg, self.dir)
            self.started = time.monotonic()
            if self.fleet.planned:
                planner = self.fleet.role("planner")[0].address
                if self.cfg.tls.enabled:  # the run's config holds the TLS files to dial with
                    planner += f" --config {self.dir / 'config.yaml'}"
                print(f"planner API on {planner} ({self.cfg.planner.backend} backend): e.g. "
                      f"`kuberl decisions -f --planner {planner}`, `kuberl scale actor 2 --planner {planner}`",
                      flush=True)
            if self.fleet.external:
                print("waiting for simulators: connect them over EnvSession to "
                      + ", ".join(p.address for p in self.fleet.role("actor")) + " (see docs/external-simulators.md"
                      + (", over TLS: docs/security.md" if self.cfg.tls.enabled else "") + ")", flush=True)
            while True:
                time.sleep(self.cfg.run.poll_interval_s)
                self.fleet.supervise()
                self.poll()
                self.fleet.write_targets()
                row = self.row()
                writer.writerow(row)
                csv_file.flush()
                episodes_file.flush()
                for k, v in row.items():
                    if k not in ("wall_s", "env_steps") and v is not None:
                        # (TensorBoard tags take [A-Za-z0-9_./-]: a fixed player's module:function has a ':')
                        self.tb.add_scalar(re.sub(r"[^\w./-]", "_", k.replace("_", "/", 1)), v, self.env_steps)
                if self.tracker is not None:
                    self.tracker.row(row, self.env_steps)
                    for d in self.fleet.new_decisions():
                        self.tracker.decision(decision_event(d), self.env_steps)
                if self.progress:
                    targets = {n: p.target_return for n, p in self.cfg.policies.items()}
                    print(progress_line(row, len(self.returns), targets), flush=True)
                if (reason := self.stop_reason()) is not None:
                    break
        except KeyboardInterrupt:
            reason = "interrupted"
            print("\ninterrupted: stopping every process", flush=True)
        except Terminated as err:   # SIGTERM (timeout, systemd, docker stop, a CI runner): as Ctrl-C
            reason = "terminated"
            print(f"\n{err}: stopping every process", flush=True)
        except (RuntimeError, TlsError, AuthError) as err:   # the last two: files broken mid-run (rotation)
            reason, error = "failed", str(err)
            print(f"kuberl up: {err}", file=sys.stderr, flush=True)
        finally:
            self.training = False
            wall = time.monotonic() - self.started
            with files:
                self.fleet.stop_all(before_buffers=lambda: self._final_stats("buffer"))
                if self.tb is not None:
                    self.tb.close()
            self.episode_rows = None
        learner = self.fleet.role("learner")[0].stats if self.fleet.role("learner") else {}
        tally = self.tally
        losses = tally.losses()
        evaluation = self.evaluate(reason)
        summary = {"reason": reason, "error": error, "env_steps": self.env_steps, "episodes": self.episodes,
                   "episodes_read": tally.episodes_read, "episodes_skipped": tally.episodes_skipped,
                   "mean_return": self.mean_return, "return_window": len(self.returns), "wall_s": round(wall, 3),
                   "samples_lost": {"total": sum(losses.values()), **losses},
                   "process_restarts": dict(self.fleet.restarts),
                   # (Several policies: each its own version and return, none the run's.)
                   **({"policies": self.policies_summary()} if self.cfg.policies
                      else {"policy_version": learner.get("learner/policy_version")}),
                   "exit_codes": self.fleet.exit_codes(), "run_dir": str(self.dir),
                   "last_stats": {name: stats for name, (role, stats) in self.fleet.last_stats().items()
                                  if role != "planner"},
                   "decisions": self.fleet.decisions(), "evaluation": evaluation}
        if self.tracker is not None:
            for d in self.fleet.new_decisions():
                self.tracker.decision(decision_event(d), self.env_steps)
            self.tracker.finish(summary)
            summary["tracking"] = self.tracker.report()
            self.tracker = None
        # The run's end in events.jsonl too, so every run directory holds one (beside the exits and restarts).
        self.fleet.sup.event("run", "ended", reason=reason, env_steps=self.env_steps, wall_s=round(wall, 3),
                             exit_codes=summary["exit_codes"])
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        skipped = f" ({tally.episodes_skipped:,} skipped)" if tally.episodes_skipped else ""
        print(f"{reason}: {self.env_steps:,} env steps, {self.episodes:,} episodes{skipped}, mean return "
              f"{fmt_return(self.mean_return)} over the last {len(self.returns)}, samples lost {fmt_losses(losses)}, "
              f"{wall:.1f} s. Run directory: {self.dir}", flush=True)
        return summary



def decision_event(d: dict) -> dict:
    """A planner decision (its journal's JSON) as a tracking event: what it set, why, the bottleneck."""
    counts = {r.get("role"): (r.get("target", 0) if d.get("applied") else r.get("current", 0)) for r in d.get("roles", [])}
    return {"action": str(d.get("action", "")).removeprefix("DECISION_ACTION_").lower(),
            "actors": int(counts.get("actor", 0)), "learners": int(counts.get("learner", 0)),
            "bottleneck": d.get("bottleneck", ""), "reason": d.get("reason", "") + (f" (error: {d['error']})" if d.get("error") else "")}


def checked_spec(cfg: ExperimentConfig):
    """The run's env spec, refused unless the config's algorithm can train on it: what `kuberl up` asks
    before it starts any process. Declared spaces were checked when the config was built; an env id's
    are read by making the env once. Blocking. ConfigError naming `algorithm` and the env, or naming
    `env.id` when the env cannot be made here."""
    from services.common.envs import made_spec   # gymnasium: imported when a run starts, not by `kuberl --help`

    if cfg.several_policies:   # each policy's agents: mapped, sharing their spaces, and trainable
        from services.common.envs import policy_specs
        try:
            specs = policy_specs(cfg)
        except ValueError as err:
            key, _, why = str(err).partition(": ")
            named = key.startswith(("policies", "env.id"))
            raise ConfigError(key if named else "policies", why if named else str(err)) from None
        for name, each in specs.items():
            check_algorithm_takes(cfg, each, f"policy {name}'s agents' action space", f"policy {name}'s agents' observations")
        return specs[cfg.policy_names[0]]
    spec = made_spec(cfg.env)
    if cfg.env.declared_spec is None:
        check_algorithm_takes(cfg, spec, f"env.id {cfg.env.id}'s action space", f"env.id {cfg.env.id}'s observations")
    return spec


class Terminated(Exception):
    """The run was asked to stop by a signal other than Ctrl-C (SIGTERM, SIGHUP)."""


def _stop_on_signals(run: LocalRun) -> None:
    """SIGTERM and SIGHUP (timeout, systemd, docker stop, a CI runner) end the run as Ctrl-C does: every
    process stopped, the final stats read, summary.json, events.jsonl and the checkpoints written. While
    the run trains, the first raises `Terminated` in the main thread; once it is stopping (or evaluating)
    a signal is only reported, so nothing of the stop is cut short."""
    def handle(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if run.training:
            run.training = False
            raise Terminated(name)
        print(f"{name}: the run is already stopping", file=sys.stderr, flush=True)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handle)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kuberl up", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=None, help="experiment YAML (default: CartPole-v1 with PPO)")
    p.add_argument("--run-dir", default=None, help="parent directory for the run (default: run.run_dir)")
    p.add_argument("--name", default=None, help="run directory name (default: <time>-<algorithm>-<env>)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--actor-port", type=int, default=50053,
                   help="env.mode external: actor i listens on 127.0.0.1:(this + i) for simulators (default 50053)")
    p.add_argument("--planner-port", type=int, default=None,
                   help=f"the planner's API listens on 127.0.0.1:(this) (default {PLANNER_PORT} when it is free and no "
                        "external actor's port, else a free port; the address is printed)")
    add_tls_arguments(p)  # written into the run's config.yaml, which every process reads
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s up: %(message)s")
    try:
        cfg = load_config(args.config)
        # The algorithm must be able to train on the env's spaces (declared ones were checked on load;
        # an env id's are read by making the env once): refused here, not by processes crash-looping.
        checked_spec(cfg)
    except (ConfigError, OSError) as err:
        print(f"kuberl up: {args.config}: {err}", file=sys.stderr)
        return 2
    try:
        cfg = with_tls_flags(cfg, args)
        check_role(cfg.tls)  # every process serves with these files: refused here, before any starts
    except TlsError as err:
        print(f"kuberl up: {err}", file=sys.stderr)
        return 2
    try:
        run = LocalRun.create(cfg, args.run_dir or cfg.run.run_dir, args.name, progress=not args.quiet,
                       actor_port=args.actor_port, planner_port=args.planner_port)
    except ConfigError as err:
        print(f"kuberl up: {err}", file=sys.stderr)
        return 2
    _stop_on_signals(run)
    summary = run.run()
    return 1 if summary["reason"] == "failed" else 0
