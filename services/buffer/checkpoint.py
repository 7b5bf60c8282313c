"""Buffer checkpoints: the DQN replay ring (its rows, insert position, size and sampling RNG), the
Store's dedupe windows and its inserted/served counters, saved as one `replay-<n>.npz` and restored
when a buffer starts, like Reverb's checkpoints. Numpy only (no torch, no pickle).

The file is a plain .npz (a zip of .npy arrays, loaded with allow_pickle=False): a JSON `header`
(as uint8 bytes), `ring.<array>` (the rows in use of each of the ring's storage arrays: a
ReplayRing's transition fields, or a CompactReplay's frame ring and rows; the header's ring state
says which, docs/architecture.md section 2, "Replay storage") and `dedupe.<key>` (the arrays of
`Store.dedupe_state()`). The zip's CRC-32 of every member is checked as it is read, so a damaged
file is refused rather than half-restored.

Consistency. The ring keeps taking inserts while a checkpoint is taken, and everything must be of
one instant: a dedupe window naming a seq whose rows are not in the ring would turn the actor's
re-send of that fragment away as a duplicate (lost), and rows whose seq the windows do not name
would be stored twice after a re-send. So the rows are copied in a thread while the event loop goes
on, then the rows written meanwhile (`ReplayRing.spans_since`) are copied again in a thread, round
after shorter round, until at most PATCH_BYTES of them are left; those are copied by the store's owner
(the event loop, or the thread that owns the store: services/buffer/owner.py; every insert happens
there, so nothing moves meanwhile), where the ring's position, RNG, dedupe windows and counters are
read too. Inserts are paused only for that last patch, never for a copy of the whole ring (docs/reliability.md: under a millisecond with pushes arriving). The copy costs one
ring's worth of memory until it is written, and is freed in the writing thread.

Durability. The copy is written to a temp file in the same directory (`.replay-<n>.<random>.tmp`),
flushed, fsync'd, renamed over `replay-<n>.npz` (os.replace) and the directory fsync'd, all in a
thread off the event loop; a crash leaves the previous checkpoints intact and a temp file that is
never read (and removed at the next start). The newest `buffer.keep_checkpoints` are kept.

Restore. At start, before serving, the newest checkpoint is read, checked and applied; one that does
not load (truncated, damaged, for another env or algorithm) is refused with a warning naming the file
and why, and the next older is tried; if none loads the buffer starts empty. It never fails to start
because of a checkpoint, so a bad file cannot cause a crash loop.

PPO's FIFO is not checkpointed: its fragments are on-policy and go stale within a few updates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.buffer.replay import Spans
from services.buffer.owner import StoreOwner
from services.buffer.store import Store
from services.common.atomic import write_atomically
from services.common.config import is_atari
from services.config import ExperimentConfig
from services.common.stats import Metrics

log = logging.getLogger(__name__)
FORMAT = "kuberl-replay"
FORMAT_VERSION = 1
_NAME = re.compile(r"^replay-(\d+)\.npz$")
_TEMP = re.compile(r"^\.replay-\d+\..*\.tmp$")


class CheckpointError(ValueError):
    """A buffer checkpoint that reads but cannot be restored into this buffer (the message says why)."""


def layout(cfg: ExperimentConfig) -> dict:
    """What a checkpoint's transitions must match to be restored: rows of another env (or another
    Atari preprocessing) would make every new fragment fail the ring's shape check."""
    out = {"algorithm": cfg.algorithm, "env_id": cfg.env.id,
           "observation_shape": list(cfg.env.observation_shape) if cfg.env.observation_shape else None,
           "observation_dtype": cfg.env.observation_dtype}
    # Declared spaces of an external simulator (only when declared: older checkpoints stay restorable).
    if cfg.env.observation_keys is not None:
        out["observation_keys"] = {k: list(v) for k, v in sorted(cfg.env.observation_keys.items())}
    if cfg.env.action_space is not None:
        out["action_space"] = str(cfg.env.declared_action_space)
    if is_atari(cfg.env.id):
        out.update(frame_stack=cfg.env.atari.frame_stack, screen_size=cfg.env.atari.screen_size)
    return out


@dataclass
class Snapshot:
    """One consistent copy of the replay state, ready to be written."""
    header: dict
    arrays: dict[str, np.ndarray]   # npz members: ring.<field>, dedupe.<key>
    pause_s: float                  # how long the event loop was held to make it consistent

    @property
    def samples(self) -> int:
        return int(self.header["ring"]["size"])


PATCH_BYTES = 8 << 20  # rows left to copy again on the event loop, at most (about 2 ms of memcpy)
PRECOPY_ROUNDS = 4     # copy rounds in a thread before patching on the loop whatever is left


def _copy_spans(dst: dict[str, np.ndarray], src: dict[str, np.ndarray], spans: Spans) -> None:
    for name, arr in src.items():
        for start, stop in spans[name]:  # slices: one memcpy each, and numpy releases the GIL for it
            dst[name][start:stop] = arr[start:stop]


def _copy_rows(live: dict[str, np.ndarray], rows: dict[str, int]) -> dict[str, np.ndarray]:
    """Copy the first `rows[name]` rows of each array into arrays of its full size (the rest stays
    unwritten, so its pages are never touched: a ring that is filling costs what it holds)."""
    out = {name: np.empty_like(arr) for name, arr in live.items()}
    _copy_spans(out, live, {name: [(0, rows[name])] for name in live})
    return out


def _span_bytes(arrays: dict[str, np.ndarray], spans: Spans) -> int:
    return sum((stop - start) * arr[0].nbytes for name, arr in arrays.items() for start, stop in spans[name])


async def take_snapshot(store: Store, cfg: ExperimentConfig, run: StoreOwner | None = None) -> Snapshot:
    """Copy the replay state as of one instant, pausing the store's work (`run`, its owner: the event
    loop or the owner thread) only to patch the last rows inserted during the copy (see the module
    docstring)."""
    run = run or StoreOwner(threaded=False)
    ring = store.replay
    copies: dict[str, np.ndarray] = {}
    mark = None
    if ring.data is not None:
        # Pre-copy (as live migration does): copy everything in a thread, then, while much was written
        # meanwhile, copy again in a thread just what was; each round is shorter than the one before.
        mark, used = await run(lambda: (ring.mark(), ring.used()))
        copies = await asyncio.to_thread(_copy_rows, ring.data, used)
        for _ in range(PRECOPY_ROUNDS):
            spans = await run(ring.spans_since, mark)
            if _span_bytes(ring.data, spans) <= PATCH_BYTES:
                break
            mark = await run(ring.mark)
            await asyncio.to_thread(_copy_spans, copies, ring.data, spans)
    return await run(_instant, store, cfg, ring, copies, mark)


def _instant(store: Store, cfg: ExperimentConfig, ring, copies: dict[str, np.ndarray], mark) -> Snapshot:
    """The snapshot's instant, on the store's owner: no insert runs meanwhile."""
    paused = time.perf_counter()
    if copies:
        _copy_spans(copies, ring.data, ring.spans_since(mark))
    elif ring.data is not None:   # the ring was empty at the pre-copy, and its first rows came since
        copies = _copy_rows(ring.data, ring.used())
    used = ring.used()
    arrays = {f"ring.{name}": arr[:used[name]] for name, arr in copies.items()}
    arrays.update({f"dedupe.{key}": np.asarray(value) for key, value in store.dedupe_state().items()})
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "created_unix_s": time.time(),
              "layout": layout(cfg), "ring": ring.state(),
              "counters": {"inserted_samples": store.inserted_samples, "served_samples": store.served_samples},
              "members": sorted(arrays)}
    return Snapshot(header, arrays, time.perf_counter() - paused)


def checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """The checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def write(directory: str | Path, snapshot: Snapshot, keep: int) -> Path:
    """Write `snapshot` as the next checkpoint in `directory` and prune to the newest `keep`.
    Blocking (disk): call it from a thread."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    found = checkpoints(directory)
    number = found[-1][0] + 1 if found else 1
    path = directory / f"replay-{number:012d}.npz"
    header = np.frombuffer(json.dumps(snapshot.header).encode(), dtype=np.uint8)
    write_atomically(path, lambda f: np.savez(f, header=header, **snapshot.arrays))
    for _, old in checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def _write_and_release(directory: Path, snapshot: Snapshot, keep: int) -> Path:
    try:
        return write(directory, snapshot, keep)
    finally:  # free the copy in this thread: returning a ring's worth of pages stalls for tens of ms
        snapshot.arrays.clear()


@dataclass
class Loaded:
    header: dict
    ring: dict[str, np.ndarray]
    dedupe: dict[str, np.ndarray]


def read(path: str | Path, cfg: ExperimentConfig) -> Loaded:
    """Read and check one checkpoint (blocking). Raises if it cannot be restored into a buffer of
    `cfg`: CheckpointError with the reason, or whatever numpy/zipfile raise for a damaged file."""
    # Our own file object: np.load leaks the one it opens when the zip does not parse.
    with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
        if "header" not in z.files:
            raise CheckpointError("no header: not a buffer checkpoint")
        header = json.loads(z["header"].tobytes().decode())
        if header.get("format") != FORMAT or header.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"format {header.get('format')!r} version {header.get('format_version')!r}, "
                                  f"this buffer reads {FORMAT!r} version {FORMAT_VERSION}")
        missing = set(header["members"]) - set(z.files)
        if missing:
            raise CheckpointError(f"members {sorted(missing)} are missing")
        if header["layout"] != layout(cfg):
            raise CheckpointError(f"it holds transitions of {header['layout']}, this buffer is configured for "
                                  f"{layout(cfg)}")
        # Reading each member in full checks its CRC-32.
        ring = {k.removeprefix("ring."): z[k] for k in header["members"] if k.startswith("ring.")}
        dedupe = {k.removeprefix("dedupe."): z[k] for k in header["members"] if k.startswith("dedupe.")}
    counters = header["counters"]
    if not all(isinstance(counters.get(k), int) and counters[k] >= 0 for k in ("inserted_samples", "served_samples")):
        raise CheckpointError(f"counters {counters} are not sample counts")
    return Loaded(header, ring, dedupe)


def apply(store: Store, loaded: Loaded) -> None:
    """Restore `loaded` into `store` (on the event loop, before serving). Raises CheckpointError and
    leaves the store as it was if the contents do not fit together."""
    before = store.dedupe_state()
    try:
        store.restore_dedupe_state(loaded.dedupe)
    except Exception as err:  # noqa: BLE001 - whatever the windows' arrays do wrong, the file is unusable
        store.restore_dedupe_state(before)
        raise CheckpointError(f"dedupe windows: {type(err).__name__}: {err}") from err
    try:
        store.restore_replay(loaded.ring, loaded.header["ring"])  # checks everything before changing anything
    except (ValueError, TypeError, KeyError) as err:
        store.restore_dedupe_state(before)
        raise CheckpointError(f"replay ring: {err}") from err
    store.inserted_samples = loaded.header["counters"]["inserted_samples"]
    store.served_samples = loaded.header["counters"]["served_samples"]


class BufferCheckpointer:
    """Saves a DQN buffer's replay state to `directory` (every `interval_s` and at shutdown: its loop is
    services/buffer/loops.py, `checkpoint_loop`), and restores the newest usable checkpoint at start."""

    def __init__(self, store: Store, cfg: ExperimentConfig, directory: str | Path, metrics: Metrics,
                 owner: StoreOwner | None = None):
        if store.replay is None:
            raise ValueError("only a DQN buffer's replay ring is checkpointed")
        self.store, self.cfg, self.directory, self.metrics = store, cfg, Path(directory), metrics
        self.owner = owner or StoreOwner(threaded=False)
        self.interval_s, self.keep = cfg.buffer.checkpoint_interval_s, cfg.buffer.keep_checkpoints
        metrics.inc("buffer/checkpoints_total", 0)
        metrics.inc("buffer/checkpoint_errors_total", 0)

    async def restore(self) -> bool:
        """Restore the newest checkpoint that loads; warn about every one that does not. Returns
        whether one was restored (False: the buffer starts empty)."""
        await asyncio.to_thread(self._remove_leftovers)
        found = checkpoints(self.directory)
        for i, (_, path) in enumerate(reversed(found)):
            started = time.perf_counter()
            try:
                loaded = await asyncio.to_thread(read, path, self.cfg)
                apply(self.store, loaded)
            except Exception as err:  # noqa: BLE001 - any failure to read or apply makes the file unusable
                older = found[-2 - i][1].name if i + 1 < len(found) else None
                log.warning("refusing buffer checkpoint %s (%s: %s); %s", path, type(err).__name__, err,
                            f"falling back to {older}" if older else "starting with an empty buffer")
                continue
            ring = loaded.header["ring"]
            log.info("restored %d samples (%d inserted, %d served before) and the dedupe windows of %d actors "
                     "from %s: %.1f MB in %.2f s", self.store.size, self.store.inserted_samples,
                     self.store.served_samples, self.store.gauges()["buffer/actors_known"], path,
                     path.stat().st_size / 1e6, time.perf_counter() - started)
            if ring["capacity"] != self.store.replay.capacity:
                log.warning("buffer checkpoint %s was of a ring of %d samples, this one holds %d: kept the newest %d "
                            "of its %d", path, ring["capacity"], self.store.replay.capacity, self.store.size,
                            ring["size"])
            self.metrics.set("buffer/checkpoint_restored_samples", self.store.size)
            return True
        if not found:
            log.info("no buffer checkpoint in %s: starting with an empty buffer", self.directory)
        return False

    def _remove_leftovers(self) -> None:
        if not self.directory.is_dir():
            return
        for leftover in self.directory.iterdir():  # a write a crash interrupted: never renamed, never read
            if _TEMP.match(leftover.name):
                log.info("removing %s, left by a buffer checkpoint write that did not finish", leftover)
                leftover.unlink(missing_ok=True)

    async def save(self) -> Path | None:
        """Checkpoint now (copy, then write in a thread). A failing disk is logged and counted, never
        raised: the buffer goes on serving and the previous checkpoint stands."""
        started = time.perf_counter()
        snapshot = await take_snapshot(self.store, self.cfg, self.owner)
        try:
            path = await asyncio.to_thread(_write_and_release, self.directory, snapshot, self.keep)
        except Exception as err:  # noqa: BLE001 - a failed save must never take the buffer down
            self.metrics.inc("buffer/checkpoint_errors_total")
            log.error("buffer checkpoint to %s failed: %s; the previous one stands", self.directory, err)
            return None
        size, seconds = path.stat().st_size, time.perf_counter() - started
        self.metrics.inc("buffer/checkpoints_total")
        self.metrics.set("buffer/checkpoint_seconds", seconds)
        self.metrics.set("buffer/checkpoint_bytes", size)
        self.metrics.set("buffer/checkpoint_pause_seconds", snapshot.pause_s)
        log.info("checkpoint %s: %d samples, %.1f MB in %.2f s (event loop paused %.1f ms)", path, snapshot.samples,
                 size / 1e6, seconds, snapshot.pause_s * 1e3)
        return path
