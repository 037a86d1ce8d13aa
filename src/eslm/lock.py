"""A lock file that guards a directory against a second process: ``fcntl.flock`` (the kernel drops it when the
holder dies, however it dies) on ``<dir>/eslm.lock``, whose JSON line (pid, host, start, command) only says who
holds it. A dead holder's file is taken over with a warning naming it; the file is removed on release."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

from eslm.errors import ESLMError, link_refused

LOCK_NAME = "eslm.lock"


class LockHeld(ESLMError):
    """Another live process holds the directory's lock."""


def _holder_text(info: dict) -> str:
    return (f"PID {info.get('pid', '?')} on host {info.get('host', '?')} since {info.get('started', '?')}"
            + (f" ({info['command']})" if info.get("command") else ""))


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        info = json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


class DirLock:
    """``with DirLock(dir, what="run directory"):`` ... ; raises LockHeld (one line) if another process holds it."""

    def __init__(self, directory: Path, what: str = "directory", warn=None, path: Path | None = None):
        self.dir = Path(directory)
        self.path = Path(path) if path is not None else self.dir / LOCK_NAME
        self.what = what
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.fd: int | None = None

    def acquire(self, wait: bool = False) -> DirLock:
        """``wait=True`` blocks until the holder releases instead of raising LockHeld."""
        import fcntl

        for _ in range(10):  # retried only when the file was replaced between open and flock (a release race)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:  # never truncate a link's target
                    raise link_refused(self.path) from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                info = _read(fd)
                os.close(fd)
                raise LockHeld(f"{self.what} {str(self.dir)!r} is in use by {_holder_text(info)} "
                               f"(lock file {self.path}); wait for it to finish, stop it, or use another "
                               "directory") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder released (and removed) the file after we opened it: open the new one
                os.close(fd)
                continue
            self._take(fd)
            return self
        raise LockHeld(f"could not lock {self.path}: it keeps being replaced; is another process starting in "
                       f"the same {self.what}?")

    def _take(self, fd: int) -> None:
        old = _read(fd)
        if old.get("pid") is not None:
            self.warn(f"warning: taking over the stale lock {self.path} of {_holder_text(old)}, which no longer "
                      "runs (it was killed or crashed)")
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)[:300]}
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(info) + "\n").encode())
        except OSError as e:  # a full disk at start: name the lock file, and leave none behind (still held here)
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                pass
            os.close(fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before unlocking: a waiter then finds a new inode and retries
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self) -> DirLock:
        return self if self.fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
