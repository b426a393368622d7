"""Fetching a released file into the cache, checked before it is kept: ``download_url``, ``download_hub_files``.

A URL file comes through huggingface_hub's ``http_get`` (its session, proxies and resume) into a temporary name,
renamed only once checked, under a lock file: an interrupted, concurrent or bad download never leaves a file under
the final name. A server that cannot be reached fails at once, in one line, instead of after retries with backoff.
Hub files go through huggingface_hub (its cache, resume, HF_HUB_OFFLINE and progress bars).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import UserError, quiet
from ..io import atomic_write
from .cache import cache_dir, check_file, checkpoint_path, first_line, hub_cache_dir, manual_hub_dir, unreadable
from .row import PretrainedRow

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer
    from tqdm import tqdm


def _hub_offline() -> bool:
    import huggingface_hub.constants as hf_constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return flag or bool(hf_constants.HF_HUB_OFFLINE)


def _lock(path: Path):
    """An inter-process lock for one destination, kept apart from the files (<cache>/.locks/...): one outside the
    cache is locked there by its path's digest, so no lock file is left beside it."""
    import hashlib

    from filelock import FileLock

    root = cache_dir()
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path("outside") / hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:32]
    lock = root / ".locks" / rel.with_name(rel.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock))


DEADLINE_ENV = "VITKIT_DOWNLOAD_DEADLINE"
DEFAULT_DEADLINE = 4 * 3600.0  # seconds for one whole file, however large, on any link that keeps moving


def download_deadline() -> float:
    """The overall time one download may take, in seconds: ``$VITKIT_DOWNLOAD_DEADLINE``, else 4 hours."""
    text = os.environ.get(DEADLINE_ENV, "").strip()
    if not text:
        return DEFAULT_DEADLINE
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{DEADLINE_ENV}={text!r}: expected a positive number of seconds")
    return value


def download_url(
    url: str,
    dst: str | Path,
    sha256: str | None = None,
    size: int | None = None,
    progress: bool = True,
    format: str | None = None,
    listed_size: str | None = None,
    deadline: float | None = None,
) -> Path:
    """Download ``url`` to ``dst`` (unless it is there) through ``atomic_write`` under a lock; returns dst. The body is
    checked before it is renamed onto dst: its announced length, its size (exact, or ``listed_size`` within the host's
    rounding), its sha256 and its ``format``, all within ``deadline`` seconds. A concurrent download waits for the first
    one's file. Failures are one-line UserErrors naming the URL (or dst)."""
    import glob

    dst = Path(dst)
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    limit = download_deadline() if deadline is None else deadline

    def fetch_and_check(tmp: str) -> None:
        _fetch(url, Path(tmp), dst, progress, limit)
        check_file(Path(tmp), url, sha256, size, listed_size)
        reason = unreadable(Path(tmp), format, full=True) if format else None
        if reason:
            raise UserError(f"{url}: the download is {reason}; it was deleted (run again to retry)")

    if _hub_offline():  # huggingface_hub's session, which downloads it, refuses any request then
        raise UserError(f"{url}: not in the cache and HF_HUB_OFFLINE is set; fetch it elsewhere and put it at {dst}")
    with _lock(dst):
        if not dst.is_file():  # else another process (or an earlier call) finished it while we waited
            for stale in dst.parent.glob(f".{glob.escape(dst.name)}.*.tmp"):  # what a killed download left
                stale.unlink(missing_ok=True)
            atomic_write(dst, fetch_and_check)
    return dst


class _DiskError(Exception):
    """Writing the download failed (a full disk, say): the destination's problem, not the network's."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.errno = error.errno


class _Expired(Exception):
    """The download ran past its overall deadline."""


class _Stalled(Exception):
    """The server dropped the connection again no further into the file than before (see ``_Body.seek``)."""


class _Body(io.RawIOBase, BinaryIO):
    """The file ``http_get`` writes into: the deadline checked on each write, a refused write told apart."""

    def __init__(self, file: BinaryIO, ends: float) -> None:
        super().__init__()
        self.file, self.ends = file, ends
        self.reached = 0  # how far the furthest attempt got before the server made http_get start over

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        if time.monotonic() > self.ends:
            raise _Expired
        try:
            return self.file.write(data)
        except OSError as e:
            raise _DiskError(e) from e

    def tell(self) -> int:
        return self.file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        # http_get seeks to start over when the server ignores Range and resends the whole file: worth it only
        # while each attempt gets further than the last (a connection that always drops at one byte would loop)
        got = self.file.tell()
        if got <= self.reached:
            raise _Stalled(f"the connection dropped again at byte {got}")
        self.reached = got
        return self.file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        try:
            return self.file.truncate(size)
        except OSError as e:
            raise _DiskError(e) from e


# http_get buffers huggingface_hub's DOWNLOAD_CHUNK_SIZE (10 MiB) before each write, so a server trickling less
# would never reach _Body.write, where the deadline is checked. While vitkit downloads, the constant is None (each
# network read as it comes) and it is put back when the last of vitkit's downloads in this process ends.
_CHUNKS = threading.Lock()
_chunk_users = 0
_chunk_size = 10 * 2**20  # huggingface_hub's value, read again when the first download starts


@contextlib.contextmanager
def _chunk_per_read() -> Iterator[None]:
    global _chunk_users, _chunk_size
    from huggingface_hub import constants

    with _CHUNKS:
        if _chunk_users == 0:
            _chunk_size = constants.DOWNLOAD_CHUNK_SIZE
            constants.DOWNLOAD_CHUNK_SIZE = None  # type: ignore[assignment]  # declared int; iter_bytes takes None
        _chunk_users += 1
    try:
        yield
    finally:
        with _CHUNKS:
            _chunk_users -= 1
            if _chunk_users == 0:
                constants.DOWNLOAD_CHUNK_SIZE = _chunk_size


def unreachable(url: str) -> str | None:
    """Why ``url``'s server cannot be reached (one HEAD request, without retries and backoff), or None when it
    answers or fails otherwise (for the request itself to meet and report)."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import http_backoff

    with quiet("huggingface_hub"):
        try:
            http_backoff(
                "HEAD", url, max_retries=0, retry_on_exceptions=(), retry_on_status_codes=(), follow_redirects=False,
                timeout=constants.HF_HUB_ETAG_TIMEOUT,
            )  # fmt: skip
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:
            return first_line(e)
        except (httpx2.HTTPError, httpx2.InvalidURL, OSError):
            pass
    return None


def _check_reachable(url: str, by_hand: str) -> None:
    """Fail at once when ``url``'s server cannot be reached (``unreachable``)."""
    reason = unreachable(url)
    if reason is not None:
        raise UserError(f"{url}: cannot download ({reason}); without network access, {by_hand}") from None


def _fetch(url: str, tmp: Path, dst: Path, progress: bool, deadline: float) -> None:
    """The body of ``url`` into ``tmp`` through ``http_get``; failures as one-line UserErrors."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.file_download import http_get

    ends = time.monotonic() + deadline
    by_hand = f"fetch this URL elsewhere and put the file at {dst}"
    _check_reachable(url, by_hand)
    problem: str | None = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(quiet("huggingface_hub"))
            try:
                out = stack.enter_context(open(tmp, "wb"))  # the module's open: a test stands in a full disk
            except OSError as e:
                raise _DiskError(e) from e
            with _chunk_per_read():  # no expected_size: a size that differs is check_file's to report, with both
                http_get(
                    url, _Body(out, ends), headers={"Accept-Encoding": "identity"}, displayed_filename=dst.name,
                    tqdm_class=_tqdm_class(progress),
                )  # fmt: skip
                try:
                    out.flush()  # so that closing the file has nothing left to write (and fail on)
                except OSError as e:
                    raise _DiskError(e) from e
    except _DiskError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        hint = f"; free space in {dst.parent} or set VITKIT_CACHE to another disk" if full else ""
        problem = f"{dst}: could not be written ({e}){hint}; no file was saved"
    except _Expired:
        problem = (
            f"{url}: the download took over {deadline:g} s (the server is too slow, or stalls); no file was saved; "
            f"set {DEADLINE_ENV} to allow more"
        )
    except HfHubHTTPError as e:
        status = e.response.status_code
        problem = f"{url}: HTTP {status} {e.response.reason_phrase}; no file was saved"
    except httpx2.TooManyRedirects:
        problem = f"{url}: too many redirects (a redirect loop); no file was saved"
    except OfflineModeIsEnabled:
        problem = f"{url}: not in the cache and HF_HUB_OFFLINE is set; {by_hand}"
    except (httpx2.RemoteProtocolError, _Stalled, OSError) as e:
        # the body ended before its announced length, each retry included (http_get: "Consistency check failed")
        problem = f"{url}: the download ended early ({first_line(e)}); no file was saved, run again to retry"
    except (httpx2.TransportError, httpx2.InvalidURL) as e:
        problem = f"{url}: cannot download ({first_line(e)}); without network access, {by_hand}"
    if problem is not None:
        raise UserError(problem)


def _tqdm_class(show: bool) -> type[tqdm]:
    """A byte-counting progress bar class, shown or not, for huggingface_hub's downloads."""
    from tqdm import tqdm

    class Bar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "unit_divisor": 1024, "leave": False, "disable": not show})

    return Bar


def download_hub_files(row: PretrainedRow, progress: bool = True) -> Path:
    """The row's files through huggingface_hub: its cache first (no network), then the Hub (or HF_ENDPOINT)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    manual = manual_hub_dir(row)
    cache = hub_cache_dir()
    revision = row.revision
    hub = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    files: list[Path] = []
    for name in row.hub_files:
        url = f"{hub}/{row.hub_repo}/resolve/{revision}/{name}"
        if len(row.hub_files) == 1:
            by_hand = f"fetch it elsewhere and put it at {manual / name}"
        else:
            by_hand = f"fetch {', '.join(row.hub_files)} elsewhere and put them in {manual}"
        try:
            got = hf_hub_download(row.repo, name, revision=revision, cache_dir=cache, local_files_only=True)
        except LocalEntryNotFoundError:
            if _hub_offline():
                raise UserError(f"{url}: not in the cache and HF_HUB_OFFLINE is set; {by_hand}") from None
            endpoint = os.environ.get("HF_ENDPOINT") or None  # read per call (huggingface_hub reads it at import)
            _check_reachable(url, by_hand)
            try:
                with quiet("huggingface_hub"):
                    got = hf_hub_download(
                        row.repo, name, revision=revision, cache_dir=cache, endpoint=endpoint,
                        tqdm_class=None if progress else _tqdm_class(False),
                    )  # fmt: skip
            except (HfHubHTTPError, EntryNotFoundError) as e:
                # huggingface_hub reports a failed look-up as LocalEntryNotFoundError, the HTTP answer (if any)
                # as its cause; no answer at all means the Hub cannot be reached
                answer = e if isinstance(e, HfHubHTTPError) else e.__cause__
                status = getattr(getattr(answer, "response", None), "status_code", None)
                if status is not None:
                    raise UserError(f"{url}: HTTP {status}; no file was saved") from None
                cause = first_line(e.__cause__ or e)
                raise UserError(f"{url}: cannot download ({cause}); without network access, {by_hand}") from None
        path = Path(got)
        if row.sha256 is not None and name == row.hub_files[-1]:
            try:
                check_file(path.resolve(), url, row.sha256, row.size)
            except UserError:
                path.unlink(missing_ok=True)  # the snapshot's link to the deleted blob
                raise
        # later files of the row from the same commit, so an HF directory never mixes two revisions
        revision = path.parent.name if row.revision == "main" and len(path.parent.name) == 40 else revision
        files.append(path)
    return checkpoint_path(row, files)
