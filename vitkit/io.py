"""Files that are never half-written or shared: atomic writes and a one-process lock on a directory.

``atomic_write`` (a temp file in the same directory, fsync, rename) is used by every writer of the package
(checkpoints, run records, figures, reports), so an interrupted write leaves the previous file (or none) under
the final name, never a truncated one. ``DirectoryLock`` keeps a run directory to one live process.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import UserError


def atomic_write(path: str | Path, write_fn: Callable[[str], object]) -> None:
    """Call write_fn(tmp_path) and rename the result onto path; the old file stays intact on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write_fn(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # a full disk may only show here, when the data is really written
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        # the system refusing the write (full disk, quota, read-only): the user's to fix, named by the final file;
        # writers in Rust (safetensors) report the OS error inside their own exception type
        if isinstance(e, OSError) or (isinstance(e, Exception) and "Os { code" in str(e)):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise UserError(f"{path}: could not be written ({reason}); nothing was replaced") from e
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Delete what an atomic write killed mid-way left behind (``.NAME.*.tmp``); returns what was removed.

    Only call this for a directory no other live process writes to (a run directory under its lock).
    """
    removed = []
    for tmp in Path(directory).glob(".*.tmp"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


class DirectoryLock:
    """An exclusive lock on a directory for the life of one process: ``DirectoryLock(run_dir).acquire()``.

    The lock is a POSIX record lock (``lockf``) on the file ``.lock`` inside it, which holds the owner's pid.
    The kernel drops it when its process ends, however it ends, so a lock left by a killed process is simply
    taken over; a live owner makes ``acquire`` fail at once with a UserError naming the directory and the pid.
    Record locks belong to the process, not to its open files, so DataLoader workers forked while the lock is
    held do not keep it alive after their parent lets go.
    """

    NAME = ".lock"
    _held: set[Path] = set()  # directories locked by this process (record locks do not exclude their owner)

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory).resolve() / self.NAME
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        import fcntl

        if self.path in DirectoryLock._held:
            raise UserError(f"{self.path.parent}: in use by this process already; a run directory takes one run")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"{self.path.parent}: in use by a live process (pid {owner}); a run directory takes one process "
                "at a time"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        DirectoryLock._held.add(self.path)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays, unlocked, for the next owner
            self._fd = None
            DirectoryLock._held.discard(self.path)
