"""Files written so that a crash at any point leaves either the old file or the whole new one.

Used for the learner's and the buffer's checkpoints: the data goes to a temp file in the same
directory (named `.<final name>.<random>.tmp`, never read as a checkpoint), is flushed and fsync'd,
renamed over the final name with os.replace (atomic within a filesystem), and the directory is
fsync'd so the rename itself survives a power loss.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (the rename itself lives in the directory's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write(file)` on a temp file beside `path`, then put it in place as `path`. Blocking
    (disk). Whatever `write` raises is raised, with the temp file removed and `path` untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
