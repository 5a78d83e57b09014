"""Directories only this user can enter, for the files epd's processes share on one machine.

The fast lane's sockets (services/rpc/fastlane.py) and the port claims (services/runtime/server.py) live in a folder
whose name anyone can compute.  Made by another local user first, it would let that user answer in a role's
place or block its ports: so the folder is made with mode 0700, and an existing one is used only when it is
a real directory (not a symlink), owned by this user, that nobody else can enter.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class PrivateDirError(OSError):
    """The folder exists but is not this user's alone: nothing is read from or written into it."""


def private_dir(name: str, path: str | os.PathLike[str] | None = None) -> Path:
    """`path` (default: `<XDG_RUNTIME_DIR or the temp folder>/<name>-<uid>`), made 0700 if it is missing, and
    checked: PrivateDirError when it is a symlink, another user's, or open to group or others."""
    uid = os.geteuid()
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    folder = Path(path) if path else Path(base) / f"{name}-{uid}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700, parents=False)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise PrivateDirError(f"{folder} is not a directory (a symlink or a file): refusing to use it")
    if info.st_uid != uid:
        raise PrivateDirError(f"{folder} belongs to uid {info.st_uid}, not to this user ({uid}): refusing to use it")
    if info.st_mode & 0o077:
        raise PrivateDirError(f"{folder} is open to other users (mode {stat.S_IMODE(info.st_mode):o}, needs 700): "
                              "refusing to use it")
    return folder
