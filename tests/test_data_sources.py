"""Hugging Face datasets, WebDataset shards and CSV/JSON manifests as data sources.

The digits are written in each format by code here (the datasets library's own writer, pyarrow, Python's
tarfile), independently of vitkit's readers; training through each must hand the model exactly the digits the
in-memory source hands it: the same multiset of (label, pixels) per epoch.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import IterableDataset

from vitkit.cli import main as cli_main
from vitkit.data import DataConfig, build_datasets
from vitkit.data.digits import load_digits_arrays
from vitkit.data.manifest import manifest_samples
from vitkit.errors import UserError
from vitkit.optional import MissingDependencyError
from vitkit.train import Trainer, config_from_dict

datasets = pytest.importorskip("datasets")
pytest.importorskip("webdataset")

REPO = Path(__file__).resolve().parents[1]
# 8x8 pixels as stored (0..16 -> 0..255), unnormalised, unaugmented (a shift by 0 pixels: "none" reads as null in
# a config, the source default): an item is the stored image / 255
PLAIN = {
    "img_size": 8,
    "in_chans": 1,
    "mean": 0.0,
    "std": 1.0,
    "train_augment": "shift",
    "shift_pixels": 0,
    "flip": False,
}
BATCH = 479  # 1437 digits training images = 3 steps of 479: one epoch sees every image once


def digits_uint8() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    images, labels, test_mask = load_digits_arrays()
    return np.round(images.astype(np.float64) * 255 / 16).astype(np.uint8), labels, test_mask


def key(label: int, pixels: np.ndarray) -> tuple[int, str]:
    return int(label), hashlib.sha1(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes()).hexdigest()


def reference(test: bool) -> Counter:
    images, labels, mask = digits_uint8()
    return Counter(key(y, x) for x, y, m in zip(images, labels, mask) if m == test)


def as_key(x: torch.Tensor, y: int | torch.Tensor) -> tuple[int, str]:
    return key(int(y), (x.float() * 255).round().to(torch.uint8).reshape(8, 8).numpy())


def items(ds) -> Counter:
    pairs = ds if isinstance(ds, IterableDataset) else (ds[i] for i in range(len(ds)))
    return Counter(as_key(x, y) for x, y in pairs)


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def run_doc(tmp_path: Path, data: dict, name: str, steps: int = 3) -> dict:
    return {
        "model": {"name": "vit_ti16", "patch_size": 4, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64},
        "data": {**PLAIN, **data},
        "optim": {"name": "adamw", "lr": 1e-3, "batch_size": BATCH},
        "schedule": {"steps": steps, "warmup_steps": 1},
        "run": {"out_dir": str(tmp_path / "runs"), "name": name, "progress": False, "plots": False, "threads": 1},
    }


def seen_by_model(tmp_path: Path, data: dict, name: str) -> Counter:
    """The (label, pixels) pairs the loss receives over one epoch of training on ``data``."""
    trainer = Trainer(config_from_dict(run_doc(tmp_path, data, name)))
    seen: Counter = Counter()
    loss = trainer.objective.loss

    def recording(model, x, y):
        seen.update(as_key(xi, yi) for xi, yi in zip(x.cpu(), y.cpu()))
        return loss(model, x, y)

    trainer.objective.loss = recording  # type: ignore[method-assign]
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    assert np.isfinite(result.metrics["eval_loss"])
    return seen


@pytest.fixture(scope="module")
def in_memory_epoch(tmp_path_factory) -> Counter:
    seen = seen_by_model(tmp_path_factory.mktemp("mem"), {"source": "digits"}, "digits")
    assert seen == reference(test=False)  # the in-memory run itself: each training digit once
    return seen


def hf_digits() -> datasets.DatasetDict:
    images, labels, mask = digits_uint8()
    features = datasets.Features(
        {"img": datasets.Image(), "digit": datasets.ClassLabel(names=[f"d{k}" for k in range(10)])}
    )

    def part(test: bool) -> datasets.Dataset:
        rows = np.flatnonzero(mask == test)
        doc = {"img": [Image.fromarray(images[i], mode="L") for i in rows], "digit": labels[rows].tolist()}
        return datasets.Dataset.from_dict(doc, features=features)

    return datasets.DatasetDict({"train": part(False), "test": part(True)})


# ------------------------------------------------------------------------------------------------- hf
def test_hf_save_to_disk_trains_on_the_digits(tmp_path, in_memory_epoch):
    hf_digits().save_to_disk(str(tmp_path / "hfdigits"))
    train, held, info = build_datasets(DataConfig(source="hf", root=str(tmp_path / "hfdigits"), **PLAIN))
    assert info.class_names == [f"d{k}" for k in range(10)]  # the ClassLabel names
    assert items(held) == reference(test=True)  # the test split is the evaluation split
    assert seen_by_model(tmp_path, {"source": "hf", "root": str(tmp_path / "hfdigits")}, "hf") == in_memory_epoch
    assert cli_main(["shard", f"hf:{tmp_path / 'hfdigits'}", str(tmp_path / "shards"), "--shard-size", "1000"]) == 0
    resharded, _, info = build_datasets(DataConfig(source="wds", root=str(tmp_path / "shards"), **PLAIN))
    assert info.class_names == [f"d{k}" for k in range(10)] and items(resharded) == reference(test=False)


def test_hf_parquet_splits_and_columns(tmp_path, in_memory_epoch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    images, labels, mask = digits_uint8()
    (tmp_path / "pq").mkdir()
    for split, test in (("train", False), ("test", True)):
        rows = np.flatnonzero(mask == test)
        table = pa.table(
            {
                "picture": [{"bytes": png(images[i]), "path": None} for i in rows],
                "target": pa.array(labels[rows], type=pa.int64()),
            }
        )
        pq.write_table(table, tmp_path / "pq" / f"{split}-00000.parquet")
    plain_ints = {"source": "hf", "root": str(tmp_path / "pq"), "image_column": "picture", "label_column": "target"}
    train, held, info = build_datasets(DataConfig(**plain_ints, **PLAIN))
    assert info.class_names == [str(k) for k in range(10)]
    assert items(held) == reference(test=True)
    assert seen_by_model(tmp_path, plain_ints, "parquet") == in_memory_epoch
    with pytest.raises(UserError, match="image_column='pic'"):
        build_datasets(DataConfig(**{**plain_ints, "image_column": "pic"}, **PLAIN))


@pytest.mark.parametrize("kind", ["ClassLabel", "plain ints"])
def test_hf_labels_of_minus_one_are_no_labels_not_a_class(tmp_path, kind):
    """-1 is datasets' mark for a row without a label: a test split of only -1 is no evaluation split (a held-out
    fraction of train instead, with a warning), and a -1 among labelled rows is an error naming the row; neither is
    ever an 11th class."""
    images, labels, mask = digits_uint8()
    label = datasets.ClassLabel(names=[str(k) for k in range(10)]) if kind == "ClassLabel" else datasets.Value("int64")
    features = datasets.Features({"image": datasets.Image(), "label": label})

    def part(test: bool, relabel) -> datasets.Dataset:
        rows = np.flatnonzero(mask == test)[:100]
        cells = {"image": [Image.fromarray(images[i], mode="L") for i in rows], "label": relabel(labels[rows])}
        return datasets.Dataset.from_dict(cells, features=features)

    def unlabelled(ys):
        return [-1] * len(ys)

    def one_missing(ys):
        return [-1 if i == 5 else int(y) for i, y in enumerate(ys)]

    datasets.DatasetDict({"train": part(False, list), "test": part(True, unlabelled)}).save_to_disk(tmp_path / "a")
    config = DataConfig(source="hf", root=str(tmp_path / "a"), val_fraction=0.2, **PLAIN)
    with pytest.warns(UserWarning, match="evaluation labels all -1 \\(no label\\); holding out of train"):
        train, held, info = build_datasets(config)
    assert info.class_names == [str(k) for k in range(10)] and (len(train), len(held)) == (80, 20)
    assert {y for _, y in (held[i] for i in range(len(held)))} <= set(range(10))
    datasets.DatasetDict({"train": part(False, one_missing), "test": part(True, list)}).save_to_disk(tmp_path / "b")
    with pytest.raises(UserError, match="train row 5 has label -1, no label \\(1 in all\\)"):
        build_datasets(DataConfig(source="hf", root=str(tmp_path / "b"), **PLAIN))
    if kind == "plain ints":  # one stray 1000 is not a 1001-class problem
        stray = datasets.DatasetDict(
            {"train": part(False, lambda ys: [1000, *map(int, ys[1:])]), "test": part(True, list)}
        )
        stray.save_to_disk(tmp_path / "c")
        with pytest.raises(
            UserError, match=r"train row 0 has label 1000, but only 11 of the 1001 classes 0..1000 have"
        ):
            build_datasets(DataConfig(source="hf", root=str(tmp_path / "c"), **PLAIN))


def test_an_hf_image_that_cannot_be_read_is_named_by_its_row(tmp_path):
    images, labels, _ = digits_uint8()
    cells = [{"bytes": png(images[i]), "path": None} for i in range(12)]
    cells[7] = {"bytes": png(images[7])[:40], "path": None}  # cut short
    cells[9] = {"bytes": None, "path": "/etc/passwd"}  # a path to something else than an image
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    table = datasets.Dataset.from_dict({"image": cells, "label": [int(y) for y in labels[:12]]}, features=features)
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(tmp_path / "d")
    config = DataConfig(source="hf", root=str(tmp_path / "d"), **PLAIN)
    train, _, _ = build_datasets(config)
    for row in (7, 9):
        with pytest.raises(
            UserError, match=rf"data.root='{tmp_path / 'd'}' train split: row {row}: cannot read its image \("
        ):
            train[row]
    assert train[8][1] == int(labels[8])


def test_hf_held_out_fraction_is_the_folder_rule(tmp_path):
    """No evaluation split: the held-out rows are those the folder source holds out of the same images."""
    images, labels, _ = digits_uint8()
    order = sorted(range(240), key=lambda i: (labels[i], i))  # the folder source's order: by class, then name
    for i in order:
        folder = tmp_path / "tree" / str(labels[i])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.png").write_bytes(png(images[i]))
    cells = {"image": [Image.fromarray(images[i], mode="L") for i in order], "label": [str(labels[i]) for i in order]}
    datasets.Dataset.from_dict(cells).save_to_disk(str(tmp_path / "one"))
    _, hf_held, hf_info = build_datasets(DataConfig(source="hf", root=str(tmp_path / "one"), split_seed=3, **PLAIN))
    _, folder_held, _ = build_datasets(DataConfig(source="folder", root=str(tmp_path / "tree"), split_seed=3, **PLAIN))
    assert hf_info.class_names == [str(k) for k in range(10)]  # string labels: classes in sorted order
    assert len(hf_held) == 48 and items(hf_held) == items(folder_held)


def test_missing_datasets_package_is_one_line(monkeypatch, tmp_path):
    real = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name.split(".")[0] == "datasets":
            raise ImportError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    monkeypatch.delitem(sys.modules, "datasets")
    with pytest.raises(MissingDependencyError, match=r"needs the datasets package: pip install 'vitkit\[hf\]'"):
        build_datasets(DataConfig(source="hf", root=str(tmp_path)))


def test_hf_name_without_network_fails_at_once_naming_what_was_typed(tmp_path, monkeypatch, capsys):
    """An uncached dataset name with the Hub unreachable (here: a port nothing listens on): one line naming
    `--data hf:NAME`, from the cache alone, without the Hub client's retries (half a minute of them)."""
    import huggingface_hub.constants as hub

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)  # read per call by vitkit; the libraries read theirs at import
    monkeypatch.setattr(hub, "ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.chdir(tmp_path)
    flags = (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    assert cli_main(["train", "--data", "hf:cifar10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "vitkit train: error: --data hf:cifar10: the Hugging Face dataset could not be loaded (not in the datasets "
        f"cache, and {endpoint} cannot be reached ("
    )
    assert len(err.splitlines()) == 1 and "Retrying" not in err
    assert flags == (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)  # as they were


# ------------------------------------------------------------------------------------------------ wds
def write_tar_shards(folder: Path, split: str, rows: list[tuple[str, bytes, int]], per_shard: int) -> None:
    """WebDataset shards by hand: KEY.png + KEY.cls members, in order, with Python's tarfile."""
    folder.mkdir(parents=True, exist_ok=True)
    for n, first in enumerate(range(0, len(rows), per_shard)):
        with tarfile.open(folder / f"{split}-{n:04d}.tar", "w") as tar:
            for name, data, label in rows[first : first + per_shard]:
                for ext, payload in (("png", data), ("cls", str(label).encode())):
                    member = tarfile.TarInfo(f"{name}.{ext}")
                    member.size = len(payload)
                    tar.addfile(member, io.BytesIO(payload))


def digits_rows(test: bool) -> list[tuple[str, bytes, int]]:
    images, labels, mask = digits_uint8()
    return [(f"d{i:05d}", png(images[i]), int(labels[i])) for i in np.flatnonzero(mask == test)]


def test_wds_hand_written_shards_train_on_the_digits(tmp_path, in_memory_epoch, capsys):
    write_tar_shards(tmp_path / "s", "train", digits_rows(False), 300)  # 5 shards, the last one short
    write_tar_shards(tmp_path / "s", "val", digits_rows(True), 200)
    data = {
        "source": "wds",
        "root": str(tmp_path / "s/train-{0000..0004}.tar"),
        "val_root": str(tmp_path / "s/val-*.tar"),
    }
    data["shuffle_buffer"] = 64
    _, held, info = build_datasets(DataConfig(**data, **PLAIN))
    assert "counted 1437 samples in 5 shards" in capsys.readouterr().out  # no manifest: one counting pass
    assert info.class_names == [str(k) for k in range(10)] and len(held) == 360
    assert items(held) == reference(test=True)
    assert seen_by_model(tmp_path, data, "wds") == in_memory_epoch


def stream(ds, **kw) -> list[tuple[list[int], list[str]]]:
    """Micro-batches of a stream as (labels, keys of the pixels) lists, for order comparisons."""
    args = {"batch_size": 60, "accum_steps": 2, "world_size": 1, "rank": 0, "seed": 5, "total_steps": 5, **kw}
    args.setdefault("start_step", 0)
    return [(y.tolist(), [as_key(xi, 0)[1] for xi in x]) for x, y in ds.batches(**args)]


def test_wds_class_indices_out_of_range_are_named_before_training(tmp_path, capsys):
    """A negative cls, a cls beyond the manifest's classes, and (counted shards) a stray large one that would add
    classes: each named with its shard before any step."""
    rows = digits_rows(False)[:40]
    for n, (bad, folder) in enumerate([(-3, "neg"), (99, "stray")]):
        write_tar_shards(tmp_path / folder, "train", [*rows[:20], (rows[20][0], rows[20][1], bad), *rows[21:]], 20)
        write_tar_shards(tmp_path / folder, "val", rows[:10], 10)
        data = DataConfig(
            source="wds",
            root=str(tmp_path / folder / "train-*.tar"),
            val_root=str(tmp_path / folder / "val-*.tar"),
            **PLAIN,
        )
        want = "a sample has cls -3, expected a class index from 0" if n == 0 else "a sample has cls 99, but only"
        with pytest.raises(UserError, match=f"{tmp_path / folder}/train-0001.tar: {want}"):
            build_datasets(data)
    from vitkit.data.wds import decode

    with pytest.raises(UserError, match=r"x.tar: sample 'k' has cls 10, expected a class index from 0 to 9"):
        decode({"__url__": "x.tar", "__key__": "k", "png": rows[0][1], "cls": b"10"}, 10)


def test_wds_order_is_independent_of_workers_and_resumes_exactly(tmp_path, capsys):
    write_tar_shards(tmp_path / "s", "train", digits_rows(False)[:200], 50)
    write_tar_shards(tmp_path / "s", "val", digits_rows(True)[:20], 50)
    cfg = DataConfig(
        source="wds", root=str(tmp_path / "s/train-*.tar"), val_root=str(tmp_path / "s/val-*.tar"), **PLAIN
    )
    train, _, _ = build_datasets(cfg)
    whole = stream(train)  # 5 steps x 2 micro-batches of 30: 3 steps per epoch, so epochs 0 and 1
    assert len(whole) == 10 and all(len(labels) == 30 for labels, _ in whole)
    first_epoch = [k for _, keys in whole[:6] for k in keys]
    assert len(set(first_epoch)) == 180  # 200 // 60 * 60: no sample twice within an epoch
    assert whole[6:] != whole[:4]  # the next epoch is shuffled anew
    assert stream(train, num_workers=2) == whole  # two DataLoader workers deal the same micro-batches
    assert stream(train, start_step=2) == whole[4:]  # a resume continues the stream exactly
    assert "skipping 120 samples of this rank without decoding them" in capsys.readouterr().out


def test_wds_run_stopped_and_resumed_equals_one_straight_through(tmp_path):
    """A training run on a stream, saved mid-epoch and resumed, ends with the weights of an uninterrupted run."""
    write_tar_shards(tmp_path / "s", "train", digits_rows(False)[:160], 40)
    write_tar_shards(tmp_path / "s", "val", digits_rows(True)[:20], 40)
    data = {"source": "wds", "root": str(tmp_path / "s/train-*.tar"), "val_root": str(tmp_path / "s/val-*.tar")}
    doc = run_doc(tmp_path, {**data, "shuffle_buffer": 16, "train_augment": "inception_crop", "flip": True}, "x", 6)
    doc["optim"]["batch_size"] = 32  # 5 steps per epoch: the cut at step 3 is mid-epoch, the run ends in epoch 1
    reference = Trainer(config_from_dict(doc, ["run.name=ref"]))
    try:
        reference.fit()
        straight = {k: v.clone() for k, v in reference.model.state_dict().items()}
    finally:
        reference.close()
    first = Trainer(config_from_dict(doc, ["run.name=cut"]))
    batches = first.batches(0)
    for _ in range(3):
        first.train_step(batches)
    first.save()
    first.close()
    resumed = Trainer(config_from_dict(doc, ["run.name=cut", "run.resume=true"]))
    try:
        resumed.fit()
        for name, value in resumed.model.state_dict().items():
            torch.testing.assert_close(value, straight[name], rtol=0, atol=0, msg=name)
    finally:
        resumed.close()


def test_vitkit_shard_writes_what_it_reads(tmp_path, capsys):
    assert cli_main(["shard", "digits", str(tmp_path / "out"), "--shard-size", "500"]) == 0
    doc = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["count"] for s in doc["splits"]["train"]["shards"]] == [500, 500, 437]
    assert doc["splits"]["val"]["total"] == 360 and doc["classes"] == [str(k) for k in range(10)]
    assert "data.in_chans=1" in doc["overrides"]
    with tarfile.open(tmp_path / "out" / "train-000000.tar") as tar:  # read back without vitkit
        names = tar.getnames()
        member = tar.extractfile(next(n for n in names if n.endswith(".png")))
        assert member is not None
        pixels = np.asarray(Image.open(io.BytesIO(member.read())))
    assert len(names) == 1000 and {n.rsplit(".", 1)[1] for n in names} == {"png", "cls"}
    train, held, _ = build_datasets(DataConfig(source="wds", root=str(tmp_path / "out"), **PLAIN))
    assert len(train) == 1437 and items(train) == reference(test=False) and items(held) == reference(test=True)
    assert key(0, pixels)[1] in {h for _, h in reference(test=False)}
    capsys.readouterr()
    assert cli_main(["shard", "digits", str(tmp_path / "out")]) == 2
    assert "already holds manifest.json; choose an empty directory" in capsys.readouterr().err


@pytest.mark.parametrize("change", [-5, +5])
def test_a_manifest_count_that_is_not_its_shards_is_named(tmp_path, capsys, change):
    """Too small would leave samples unused, too big would end a stream early: either is named with the shard."""
    assert cli_main(["shard", "digits", str(tmp_path / "out"), "--shard-size", "500"]) == 0
    doc = json.loads((tmp_path / "out" / "manifest.json").read_text())
    for split in ("train", "val"):
        doc["splits"][split]["shards"][0]["count"] += change
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(doc))
    train, held, _ = build_datasets(DataConfig(source="wds", root=str(tmp_path / "out"), **PLAIN))
    said = "more than the 495" if change < 0 else "500, not the 505"
    with pytest.raises(UserError, match=f"train-000000.tar: holds {said} samples its manifest gives; shard again"):
        stream(train, batch_size=500, accum_steps=1, total_steps=3)
    with pytest.raises(UserError, match="val-000000.tar: holds .* samples its manifest gives"):
        list(held)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_vitkit_shard_never_writes_over_or_through_what_is_there(tmp_path, capsys):
    """Into the source's own directory, over a link planted at a shard's name, through a link at the output: each
    refused in one line, with every file as it was."""
    src = tmp_path / "src"
    assert cli_main(["shard", "digits", str(src), "--shard-size", "500"]) == 0
    before = _files(src)
    capsys.readouterr()
    own = ["shard", f"wds:{src}/train-{{000000..000002}}.tar", str(src), f"data.val_root={src}/val-000000.tar"]
    assert cli_main([*own, "--shard-size", "300"]) == 2
    assert f"{src}: already holds manifest.json; choose an empty directory" in capsys.readouterr().err
    assert _files(src) == before
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("mine")
    (out / "train-000000.tar").symlink_to(victim)  # no manifest.json beside it
    assert cli_main(["shard", "digits", str(out)]) == 2
    assert f"{out}: already holds train-000000.tar" in capsys.readouterr().err
    assert victim.read_text() == "mine" and (out / "train-000000.tar").is_symlink()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert cli_main(["shard", "digits", str(link)]) == 2
    assert f"{link}: a symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("meanwhile", ["disk full", "another run finished"])
def test_a_shard_run_is_whole_or_leaves_nothing(tmp_path, monkeypatch, capsys, meanwhile):
    """Shards are written beside the output and renamed into place once whole: a full disk midway leaves nothing
    (no half-written tar under the name, no temporary directory); a run that finds another's shards there by then
    leaves them as they are."""
    from vitkit.data import shard

    out, real = tmp_path / "out", shard.write_split

    def then(items, directory, split, size):
        if split == "val" and meanwhile == "disk full":
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / "val-000000.tar"))
        if split == "val":
            out.mkdir()
            (out / "manifest.json").write_text("theirs")
        return real(items, directory, split, size)

    monkeypatch.setattr(shard, "write_split", then)
    assert cli_main(["shard", "digits", str(out)]) == 2
    err = capsys.readouterr().err
    if meanwhile == "disk full":
        assert f"{out}: could not be written (No space left on device); nothing was written there" in err
        assert list(tmp_path.iterdir()) == []
    else:
        assert f"{out}: already holds manifest.json" in err
        assert [p.name for p in tmp_path.iterdir()] == ["out"] and _files(out) == {"manifest.json": b"theirs"}


WORKER = """
import json, sys, torch
from vitkit.train import Trainer, config_from_dict
trainer = Trainer(config_from_dict(json.loads(sys.argv[1])))
trainer.train_ds.record_keys = []
start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
trainer.fit()
weights = {k: v.tolist() for k, v in trainer.model.state_dict().items()}
moved = any(not torch.equal(v, start[k]) for k, v in trainer.model.state_dict().items())
json.dump({"keys": trainer.train_ds.record_keys, "weights": weights, "moved": moved}, open(sys.argv[2], "w"))
trainer.close()
"""


def test_two_nodes_see_every_sample_once_and_agree(tmp_path):
    rows = digits_rows(False)[:240]
    write_tar_shards(tmp_path / "s", "train", rows, 40)
    write_tar_shards(tmp_path / "s", "val", digits_rows(True)[:40], 40)
    data = {"source": "wds", "root": str(tmp_path / "s/train-*.tar"), "val_root": str(tmp_path / "s/val-*.tar")}
    doc = run_doc(tmp_path, {**data, "shuffle_buffer": 32}, "nodes", steps=4)
    doc["optim"]["batch_size"] = 60  # 4 steps of 60 = one epoch of the 240 samples; 30 per node per step
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        path = os.pathsep.join(part for part in (str(REPO), os.environ.get("PYTHONPATH", "")) if part)
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": "0"}
        env.update({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        out = tmp_path / f"rank{rank}.json"
        cmd = [sys.executable, "-c", WORKER, json.dumps(doc), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        output = p.communicate(timeout=120)[0]
        assert p.returncode == 0, output
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    keys = [r["keys"] for r in results]
    assert len(keys[0]) == len(keys[1]) == 120 and not set(keys[0]) & set(keys[1])
    assert sorted(keys[0] + keys[1]) == sorted(name for name, _, _ in rows)  # every sample exactly once
    assert results[0]["moved"] and results[0]["weights"] == results[1]["weights"]


# ------------------------------------------------------------------------------------------- manifest
@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_manifest_files_with_splits(tmp_path, fmt):
    images, labels, mask = digits_uint8()
    rows = []
    for i in range(0, 300):
        rel = f"img/{i:04d}.png"
        (tmp_path / "img").mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(png(images[i]))
        rows.append({"path": rel, "label": f"digit{labels[i]}", "split": "val" if mask[i] else "train"})
    if fmt == "csv":
        lines = ["path,label,split", *(f"{r['path']},{r['label']},{r['split']}" for r in rows)]
        (tmp_path / "list.csv").write_text("\n".join(lines) + "\n")
    else:
        (tmp_path / "list.json").write_text(json.dumps(rows))
    train, held, info = build_datasets(DataConfig(source="manifest", root=str(tmp_path / f"list.{fmt}"), **PLAIN))
    assert info.class_names == [f"digit{k}" for k in range(10)]
    want = {False: Counter(), True: Counter()}
    for i in range(300):
        want[bool(mask[i])][key(labels[i], images[i])] += 1
    assert items(train) == want[False] and items(held) == want[True]
    (tmp_path / "bad.csv").write_text("path,label\nimg/none.png,digit1\n")
    with pytest.raises(UserError, match="image files not found: img/none.png"):
        build_datasets(DataConfig(source="manifest", root=str(tmp_path / "bad.csv"), **PLAIN))


def test_a_manifest_with_a_byte_order_mark_reads_and_one_not_in_utf8_is_named(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark; a latin-1 file is refused naming its line."""
    images, labels, _ = digits_uint8()
    (tmp_path / "img").mkdir()
    lines = ["path,label"]
    for i in range(20):
        (tmp_path / f"img/{i}.png").write_bytes(png(images[i]))
        lines.append(f"img/{i}.png,chiffre {labels[i]}")
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    names, parts = manifest_samples(tmp_path / "bom.csv")
    assert len(parts["train"]) == 20 and names == sorted({f"chiffre {k}" for k in labels[:20]})
    lines[3] = lines[3].replace("chiffre", "caf\xe9")
    (tmp_path / "latin1.csv").write_bytes("\n".join(lines).encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.csv: line 4 is not UTF-8 \(byte 0xe9\); save the manifest as UTF-8$"):
        manifest_samples(tmp_path / "latin1.csv")


def test_verify_finds_a_manifests_bad_image_before_training_and_is_refused_where_there_are_no_files(tmp_path):
    images, labels, _ = digits_uint8()
    (tmp_path / "img").mkdir()
    lines = ["path,label,split"]
    for i in range(30):
        (tmp_path / f"img/{i}.png").write_bytes(png(images[i]) if i != 25 else b"not a png")
        lines.append(f"img/{i}.png,{labels[i]},{'val' if i >= 20 else 'train'}")
    (tmp_path / "m.csv").write_text("\n".join(lines))
    with pytest.raises(UserError, match=r"img/25.png"):
        build_datasets(DataConfig(source="manifest", root=str(tmp_path / "m.csv"), verify=True, **PLAIN))
    for key in ("skip_corrupt", "verify"):
        for source in ("hf", "wds"):
            with pytest.raises(
                UserError, match=rf"data.{key}=true: for image folders and manifests; data.source={source}"
            ):
                build_datasets(DataConfig(source=source, root=str(tmp_path), **{key: True}, **PLAIN))


def test_data_prefixes_name_the_sources():
    from vitkit.train.config_files import data_section

    assert data_section("hf:ylecun/mnist:default") == {"source": "hf", "root": "ylecun/mnist:default"}
    assert data_section("wds:/d/train-{0..3}.tar") == {"source": "wds", "root": "/d/train-{0..3}.tar"}
    assert data_section("manifest:list.csv") == {"source": "manifest", "root": "list.csv"}
    with pytest.raises(UserError, match="expected hf:WHERE"):
        data_section("hf:")


# ------------------------------------------------------------------------------------------- every road's page
def write_road(tmp_path: Path, road: str) -> str:
    """The digits as ``road`` keeps them (300 of them where a file per image is written); the --data argument."""
    images, labels, mask = digits_uint8()
    if road == "wds":
        assert cli_main(["shard", "digits", str(tmp_path / "shards")]) == 0
        return f"wds:{tmp_path / 'shards'}"
    if road == "hf":
        hf_digits().save_to_disk(str(tmp_path / "hf"))
        return f"hf:{tmp_path / 'hf'}"
    rows = []
    for i in range(300):  # the folder holds out a fraction; the manifest keeps the digits' own split
        path = tmp_path / road / f"digit{labels[i]}" / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png(images[i]))
        rows.append(f"{path.relative_to(tmp_path)},digit{labels[i]},{'val' if mask[i] else 'train'}")
    if road == "folder":
        return str(tmp_path / road)
    (tmp_path / "list.csv").write_text("\n".join(["path,label,split", *rows]) + "\n")
    return f"manifest:{tmp_path / 'list.csv'}"


@pytest.mark.parametrize("road", ["folder", "manifest", "hf", "wds"])
def test_every_data_road_ends_with_its_report(tmp_path, capsys, road):
    """`vitkit train --data ROAD` writes report.html with its worst-classified images and inspection figures, and
    `vitkit report RUN` rewrites it: exit 0 on every road (a stream is not indexed: its worst images are kept as the
    evaluation passes)."""
    data = write_road(tmp_path, road)
    out = tmp_path / "runs"
    args = ["schedule.steps=2", "schedule.epochs=none", f"run.out_dir={out}", "run.progress=false", "run.threads=1"]
    assert cli_main(["train", "--data", data, *args, "data.img_size=8", "data.in_chans=1"]) == 0
    (run,) = out.iterdir()
    again = (tmp_path / "again.html",) if road == "wds" else ()  # the stream whose `vitkit report` crashed
    for page in (run / "report.html", *again):
        if page.name == "again.html":
            assert cli_main(["report", str(run), "--out", str(page)]) == 0
        text = page.read_text()
        assert len(re.findall(r"p\(true\) [\d.]+% · #\d+", text)) == 16
        assert all(f"{figure}:" in text for figure in ("Fig 6", "Fig 7 left", "Fig 7 right / Fig 11"))
