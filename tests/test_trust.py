"""A tag means one file: the file at a tag's cache path is checked against its row (architecture, classes,
resolution, listed size) and, once verified, against the sha256 recorded beside it; a download is checked before
it gets its final name (a body cut short without Content-Length, an HTML page, a trickling server, a full disk,
a redirect loop), and what a killed download left is cleaned. Served by a local HTTP server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.server
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_pretrained import TINY, npz_bytes, one_line, tiny_model

import vitkit
from vitkit import UserError
from vitkit import pretrained as released
from vitkit.cli import main
from vitkit.pretrained import PRETRAINED, PretrainedRow, download, resolve_pretrained

Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


class Server:
    """http.server on 127.0.0.1 answering each path with its own handler function."""

    def __init__(self) -> None:
        self.routes: dict[str, Handler] = {}
        routes = self.routes

        class Answer(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (a deadline)
                    route(self)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("VITKIT_CACHE", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv(released.DEADLINE_ENV, raising=False)
    return root


def body(data: bytes, length: bool = True, content_type: str = "application/octet-stream") -> Handler:
    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        if length:
            h.send_header("Content-Length", str(len(data)))
        else:
            h.send_header("Connection", "close")  # no length: the body ends when the connection does
        h.end_headers()
        h.wfile.write(data)
        h.wfile.flush()
        h.close_connection = True

    return answer


def row_at(server: Server, path: str, **fields) -> PretrainedRow:
    return PretrainedRow("vit_ti16", "test_npz", "official", url=server.url + path, img_size=16, config=TINY, **fields)


def fetch(row: PretrainedRow):
    return resolve_pretrained(row.tag, {row.tag: row}, progress=False)


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".tmp", ".part", ".incomplete"))]


# -------------------------------------------------------------------------------------- a tag means its file
def test_a_file_of_another_model_at_the_tags_path_is_refused_naming_both(server, cache, monkeypatch):
    other = vitkit.VisionTransformer(**{**TINY, "depth": 3, "num_classes": 10})  # a valid checkpoint, not the tag's
    server.routes["/w/tiny.npz"] = body(npz_bytes(other))
    row = row_at(server, "/w/tiny.npz")
    monkeypatch.setitem(PRETRAINED, row.tag, row)
    with pytest.raises(UserError) as e:
        vitkit.load_model(row.tag)
    message = one_line(e)
    path = cache / "w" / "tiny.npz"
    assert message.startswith(f"{path}: not the file of {row.tag}:")
    assert "depth 3 (the tag: 2)" in message and "num_classes 10 (the tag: 1000)" in message
    assert f"rm '{path}'" in message
    assert not path.with_name(path.name + released.VERIFIED_SUFFIX).exists()  # nothing refused is recorded


def test_the_row_implies_resolution_and_pre_logits(server, cache, monkeypatch):
    model = tiny_model()
    server.routes["/w/tiny.npz"] = body(npz_bytes(model))
    for fields, wanted in (
        ({**TINY, "img_size": 32}, "img_size (16, 16) (the tag: (32, 32))"),
        ({**TINY, "representation_size": 32}, "representation_size None (the tag: 32)"),
    ):
        row = PretrainedRow("vit_ti16", "test_npz", "official", url=server.url + "/w/tiny.npz", config=fields)
        monkeypatch.setitem(PRETRAINED, row.tag, row)
        with pytest.raises(UserError, match=r"not the file of vit_ti16\.test_npz") as e:
            vitkit.load_model(row.tag)
        assert wanted in one_line(e)


def test_a_verified_file_that_changes_later_is_named_with_how_to_fetch_it_again(server, cache, monkeypatch, capsys):
    model = tiny_model()
    data = npz_bytes(model)
    server.routes["/w/tiny.npz"] = body(data)
    row = row_at(server, "/w/tiny.npz")
    monkeypatch.setitem(PRETRAINED, row.tag, row)
    path = cache / "w" / "tiny.npz"
    assert main(["models", "--pretrained", "test_npz"]) == 0
    assert "  no  " in capsys.readouterr().out.splitlines()[1]
    vitkit.load_model(row.tag)
    record = json.loads(path.with_name(path.name + released.VERIFIED_SUFFIX).read_text())
    assert record["sha256"] == hashlib.sha256(data).hexdigest() and record["tag"] == row.tag
    assert main(["models", "--pretrained", "test_npz"]) == 0
    assert "cached (arch)" in capsys.readouterr().out
    # flip one byte of one array's data: still a valid zip directory, another file
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    with pytest.raises(UserError) as e:
        vitkit.load_model(row.tag)
    message = one_line(e)
    assert message.startswith(f"{path}: the cached file of {row.tag} changed since it was first verified")
    assert f"rm '{path}'" in message
    assert main(["models", "--pretrained", "test_npz"]) == 0
    assert "cached (changed)" in capsys.readouterr().out
    path.unlink()  # the remedy the message gives: the next use downloads it anew
    torch.testing.assert_close(
        vitkit.load_model(row.tag).state_dict()["head.weight"], model.state_dict()["head.weight"]
    )


def test_an_unreadable_cached_file_says_so_and_how_to_remove_it(server, cache, monkeypatch, capsys):
    row = row_at(server, "/w/tiny.npz")
    monkeypatch.setitem(PRETRAINED, row.tag, row)
    path = cache / "w" / "tiny.npz"
    path.parent.mkdir(parents=True)
    path.write_bytes(npz_bytes(tiny_model())[:-100])  # cut short: its zip directory is gone
    with pytest.raises(UserError) as e:
        vitkit.load_model(row.tag)
    message = one_line(e)
    assert message.startswith(f"{path}: the cached file of {row.tag} is unreadable (not an .npz archive")
    assert f"rm '{path}'" in message
    assert main(["models", "--pretrained", "test_npz"]) == 0
    assert "cached (unreadable)" in capsys.readouterr().out


def test_a_file_put_by_hand_is_held_to_the_published_checksum(server, cache):
    data = npz_bytes(tiny_model())
    row = row_at(server, "/w/tiny.npz", sha256=hashlib.sha256(data).hexdigest())
    path = cache / "w" / "tiny.npz"
    path.parent.mkdir(parents=True)
    path.write_bytes(npz_bytes(vitkit.VisionTransformer(**TINY)))  # readable, of the right model, another file
    with pytest.raises(UserError, match=f"not the published file of {row.tag} \\(sha256 [0-9a-f]{{64}}, published"):
        fetch(row)
    path.write_bytes(data)
    assert fetch(row)[0] == path


def test_listed_sizes_stand_for_the_range_their_rounding_allows():
    lo, hi = released.listed_bounds("393.69 MiB")
    assert lo <= 393.69 * 2**20 <= hi and hi < 393.71 * 2**20 and lo > 393.67 * 2**20
    lo, hi = released.listed_bounds("346 MB")
    assert lo <= 346e6 <= hi and hi < 347.1e6 and lo > 344.9e6
    listed = [row for row in PRETRAINED.values() if row.listed_size]
    assert len(listed) >= 20
    for row in listed:  # every listed size of the table parses
        assert released.listed_bounds(row.listed_size)[0] > 10 * 2**20, row.tag


def test_a_download_of_another_size_than_listed_is_deleted(server, cache):
    data = npz_bytes(tiny_model())
    server.routes["/w/tiny.npz"] = body(data)
    row = row_at(server, "/w/tiny.npz", listed_size="37 MiB")
    with pytest.raises(UserError) as e:
        fetch(row)
    assert f"expected about 37 MiB as listed, got {len(data)} bytes" in one_line(e)
    assert not (cache / "w" / "tiny.npz").exists() and leftovers(cache) == []


# ---------------------------------------------------------------------------------------------- downloads
def bad_body(kind: str) -> Handler:
    if kind == "html_page":  # a sign-in or error page served with status 200
        return body(b"<html><body>Please sign in</body></html>", content_type="text/html")
    if kind == "cut_short_without_length":  # the connection drops and no Content-Length tells
        return body(npz_bytes(tiny_model())[:5000], length=False)
    return body(b"")


@pytest.mark.parametrize("kind", ["html_page", "cut_short_without_length", "empty"])
def test_a_bad_body_never_gets_the_final_name(server, cache, kind):
    server.routes["/w/tiny.npz"] = bad_body(kind)
    row = row_at(server, "/w/tiny.npz")
    with pytest.raises(UserError) as e:
        fetch(row)
    message = one_line(e)
    assert message.startswith(f"{row.url}: the download is not an .npz archive") and "deleted" in message
    assert not (cache / "w" / "tiny.npz").exists() and leftovers(cache) == []


def test_an_npz_of_another_kind_is_refused_at_download(server, cache):
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, weights=np.zeros(3))
    server.routes["/w/tiny.npz"] = body(buffer.getvalue())
    with pytest.raises(UserError, match="no 'embedding/kernel' array, so not a official checkpoint"):
        fetch(row_at(server, "/w/tiny.npz"))


def test_what_a_killed_download_left_is_cleaned_by_the_next(server, cache):
    server.routes["/w/tiny.npz"] = body(npz_bytes(tiny_model()))
    stale = cache / "w" / ".tiny.npz.k1ll3d.tmp"  # atomic_write's temporary name, left by SIGKILL
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a file")
    other = cache / "w" / ".other.npz.k1ll3d.tmp"  # another entry's: not this download's to remove
    other.write_bytes(b"x")
    path, _ = fetch(row_at(server, "/w/tiny.npz"))
    assert path.is_file() and not stale.exists() and other.exists()


def test_a_trickling_server_meets_the_overall_deadline(server, cache, monkeypatch):
    def trickle(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        for _ in range(400):  # 4 bytes every 10 ms: never silent long enough for a read timeout
            h.wfile.write(b"PK\x03\x04")
            h.wfile.flush()
            time.sleep(0.01)

    server.routes["/w/slow.npz"] = trickle
    monkeypatch.setenv(released.DEADLINE_ENV, "0.5")
    with pytest.raises(UserError) as e:
        fetch(row_at(server, "/w/slow.npz"))
    assert one_line(e).startswith(f"{server.url}/w/slow.npz: the download took over 0.5 s")
    assert released.DEADLINE_ENV in str(e.value) and leftovers(cache) == []
    monkeypatch.setenv(released.DEADLINE_ENV, "soon")
    with pytest.raises(UserError, match="VITKIT_DOWNLOAD_DEADLINE='soon': expected a positive number of seconds"):
        fetch(row_at(server, "/w/slow.npz"))


def test_a_redirect_loop_is_one_line(server, cache, capfd):
    def loop(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", "/w/loop.npz")
        h.send_header("Content-Length", "0")
        h.end_headers()

    server.routes["/w/loop.npz"] = loop
    row = row_at(server, "/w/loop.npz")
    with pytest.raises(UserError) as e:
        fetch(row)
    assert one_line(e) == f"{row.url}: too many redirects (a redirect loop); no file was saved"
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_a_full_disk_during_a_download_is_one_line_naming_the_file(server, cache, monkeypatch):
    server.routes["/w/tiny.npz"] = body(npz_bytes(tiny_model()))

    class Full:
        def __init__(self, *args) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(download, "open", Full, raising=False)  # the module's open: its download file only
    with pytest.raises(UserError) as e:
        fetch(row_at(server, "/w/tiny.npz"))
    path = cache / "w" / "tiny.npz"
    assert one_line(e) == (
        f"{path}: could not be written (No space left on device); free space in {path.parent} or set VITKIT_CACHE to "
        "another disk; no file was saved"
    )
    assert not path.exists() and leftovers(cache) == []


def test_a_refused_hub_connection_prints_vitkits_line_only(cache, monkeypatch, capfd, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    row = PretrainedRow("vit_ti16", "test_hub", "hf", hub_repo="org/none", hub_files=("config.json",), config=TINY)
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.get_logger("huggingface_hub")  # its first use sets its logger's level: read the level after it
    level = logging.getLogger("huggingface_hub").level
    with caplog.at_level("INFO"), pytest.raises(UserError) as e:
        fetch(row)
    assert one_line(e).startswith(f"http://127.0.0.1:{port}/org/none/resolve/main/config.json: cannot download")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]
    assert logging.getLogger("huggingface_hub").level == level  # left as it was for the rest of the process


def resumable(data: bytes, rest: bytes | None = None) -> tuple[Handler, list[str | None]]:
    """Serves data, but the first answer drops the connection halfway; a Range request gets the rest (``rest``
    in place of the true remainder, when given). Returns the handler and the Range header of each request."""
    ranges: list[str | None] = []

    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        asked = h.headers.get("Range")
        ranges.append(asked)
        if asked is None:
            h.send_response(200)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data[: len(data) // 2])  # then the connection drops
        else:
            start = int(asked.removeprefix("bytes=").removesuffix("-"))
            tail = data[start:] if rest is None else rest
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            h.send_header("Content-Length", str(len(tail)))
            h.end_headers()
            h.wfile.write(tail)
        h.wfile.flush()
        h.close_connection = True

    return answer, ranges


def test_a_dropped_connection_is_resumed_and_the_whole_file_checked(server, cache):
    data = npz_bytes(tiny_model())
    server.routes["/w/tiny.npz"], ranges = resumable(data)
    row = row_at(server, "/w/tiny.npz", sha256=hashlib.sha256(data).hexdigest())
    path, _ = fetch(row)
    assert path.read_bytes() == data and ranges == [None, f"bytes={len(data) // 2}-"]
    assert leftovers(cache) == []


def test_a_resumed_body_that_does_not_fit_never_gets_the_final_name(server, cache):
    data = npz_bytes(tiny_model())
    half = len(data) // 2
    wrong = bytearray(data[half:])
    wrong[10] ^= 0xFF  # one byte of an array's data: the zip directory at the end still reads
    server.routes["/w/tiny.npz"], ranges = resumable(data, rest=bytes(wrong))
    row = row_at(server, "/w/tiny.npz")
    with pytest.raises(UserError) as e:
        fetch(row)
    assert one_line(e).startswith(f"{row.url}: the download is member ") and "corrupt" in str(e.value)
    assert ranges == [None, f"bytes={half}-"]
    assert not (cache / "w" / "tiny.npz").exists() and leftovers(cache) == []


def test_hf_hub_offline_stops_a_url_download_too(server, cache, monkeypatch):
    from huggingface_hub import constants

    before = constants.DOWNLOAD_CHUNK_SIZE
    server.routes["/w/tiny.npz"], ranges = resumable(npz_bytes(tiny_model()))
    row = row_at(server, "/w/tiny.npz")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as e:
        fetch(row)
    path = cache / "w" / "tiny.npz"
    assert (
        one_line(e) == f"{row.url}: not in the cache and HF_HUB_OFFLINE is set; fetch it elsewhere and put it at {path}"
    )
    assert ranges == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert fetch(row)[0] == path
    assert before == constants.DOWNLOAD_CHUNK_SIZE  # huggingface_hub's setting, as it was before the download
