"""services/buffer/checkpoint.py: the replay ring, its RNG, the Store's dedupe windows and counters
saved and restored; damaged checkpoints refused (never raised); consistency while inserts go on;
the buffer.checkpoint_* config keys."""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import pytest

from services.buffer import checkpoint
from services.buffer.checkpoint import BufferCheckpointer
from services.buffer.compact import CompactReplay
from services.buffer.loops import checkpoint_loop
from services.buffer.main import parse_args
from services.buffer.replay import ReplayRing
from services.buffer.store import Outcome, Store
from services.config import ConfigError, config_from_dict
from services.common.stats import Metrics
from tests.unit.fragment_factory import DQN, FrameEnvs, make_msg

T, N = 4, 2  # fragments of 8 transitions


def config(buffer_size: int = 64, env_id: str = "CartPole-v1", **buffer):
    return config_from_dict({"algorithm": "dqn", "env": {"id": env_id, "num_envs": N},
                             "dqn": {"buffer_size": buffer_size, "batch_size": 8, "learning_starts": 8,
                                     "rollout_steps": T}, "buffer": buffer})


def msg(seq: int, actor_id: str = "actor-0", incarnation: int = 7, frames: bool = False):
    """A fragment of float vectors, or with `frames` of stacked uint8 frames (stored compactly)."""
    if frames:
        envs = FrameEnvs(N, seed=seq * 100 + int(actor_id.rsplit("-", 1)[-1]))
        return envs.fragment(T, actor_id=actor_id, seq=seq, policy_version=seq, incarnation=incarnation)
    return make_msg(T, N, obs_shape=(4,), algorithm=DQN, seq=seq, actor_id=actor_id, base=10 * seq,
                    policy_version=seq, incarnation=incarnation)


def filled_store(cfg, fragments: int = 11, frames: bool = False) -> Store:
    """A store whose ring has wrapped (11 x 8 = 88 transitions into 64), fed by two actors, sampled from."""
    store = Store(cfg, Metrics("buffer"))
    for seq in range(fragments):
        assert store.insert(msg(seq, actor_id=f"actor-{seq % 2}", frames=frames)) is Outcome.ACCEPTED
    store.next_batch(8, "learner-0")
    return store


def checkpointer(store: Store, cfg, directory) -> BufferCheckpointer:
    return BufferCheckpointer(store, cfg, directory, store.metrics)


async def restored(cfg, directory) -> Store:
    store = Store(cfg, Metrics("buffer"))
    assert await checkpointer(store, cfg, directory).restore()
    return store


def assert_same_replay(a: Store, b: Store) -> None:
    assert a.replay.state() == b.replay.state()
    used = a.replay.used()
    for name, arr in a.replay.data.items():
        np.testing.assert_array_equal(arr[:used[name]], b.replay.data[name][:used[name]], err_msg=name)
    assert (a.inserted_samples, a.served_samples) == (b.inserted_samples, b.served_samples)
    da, db = a.dedupe_state(), b.dedupe_state()
    assert da.keys() == db.keys()
    for key in da:
        np.testing.assert_array_equal(da[key], db[key], err_msg=key)


async def test_round_trip_restores_contents_position_counters_dedupe_and_rng(tmp_path):
    cfg = config()
    store = filled_store(cfg)
    path = await checkpointer(store, cfg, tmp_path).save()
    assert path == tmp_path / "replay-000000000001.npz"
    again = await restored(cfg, tmp_path)
    assert again.size == store.size == 64 and again.replay.state()["next"] == 88 % 64
    assert_same_replay(store, again)
    for _ in range(5):  # sampling goes on exactly as it would have without the restart
        want, got = store.replay.sample(16), again.replay.sample(16)
        for name in want:
            np.testing.assert_array_equal(want[name], got[name])


async def test_after_a_restore_resent_fragments_are_duplicates_and_new_ones_are_stored(tmp_path):
    cfg = config()
    store = filled_store(cfg)
    await checkpointer(store, cfg, tmp_path).save()
    again = await restored(cfg, tmp_path)
    assert again.insert(msg(10, actor_id="actor-0")) is Outcome.DUPLICATE
    assert again.insert(msg(9, actor_id="actor-1")) is Outcome.DUPLICATE
    assert again.high_water("actor-0", 7) == 10
    assert again.insert(msg(11, actor_id="actor-1")) is Outcome.ACCEPTED
    assert again.insert(msg(10, actor_id="actor-0", incarnation=8)) is Outcome.ACCEPTED  # a new process
    assert again.inserted_samples == store.inserted_samples + 16


async def test_empty_ring_round_trips(tmp_path):
    cfg = config()
    store = Store(cfg, Metrics("buffer"))
    await checkpointer(store, cfg, tmp_path).save()
    again = await restored(cfg, tmp_path)
    assert again.size == 0 and again.replay.data is None
    assert again.insert(msg(0)) is Outcome.ACCEPTED


async def test_restore_into_a_smaller_ring_keeps_the_newest(tmp_path):
    cfg = config()
    store = filled_store(cfg)
    await checkpointer(store, cfg, tmp_path).save()
    small = await restored(config(buffer_size=24), tmp_path)
    assert small.size == 24
    for name in ("policy_version", "rewards"):   # policy_version: the fragment's seq, newest the largest
        order = np.argsort(store.replay.data["policy_version"][:64], kind="stable")
        newest = np.sort(store.replay.data[name][:64][order][-24:])
        np.testing.assert_array_equal(np.sort(small.replay.data[name][:24]), newest, err_msg=name)
    assert small.insert(msg(11, actor_id="actor-1")) is Outcome.ACCEPTED  # and the ring goes on
    assert small.size == 24


async def corrupt_newest(tmp_path, damage) -> tuple[Store, object]:
    """Two checkpoints (of 5 then 11 fragments); the newest is then damaged by `damage(path)`."""
    cfg = config()
    first = filled_store(cfg, fragments=5)
    await checkpointer(first, cfg, tmp_path).save()
    second = filled_store(cfg)
    newest = await checkpointer(second, cfg, tmp_path).save()
    damage(newest)
    return first, newest


def flip_byte(path, at: int = 3000) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF  # inside the ring's arrays: only the zip's CRC-32 can tell
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(b"\x80\x04not a checkpoint at all"),
    "flipped byte": flip_byte,
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
async def test_damaged_newest_is_refused_with_a_warning_and_the_previous_restored(tmp_path, caplog, damage):
    first, newest = await corrupt_newest(tmp_path, damage)
    with caplog.at_level(logging.WARNING, logger="services.buffer.checkpoint"):
        again = await restored(config(), tmp_path)
    assert_same_replay(first, again)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert str(newest) in warning.getMessage() and "replay-000000000001.npz" in warning.getMessage()


async def test_nothing_usable_starts_empty_with_a_warning_never_raises(tmp_path, caplog):
    (tmp_path / "replay-000000000001.npz").write_bytes(b"PK\x03\x04 truncated")
    (tmp_path / "replay-000000000002.npz").write_bytes(b"")
    store = Store(config(), Metrics("buffer"))
    with caplog.at_level(logging.WARNING):
        assert not await checkpointer(store, config(), tmp_path).restore()
    assert store.size == 0 and store.inserted_samples == 0
    assert "starting with an empty buffer" in caplog.text
    assert store.insert(msg(0)) is Outcome.ACCEPTED


async def test_checkpoint_of_another_env_is_refused(tmp_path, caplog):
    cfg = config()
    await checkpointer(filled_store(cfg), cfg, tmp_path).save()
    other = config(env_id="Acrobot-v1")
    store = Store(other, Metrics("buffer"))
    with caplog.at_level(logging.WARNING):
        assert not await checkpointer(store, other, tmp_path).restore()
    assert store.size == 0 and "Acrobot-v1" in caplog.text


async def test_inconsistent_contents_leave_the_store_untouched(tmp_path):
    cfg = config()
    await checkpointer(filled_store(cfg), cfg, tmp_path).save()
    loaded = checkpoint.read(tmp_path / "replay-000000000001.npz", cfg)
    loaded.ring["rewards"] = loaded.ring["rewards"][:-1]
    store = Store(cfg, Metrics("buffer"))
    with pytest.raises(checkpoint.CheckpointError, match="rewards"):
        checkpoint.apply(store, loaded)
    assert store.size == 0 and store.gauges()["buffer/actors_known"] == 0 and store.inserted_samples == 0


async def test_temp_file_of_a_crashed_write_is_ignored_and_removed(tmp_path):
    cfg = config()
    store = filled_store(cfg)
    await checkpointer(store, cfg, tmp_path).save()
    leftover = tmp_path / ".replay-000000000002.x1y2z3.tmp"
    leftover.write_bytes(b"PK\x03\x04 half of a zip")
    assert_same_replay(store, await restored(cfg, tmp_path))
    assert not leftover.exists()


async def test_a_write_failing_halfway_is_counted_and_the_previous_newest_still_restores(tmp_path, monkeypatch):
    cfg = config()
    first = filled_store(cfg, fragments=5)
    await checkpointer(first, cfg, tmp_path).save()
    second = filled_store(cfg)
    visible = []

    def half_then_fail(f, **arrays):
        f.write(b"PK\x03\x04" + bytes(1000))
        f.flush()
        visible.append(sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.np, "savez", half_then_fail)
    assert await checkpointer(second, cfg, tmp_path).save() is None
    monkeypatch.undo()
    assert visible == [["replay-000000000001.npz"]]  # the half-written file never had a checkpoint's name
    assert second.metrics.counters["buffer/checkpoint_errors_total"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["replay-000000000001.npz"]
    assert_same_replay(first, await restored(cfg, tmp_path))


async def test_keeps_the_newest_k(tmp_path):
    cfg = config(keep_checkpoints=2)
    store = filled_store(cfg)
    for _ in range(4):
        await checkpointer(store, cfg, tmp_path).save()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay-000000000003.npz", "replay-000000000004.npz"]


@pytest.mark.parametrize("frames", [False, True], ids=["plain", "compact"])
@pytest.mark.parametrize("inserted_during_copy, patch_bytes", [
    (3, checkpoint.PATCH_BYTES),   # a few rows: patched on the loop
    (20, checkpoint.PATCH_BYTES),  # 20 x 8 rows: the ring goes all the way round during the copy
    (3, 0),                        # every write is "too much" to patch: more copy rounds in a thread
    (20, 0),
])
async def test_inserts_during_the_copy_land_in_a_consistent_checkpoint(tmp_path, monkeypatch, inserted_during_copy,
                                                                       patch_bytes, frames):
    """The rows are copied in a thread while the event loop keeps inserting; the checkpoint must equal
    the state at one instant (the ring, its position and the dedupe windows together; for a compact
    replay, its frame ring too)."""
    cfg = config()
    store = filled_store(cfg, frames=frames)
    monkeypatch.setattr(checkpoint, "PATCH_BYTES", patch_bytes)
    copying, go_on = threading.Event(), threading.Event()
    real_copy, real_spans, rounds = checkpoint._copy_rows, checkpoint._copy_spans, []
    seq = 100

    def slow_copy(live, rows):
        copying.set()
        out = real_copy(live, rows)
        assert go_on.wait(10)
        return out

    def counted_spans(dst, src, spans):
        if threading.current_thread() is not threading.main_thread():
            rounds.append(spans)
        real_spans(dst, src, spans)

    async def insert(n: int) -> None:
        nonlocal seq
        for _ in range(n):  # on the loop, as the servicer inserts
            assert store.insert(msg(seq, actor_id="actor-2", frames=frames)) is Outcome.ACCEPTED
            seq += 1

    snapshot_taken, real_dedupe_state = [], store.dedupe_state

    def dedupe_state():  # read once, at the checkpoint's instant (on the loop, between two inserts)
        snapshot_taken.append(True)
        return real_dedupe_state()

    monkeypatch.setattr(checkpoint, "_copy_rows", slow_copy)
    monkeypatch.setattr(checkpoint, "_copy_spans", counted_spans)
    monkeypatch.setattr(store, "dedupe_state", dedupe_state)
    saving = asyncio.ensure_future(checkpointer(store, cfg, tmp_path).save())
    while not copying.is_set():
        await asyncio.sleep(0.01)
    await insert(inserted_during_copy)
    go_on.set()
    while not snapshot_taken:  # inserts go on during the later rounds too, until the instant it holds
        await insert(1)
        await asyncio.sleep(0.001)
    await saving
    if patch_bytes == 0:
        assert len(rounds) >= 2  # the first copy, and at least one more round in a thread
    again = await restored(cfg, tmp_path)
    assert_same_replay(store, again)
    assert again.insert(msg(seq - 1, actor_id="actor-2", frames=frames)) is Outcome.DUPLICATE
    assert type(again.replay) is type(store.replay) is (CompactReplay if frames else ReplayRing)


async def test_the_checkpoint_loop_saves_periodically_and_once_more_at_stop(tmp_path, monkeypatch):
    cfg = config()
    store = filled_store(cfg)
    ck = checkpointer(store, cfg, tmp_path)
    ck.interval_s = 0.05
    stop = asyncio.Event()
    running = asyncio.ensure_future(checkpoint_loop(ck, stop))
    while store.metrics.counters["buffer/checkpoints_total"] < 2:
        await asyncio.sleep(0.01)
    store.insert(msg(50))  # the last checkpoint holds what came after the periodic ones
    stop.set()
    await running
    assert_same_replay(store, await restored(cfg, tmp_path))


def test_ppo_store_has_no_replay_to_checkpoint(tmp_path):
    cfg = config_from_dict({"algorithm": "ppo"})
    with pytest.raises(ValueError, match="DQN"):
        BufferCheckpointer(Store(cfg, Metrics("buffer")), cfg, tmp_path, Metrics("buffer"))


@pytest.mark.parametrize("buffer, key", [
    ({"checkpoint_dir": ""}, "buffer.checkpoint_dir"),
    ({"checkpoint_dir": 3}, "buffer.checkpoint_dir"),
    ({"checkpoint_interval_s": 0}, "buffer.checkpoint_interval_s"),
    ({"checkpoint_interval_s": 0.5}, "buffer.checkpoint_interval_s"),
    ({"keep_checkpoints": 0}, "buffer.keep_checkpoints"),
])
def test_invalid_checkpoint_options_name_the_key(buffer, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"buffer": buffer})
    assert err.value.key == key and str(err.value).startswith(f"{key}: ")


def test_checkpoint_options_default_off_and_parse():
    assert config_from_dict({}).buffer.checkpoint_dir is None
    b = config_from_dict({"buffer": {"checkpoint_dir": "/data/replay", "checkpoint_interval_s": 60,
                                     "keep_checkpoints": 1}}).buffer
    assert (b.checkpoint_dir, b.checkpoint_interval_s, b.keep_checkpoints) == ("/data/replay", 60.0, 1)


def test_checkpoint_dir_flag(monkeypatch):
    monkeypatch.delenv("KUBERL_BUFFER_CHECKPOINT_DIR", raising=False)
    assert parse_args([]).checkpoint_dir is None
    assert parse_args(["--checkpoint-dir", "/ck"]).checkpoint_dir == "/ck"
    monkeypatch.setenv("KUBERL_BUFFER_CHECKPOINT_DIR", "/env-ck")
    assert parse_args([]).checkpoint_dir == "/env-ck"
