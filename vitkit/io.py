"""Files that are never half-written, shared or written through a link: atomic writes and a one-process lock.

``atomic_write`` (a temp file in the same directory, fsync, rename), used by every writer of the package, leaves
the previous file (or none) under the final name when interrupted; ``DirectoryLock`` keeps a run directory to one
live process. A write the system refuses is one line naming the file and the reason: an OSError with an errno of
``REFUSED`` or ``BAD_PATH`` along the exception's cause / context chain, or an errno in a wrapping library's
message that the filesystem confirms (``_confirmed``). Anything else keeps its traceback: it is a bug.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

from .errors import UserError

# the system refused the write: the user's to fix (free space, quota, read-only, permissions, size limit, disk)
REFUSED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO})
# the final name cannot hold a file (a directory there, a name too long): from a real OSError, never a message
BAD_PATH = frozenset({errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST})

# an errno in a library's message: Rust's io::Error, Python's "[Errno 28]", and the plain "errno 28" / "errno=28"
_ERRNO_IN_TEXT = re.compile(r"\(os error (\d+)\)|\bOs \{ code: (\d+)|\[Errno (\d+)\]|\berrno[ =:]+(\d+)", re.I)


def atomic_write(path: str | Path, write_fn: Callable[[str], object], *, size: int | None = None) -> None:
    """Call write_fn(tmp_path) and rename the result onto path; the old file stays intact on failure. ``size``
    (the bytes written, where known) confirms a full disk a library reports only in its message."""
    path = Path(path)
    created: list[Path] = []
    tmp: str | None = None
    mine = {str(path)}  # the files this write names: an OSError about another one says which
    try:
        _make_directories(path.parent, created)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL: never a link
        os.close(fd)
        mine.add(tmp)
        write_fn(tmp)
        _seal(tmp)
        os.replace(tmp, path)  # rename replaces whatever is at path, a link included, never writing through it
        tmp = None
        _fsync_directory(path.parent)
    except BaseException as e:
        # judged before the temp file goes, while the space it holds still counts as used
        attempted = max(size or 0, _size_of(tmp))
        # a UserError is the writer's own account of what went wrong (it knows best): passed on as it is
        reason = None
        if isinstance(e, Exception) and not isinstance(e, UserError):
            reason = _refusal(e, path.parent, attempted, mine)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        for directory in reversed(created):  # only what this write created, and only while it is empty
            try:
                directory.rmdir()
            except OSError:
                break
        if reason is None:
            raise
        raise UserError(f"{path}: could not be written ({reason}); nothing was replaced") from e


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def append_text(path: str | Path, text: str) -> None:
    """Append text to path (created if missing), never through a symbolic link; one write call."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if path.is_symlink():
            raise UserError(
                f"{path}: is a symbolic link; vitkit appends only to a plain file (remove the link)"
            ) from None
        if e.errno in REFUSED | BAD_PATH:
            raise UserError(f"{path}: could not be written ({e.strerror})") from e
        raise
    try:
        os.write(fd, text.encode())
    except OSError as e:
        if e.errno in REFUSED:
            raise UserError(f"{path}: could not be written ({e.strerror})") from e
        raise
    finally:
        os.close(fd)


def _make_directories(directory: Path, created: list[Path]) -> None:
    """mkdir -p directory, appending each directory it creates (outermost first) to created."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # a concurrent writer made it: not ours to remove
        created.append(d)


def _seal(tmp: str) -> None:
    """fsync what write_fn wrote (a full disk may only show here) and give it the permissions a new file gets."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RuntimeError(f"{tmp}: the writer left something other than a regular file")
        os.fsync(fd)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp (and the writers' own temp files) make it private
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (its directory entry), where the system allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the file itself is already on disk
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _size_of(tmp: str | None) -> int:
    try:
        return os.lstat(tmp).st_size if tmp is not None else 0
    except OSError:
        return 0


def _chain(e: BaseException) -> Iterator[BaseException]:
    """e, then its causes and contexts, each once."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo.extend(c for c in (x.__cause__, x.__context__) if c is not None)


def _refusal(e: Exception, directory: Path, attempted: int, mine: set[str]) -> str | None:
    """Why the system refused the write that raised e (the module docstring's rule), or None for anything else."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in REFUSED | BAD_PATH:
            reason = x.strerror or os.strerror(x.errno)
            if x.filename is not None and os.fsdecode(x.filename) not in mine:
                reason += f": {os.fsdecode(x.filename)}"  # another file than the one being written
            return reason
    for x in _chain(e):
        for match in _ERRNO_IN_TEXT.finditer(str(x)):
            code = int(next(g for g in match.groups() if g is not None))
            if code in REFUSED and _confirmed(code, directory, attempted):
                return os.strerror(code)
    return None


def _confirmed(code: int, directory: Path, attempted: int) -> bool:
    """Whether the filesystem under directory bears out an errno that a library only wrote in its message."""
    while not directory.is_dir() and directory.parent != directory:
        directory = directory.parent
    try:
        fs = os.statvfs(directory)
    except OSError:
        return False
    if code in (errno.ENOSPC, errno.EDQUOT):
        no_inodes = fs.f_files > 0 and fs.f_favail == 0  # f_files 0: the filesystem does not count inodes
        return fs.f_bavail == 0 or no_inodes or fs.f_bavail * fs.f_frsize < attempted
    if code == errno.EROFS:
        return bool(fs.f_flag & os.ST_RDONLY)
    if code in (errno.EACCES, errno.EPERM):
        return not os.access(directory, os.W_OK)
    if code == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return limit != resource.RLIM_INFINITY and attempted > limit
    return False  # EIO: nothing on the filesystem to check it against


# ------------------------------------------------------------------------------------------- leftovers
# Every temporary name vitkit's writers use beside their final file: what a process killed mid-write can leave.
TEMP_FILES = (
    # atomic_write: tempfile.mkstemp(prefix=".NAME.", suffix=".tmp"), 8 characters of tempfile's alphabet
    re.compile(r"\..+\.[a-z0-9_]{8}\.tmp"),
    # safetensors (>= 0.8) writes through a sibling tempfile::NamedTempFile of the Rust crate, renamed onto the
    # name it was given (atomic_write's temp file): ".tmp" and 6 ASCII letters or digits
    re.compile(r"\.tmp[A-Za-z0-9]{6}"),
)
# export_onnx(int8=True): a work directory beside the destination holding the fp32 graph
TEMP_DIRS = (re.compile(r"\.vitkit-export-[a-z0-9_]{8}"),)
_TEMP_DIR_CONTENTS = {"fp32.onnx", "fp32.onnx.data"}


def is_temp_name(name: str) -> bool:
    """Whether name is one of the temporary file names vitkit's writers use."""
    return any(p.fullmatch(name) for p in TEMP_FILES)


def _is_temp_dir(path: Path) -> bool:
    """A work directory of TEMP_DIRS holding nothing but what its writer puts there."""
    return any(p.fullmatch(path.name) for p in TEMP_DIRS) and set(os.listdir(path)) <= _TEMP_DIR_CONTENTS


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Delete what killed writers left in a directory no live process writes to (never a link); returns it."""
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            path = Path(entry.path)
            if entry.is_file(follow_symlinks=False) and is_temp_name(entry.name):
                path.unlink(missing_ok=True)
                removed.append(path)
            elif entry.is_dir(follow_symlinks=False) and _is_temp_dir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return sorted(removed)


# ------------------------------------------------------------------------------------------------ lock
class DirectoryLock:
    """An exclusive lock on a directory for the life of one process: ``DirectoryLock(run_dir).acquire()``. A POSIX
    record lock (``lockf``) on ``.lock`` inside it, which holds the owner's pid: the kernel drops it when its process
    ends, however it ends, and forked DataLoader workers do not keep it alive. The flip side: closing any descriptor of
    ``.lock`` drops the lock, so the owner must never open that file itself. A live owner makes ``acquire`` fail at once
    with a UserError naming the pid. ``release`` unlinks the file while still holding the lock, and ``acquire`` checks
    after locking that ``.lock`` is still the file it locked, so two processes never both hold the directory. A
    symbolic or hard link planted at ``.lock`` is refused."""

    NAME = ".lock"
    ATTEMPTS = 100  # of the open-lock-check cycle; each retry means another process released the file meanwhile
    _held: ClassVar[set[Path]] = set()  # directories locked by this process (record locks do not exclude it)

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory).resolve() / self.NAME
        self._fd: int | None = None
        self._pid = 0

    def acquire(self) -> DirectoryLock:
        import fcntl

        if self.path in DirectoryLock._held:
            raise UserError(f"{self.path.parent}: in use by this process already; a run or sweep directory takes one")
        for _ in range(self.ATTEMPTS):
            fd = self._open()
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(fd)
                    raise
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                named = self._names(fd)
                os.close(fd)
                if not named:
                    continue  # its owner is releasing it: the file is gone from the directory
                raise UserError(
                    f"{self.path.parent}: in use by a live process (pid {owner}); a run or sweep directory takes "
                    "one process at a time"
                ) from None
            if self._names(fd):
                break
            os.close(fd)  # locked after its owner removed it: an orphan; the directory's lock is a new file
        else:
            raise UserError(f"{self.path}: replaced every time it was locked ({self.ATTEMPTS} tries)")
        if os.fstat(fd).st_nlink > 1:  # another name for the same file, planted to make us truncate it
            os.close(fd)
            raise UserError(f"{self.path}: has other hard links; a run directory's lock must be a file of its own")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd, self._pid = fd, os.getpid()
        DirectoryLock._held.add(self.path)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            # only the process that locked it, and only while the name is still the file it holds
            if self._pid == os.getpid() and self._names(fd):
                self.path.unlink()
        finally:
            os.close(fd)  # closing drops the lock
            DirectoryLock._held.discard(self.path)

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if self.path.is_symlink():
                raise UserError(
                    f"{self.path}: is a symbolic link; a run directory's lock is a plain file vitkit makes "
                    "(remove the link)"
                ) from None
            raise UserError(f"{self.path}: cannot be opened to lock the run directory ({e.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UserError(f"{self.path}: is not a regular file; a run directory's lock is a plain file vitkit makes")
        return fd

    def _names(self, fd: int) -> bool:
        """Whether self.path still names the file open as fd."""
        try:
            now = os.lstat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
