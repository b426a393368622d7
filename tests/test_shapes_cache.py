"""Drawn shapes kept in files ($VITKIT_SHAPES_CACHE): the same pixels as drawn anew, each file drawn once, a file
that holds anything else refused by name, and a sweep's cells sharing them while it runs."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from vitkit.data import procedural
from vitkit.data.procedural import CACHE_ENV, CHUNK, EVAL_STREAM, RENDERER_KEY, ProceduralShapes, render_shape_image
from vitkit.errors import UserError
from vitkit.sweep import run_sweep
from vitkit.train import config_from_dict, train


def _files(root, seed=1, stream=EVAL_STREAM, size=8):
    return root / RENDERER_KEY / f"seed{seed}-stream{stream}-{size}px"


def test_kept_images_are_the_drawn_ones_and_each_file_is_drawn_once(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    plain = ProceduralShapes(CHUNK + 50, seed=1, stream=EVAL_STREAM, img_size=8)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    kept = ProceduralShapes(CHUNK + 50, seed=1, stream=EVAL_STREAM, img_size=8)
    across = torch.arange(CHUNK - 5, CHUNK + 5)  # both sides of the first file's end
    assert torch.equal(kept.images_at(across), plain.images_at(across))
    assert torch.equal(kept[CHUNK + 7][0], plain[CHUNK + 7][0]) and kept[CHUNK + 7][1] == plain[CHUNK + 7][1]
    folder = _files(tmp_path)
    assert sorted(p.name for p in folder.glob("*.npy")) == ["000000.npy", "000001.npy"]  # whole files, the next not
    second = np.load(folder / "000001.npy", allow_pickle=False)
    assert second.shape == (CHUNK, 8, 8, 3) and second.dtype == np.uint8
    for i in (0, 49, CHUNK - 1):  # the file runs past the set's 1,074 images: another set of the split shares it
        assert np.array_equal(second[i], render_shape_image(1, EVAL_STREAM, CHUNK + i, 8)[0])

    drawn = []
    monkeypatch.setattr(procedural, "render_shape_image", lambda *a: drawn.append(a) or render_shape_image(*a))
    again = ProceduralShapes(2 * CHUNK, seed=1, stream=EVAL_STREAM, img_size=8)
    assert torch.equal(again.images_at(across), plain.images_at(across))
    assert drawn == [(1, EVAL_STREAM, 0, 8), (1, EVAL_STREAM, CHUNK, 8)]  # each file's first image, to check it
    clone = pickle.loads(pickle.dumps(again))  # what a DataLoader worker gets: the files, not their maps
    assert clone._files is not None and clone._files._chunks == {} and torch.equal(clone[3][0], plain[3][0])


def test_a_file_being_drawn_is_waited_for_and_read_not_drawn_twice(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    drawing, drawn = threading.Event(), []

    def slow(*args):  # the first drawer pauses inside its lock, long enough for the second to arrive
        if args[2] == 1 and not drawing.is_set():
            drawing.set()
            time.sleep(0.5)
        drawn.append(args[2])
        return render_shape_image(*args)

    monkeypatch.setattr(procedural, "render_shape_image", slow)
    sets = [ProceduralShapes(10, seed=1, stream=EVAL_STREAM, img_size=8) for _ in range(2)]
    first = threading.Thread(target=sets[0].images_at, args=(torch.arange(10),))
    first.start()
    assert drawing.wait(10)
    second = sets[1].images_at(torch.arange(10))  # waits on the lock, then maps the file the first wrote
    first.join()
    assert sorted(drawn) == [0, 0, *range(1, CHUNK)]  # the file's images once, and each set's check image
    assert torch.equal(second, sets[0].images_at(torch.arange(10))) and isinstance(sets[1]._files._chunks[0], np.memmap)


def test_a_file_another_process_is_drawing_is_waited_for_after_the_files_no_one_is_drawing(tmp_path, monkeypatch):
    """Processes that need the same files divide them: while file 0's lock is held elsewhere, a batch that also needs
    file 1 draws file 1 first, then waits for file 0 (and draws it, as its holder left without writing it)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    folder = _files(tmp_path)
    folder.mkdir(parents=True)
    elsewhere = FileLock(folder / ".000000.lock")
    elsewhere.acquire()
    shapes = ProceduralShapes(2 * CHUNK, seed=1, stream=EVAL_STREAM, img_size=8)
    across, got = torch.arange(CHUNK - 5, CHUNK + 5), []  # file 0's images first, then file 1's
    worker = threading.Thread(target=lambda: got.append(shapes.images_at(across)))
    worker.start()
    deadline = time.monotonic() + 20
    while not (folder / "000001.npy").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (folder / "000001.npy").exists() and not (folder / "000000.npy").exists() and worker.is_alive()
    elsewhere.release()
    worker.join(60)
    monkeypatch.delenv(CACHE_ENV)
    assert len(got) == 1 and torch.equal(
        got[0], ProceduralShapes(2 * CHUNK, seed=1, stream=EVAL_STREAM, img_size=8).images_at(across)
    )
    assert (folder / "000000.npy").exists()


@pytest.mark.parametrize("damage", ["other images", "truncated", "wrong size"])
def test_a_file_that_holds_anything_else_is_refused_by_name(tmp_path, monkeypatch, damage):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    ProceduralShapes(10, seed=1, stream=EVAL_STREAM, img_size=8)[0]
    path = _files(tmp_path) / "000000.npy"
    pixels = np.load(path)
    if damage == "other images":
        np.save(path, pixels[::-1].copy())
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        np.save(path, pixels[:10])
    with pytest.raises(UserError, match=f"^{path}: .*delete it") as info:
        ProceduralShapes(10, seed=1, stream=EVAL_STREAM, img_size=8)[0]
    assert "\n" not in str(info.value)


def test_a_sweep_shares_the_drawn_shapes_and_its_runs_equal_runs_drawing_anew(tmp_path, monkeypatch):
    """The cell trained with the kept images ends with the weights of the same run drawing every image itself."""
    monkeypatch.setenv("VITKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    base = {
        "model": {"name": "vit_ti16", "patch_size": 4, "width": 16, "depth": 1, "num_heads": 2, "mlp_dim": 32},
        "data": {"source": "shapes", "img_size": 8, "num_images": 96, "eval_images": 20},
        "optim": {"batch_size": 16, "lr": 1e-3},
        "schedule": {"steps": 6},
        "run": {"threads": 1, "save_every": 0, "log_every": 0, "eval_every": 0, "plots": False},
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"config: {base}\ngrid: {{model.depth: [1]}}\nseeds: [0]\nmetrics: [eval_top1]\n")
    result = run_sweep(spec, tmp_path / "sweep", jobs=1, log=lambda _: None)
    assert CACHE_ENV not in os.environ  # set for the sweep's life only
    kept = sorted(p.parent.name for p in (tmp_path / "cache" / "shapes" / RENDERER_KEY).glob("*/000000.npy"))
    assert kept == ["seed0-stream0-8px", "seed0-stream1-8px"]
    alone = train(config_from_dict({**base, "run": {**base["run"], "out_dir": str(tmp_path), "name": "alone"}}))
    swept = load_file(result.out / "depth-1_seed-0" / "model.safetensors")
    mine = load_file(alone.run_dir / "model.safetensors")
    assert swept.keys() == mine.keys() and all(torch.equal(swept[k], mine[k]) for k in mine)
