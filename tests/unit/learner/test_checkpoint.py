"""services/learner/checkpoint.py and Trainer.checkpoint: atomic writes, the fallback to the previous
checkpoint when the newest does not load, leftovers of crashed writes, the write outside the lock."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from services.common import atomic
from services.config import config_from_dict
from services.common.stats import Metrics
from services.learner import checkpoint
from services.learner.trainer import Trainer

CONFIG = {"algorithm": "ppo", "env": {"num_envs": 2},
          "ppo": {"rollout_steps": 4, "batch_steps": 8, "num_epochs": 1, "num_minibatches": 2, "hidden_sizes": [8]},
          "learner": {"keep_checkpoints": 3}}


def make_trainer(directory) -> Trainer:
    return Trainer(config_from_dict(CONFIG), Metrics("learner"), directory)


def first_weight(trainer: Trainer) -> torch.Tensor:
    return next(iter(trainer.algo.net.parameters())).detach().clone()


def advance(trainer: Trainer, version: int, value: float) -> None:
    """Stand in for training: move to `version` with recognisable weights."""
    with torch.no_grad():
        next(iter(trainer.algo.net.parameters())).fill_(value)
    trainer.algo.version = version


@pytest.fixture
def two_checkpoints(tmp_path):
    """A directory holding checkpoints of versions 1 (weights 1.0) and 2 (weights 2.0)."""
    trainer = make_trainer(tmp_path)
    for version in (1, 2):
        advance(trainer, version, float(version))
        assert trainer.checkpoint() == tmp_path / f"ckpt-{version:012d}.pt"
    return tmp_path


def test_restores_the_newest(two_checkpoints):
    trainer = make_trainer(two_checkpoints)
    assert trainer.version == 2
    assert torch.all(first_weight(trainer) == 2.0)


def test_truncated_newest_falls_back_to_the_previous_with_a_warning(two_checkpoints, caplog):
    newest = two_checkpoints / "ckpt-000000000002.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="services.learner.checkpoint"):
        trainer = make_trainer(two_checkpoints)
    assert trainer.version == 1
    assert torch.all(first_weight(trainer) == 1.0)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert str(newest) in warning.getMessage() and "ckpt-000000000001.pt" in warning.getMessage()


def test_checkpoint_of_another_model_falls_back_and_leaves_no_half_loaded_state(two_checkpoints, caplog):
    """A checkpoint that loads but does not fit (here: another network) is skipped like a corrupt one."""
    newest = two_checkpoints / "ckpt-000000000002.pt"
    state = torch.load(newest, weights_only=True)
    state["algo"]["net"] = {k: torch.zeros(3) for k in state["algo"]["net"]}
    torch.save(state, newest)
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(two_checkpoints)
    assert (trainer.version, float(first_weight(trainer).flatten()[0])) == (1, 1.0)
    assert "unusable" in caplog.text


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["net", "optimizer"])
def test_a_checkpoint_holding_nan_or_infinity_is_never_resumed_from(two_checkpoints, caplog, where, value):
    """One written by something else than this learner (which never writes one): skipped like a corrupt
    file, the previous one is resumed from."""
    newest = two_checkpoints / "ckpt-000000000002.pt"
    state = torch.load(newest, weights_only=True)
    if where == "net":
        name = next(iter(state["algo"]["net"]))
        state["algo"]["net"][name].view(-1)[0] = value
        bad = f"algo.net.{name}"
    else:
        state["algo"]["optimizer"]["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.full((2,), value)}}
        bad = "algo.optimizer.state.0.exp_avg"
    torch.save(state, newest)
    with pytest.raises(checkpoint.CheckpointError, match=f"^{bad} holds NaN or infinity$"):
        checkpoint.load(newest)
    with caplog.at_level(logging.WARNING, logger="services.learner.checkpoint"):
        trainer = make_trainer(two_checkpoints)
    assert (trainer.version, float(first_weight(trainer).flatten()[0])) == (1, 1.0)
    assert f"{bad} holds NaN or infinity" in caplog.text and "falling back to ckpt-000000000001.pt" in caplog.text


def test_nothing_loads_starts_fresh_with_a_warning(two_checkpoints, tmp_path_factory, caplog):
    fresh = make_trainer(tmp_path_factory.mktemp("empty"))
    for path in two_checkpoints.glob("ckpt-*.pt"):
        path.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(two_checkpoints)
    assert trainer.version == 0
    assert torch.equal(first_weight(trainer), first_weight(fresh))  # the seeded initialisation, not a half-load
    assert "none of the 2 checkpoints" in caplog.text


def test_empty_file_and_wrong_version_name_are_refused(tmp_path):
    (tmp_path / "ckpt-000000000003.pt").write_bytes(b"")
    with pytest.raises(EOFError):   # torch.load of an empty file
        checkpoint.load(tmp_path / "ckpt-000000000003.pt")
    torch.save({"algo": {"version": 5}}, tmp_path / "ckpt-000000000004.pt")
    with pytest.raises(checkpoint.CheckpointError, match="name says version 4"):
        checkpoint.load(tmp_path / "ckpt-000000000004.pt")


def test_temp_file_left_by_a_crash_mid_write_is_ignored_and_removed(two_checkpoints):
    leftover = two_checkpoints / ".ckpt-000000000003.abc123.tmp"
    leftover.write_bytes(b"half a checkpoint")
    trainer = make_trainer(two_checkpoints)
    assert trainer.version == 2
    assert not leftover.exists()


def test_a_write_failing_halfway_leaves_the_previous_newest_loadable(two_checkpoints, monkeypatch, caplog):
    trainer = make_trainer(two_checkpoints)
    advance(trainer, 3, 3.0)
    seen_under_final_name = []

    def half_then_fail(state, f):
        f.write(b"PK\x03\x04 the first half of a zip")
        f.flush()
        seen_under_final_name.append((two_checkpoints / "ckpt-000000000003.pt").exists())
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", half_then_fail)
    with caplog.at_level(logging.ERROR):
        assert trainer.checkpoint() is None  # logged and counted, training goes on
    monkeypatch.undo()
    assert seen_under_final_name == [False]
    assert trainer.metrics.counters["learner/checkpoint_errors_total"] == 1
    assert "No space left" in caplog.text
    assert sorted(p.name for p in two_checkpoints.iterdir()) == ["ckpt-000000000001.pt", "ckpt-000000000002.pt"]
    assert make_trainer(two_checkpoints).version == 2


def test_written_through_a_temp_file_and_os_replace(tmp_path, monkeypatch):
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        replaced.append((os.path.basename(src), os.path.basename(dst), os.path.getsize(src)))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", spy)
    make_trainer(tmp_path).checkpoint()
    [(src, dst, size)] = replaced
    assert src.startswith(".ckpt-000000000000.") and src.endswith(".tmp") and dst == "ckpt-000000000000.pt"
    assert size > 0  # complete (and fsync'd) before it gets the final name


def test_keeps_the_newest_k(tmp_path):
    trainer = make_trainer(tmp_path)
    for version in range(1, 6):
        advance(trainer, version, float(version))
        trainer.checkpoint()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ckpt-{v:012d}.pt" for v in (3, 4, 5)]


def test_disk_write_runs_outside_the_training_lock_on_a_copy(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    advance(trainer, 1, 1.0)
    real_save = checkpoint.save

    def save_while_training_goes_on(directory, version, state, keep):
        assert trainer.lock.acquire(blocking=False), "the training lock is held during the disk write"
        try:  # an update lands while the file is written: the checkpoint keeps the snapshot's values
            advance(trainer, 2, 2.0)
        finally:
            trainer.lock.release()
        return real_save(directory, version, state, keep)

    monkeypatch.setattr(checkpoint, "save", save_while_training_goes_on)
    assert trainer.checkpoint() == tmp_path / "ckpt-000000000001.pt"
    state = checkpoint.load(tmp_path / "ckpt-000000000001.pt")
    assert state["algo"]["version"] == 1
    assert torch.all(next(iter(state["algo"]["net"].values())) == 1.0)
