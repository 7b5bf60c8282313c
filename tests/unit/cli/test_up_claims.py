"""Two `kuberl up` runs started at the same moment never share a run directory or the planner's
default port (services/cli/up.py `_new_dir`, services/cli/fleet.py `_claim`); and what `kuberl up` shows
of its runs (the live stats of a re-formed learner, metrics.csv's self-play columns)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from services.cli.fleet import _claim
from services.cli.up import _new_dir


def test_runs_named_in_the_same_second_get_directories_of_their_own(tmp_path):
    made = [_new_dir(tmp_path / "runs", "20261125-230000-ppo-cartpole-v1") for _ in range(3)]
    assert [p.name for p in made] == ["20261125-230000-ppo-cartpole-v1", "20261125-230000-ppo-cartpole-v1-2",
                                      "20261125-230000-ppo-cartpole-v1-3"]
    assert all(p.is_dir() for p in made)


def _try_claim(port: int, out) -> None:
    out.put(_claim(port) is not None)


def test_a_port_claimed_by_one_run_is_not_claimed_by_another_until_released(tmp_path):
    port = 1  # never bound: only the lock is tested
    first = _claim(port)
    assert first is not None
    ctx = multiprocessing.get_context("spawn")   # another process, as another `kuberl up` is
    out = ctx.Queue()
    p = ctx.Process(target=_try_claim, args=(port, out))
    p.start()
    assert out.get(timeout=60) is False
    p.join(60)
    first.close()
    p = ctx.Process(target=_try_claim, args=(port, out))
    p.start()
    assert out.get(timeout=60) is True
    p.join(60)
    assert Path(first.name).exists()


def test_the_run_lists_every_live_process_metrics_endpoint_for_prometheus(tmp_path):
    """prometheus-targets.json (file_sd): the processes kuberl up started (their own ready info) and the
    ones the planner runs (their ready files in the run directory), labelled; rewritten only on change."""
    import json
    from types import SimpleNamespace

    from services.cli.fleet import TARGETS_FILE, Fleet, Member
    from services.config import config_from_dict

    fleet = Fleet(config_from_dict({}), tmp_path)
    (tmp_path / "ready").mkdir()
    (tmp_path / "ready" / "actor-0.json").write_text(json.dumps({"address": "127.0.0.1:1", "metrics": "127.0.0.1:9401"}))
    buffer = SimpleNamespace(metrics="127.0.0.1:9400", poll_ready=lambda: True)
    fleet.members += [Member("buffer", "buffer-0", proc=buffer), Member("actor", "actor-0"),
                      Member("actor", "actor-1")]   # actor-1: no ready file yet, not listed
    fleet.write_targets()
    groups = json.loads((tmp_path / TARGETS_FILE).read_text())
    assert groups == [{"targets": ["127.0.0.1:9401"], "labels": {"role": "actor", "name": "actor-0", "run": tmp_path.name}},
                      {"targets": ["127.0.0.1:9400"], "labels": {"role": "buffer", "name": "buffer-0", "run": tmp_path.name}}]
    stamp = (tmp_path / TARGETS_FILE).stat().st_mtime_ns
    fleet.write_targets()
    assert (tmp_path / TARGETS_FILE).stat().st_mtime_ns == stamp   # unchanged: not rewritten
    fleet.members.pop(0)                                            # the buffer went
    fleet.write_targets()
    assert [g["labels"]["name"] for g in json.loads((tmp_path / TARGETS_FILE).read_text())] == ["actor-0"]


def test_a_port_handed_to_one_process_of_a_run_is_never_handed_to_another(tmp_path, monkeypatch):
    """The buffer's port is picked, the buffer starts, the planner's port is picked before the buffer has
    bound its own: a free-now check alone could pick the same port again (seen in a clean-clone run: the
    planner then failed to bind five times and the run ended). The fleet, and the planner's local
    backend, never hand out a port twice."""
    from services.cli import fleet
    from services.common.local import procs
    from services.config import config_from_dict
    from services.planner import local
    from tests.helpers import TINY_PPO

    picks = iter([12001, 12001, 12001, 12002, 12001, 12003])
    monkeypatch.setattr(procs, "free_port", lambda: next(picks))
    f = fleet.Fleet(config_from_dict(TINY_PPO), tmp_path / "run")
    assert [f._free_port(), f._free_port()] == [12001, 12002]

    picks = iter([12005, 12005, 12006, 12007])
    monkeypatch.setattr(procs, "free_port", lambda: next(picks))
    backend = local.LocalBackend(config_from_dict(TINY_PPO), config_path=tmp_path / "c.yaml", run_dir=tmp_path / "r",
                                 buffer="127.0.0.1:12006")
    assert backend.learner_address == "default=127.0.0.1:12005"   # (every policy named, the one too)
    assert backend._free_port() == 12007   # (12005 is the learner's, 12006 the buffer's)


def test_a_learner_re_formed_under_its_old_name_reports_its_own_stats_not_the_stopped_ones(tmp_path):
    """The planner re-forms a policy's learner group under the same process names: the run's summary
    and progress line read the live learner's version, not the one it stopped (a 2026-11-28 run showed
    team at v16 for two minutes while its learner trained on to v61)."""
    from services.cli.fleet import Fleet, Member
    from services.config import config_from_dict

    f = Fleet(config_from_dict({}), tmp_path)
    f.retired = [Member("learner", "learner-team-0", stats={"learner/policy_version": 4.0}),
                 Member("learner", "learner-team-0", stats={"learner/policy_version": 16.0}),
                 Member("actor", "actor-1", stats={"actor/env_steps_total": 10.0})]
    f.members = [Member("learner", "learner-team-0", stats={"learner/policy_version": 61.0})]
    assert f.last_stats() == {"learner-team-0": ("learner", {"learner/policy_version": 61.0}),
                              "actor-1": ("actor", {"actor/env_steps_total": 10.0})}
    f.members = []
    assert f.last_stats()["learner-team-0"] == ("learner", {"learner/policy_version": 16.0})


def test_metrics_csv_has_a_win_rate_column_per_fixed_player():
    from services.cli.up import SELFPLAY_COLUMNS, selfplay_columns
    from services.config import config_from_dict

    tron = {"algorithm": "ppo", "env": {"id": "pettingzoo:kuberl_envs.tron"}}
    assert selfplay_columns(config_from_dict(tron)) == []
    assert selfplay_columns(config_from_dict({**tron, "selfplay": {"enabled": True}})) == SELFPLAY_COLUMNS
    fixed = config_from_dict({**tron, "selfplay": {"enabled": True, "fixed_probability": 0.1,
                                                   "fixed_players": ["kuberl_envs.tron:roomy", "kuberl_envs.tron:scripted"]}})
    assert selfplay_columns(fixed) == SELFPLAY_COLUMNS + ["selfplay_fixed/kuberl_envs.tron:roomy_win_rate",
                                                          "selfplay_fixed/kuberl_envs.tron:scripted_win_rate"]
