"""Two `kuberl up` runs started at the same moment never share a run directory or the planner's
default port (services/cli/up.py `_new_dir`, services/cli/fleet.py `_claim`)."""

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
