"""``vitkit shard SOURCE OUT_DIR``: any source vitkit reads, written as WebDataset shards with a manifest. Each sample
is the stored image (its own JPEG / PNG / WebP bytes, decoded arrays as PNG) and ``KEY.cls`` (the class index as text),
in ``train-000000.tar``, ... and ``val-000000.tar``, ...; ``manifest.json`` records every shard's sample count, the
class names and the source's preprocessing (as ``data.key=value`` overrides).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import UserError
from ..io import REFUSED, atomic_write_text
from ..optional import require
from .build import build_datasets
from .config import DataConfig, SourceFields
from .datasets import ArrayImageDataset, ImageFolderDataset, TensorImageDataset
from .digits import MAX_VALUE, load_digits_arrays
from .hf import HFImageDataset
from .wds import IMAGE_KEYS, MANIFEST_FORMAT, MANIFEST_NAME, WebDatasetItems, WebDatasetStream, read_shard

Raw = tuple[bytes, str, int]  # (encoded image, extension, class index)


def png(array: np.ndarray) -> bytes:
    """uint8 (H, W) or (H, W, 3) -> PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def _encoded(data: bytes) -> tuple[bytes, str]:
    """A stored image's bytes and extension: JPEG, PNG and WebP as they are, anything else re-encoded as PNG."""
    with Image.open(io.BytesIO(data)) as img:
        ext = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}.get(img.format or "", "")
        return (data, ext) if ext else (png(np.asarray(img.convert("RGB"))), "png")


def raw_images(ds: Dataset, mean: list[float], std: list[float]) -> Iterator[Raw]:
    """The stored images of a built data set, before any preprocessing, with their labels."""
    if isinstance(ds, ImageFolderDataset):
        for path, label in ds.samples:
            yield (*_encoded(Path(path).read_bytes()), label)
    elif isinstance(ds, HFImageDataset):
        datasets = require("datasets", "vitkit shard of an hf source")
        table = ds.table.cast_column(ds.image_column, datasets.Image(decode=False))
        for row in ds.rows:
            cell = table[row][ds.image_column]
            data = cell["bytes"] if cell.get("bytes") else Path(cell["path"]).read_bytes()
            yield (*_encoded(data), ds.label_of(table[row][ds.label_column]))
    elif isinstance(ds, ArrayImageDataset):
        for image, label in zip(ds.images, ds.labels):
            yield png(image), "png", int(label)
    elif isinstance(ds, TensorImageDataset):  # normalised in memory: back to 8-bit pixels
        m, s = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)
        for image, label in zip(ds.images, ds.labels):
            pixels = ((image * s + m).clamp(0, 1) * 255).round().to(torch.uint8)  # (C, H, W)
            array = pixels[0].numpy() if pixels.shape[0] == 1 else pixels.permute(1, 2, 0).numpy()
            yield png(array), "png", int(label)
    elif isinstance(ds, (WebDatasetStream, WebDatasetItems)):
        for shard in ds.shards.paths:
            for sample in read_shard(shard):
                key = next(k for k in IMAGE_KEYS if k in sample)
                yield sample[key], key, int(sample["cls"])
    else:
        raise TypeError(f"vitkit shard: no stored images in a {type(ds).__name__}")


def digits_raw(test: bool) -> Iterator[Raw]:
    """The digits at their native 8x8, 0..16 mapped to 0..255 (rounded), as grayscale PNG."""
    images, labels, test_mask = load_digits_arrays()
    for image, label, held in zip(images, labels, test_mask):
        if held == test:
            yield png(np.round(image.astype(np.float64) * 255 / MAX_VALUE).astype(np.uint8)), "png", int(label)


def write_split(items: Iterator[Raw], out_dir: Path, split: str, shard_size: int) -> list[dict[str, Any]]:
    """Write one split's samples as shards of ``shard_size``; returns [{"name", "count"}] per shard."""
    wds = require("webdataset", "vitkit shard")
    shards: list[dict[str, Any]] = []
    writer = None
    for index, (data, ext, label) in enumerate(items):
        if index % shard_size == 0:
            if writer is not None:
                writer.close()
            name = f"{split}-{len(shards):06d}.tar"
            writer = wds.TarWriter(str(out_dir / name))
            shards.append({"name": name, "count": 0})
        assert writer is not None
        writer.write({"__key__": f"{split}{index:08d}", ext: data, "cls": str(label).encode()})
        shards[-1]["count"] += 1
    if writer is not None:
        writer.close()
    return shards


def _value(v: Any) -> str:
    """A value as the config parser reads it after ``data.key=``: true / false, a, b, c for a list."""
    if isinstance(v, list):
        return ",".join(_value(x) for x in v)
    return v if isinstance(v, str) else json.dumps(v)


def _unclaimed(out: Path) -> None:
    """out must be free for new shards: absent, or an empty directory that is no link (nothing of anyone's, the
    source's shards included, is ever written over or through)."""
    if out.is_symlink():
        raise UserError(f"{out}: a symbolic link; shards go into a new or empty directory of its own")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory; choose an empty directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        raise UserError(f"{out}: already holds {MANIFEST_NAME if MANIFEST_NAME in held else held[0]}; choose an empty "
                        "directory")  # fmt: skip


def write_shards(cfg: DataConfig, out_dir: str | Path, shard_size: int = 1000) -> dict[str, Any]:
    """Shard the data ``cfg`` names into out_dir, which must be absent or empty; returns the manifest. Everything is
    written into a temporary directory beside it, renamed into place once whole: a failed or interrupted run
    leaves nothing under out_dir, and a second run into the same out_dir is refused."""
    if shard_size < 1:
        raise UserError(f"--shard-size: expected a positive number of samples per shard, got {shard_size}")
    out = Path(out_dir)
    _unclaimed(out)
    cfg = cfg.resolve()
    train, held, info = build_datasets(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        splits = {}
        for split, ds in (("train", train), ("val", held)):
            items = digits_raw(split == "val") if cfg.source == "digits" else raw_images(ds, info.mean, info.std)
            shards = write_split(items, tmp, split, shard_size)
            splits[split] = {"shards": shards, "total": sum(s["count"] for s in shards)}
        hints = {**asdict(SourceFields.of(cfg)), "mean": info.mean, "std": info.std}
        doc = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "source": {k: v for k, v in cfg.to_dict().items() if k in ("source", "root", "val_root") and v is not None},
            "classes": info.class_names,
            "total": sum(part["total"] for part in splits.values()),
            "splits": splits,
            "preprocessing": hints,
            "overrides": [f"data.{k}={_value(v)}" for k, v in hints.items()],
        }
        atomic_write_text(tmp / MANIFEST_NAME, json.dumps(doc, indent=1) + "\n")
        _unclaimed(out)  # again: another run may have finished into it meanwhile
        try:
            if out.is_dir():
                out.rmdir()  # empty: rename(2) replaces only an empty directory, and refuses a full one
            os.rename(tmp, out)
        except OSError as e:
            raise UserError(f"{out}: written by another process meanwhile ({e.strerror}); it is left as it is") from e
    except OSError as e:
        if e.errno not in REFUSED:  # not the disk's refusal (a full disk, no permission): a bug or a source's
            raise
        raise UserError(f"{out}: could not be written ({e.strerror}); nothing was written there") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return doc
