"""A tracking sink that fails never stops training: its error is counted, logged once, and the sink is
dropped for the rest of the run while the others go on (services/cli/tracking.py, Tracker)."""

from __future__ import annotations

import logging

from services.cli import tracking
from services.config import config_from_dict


class Recording:
    name = "mlflow"

    def __init__(self, cfg, run_dir):
        self.calls = []

    def scalars(self, values, step):
        self.calls.append(("scalars", values, step))

    def episodes(self, episodes, step):
        self.calls.append(("episodes", episodes, step))

    def decision(self, d, step):
        self.calls.append(("decision", d, step))

    def finish(self, summary, artifacts):
        self.calls.append(("finish", summary["reason"], artifacts))


class Broken(Recording):
    name = "wandb"

    def scalars(self, values, step):
        raise ConnectionError("the W&B service is gone")


def test_a_failing_sink_is_counted_logged_once_and_dropped(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tracking, "SINKS", {"wandb": Broken, "mlflow": Recording})
    cfg = config_from_dict({"tracking": {"wandb": {"enabled": True}, "mlflow": {"enabled": True}, "artifacts": False}})
    t = tracking.Tracker(cfg, tmp_path)
    broken, ok = t.sinks
    with caplog.at_level(logging.WARNING, logger="kuberl.tracking"):
        for step in (100, 200, 300):
            t.row({"wall_s": 1.0, "env_steps": step, "return_mean": 9.5, "learner_policy_version": None}, step)
    t.episodes([(9.0, 9), (10.0, 10)], 300)
    t.finish({"reason": "max_env_steps", "env_steps": 300})
    assert t.sinks == [ok] and t.report()["errors"] == {"wandb": 1}
    assert "ConnectionError: the W&B service is gone" in t.report()["first_error"]["wandb"]
    assert len([r for r in caplog.records if "wandb failed" in r.getMessage()]) == 1
    # the other sink saw every row (None values left out, names as TensorBoard's) and the end
    assert [c[2] for c in ok.calls if c[0] == "scalars"] == [100, 200, 300]
    assert ok.calls[0][1] == {"return/mean": 9.5} and ok.calls[-1] == ("finish", "max_env_steps", [])
    assert ("episodes", [(9.0, 9.0), (10.0, 10.0)], 300) in ok.calls


def test_a_sink_that_cannot_start_says_what_to_install(tmp_path, monkeypatch):
    class Missing(Recording):
        def __init__(self, cfg, run_dir):
            raise ImportError("No module named 'mlflow'")

    monkeypatch.setattr(tracking, "SINKS", {"wandb": Recording, "mlflow": Missing})
    cfg = config_from_dict({"tracking": {"mlflow": {"enabled": True}}})
    t = tracking.Tracker(cfg, tmp_path)
    assert not t.active and t.report()["errors"] == {"mlflow": 1}
    assert "pip install 'kuberl[tracking]'" in t.report()["first_error"]["mlflow"]
