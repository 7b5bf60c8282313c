"""Files written so that a crash at any point leaves either the old file or the whole new one, and
files read again when they change (`stamps`).

Used for the learner's and the buffer's checkpoints: the data goes to a temp file in the same
directory (named `.<final name>.<random>.tmp`, never read as a checkpoint), is flushed and fsync'd,
renamed over the final name with os.replace (atomic within a filesystem), and the directory is
fsync'd so the rename itself survives a power loss.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
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


def stamps(paths: Iterable[str | os.PathLike[str]]) -> tuple[tuple[int, int, int] | None, ...]:
    """Each file's (mtime, size, inode), None for one that is gone: how the readers of mounted Secrets
    (tls.py's certificates, auth.py's tokens) tell that a file changed. The kubelet updates a Secret
    volume by swapping a symlink, which changes the inode even when size and mtime happen to agree."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)
