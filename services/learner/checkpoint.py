"""Learner checkpoints: crash-safe writes of `ckpt-<version>.pt`, keep the newest K, restore the newest
that loads.

Files hold only tensors and plain containers, and are read back with `weights_only=True`, so a
checkpoint can never execute code when loaded.

A write goes to a temp file in the same directory (`.ckpt-<version>.<random>.tmp`), is flushed and
fsync'd, renamed over the final name with os.replace, and the directory is fsync'd: a crash at any
point leaves either the previous checkpoint set or the new one, never a partial file under a
`ckpt-*.pt` name. Temp files a crash left behind match no checkpoint name, so they are ignored (and
removed when the next learner process restores: one process writes to a directory). If the newest
checkpoint still does not load (a disk fault, a truncated copy, another model, a tensor holding NaN
or infinity), `restore_latest` falls back to the one before it, with a warning naming the file and
why. The learner never writes a state with such a tensor (`nonfinite`, checked by the Trainer), so
the last one only comes from elsewhere (an older kuberl, a copied file); `load` refuses it all the same.

The state written is a `snapshot` (detached CPU copies) taken under the training lock; the write
itself runs outside the lock, in the caller's thread, so a slow disk does not stall training.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from services.common.atomic import write_atomically

log = logging.getLogger(__name__)
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TEMP = re.compile(r"^\.ckpt-\d+\..*\.tmp$")


class CheckpointError(ValueError):
    """A checkpoint file that loads but does not hold what a learner checkpoint must."""


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def snapshot(obj):
    """A copy of `obj` (nested dicts/lists of tensors and plain values) whose tensors are detached CPU
    copies: state_dict() returns the live parameter and optimizer tensors, which the next update
    changes in place, so the copy is what a checkpoint written later (outside the lock) must hold."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def nonfinite(obj, name: str = "") -> str | None:
    """The name of the first floating-point tensor in `obj` (nested dicts/lists/tuples of tensors and
    plain values) that holds NaN or infinity, e.g. "algo.net.pi.0.weight"; None when all are finite."""
    if isinstance(obj, torch.Tensor):
        return name if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        if (found := nonfinite(value, f"{name}.{key}" if name else str(key))) is not None:
            return found
    return None


def save(directory: str | Path, version: int, state: dict, keep: int) -> Path:
    """Write `state` as checkpoint `version` and prune to `keep` files. Blocking (disk): call it from a
    thread, outside the training lock, with a `snapshot` of the state."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{version:012d}.pt"
    write_atomically(path, lambda f: torch.save(state, f))
    for _, old in _checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def latest(directory: str | Path) -> Path | None:
    found = _checkpoints(Path(directory))
    return found[-1][1] if found else None


def load(path: str | Path) -> dict:
    """Read and check one checkpoint; raises (CheckpointError or whatever torch.load raises) if unusable."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not isinstance(state.get("algo"), dict):
        raise CheckpointError("holds no 'algo' state dict")
    version = state["algo"].get("version")
    if not isinstance(version, int) or version < 0:
        raise CheckpointError(f"its algo version {version!r} is not a version")
    m = _NAME.match(Path(path).name)
    if m is not None and int(m.group(1)) != version:
        raise CheckpointError(f"its name says version {int(m.group(1))} but it holds version {version}")
    if (bad := nonfinite(state["algo"], "algo")) is not None:
        raise CheckpointError(f"{bad} holds NaN or infinity")
    return state


def restore_latest(directory: str | Path, apply: Callable[[dict], None]) -> tuple[Path, dict] | None:
    """Load the newest checkpoint and `apply` it; if that fails (truncated, corrupt, or not this
    learner's model), warn naming the file and why, and try the next older. Returns the path and state
    applied, or None (with a warning if there were checkpoints) when none could be.

    `apply` must leave its target as it found it when it raises, so the next attempt starts clean."""
    directory = Path(directory)
    found = _checkpoints(directory)
    if directory.is_dir():
        for leftover in directory.iterdir():  # a write that a crash interrupted; never renamed, never read
            if _TEMP.match(leftover.name):
                log.info("removing %s, left by a checkpoint write that did not finish", leftover)
                leftover.unlink(missing_ok=True)
    for i, (_, path) in enumerate(reversed(found)):
        try:
            state = load(path)
            apply(state)
        except Exception as err:  # noqa: BLE001 - any failure to read or apply makes the file unusable
            older = found[-2 - i][1].name if i + 1 < len(found) else None
            log.warning("checkpoint %s is unusable (%s: %s); %s", path, type(err).__name__, err,
                        f"falling back to {older}" if older else "no older checkpoint to fall back to")
            continue
        return path, state
    if found:
        log.warning("none of the %d checkpoints in %s could be loaded; starting from a fresh initialisation",
                    len(found), directory)
    return None
