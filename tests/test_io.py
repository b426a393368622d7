"""vitkit.io: atomic writes that never write through a link and report a refused write (full disk, read-only
mount) as one line naming the file; the run-directory lock (links refused, removed on release, still exclusive);
the cleanup of what killed writers leave behind (every temporary name of vitkit's writers, and nothing else)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vitkit import UserError
from vitkit.io import DirectoryLock, append_text, atomic_write, atomic_write_text, is_temp_name, remove_stale_temp_files

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _one_line(e: pytest.ExceptionInfo[UserError]) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------------------------------ links
@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the run directory that a planted link points at."""
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_bytes(b"precious bytes\n")
    return target


def test_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(outside)
    with pytest.raises(UserError) as e:
        DirectoryLock(run).acquire()
    assert str(run.resolve() / ".lock") in _one_line(e) and "symbolic link" in str(e.value)
    assert outside.read_bytes() == b"precious bytes\n" and (run / ".lock").is_symlink()
    dangling = tmp_path / "run2"
    dangling.mkdir()
    (dangling / ".lock").symlink_to(tmp_path / "not-yet")  # O_CREAT would make the target through a dangling link
    with pytest.raises(UserError, match="symbolic link"):
        DirectoryLock(dangling).acquire()
    assert not (tmp_path / "not-yet").exists()


def test_a_lock_that_is_a_hard_link_or_not_a_file_is_refused(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    os.link(outside, run / ".lock")
    with pytest.raises(UserError, match=r"\.lock: has other hard links"):
        DirectoryLock(run).acquire()
    assert outside.read_bytes() == b"precious bytes\n"
    (run / ".lock").unlink()
    (run / ".lock").mkdir()
    with pytest.raises(UserError, match=r"\.lock: "):
        DirectoryLock(run).acquire()


def test_atomic_write_replaces_a_link_at_the_final_name_never_its_target(tmp_path, outside):
    link = tmp_path / "config.yaml"
    link.symlink_to(outside)
    atomic_write_text(link, "new: 1\n")
    assert outside.read_bytes() == b"precious bytes\n"
    assert not link.is_symlink() and link.read_text() == "new: 1\n"
    weights = tmp_path / "model.safetensors"
    weights.symlink_to(outside)
    atomic_write(weights, lambda tmp: save_file({"w": torch.arange(4.0)}, tmp))
    assert outside.read_bytes() == b"precious bytes\n" and not weights.is_symlink()
    assert torch.equal(load_file(weights)["w"], torch.arange(4.0))


def test_atomic_write_gives_the_file_the_permissions_of_a_new_file(tmp_path):
    mask = os.umask(0o027)
    try:
        atomic_write(tmp_path / "a.safetensors", lambda tmp: save_file({"w": torch.zeros(2)}, tmp))
        atomic_write_text(tmp_path / "b.txt", "b")
        with open(os.open(tmp_path / "c.txt", os.O_CREAT | os.O_WRONLY, 0o666), "w"):
            pass  # what the system gives a plain new file under this umask
    finally:
        os.umask(mask)
    expected = (tmp_path / "c.txt").stat().st_mode & 0o777
    assert expected == 0o640
    assert {(tmp_path / n).stat().st_mode & 0o777 for n in ("a.safetensors", "b.txt")} == {expected}


def test_appended_records_never_go_through_a_link(tmp_path, outside):
    log = tmp_path / "metrics.jsonl"
    append_text(log, "a\n")
    append_text(log, "b\n")
    assert log.read_text() == "a\nb\n"
    log.unlink()
    log.symlink_to(outside)
    with pytest.raises(UserError) as e:
        append_text(log, "c\n")
    assert str(log) in _one_line(e) and "symbolic link" in str(e.value)
    assert outside.read_bytes() == b"precious bytes\n"


# ------------------------------------------------------------------------------------------------- lock
_HOLD = """
import sys, time
from vitkit.io import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def _held_elsewhere(run: Path) -> bool:
    """Whether another process finds run locked by this one. Asked from a fresh process: record locks do not
    exclude their owner, and this process must not open .lock itself (closing it would drop its lock)."""
    code = "import sys\nfrom vitkit.io import DirectoryLock\ntry:\n DirectoryLock(sys.argv[1]).acquire()\n"
    code += "except ValueError as e:\n print(e)\n sys.exit(3)\n"
    done = subprocess.run([sys.executable, "-c", code, str(run)], env=_env(), capture_output=True, text=True)
    assert done.returncode in (0, 3), done.stderr
    return done.returncode == 3 and f"in use by a live process (pid {os.getpid()})" in done.stdout


def test_release_removes_the_lock_file_and_a_new_owner_takes_the_directory(tmp_path):
    lock = DirectoryLock(tmp_path).acquire()
    assert _held_elsewhere(tmp_path)  # its pid is read from .lock
    lock.release()
    assert not (tmp_path / ".lock").exists() and list(tmp_path.iterdir()) == []
    lock.release()  # twice is harmless
    assert not _held_elsewhere(tmp_path)
    again = DirectoryLock(tmp_path).acquire()
    assert (tmp_path / ".lock").is_file()
    again.release()
    assert not (tmp_path / ".lock").exists()


def test_a_forked_child_releasing_its_copy_leaves_the_parents_lock(tmp_path):
    lock = DirectoryLock(tmp_path).acquire()
    try:
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say, that tidies up on exit
            try:
                lock.release()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert _held_elsewhere(tmp_path)
    finally:
        lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_lock_file_removed_between_open_and_lock_is_not_the_lock(tmp_path, monkeypatch):
    """The race of removing lock files: B opens .lock, its owner releases (unlinks, unlocks), B locks the orphan.
    B must see that the name no longer leads to what it locked and lock the directory's new file instead."""
    (tmp_path / ".lock").write_text("12345\n")  # the file the departing owner held
    opened = DirectoryLock._open
    calls: list[int] = []
    kept: list[int] = []

    def open_then_owner_leaves(self: DirectoryLock) -> int:
        fd = opened(self)
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:
            os.unlink(self.path)  # the owner's release, after our open and before our lockf
            kept.append(os.dup(fd))  # keeps the orphan's inode from being reused by the next file
        return fd

    monkeypatch.setattr(DirectoryLock, "_open", open_then_owner_leaves)
    lock = DirectoryLock(tmp_path).acquire()
    try:
        assert len(calls) == 2 and calls[0] != calls[1]
        assert (tmp_path / ".lock").stat().st_ino == calls[1]
        assert _held_elsewhere(tmp_path)  # the lock is on the file the directory names
    finally:
        lock.release()
        os.close(kept[0])


_CONTEND = """
import os, sys, time
from vitkit.io import DirectoryLock
run, marker, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
opened = DirectoryLock._open
def slow_open(self):  # widens the window between open and lock, where a release can remove the file
    fd = opened(self)
    time.sleep(0.0005)
    return fd
DirectoryLock._open = slow_open
won = 0
while won < rounds:
    try:
        lock = DirectoryLock(run).acquire()
    except ValueError:
        continue
    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # FileExistsError: two owners at once
    os.close(fd)
    time.sleep(0.001)  # holds the directory a while, as a run does
    os.unlink(marker)
    lock.release()
    won += 1
print("done", flush=True)
"""


def test_processes_contending_for_a_lock_that_is_removed_on_release_still_exclude_each_other(tmp_path):
    marker = tmp_path / "inside"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONTEND, str(tmp_path / "run"), str(marker), "80"],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    (tmp_path / "run").mkdir()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0 and out.strip() == "done", err
    assert not (tmp_path / "run" / ".lock").exists() and not marker.exists()


# ------------------------------------------------------------------------------------------- refused writes
@pytest.fixture
def small_fs(tmp_path):
    """A real 64 KiB filesystem (tmpfs), mounted for the test: needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (os.geteuid() != 0)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _free(path: Path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def test_a_full_disk_under_safetensors_is_one_line_and_leaves_nothing(small_fs):
    tensors = {"w": torch.zeros(64 * 1024)}  # 256 KiB on a 64 KiB filesystem
    size = sum(t.nbytes for t in tensors.values())
    assert size > _free(small_fs)
    final = small_fs / "out" / "model.safetensors"
    with pytest.raises(UserError) as e:
        atomic_write(final, lambda tmp: save_file(tensors, tmp), size=size)
    assert _one_line(e) == f"{final}: could not be written (No space left on device); nothing was replaced"
    assert list(small_fs.iterdir()) == []  # no temp file, and the directory the write created is gone
    # the library's own error names the errno only in its text: without a size the free space left after its
    # temp file went (all 64 KiB) cannot confirm it, so it keeps its traceback, and still leaves nothing
    with pytest.raises(Exception, match=r"os error 28") as raw:
        atomic_write(final, lambda tmp: save_file(tensors, tmp))
    assert not isinstance(raw.value, UserError) and list(small_fs.iterdir()) == []


def test_a_full_disk_keeps_the_old_file_and_a_directory_the_write_did_not_create(small_fs):
    out = small_fs / "out"
    out.mkdir()
    old = out / "notes.txt"
    old.write_text("old\n")
    with pytest.raises(UserError) as e:
        atomic_write_text(old, "x" * 200_000)  # Python's own write: a real OSError
    assert _one_line(e) == f"{old}: could not be written (No space left on device); nothing was replaced"
    assert old.read_text() == "old\n" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    old.unlink()
    with pytest.raises(UserError, match="No space left on device"):
        atomic_write(out / "m.safetensors", lambda tmp: save_file({"w": torch.zeros(65536)}, tmp), size=262144)
    assert out.is_dir() and list(out.iterdir()) == []  # there before the write: not the write's to remove


def test_a_full_disk_during_convert_is_one_line_and_leaves_no_directory(small_fs, tmp_path, capsys):
    from vitkit import VisionTransformer
    from vitkit.checkpoint import save_pretrained
    from vitkit.cli import main

    src = tmp_path / "src"
    save_pretrained(VisionTransformer(img_size=16, patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64), src)
    assert (src / "model.safetensors").stat().st_size > _free(small_fs)
    dst = small_fs / "converted"
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{dst / 'model.safetensors'}: could not be written (No space left" in err
    assert list(small_fs.iterdir()) == []


def test_a_read_only_filesystem_is_one_line(small_fs):
    (small_fs / "keep.txt").write_text("kept\n")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(UserError) as e:
            atomic_write_text(small_fs / "keep.txt", "new\n")
        assert _one_line(e).startswith(f"{small_fs / 'keep.txt'}: could not be written (Read-only file system")
        assert (small_fs / "keep.txt").read_text() == "kept\n"
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)


class LibraryError(Exception):
    """A writing library's own exception type, which carries no errno."""


def _fake_statvfs(free_blocks: int):
    # bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax
    return lambda path: os.statvfs_result((4096, 4096, 1000, free_blocks, free_blocks, 100, 50, 50, 0, 255))


def test_an_errno_only_in_a_library_message_counts_when_the_filesystem_confirms_it(tmp_path, monkeypatch):
    final = tmp_path / "model.safetensors"

    def fail(message: str):
        def write(tmp: str) -> None:
            Path(tmp).write_bytes(b"partial")
            raise LibraryError(message)

        return write

    for message in ("I/O error: No space left on device (os error 28)", "Os { code: 28, kind: StorageFull, .. }"):
        monkeypatch.setattr(os, "statvfs", _fake_statvfs(0))  # the disk is full
        with pytest.raises(UserError) as e:
            atomic_write(final, fail(message))
        assert _one_line(e) == f"{final}: could not be written (No space left on device); nothing was replaced"
        monkeypatch.setattr(os, "statvfs", _fake_statvfs(10))  # 40 KiB free: too little for 1 MB
        with pytest.raises(UserError, match="No space left on device"):
            atomic_write(final, fail(message), size=1 << 20)
        monkeypatch.setattr(os, "statvfs", _fake_statvfs(900))  # 3.6 MB free: the message is not borne out
        with pytest.raises(LibraryError):
            atomic_write(final, fail(message), size=1 << 20)
    # a library error with no errno at all is a bug and keeps its traceback
    monkeypatch.undo()
    with pytest.raises(LibraryError, match="tensor is not contiguous"):
        atomic_write(final, fail("tensor is not contiguous"))
    # EIO is never taken from a message alone: nothing on the filesystem can confirm it
    with pytest.raises(LibraryError):
        atomic_write(final, fail("Input/output error (os error 5)"))
    assert list(tmp_path.iterdir()) == []  # every failed attempt removed its temp file


def test_an_os_error_wrapped_by_a_library_is_found_along_the_cause_chain(tmp_path):
    final = tmp_path / "out.json"

    def wrapped(tmp: str) -> None:
        try:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), tmp)
        except OSError as e:
            raise LibraryError("write failed") from e

    with pytest.raises(UserError) as e:
        atomic_write(final, wrapped)
    assert _one_line(e) == f"{final}: could not be written ({os.strerror(errno.EDQUOT)}); nothing was replaced"

    other = tmp_path / "elsewhere.bin"

    def implicit(tmp: str) -> None:  # raised while handling: __context__, and about another file
        try:
            raise PermissionError(errno.EACCES, "Permission denied", str(other))
        except OSError:
            raise LibraryError("could not read the source")  # noqa: B904 -- the implicit chain is the point

    with pytest.raises(UserError, match=rf"\(Permission denied: {other}\)"):
        atomic_write(final, implicit)

    def not_the_system(tmp: str) -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "weights.npz")

    with pytest.raises(FileNotFoundError):  # not a refusal of the write: keeps its traceback
        atomic_write(final, not_the_system)
    assert list(tmp_path.iterdir()) == []


def test_a_final_name_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError) as e:
        atomic_write_text(tmp_path / "a-file" / "sub" / "config.json", "{}")
    assert _one_line(e).startswith(f"{tmp_path / 'a-file' / 'sub' / 'config.json'}: could not be written (")


def test_an_interrupted_write_removes_its_temp_file_and_the_directories_it_made(tmp_path):
    def interrupted(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "a" / "b" / "model.safetensors", interrupted)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ leftovers
def _safetensors_temp_names(directory: Path) -> set[str]:
    """The names safetensors' save_file really uses beside its destination, watched while it writes."""
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(os.listdir(directory))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(40):
            save_file({"w": torch.zeros(4 << 20)}, directory / "model.safetensors")
            if len(seen - {"model.safetensors"}) >= 2:
                break
    finally:
        stop.set()
        watcher.join()
    return seen - {"model.safetensors"}


def test_the_cleanup_matches_the_temp_names_each_writer_really_uses(tmp_path):
    names = _safetensors_temp_names(tmp_path)
    if not names:
        pytest.skip("safetensors' temporary file was never seen while it wrote (too fast to watch here)")
    assert all(is_temp_name(n) for n in names), names
    fd, tmp = tempfile.mkstemp(prefix=".model.safetensors.", suffix=".tmp", dir=tmp_path)  # atomic_write's call
    os.close(fd)
    assert is_temp_name(Path(tmp).name)


def test_leftovers_of_every_writer_are_removed_and_nothing_else(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    leftovers = [
        ".model.safetensors.k1ll3d_x.tmp",  # atomic_write's temp file
        ".train_state.safetensors.abc_1234.tmp",
        ".tmpAb3dE9",  # safetensors' own temp file
        ".vit_b16.npz.dl_4x9zq.tmp",  # a download's body so far (atomic_write's temp file in the cache)
    ]
    kept = [
        "model.safetensors",
        "config.yaml",
        "notes.tmp",  # not hidden: a user's
        ".tmpAb3",  # not six characters
        ".tmpAb3dE9x",
        ".m.onnx.abcdefgh.tmp.data",  # the external data a large ONNX graph refers to: live, not a leftover
        ".model.safetensors.short.tmp",
        ".lock",
        f".vit_b16.npz.{uuid.uuid4().hex}.part",  # no writer of vitkit's uses this name
    ]
    for name in leftovers + kept:
        (run / name).write_bytes(b"x")
    work = run / ".vitkit-export-a1b2_c3d"  # export_onnx's int8 work directory
    work.mkdir()
    (work / "fp32.onnx").write_bytes(b"graph")
    busy = run / ".vitkit-export-zzzzzzzz"  # something else lives in it: not ours to remove
    busy.mkdir()
    (busy / "mine.txt").write_text("user")
    link = run / ".config.yaml.abcdefgh.tmp"  # a link named like a leftover: never followed nor removed
    link.symlink_to(outside)
    removed = remove_stale_temp_files(run)
    assert sorted(p.name for p in removed) == sorted([*leftovers, work.name])
    left = sorted(p.name for p in run.iterdir())
    assert left == sorted([*kept, busy.name, link.name])
    assert outside.read_bytes() == b"precious bytes\n"
