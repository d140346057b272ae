"""Atomic file writes (no imports of ours: every stage may use it, the engine and the stdlib-only modules too).

A reader sees either no file or the whole file: write a temp file in the same directory, fsync, then rename.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str, *, mode: int = 0o644) -> None:
    write_bytes_atomic(path, text.encode(), mode=mode)


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int = 0o644) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
