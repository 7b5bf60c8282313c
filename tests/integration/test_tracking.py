"""`kuberl up` with both tracking sinks on (config `tracking`, services/cli/tracking.py), offline: Weights
& Biases in offline mode (its run file under the run directory) and MLflow on a local SQLite store.
What the run produced is read back through each library's own structures and compared with the run
directory: the config, every episode, the progress rows, the planner's decisions, the evaluation, the
final checkpoint, the exported policy and a video of it.
"""

from __future__ import annotations

import csv
import json
import struct
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT, TINY_PPO, write_config


def wandb_records(path):
    """The records of a W&B run file (`run-<id>.wandb`): W&B's protobuf Records in its LevelDB-style log
    (a 7-byte header, 32 KiB blocks of chunks with a 7-byte header: checksum, length, type)."""
    from wandb.proto import wandb_internal_pb2 as wpb

    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:7]
    records, partial = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:   # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):    # full, or last of several
            rec = wpb.Record()
            rec.ParseFromString(partial + chunk)
            records.append(rec)
            partial = b""
        else:                 # first or middle
            partial += chunk
    return records


# MLflow's SQL store uses a loader strategy SQLAlchemy 2.1 deprecates (reading back, in this process).
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")
def test_a_run_is_recorded_in_wandb_offline_and_mlflow(tmp_path):
    mlflow_db = tmp_path / "mlflow.db"
    config = write_config(tmp_path / "c.yaml", {
        **TINY_PPO, "topology": {"actors": 1},
        "planner": {"enabled": True, "interval_s": 1, "warmup_s": 1},
        "run": {"target_return": None, "max_env_steps": 30_000, "poll_interval_s": 0.25},
        "evaluation": {"episodes": 2, "num_envs": 2},
        "tracking": {"wandb": {"enabled": True, "mode": "offline", "project": "kuberl-test", "tags": ["ci"]},
                     "mlflow": {"enabled": True, "tracking_uri": f"sqlite:///{mlflow_db}", "experiment": "ci"}}})
    env = {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                           "--name", "run", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**env, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reason"] == "max_env_steps"
    assert summary["tracking"] == {"sinks": ["wandb", "mlflow"], "errors": {}, "first_error": {}}, summary["tracking"]
    with open(run / "episodes.csv") as f:
        episodes = [float(r["return"]) for r in csv.DictReader(f)]
    assert episodes and len(episodes) == summary["episodes_read"]
    decisions = [json.loads(line) for line in (run / "decisions.jsonl").read_text().splitlines()]
    assert decisions
    onnx = sorted(run.glob("policy-v*.onnx"))
    video = sorted(run.glob("policy-v*.mp4"))
    ckpt = sorted((run / "checkpoints").glob("ckpt-*.pt"))
    assert len(onnx) == 1 and len(video) == 1 and ckpt

    # --- MLflow -----------------------------------------------------------------------------------------
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{mlflow_db}")
    (mrun,) = client.search_runs([client.get_experiment_by_name("ci").experiment_id])
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "run"
    resolved = yaml.safe_load((run / "config.yaml").read_text())   # the run's config, every default filled in
    assert mrun.data.params["ppo.learning_rate"] == str(resolved["ppo"]["learning_rate"])
    assert mrun.data.params["env.id"] == "CartPole-v1" and mrun.data.tags["reason"] == "max_env_steps"
    returns = [m.value for m in client.get_metric_history(mrun.info.run_id, "charts/episodic_return")]
    assert sorted(returns) == sorted(episodes)
    rows = client.get_metric_history(mrun.info.run_id, "actor/env_steps_per_s")
    assert len(rows) >= 3 and max(m.step for m in rows) <= summary["env_steps"]
    assert len(client.get_metric_history(mrun.info.run_id, "planner/actors")) == len(decisions)
    assert mrun.data.metrics["eval.mean_return"] == summary["evaluation"]["return"]["mean"]
    artifacts = {a.path for a in client.list_artifacts(mrun.info.run_id)}
    assert {"config.json", "summary.json", "planner_decisions.json", onnx[0].name, ckpt[-1].name,
            video[0].name} <= artifacts

    # --- Weights & Biases (offline) ----------------------------------------------------------------------
    (wfile,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(wfile)
    kinds = [r.WhichOneof("record_type") for r in records]
    (wrun,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert wrun.project == "kuberl-test" and wrun.display_name == "run" and list(wrun.tags) == ["ci"]
    config_items = {i.key: json.loads(i.value_json) for i in wrun.config.update}
    assert config_items["env"]["id"] == "CartPole-v1" and config_items["algorithm"] == "ppo"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert sorted(h["charts/episodic_return"] for h in history if "charts/episodic_return" in h) == sorted(episodes)
    assert sum("planner/actors" in h for h in history) == len(decisions)
    assert any("actor/env_steps_per_s" in h for h in history) and all("env_steps" in h for h in history)
    (clip,) = [h for h in history if h.get("eval/video/_type") == "video-file"]   # the final policy, one episode
    assert (wfile.parent / "files" / clip["eval/video/path"]).stat().st_size == video[0].stat().st_size
    summaries = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summaries.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    assert summaries["eval.mean_return"] == summary["evaluation"]["return"]["mean"]
    assert summaries["reason"] == "max_env_steps"
    logged = {m.path for r in records if r.WhichOneof("record_type") == "artifact" for m in r.artifact.manifest.contents}
    assert {onnx[0].name, ckpt[-1].name} <= logged, logged
    assert "exit" in kinds
