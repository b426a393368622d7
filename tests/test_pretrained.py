"""Released weights by tag: the table itself, and downloads served by a local HTTP server (plain URLs and the
Hugging Face Hub's resolve URLs) into a cache under tmp_path: success and cache reuse, HTTP errors, a body
cut short, a checksum mismatch, no network, concurrent downloads, and models built from tags."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import re
import socket
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit import UserError, VisionTransformer
from vitkit import pretrained as released
from vitkit.checkpoint import read_checkpoint
from vitkit.checkpoint.hf import save_hf
from vitkit.checkpoint.official import vitkit_to_official
from vitkit.cli import main
from vitkit.models import MODELS, registry
from vitkit.predict import load_for_inference
from vitkit.pretrained import PRETRAINED, PretrainedRow, list_pretrained, resolve_pretrained
from vitkit.pretrained.download import download_url

# a tiny ViT with an ImageNet-1k head, so the released class names apply to it
TINY = dict(img_size=16, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=1000)
COMMIT = "c0ffee" + "0" * 34


# ------------------------------------------------------------------------------------------ local server
@dataclass
class Route:
    body: bytes
    status: int = 200
    announce: int | None = None  # Content-Length to announce (more than the body: a download cut short)
    delay: float = 0.0  # seconds to stall halfway through the body
    hub: bool = False  # answer as the Hub's resolve URLs do (ETag, X-Repo-Commit)


class Server:
    """http.server on 127.0.0.1 (an ephemeral port) serving registered paths and counting requests."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: Counter[tuple[str, str]] = Counter()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, with_body: bool) -> None:
                server.hits[(self.command, self.path)] += 1
                route = server.routes.get(self.path)
                if route is None or route.status != 200:
                    self.send_error(route.status if route else 404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(route.announce or len(route.body)))
                if route.hub:
                    self.send_header("ETag", f'"{hashlib.sha256(route.body).hexdigest()}"')
                    self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if with_body:
                    half = len(route.body) // 2
                    self.wfile.write(route.body[:half])
                    self.wfile.flush()
                    time.sleep(route.delay)
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that gave up
                        self.wfile.write(route.body[half:])

            def do_GET(self) -> None:
                self._answer(with_body=True)

            def do_HEAD(self) -> None:
                self._answer(with_body=False)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, path: str) -> int:
        return self.hits[("GET", path)]

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
    return root


def tiny_model() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a head that is not zero, so it is seen to load
    return model


def npz_bytes(model: VisionTransformer) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **vitkit_to_official(model))
    return buf.getvalue()


def url_row(server: Server, path: str, **fields) -> PretrainedRow:
    return PretrainedRow("vit_ti16", "test_npz", "official", url=server.url + path, img_size=16, config=TINY, **fields)


def hub_row(files: tuple[str, ...] = ("config.json", "model.safetensors"), **fields) -> PretrainedRow:
    fields = {"img_size": 16, "config": TINY, **fields}
    return PretrainedRow("vit_ti16", "test_hub", "hf", hub_repo="org/tiny-vit", hub_files=files, **fields)


def leftovers(root: Path) -> list[Path]:
    """Partial downloads anywhere under root."""
    return [p for p in root.rglob("*") if p.name.endswith((".part", ".incomplete", ".tmp"))]


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------- URL rows
def test_download_lands_in_the_cache_once(server, cache):
    body = npz_bytes(tiny_model())
    server.routes["/vit_models/x%2By/tiny.npz"] = Route(body)
    row = url_row(server, "/vit_models/x%2By/tiny.npz", sha256=hashlib.sha256(body).hexdigest(), size=len(body))
    table = {row.tag: row}
    path, got = resolve_pretrained(row.tag, table, progress=False)
    assert got is row and path == cache / "vit_models" / "x+y" / "tiny.npz"  # the URL's path, unquoted
    assert path.read_bytes() == body and server.gets("/vit_models/x%2By/tiny.npz") == 1
    assert resolve_pretrained(row.tag, table, progress=False)[0] == path
    assert server.gets("/vit_models/x%2By/tiny.npz") == 1  # the cached file is used without any request
    assert released.cached_path(row) == path and leftovers(cache) == []


def test_a_download_outside_the_cache_leaves_no_lock_file_beside_it(server, cache, tmp_path):
    server.routes["/file.bin"] = Route(b"x" * 100)
    (tmp_path / "mine").mkdir()
    got = download_url(f"{server.url}/file.bin", tmp_path / "mine" / "file.bin", size=100, progress=False)
    assert got.read_bytes() == b"x" * 100
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["file.bin"]


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("VITKIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert released.cache_dir() == tmp_path / "xdg" / "vitkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert released.cache_dir() == Path("~/.cache/vitkit").expanduser()
    monkeypatch.setenv("VITKIT_CACHE", str(tmp_path / "moved"))
    assert released.cache_dir() == tmp_path / "moved"


def test_http_error_is_one_line_naming_the_url(server, cache):
    row = url_row(server, "/missing.npz")
    with pytest.raises(UserError) as e:
        resolve_pretrained(row.tag, {row.tag: row}, progress=False)
    assert f"{server.url}/missing.npz: HTTP 404" in one_line(e)
    assert not (cache / "missing.npz").exists() and leftovers(cache) == []


def test_a_body_cut_short_leaves_nothing_under_the_final_name(server, cache):
    body = npz_bytes(tiny_model())
    server.routes["/short.npz"] = Route(body, announce=len(body) + 1000)
    row = url_row(server, "/short.npz")
    with pytest.raises(UserError) as e:
        resolve_pretrained(row.tag, {row.tag: row}, progress=False)
    assert "ended early" in one_line(e) and "no file was saved" in str(e.value)
    assert not (cache / "short.npz").exists() and leftovers(cache) == []


def test_checksum_mismatch_deletes_the_download(server, cache):
    body = npz_bytes(tiny_model())
    server.routes["/bad.npz"] = Route(body)
    row = url_row(server, "/bad.npz", sha256="0" * 64)
    with pytest.raises(UserError) as e:
        resolve_pretrained(row.tag, {row.tag: row}, progress=False)
    message = one_line(e)
    assert f"expected {'0' * 64}, got {hashlib.sha256(body).hexdigest()}" in message and "deleted" in message
    assert not (cache / "bad.npz").exists() and leftovers(cache) == []
    row = url_row(server, "/bad.npz", size=len(body) - 1)
    with pytest.raises(UserError, match=f"expected {len(body) - 1} bytes, got {len(body)}"):
        resolve_pretrained(row.tag, {row.tag: row}, progress=False)
    assert not (cache / "bad.npz").exists()


def test_without_network_the_error_says_where_to_put_the_file(cache):
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    row = PretrainedRow("vit_ti16", "test_npz", "official", url=f"http://127.0.0.1:{port}/w/tiny.npz", config=TINY)
    table = {row.tag: row}
    with pytest.raises(UserError) as e:
        resolve_pretrained(row.tag, table, progress=False)
    final = cache / "w" / "tiny.npz"
    message = one_line(e)
    assert message.startswith(f"http://127.0.0.1:{port}/w/tiny.npz: cannot download") and str(final) in message
    final.write_bytes(npz_bytes(tiny_model()))  # put by hand: used as it is
    assert resolve_pretrained(row.tag, table, progress=False)[0] == final


def test_concurrent_downloads_of_one_file_make_one_correct_file(server, cache):
    body = npz_bytes(tiny_model())
    server.routes["/slow.npz"] = Route(body, delay=0.5)
    row = url_row(server, "/slow.npz")
    results, errors = [], []

    def fetch():
        try:
            results.append(resolve_pretrained(row.tag, {row.tag: row}, progress=False)[0])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [cache / "slow.npz"] * 2
    assert (cache / "slow.npz").read_bytes() == body
    assert server.gets("/slow.npz") == 1  # the second waited on the lock and took the first one's file
    assert leftovers(cache) == [] and sorted(p.name for p in cache.iterdir()) == [".locks", "slow.npz"]


def _resolve_in_a_process(tag: str, row: PretrainedRow, cache: str, start, results) -> None:
    import os

    os.environ["VITKIT_CACHE"] = cache
    start.wait()  # both processes are up: they ask at the same moment
    results.put(str(resolve_pretrained(tag, {tag: row}, progress=False)[0]))


def test_two_processes_downloading_one_file_share_one_download(server, cache):
    import multiprocessing

    body = npz_bytes(tiny_model())
    server.routes["/slow.npz"] = Route(body, delay=1.0)
    row = url_row(server, "/slow.npz")
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_resolve_in_a_process, args=(row.tag, row, str(cache), start, results)) for _ in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [results.get(timeout=5) for _ in procs] == [str(cache / "slow.npz")] * 2
    assert (cache / "slow.npz").read_bytes() == body
    assert server.gets("/slow.npz") == 1 and leftovers(cache) == []  # the second waited on the lock file


# --------------------------------------------------------------------------------------------- Hub rows
@pytest.fixture
def hub(server, cache, monkeypatch, tmp_path):
    """The Hub's resolve URLs for org/tiny-vit (an HF directory of the tiny model), on the local server."""
    model = tiny_model()
    save_hf(model, tmp_path / "hf")
    for name in ("config.json", "model.safetensors"):
        body = (tmp_path / "hf" / name).read_bytes()
        server.routes[f"/org/tiny-vit/resolve/main/{name}"] = Route(body, hub=True)
        server.routes[f"/org/tiny-vit/resolve/{COMMIT}/{name}"] = Route(body, hub=True)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    return model


def test_hub_files_come_through_huggingface_hub_into_its_cache(hub, server, cache):
    row = hub_row()
    table = {row.tag: row}
    path, _ = resolve_pretrained(row.tag, table, progress=False)
    assert path == cache / "huggingface" / "models--org--tiny-vit" / "snapshots" / COMMIT
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    requests = sum(server.hits.values())
    assert resolve_pretrained(row.tag, table, progress=False)[0] == path
    assert sum(server.hits.values()) == requests  # the cache answers without a request
    assert released.cached_path(row) == path
    model = vitkit.load_model(str(path))
    torch.testing.assert_close(model.state_dict()["head.weight"], hub.state_dict()["head.weight"])


def test_hub_offline_uses_the_cache_or_says_where_to_put_the_files(hub, server, cache, monkeypatch):
    row = hub_row()
    table = {row.tag: row}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as e:
        resolve_pretrained(row.tag, table, progress=False)
    manual = cache / "org" / "tiny-vit"
    assert "HF_HUB_OFFLINE" in one_line(e) and str(manual) in str(e.value)
    assert sum(server.hits.values()) == 0
    monkeypatch.delenv("HF_HUB_OFFLINE")
    path, _ = resolve_pretrained(row.tag, table, progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    requests = sum(server.hits.values())
    assert resolve_pretrained(row.tag, table, progress=False)[0] == path  # cached: fine offline
    assert sum(server.hits.values()) == requests
    # files put by hand at <cache>/<repo>/ are used first
    manual.mkdir(parents=True)
    for f in path.iterdir():
        (manual / f.name).write_bytes(f.read_bytes())
    assert resolve_pretrained(row.tag, table, progress=False)[0] == manual


def test_hub_errors_name_the_url(hub, server, cache):
    row = hub_row(files=("missing.safetensors",))
    with pytest.raises(UserError) as e:
        resolve_pretrained(row.tag, {row.tag: row}, progress=False)
    assert f"{server.url}/org/tiny-vit/resolve/main/missing.safetensors: HTTP 404" in one_line(e)
    row = hub_row(files=("model.safetensors",), sha256="f" * 64)
    with pytest.raises(UserError, match=f"sha256 mismatch \\(expected {'f' * 64}, got"):
        resolve_pretrained(row.tag, {row.tag: row}, progress=False)
    assert released.cached_path(row) is None  # the bad file is gone from the Hub cache too


def test_a_damaged_hub_file_is_named_with_its_blob_to_remove(hub, server, cache, monkeypatch, capsys):
    row = hub_row()
    monkeypatch.setitem(PRETRAINED, row.tag, row)
    vitkit.load_model(row.tag)  # verified: its sha256 is recorded beside the snapshot's file
    weights = released.cached_path(row) / "model.safetensors"
    assert weights.with_name(weights.name + released.VERIFIED_SUFFIX).is_file()
    blob = weights.resolve()
    blob.write_bytes(blob.read_bytes()[:-10])  # a truncated blob
    with pytest.raises(UserError) as e:
        vitkit.load_model(row.tag)
    message = one_line(e)
    assert message.startswith(f"{weights}: the cached file of {row.tag} changed since it was first verified")
    assert f"rm '{weights}' '{blob}'" in message
    weights.with_name(weights.name + released.VERIFIED_SUFFIX).unlink()  # never verified: read for what it is
    with pytest.raises(UserError, match="is unreadable \\(truncated or padded"):
        vitkit.load_model(row.tag)
    assert main(["models", "--pretrained", "test_hub"]) == 0
    assert "cached (unreadable)" in capsys.readouterr().out


def test_a_timm_file_by_tag_is_built_as_the_table_says_without_guessing(hub, server, cache, monkeypatch, tmp_path):
    from safetensors.torch import save_file

    from vitkit.checkpoint.timm import vitkit_to_timm

    model = tiny_model()
    save_file(vitkit_to_timm(model), tmp_path / "timm.safetensors")
    server.routes["/org/tiny-vit/resolve/main/timm.safetensors"] = Route(
        (tmp_path / "timm.safetensors").read_bytes(), hub=True
    )
    row = hub_row(files=("timm.safetensors",), config={**TINY, "gelu": "exact"})
    monkeypatch.setitem(PRETRAINED, row.tag, replace(row, format="timm"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # num_heads and gelu come from the table, not from a guess
        loaded, report = vitkit.load_model(row.tag, return_report=True)
        created = vitkit.create_model("vit_ti16", pretrained="test_hub")
    assert report.format == "timm" and loaded.config == created.config and loaded.config.gelu == "exact"
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), created.eval()(x))


# ---------------------------------------------------------------------------------- models from tags
@pytest.fixture
def tagged(server, cache, monkeypatch):
    """The tiny model served as vit_ti16.test_npz (a URL row) in the real table, for the test's duration."""
    model = tiny_model()
    server.routes["/t/tiny.npz"] = Route(npz_bytes(model))
    monkeypatch.setitem(PRETRAINED, "vit_ti16.test_npz", url_row(server, "/t/tiny.npz"))
    return model


def test_create_model_and_load_model_take_a_tag(tagged):
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = tagged(x)
        for model in (
            vitkit.create_model("vit_ti16", pretrained="test_npz"),
            vitkit.create_model("vit_ti16", pretrained="vit_ti16.test_npz"),
            vitkit.load_model("vit_ti16.test_npz"),
        ):
            torch.testing.assert_close(model.eval()(x), want, rtol=1e-5, atol=1e-5)
    model, meta = vitkit.load_model("vit_ti16.test_npz", return_metadata=True)
    assert meta["pretrained_tag"] == "vit_ti16.test_npz" and meta["img_size"] == 16 and meta["mean"] == [0.5] * 3
    assert len(meta["class_names"]) == 1000 and meta["class_names"][0] == "tench, Tinca tinca"
    fresh = vitkit.create_model("vit_ti16", pretrained="test_npz", num_classes=10)  # the head is asked anew
    assert fresh.config.num_classes == 10 and not fresh.head.weight.any()
    _, meta = vitkit.load_model("vit_ti16.test_npz", return_metadata=True, num_classes=10)
    assert "class_names" not in meta  # the released names belong to the released head
    with pytest.raises(UserError, match="unknown pretrained weights 'vit_ti16.test_np'; did you mean"):
        vitkit.create_model("vit_ti16", pretrained="test_np")
    with pytest.raises(UserError, match="holds weights of vit_ti16, not of vit_s16"):
        vitkit.create_model("vit_s16", pretrained="vit_ti16.test_npz")
    with pytest.raises(FileNotFoundError, match="no-such.npz"):
        vitkit.load_model("no-such.npz")  # not a tag: a path, and a missing one


def test_predict_and_convert_take_a_tag(tagged, tmp_path, capsys):
    model, prep, meta = load_for_inference("vit_ti16.test_npz")
    assert prep.img_size == 16 and prep.crop_fraction == 1.0 and len(prep.class_names) == 1000
    image = tmp_path / "cat.png"
    Image.fromarray(np.full((20, 24, 3), 128, np.uint8)).save(image)
    assert main(["predict", "vit_ti16.test_npz", str(image), "--top-k", "1"]) == 0
    out = capsys.readouterr().out
    assert "cat.png" in out and any(name in out for name in prep.class_names)
    assert main(["convert", "vit_ti16.test_npz", str(tmp_path / "converted")]) == 0
    converted = vitkit.load_model(str(tmp_path / "converted"))
    torch.testing.assert_close(converted.state_dict()["head.weight"], tagged.state_dict()["head.weight"])
    assert read_checkpoint(tmp_path / "converted").preprocessing == prep  # the row's record, classes and all


def test_models_lists_the_pretrained_tags(tagged, capsys, server, monkeypatch):
    assert main(["models", "--pretrained", "vit_b16.augreg*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tag", "res", "classes", "cached", "source"]
    assert [line.split()[0] for line in lines[1:-1]] == list_pretrained("vit_b16.augreg*")
    assert lines[-1].startswith("cached (checked against the release): sha256 = the exact file;")
    assert "storage.googleapis.com/vit_models/augreg/B_16-i21k-300ep" in lines[1]
    vitkit.load_model("vit_ti16.test_npz")
    assert main(["models", "--pretrained", "test_npz"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:5] == ["vit_ti16.test_npz", "16", "imagenet-1k", "cached", "(arch)"]  # the row gives no size
    monkeypatch.setitem(PRETRAINED, "vit_ti16.test_npz", url_row(server, "/t/tiny.npz", size=7, sha256="ab" * 32))
    assert released.cache_status(PRETRAINED["vit_ti16.test_npz"]) == "cached (sha256+size+arch)"
    assert main(["models", "--pretrained", "nothing-like-this"]) == 2


# ------------------------------------------------------------------------------------------ the real table
def test_every_row_names_a_model_a_known_source_and_consistent_inputs():
    assert len(PRETRAINED) >= 30
    cache_paths = set()
    for tag, row in PRETRAINED.items():
        assert row.tag == tag and row.model in MODELS and released.is_tag(tag), tag
        assert row.format in released.FORMATS and row.licence == "Apache-2.0"
        if row.url:
            bucket = {"official": "vit_models", "big_transfer": "bit_models"}[row.format]
            assert row.url.startswith(f"https://storage.googleapis.com/{bucket}/") and row.url.endswith(".npz")
            assert not row.hub_repo and "+" not in row.url
            cache_paths.add(released.url_cache_path(row.url))
        else:
            assert row.hub_repo.split("/")[0] in ("timm", "google") and row.hub_files[-1] == "model.safetensors"
            assert row.format == ("hf" if row.hub_files[0] == "config.json" else "timm")
        assert row.sha256 is None or re.fullmatch("[0-9a-f]{64}", row.sha256)
        assert len(row.mean) == len(row.std) == 3 and 0 < row.crop_fraction <= 1
        assert row.interpolation in ("bilinear", "bicubic")
        # the model it needs builds, and agrees with the row on resolution and classes
        cfg = registry.model_config(row.model, **row.config)
        assert cfg.img_size == (row.img_size, row.img_size) and row.img_size in (224, 384)
        assert cfg.num_classes == row.num_classes == released.CLASS_COUNTS[row.classes]
        meta = row.metadata()
        assert meta["img_size"] == row.img_size and meta["in_chans"] == 3
        assert len(meta.get("class_names", [])) == (1000 if row.classes == "imagenet-1k" else 0)
        # original ImageNet-21k files carry pre-logits; AugReg and fine-tuned ones do not
        assert bool(getattr(cfg, "representation_size", None)) == (row.weights == "orig_in21k"), tag
    assert len(cache_paths) == sum(1 for r in PRETRAINED.values() if r.url)  # no two rows share a file


def test_imagenet_class_names_are_1000_unique_lines():
    path = Path(vitkit.__file__).with_name("data") / "imagenet1k_classes.txt"
    lines = path.read_text().splitlines()
    assert len(lines) == 1000 and len(set(lines)) == 1000 and all(line.strip() == line != "" for line in lines)
    assert lines[0] == "tench, Tinca tinca" and lines[-1] == "toilet tissue, toilet paper, bathroom tissue"
    assert lines[134] == "crane (n02012849)" and lines[517] == "crane (n03126707)"  # bird and machine
    assert released.class_names("imagenet-1k") == lines and released.class_names("imagenet-21k") is None


def test_tags_and_paths_are_told_apart(tmp_path):
    assert released.is_tag("vit_b16.orig_in21k") and not released.is_tag("ViT-B_16.npz")
    assert not released.is_tag("runs/vit_b16.x") and not released.is_tag("vit_b16")
    assert list_pretrained("*.orig_in21k") == [t for t in PRETRAINED if t.endswith(".orig_in21k")]
    with pytest.raises(UserError, match="unknown pretrained weights"):
        released.get_pretrained("vit_b16.nope")
    row = replace(PRETRAINED["vit_b16.augreg2_in21k_ft_in1k"], revision="abc")
    assert row.source.endswith("model.safetensors@abc")


def test_a_big_transfer_tag_loads_the_released_layout(server, cache, monkeypatch):
    """A BiT row: the released .npz layout served by URL, read as BiT (big_transfer format), its head and
    preprocessing those of the row."""
    from test_bit import released_arrays

    arrays = released_arrays(classes=5)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    server.routes["/bit/BiT-T.npz"] = Route(buffer.getvalue())
    row = PretrainedRow(
        "bit_r50x1", "test_bit", "big_transfer", url=server.url + "/bit/BiT-T.npz", img_size=32,
        config={"num_classes": 5, "layers": (2, 1, 1, 1), "img_size": 32},
    )  # fmt: skip
    monkeypatch.setitem(PRETRAINED, row.tag, row)
    model, meta = vitkit.load_model("bit_r50x1.test_bit", return_metadata=True)
    assert model.config.arch == "bit" and model.config.layers == (2, 1, 1, 1) and model.config.num_classes == 5
    assert meta["pretrained_tag"] == "bit_r50x1.test_bit" and meta["mean"] == [0.5] * 3
    created = vitkit.create_model("bit_r50x1", pretrained="test_bit")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(created.eval()(x), model.eval()(x))
    bit_rows = [r for r in PRETRAINED.values() if r.format == "big_transfer" and r.weights != "test_bit"]
    assert len(bit_rows) == 11 and all(r.url.startswith("https://storage.googleapis.com/bit_models/") for r in bit_rows)
