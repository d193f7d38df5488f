"""Files a command writes when its work is done, checked before the work starts: a bad path
then fails at once instead of after a long run, whose result it would lose."""

from __future__ import annotations

import os
from pathlib import Path


def check_output_path(path: Path | None, flag: str) -> None:
    """ValueError naming `flag` when `path` cannot be written (missing directories are fine:
    they are made when it is written)."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {ancestor} is not a writable directory; give a path "
                         "where this user may write")
