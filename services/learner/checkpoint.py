"""Learner checkpoints: atomic writes of `ckpt-<version>.pt`, keep the newest K, restore the latest.

Files hold only tensors and plain containers, and are read back with `weights_only=True`, so a
checkpoint can never execute code when loaded.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def save(directory: str | Path, version: int, state: dict, keep: int) -> Path:
    """Write `state` as checkpoint `version` (blocking; call from a thread) and prune to `keep` files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{version:012d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for _, old in _checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def latest(directory: str | Path) -> Path | None:
    found = _checkpoints(Path(directory))
    return found[-1][1] if found else None


def load(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
