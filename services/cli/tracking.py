"""Experiment tracking sinks that `kuberl up` feeds (config `tracking`, docs/tracking.md): Weights &
Biases and MLflow.

Each sink receives the resolved config when training starts, every progress row's scalars (what
metrics.csv holds) and every finished episode's return and length at the run's env steps, each
planner decision applied (as scalars when it is made, and the whole list at the end), and at the end
the run's summary, the final evaluation, with `tracking.artifacts` the final checkpoint and the
policy exported to ONNX, and with `tracking.video` one episode of the final policy (MP4). A sink that raises is counted (`errors` in summary.json's `tracking`) and
logged once, then skipped for the rest of the run: it never stops training. The libraries are
imported only when a sink is on (the `tracking` extra).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

from services.config import ExperimentConfig

log = logging.getLogger("kuberl.tracking")
VIDEO_FPS = 30.0


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"ppo": {"learning_rate": 1e-3}} -> {"ppo.learning_rate": 1e-3} (lists as they are)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _finite(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        import wandb

        w = cfg.tracking.wandb
        self.wandb = wandb
        self.run = wandb.init(project=w.project, entity=w.entity, group=w.group, tags=list(w.tags) or None,
                              name=run_dir.name, dir=str(run_dir), mode=w.mode, config=cfg.to_dict(),
                              reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
        # Every value is plotted against the run's env steps; each log call is a row of its own (several
        # episodes end between two reads of the same env-step count, and W&B would merge a step's rows).
        self.run.define_metric("env_steps")
        self.run.define_metric("*", step_metric="env_steps")
        self.decisions: list[list[Any]] = []

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "env_steps": step})

    def episodes(self, episodes: list[tuple[float, float]], step: int) -> None:
        for ret, length in episodes:   # a row each: W&B keeps one value per key and row
            self.run.log({"charts/episodic_return": ret, "charts/episodic_length": length, "env_steps": step})

    def decision(self, d: dict, step: int) -> None:
        self.decisions.append([step, d["action"], d["actors"], d["learners"], d["bottleneck"], d["reason"]])
        self.run.log({"planner/actors": d["actors"], "planner/learners": d["learners"], "env_steps": step})

    def finish(self, summary: dict, artifacts: list[Path]) -> None:
        wandb, run = self.wandb, self.run
        if self.decisions:
            run.log({"planner/decisions": wandb.Table(
                columns=["env_steps", "action", "actors", "learners", "bottleneck", "reason"], data=self.decisions)})
        run.summary.update(_finite(flatten(summary_fields(summary))))
        run.summary["reason"] = summary["reason"]
        for path in [p for p in artifacts if p.suffix == ".mp4"]:
            run.log({"eval/video": wandb.Video(str(path), format="mp4"), "env_steps": summary.get("env_steps") or 0})
        for path in [p for p in artifacts if p.suffix != ".mp4"]:
            art = wandb.Artifact(f"{run.name}-{path.stem}".replace("/", "-")[:120],
                                 type="model" if path.suffix in (".pt", ".onnx") else "result")
            art.add_file(str(path))
            run.log_artifact(art)
        run.finish(exit_code=0 if summary["reason"] != "failed" else 1)


class MlflowSink:
    name = "mlflow"
    MAX_BATCH = 100   # MLflow takes at most 100 params and 1000 metrics per call

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        import os

        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        m = cfg.tracking.mlflow
        uri = m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{(Path(cfg.run.run_dir) / 'mlflow.db').resolve()}"
        self.client, self.Metric = MlflowClient(tracking_uri=uri), Metric
        exp = self.client.get_experiment_by_name(m.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            m.experiment, artifact_location=(Path(cfg.run.run_dir) / "mlartifacts").resolve().as_uri()
            if uri.startswith("sqlite:") else None)
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(cfg.to_dict()).items()]
        for i in range(0, len(params), self.MAX_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_BATCH])
        self.client.log_dict(self.run_id, cfg.to_dict(), "config.json")
        self.decisions: list[dict] = []

    def _metrics(self, values: dict[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        # MLflow names: letters, digits and _-./ only, which kuberl's metric names already are.
        metrics = [self.Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def scalars(self, values: dict[str, float], step: int) -> None:
        self._metrics(values, step)

    def episodes(self, episodes: list[tuple[float, float]], step: int) -> None:
        import time

        # One write for the poll's episodes, however many ended. Each gets a timestamp of its own (1 ms
        # apart): MLflow's SQL store keys a value by (key, timestamp, step, value), so two episodes with
        # the same return at the same step and instant would be one row.
        now = int(time.time() * 1000)
        metrics = [self.Metric(k, v, now + j, step) for j, (ret, length) in enumerate(episodes)
                   for k, v in (("charts/episodic_return", ret), ("charts/episodic_length", length))]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def decision(self, d: dict, step: int) -> None:
        self.decisions.append({"env_steps": step, **d})
        self._metrics({"planner/actors": d["actors"], "planner/learners": d["learners"]}, step)

    def finish(self, summary: dict, artifacts: list[Path]) -> None:
        self._metrics(_finite(flatten(summary_fields(summary))), summary.get("env_steps") or 0)
        self.client.set_tag(self.run_id, "reason", summary["reason"])
        if self.decisions:
            self.client.log_dict(self.run_id, self.decisions, "planner_decisions.json")
        self.client.log_dict(self.run_id, json.loads(json.dumps(summary, default=str)), "summary.json")
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, "FAILED" if summary["reason"] == "failed" else "FINISHED")


SINKS = {"wandb": WandbSink, "mlflow": MlflowSink}


def summary_fields(summary: dict) -> dict:
    """What of summary.json a sink records as the run's results."""
    evaluation = summary.get("evaluation") or {}
    out = {"env_steps": summary.get("env_steps"), "episodes": summary.get("episodes"),
           "mean_return": summary.get("mean_return"), "wall_s": summary.get("wall_s"),
           "samples_lost": summary.get("samples_lost", {}).get("total")}
    if "return" in evaluation:
        out["eval"] = {"mean_return": evaluation["return"]["mean"], "std_return": evaluation["return"]["std"],
                       "mean_length": evaluation["length"]["mean"], "episodes": evaluation.get("episodes")}
    elif "against" in evaluation:   # a self-play run's games against random
        out["eval"] = {"win_rate": evaluation["win_rate"], "games": evaluation["games"]}
    return out


class Tracker:
    """The sinks the config turns on, each called through `_call`: an error is counted and logged once,
    and the sink is dropped for the rest of the run."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.sinks: list[Any] = []
        self.errors: Counter[str] = Counter()
        self.first_error: dict[str, str] = {}
        for name, on in (("wandb", cfg.tracking.wandb.enabled), ("mlflow", cfg.tracking.mlflow.enabled)):
            if not on:
                continue
            try:
                self.sinks.append(SINKS[name](cfg, run_dir))
            except ImportError as err:
                self._failed(name, f"{err}; install the tracking extra: pip install 'kuberl[tracking]'")
            except Exception as err:  # noqa: BLE001 - a sink never stops training
                self._failed(name, f"{type(err).__name__}: {err}")

    @property
    def active(self) -> bool:
        return bool(self.sinks)

    def _failed(self, name: str, why: str) -> None:
        self.errors[name] += 1
        if name not in self.first_error:
            self.first_error[name] = why
            log.warning("tracking: %s failed and is off for the rest of the run (training goes on): %s", name, why)

    def _call(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # noqa: BLE001 - a sink never stops training
                self.sinks.remove(sink)
                self._failed(sink.name, f"{method}: {type(err).__name__}: {err}")

    def row(self, row: dict, step: int) -> None:
        """One progress row (metrics.csv's columns, `_` -> `/` after the first word, as TensorBoard's)."""
        values = {k.replace("_", "/", 1): v for k, v in _finite(row).items() if k not in ("wall_s", "env_steps")}
        self._call("scalars", values, step)

    def episodes(self, episodes: list[tuple[float, int]], step: int) -> None:
        """The episodes read in one poll, each with its return and length, at the run's env steps."""
        self._call("episodes", [(float(r), float(n)) for r, n in episodes], step)

    def decision(self, d: dict, step: int) -> None:
        self._call("decision", d, step)

    def finish(self, summary: dict) -> None:
        artifacts: list[Path] = []
        if self.sinks and (self.cfg.tracking.artifacts or self.cfg.tracking.video):
            artifacts = self._artifacts()
        self._call("finish", summary, artifacts)

    def report(self) -> dict:
        """For summary.json: which sinks ran and what failed."""
        return {"sinks": [n for n, on in (("wandb", self.cfg.tracking.wandb.enabled),
                                          ("mlflow", self.cfg.tracking.mlflow.enabled)) if on],
                "errors": dict(self.errors), "first_error": dict(self.first_error)}

    def _artifacts(self) -> list[Path]:
        """The newest checkpoint and its policy exported to ONNX (services/cli/export.py); what cannot
        be had is left out, and why is logged."""
        from services.cli.trained import TrainedPolicyError, find_checkpoint

        try:
            ckpt = find_checkpoint(self.run_dir)
        except (TrainedPolicyError, OSError) as err:
            log.warning("tracking: no checkpoint to log: %s", err)
            return []
        out = [ckpt] if self.cfg.tracking.artifacts else []
        try:
            from services.cli.trained import load_trained

            trained = load_trained(ckpt)
        except Exception as err:  # noqa: BLE001 - what cannot be loaded is not logged; training is over anyway
            log.warning("tracking: the final checkpoint could not be loaded (no ONNX, no video): %s", err)
            return out
        if self.cfg.tracking.artifacts:
            try:
                from services.cli.export import export, mask_input

                masked, _ = mask_input(trained, "auto")
                out.append(export(trained, "onnx", self.run_dir / f"policy-v{trained.version}.onnx", masked))
            except Exception as err:  # noqa: BLE001 - an export that fails leaves the checkpoint logged
                log.warning("tracking: the policy was not exported to ONNX (the checkpoint is logged): %s", err)
        if self.cfg.tracking.video and self.cfg.env.mode != "external":   # a simulator's env cannot be made here
            try:
                from services.cli.evaluate import act_fn, record_video

                path = self.run_dir / f"policy-v{trained.version}.mp4"
                record_video(trained, act_fn(trained, True), path, episodes=1, seed=self.cfg.evaluation.seed,
                             fps=VIDEO_FPS)
                out.append(path)
            except Exception as err:  # noqa: BLE001 - an env that does not render has no video
                log.warning("tracking: no video of the final policy: %s", err)
        return out
