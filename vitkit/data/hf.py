"""Hugging Face datasets through the ``datasets`` library: ``--data hf:WHERE`` (data.source=hf, data.root=WHERE).

WHERE is, in the order tried: a ``save_to_disk`` directory, parquet files (a file, glob or directory), an
imagefolder (``imagefolder:DIR``, or a DIR with metadata.csv / .jsonl), or a dataset name[:config] (read from the
``datasets`` cache once downloaded). Training uses "train" (or the only split), evaluation the first of
EVAL_SPLITS, else a held-out data.val_fraction. The image and label columns are data.image_column /
data.label_column, else the first ``Image`` / ``ClassLabel`` feature, else a usual name.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import UserError
from ..optional import require
from ..pretrained.download import unreachable
from .datasets import stratified_split

EVAL_SPLITS = ("validation", "valid", "val", "test")
IMAGE_NAMES = ("image", "img", "picture", "jpg", "png")
LABEL_NAMES = ("label", "labels", "fine_label", "class", "cls")


def load_hf(where: str, purpose: str = "data.source=hf") -> Any:
    """The ``datasets`` object (a DatasetDict, or a Dataset) that WHERE names (see the module docstring)."""
    datasets = require("datasets", purpose)
    path = Path(where)
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        return datasets.load_from_disk(str(path))
    parquet = _parquet_files(where)
    if parquet is not None:
        return datasets.load_dataset("parquet", data_files=_by_split(parquet))
    if where.startswith("imagefolder:") or (
        path.is_dir() and any((path / f"metadata.{ext}").is_file() for ext in ("csv", "jsonl"))
    ):
        folder = where.removeprefix("imagefolder:")
        if not Path(folder).is_dir():
            raise UserError(f"data.root={where!r}: {folder} is not a directory")
        return datasets.load_dataset("imagefolder", data_dir=folder)
    if path.exists():
        raise UserError(
            f"data.root={where!r}: not a save_to_disk directory, parquet files or an imagefolder with metadata.csv "
            "(for a class-per-folder tree use --data DIR, the folder source)"
        )
    name, _, config = where.partition(":")
    hub = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    # no network: the cache alone, at once (the Hub's client would retry for half a minute before failing)
    offline = None if datasets.config.HF_HUB_OFFLINE else unreachable(f"{hub}/api/datasets/{name}")
    try:
        with _hub_offline(datasets) if offline else contextlib.nullcontext():
            return datasets.load_dataset(name, config or None)
    except (FileNotFoundError, ConnectionError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        problem = f"not in the datasets cache, and {hub} cannot be reached ({offline})" if offline else first
        raise UserError(
            f"--data hf:{where}: the Hugging Face dataset could not be loaded ({problem}); download it once with "
            "network access (it is then read from the cache, also with HF_HUB_OFFLINE=1)"
        ) from None


@contextlib.contextmanager
def _hub_offline(datasets: Any) -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for the block, where huggingface_hub and datasets keep it (both read it at import)."""
    import huggingface_hub.constants as constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _parquet_files(where: str) -> list[str] | None:
    """The parquet files WHERE names (a file, a glob, a directory holding them), or None if it names none."""
    path = Path(where)
    if path.is_dir():
        found = sorted(str(p) for p in path.rglob("*.parquet"))
        return found or None
    if path.suffix == ".parquet" and path.is_file():
        return [str(path)]
    if any(c in where for c in "*?[") and where.endswith(".parquet"):
        found = sorted(glob.glob(where, recursive=True))
        if not found:
            raise UserError(f"data.root={where!r}: no parquet files match the pattern")
        return found
    return None


def _by_split(files: list[str]) -> dict[str, list[str]]:
    """Parquet files grouped by the split their name or folder starts with (else training files)."""
    groups: dict[str, list[str]] = {}
    for file in files:
        parts = [Path(file).name.lower(), Path(file).parent.name.lower()]
        split = next((s for s in ("train", *EVAL_SPLITS) for part in parts if part.startswith(s)), "train")
        groups.setdefault(split, []).append(file)
    return groups


def pick_splits(loaded: Any, where: str) -> tuple[Any, Any | None]:
    """(training split, evaluation split or None) of a DatasetDict (or a lone Dataset: its only split)."""
    if not hasattr(loaded, "keys"):  # a Dataset, not a DatasetDict
        return loaded, None
    names = list(loaded.keys())
    if "train" in names:
        train = loaded["train"]
    elif len(names) == 1:
        train = loaded[names[0]]
    else:
        raise UserError(f"data.root={where!r}: no 'train' split among {names}")
    held = next((loaded[s] for s in EVAL_SPLITS if s in names), None)
    return train, held


def image_and_label_columns(features: Any, image_column: str | None, label_column: str | None) -> tuple[str, str]:
    """The image and label column names: the ones given (checked) or detected from the features."""
    datasets = require("datasets", "data.source=hf")
    columns = list(features)
    for key, given in (("image_column", image_column), ("label_column", label_column)):
        if given is not None and given not in columns:
            raise UserError(f"data.{key}={given!r}: no such column; the columns are {columns}")
    image = image_column or next((c for c in columns if isinstance(features[c], datasets.Image)), None)
    image = image or next((c for c in columns if c.lower() in IMAGE_NAMES), None)
    label = label_column or next((c for c in columns if isinstance(features[c], datasets.ClassLabel)), None)
    label = label or next((c for c in columns if c.lower() in LABEL_NAMES and c != image), None)
    if image is None or label is None:
        what, key = ("images", "data.image_column") if image is None else ("labels", "data.label_column")
        raise UserError(f"cannot tell which column holds the {what}: set {key} (the columns are {columns})")
    return image, label


def class_names_of(feature: Any, values: Sequence[Any]) -> tuple[list[str], dict[Any, int] | None]:
    """(class names, value -> index or None when the values are already indices) of a label column."""
    datasets = require("datasets", "data.source=hf")
    if isinstance(feature, datasets.ClassLabel):
        return [str(n) for n in feature.names], None
    distinct = sorted(set(values))
    integers = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in distinct)
    if integers and distinct and distinct[0] >= 0:
        return [str(k) for k in range(int(distinct[-1]) + 1)], None
    names = [str(v) for v in distinct]
    return names, {v: i for i, v in enumerate(distinct)}


def to_pil(value: Any) -> Image.Image:
    """An image cell as ``datasets`` hands it out: a PIL image, {"bytes", "path"}, raw bytes, a path or an array."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str):
        return Image.open(value)
    if isinstance(value, np.ndarray):
        return Image.fromarray(value)
    raise UserError(f"an image cell of type {type(value).__name__}: expected an image, bytes or a path")


class HFImageDataset(Dataset):
    """Rows of a ``datasets.Dataset`` (optionally a subset of row indices) as (image tensor, label) items."""

    def __init__(
        self,
        table: Any,
        rows: Sequence[int] | None,
        image_column: str,
        label_column: str,
        transform: Callable[[Image.Image], torch.Tensor],
        label_index: dict[Any, int] | None = None,
        where: str = "data.source=hf",
    ) -> None:
        self.table, self.where = table, where
        self.rows = list(range(len(table))) if rows is None else list(rows)
        self.image_column, self.label_column = image_column, label_column
        self.transform = transform
        self.label_index = label_index
        self.num_skipped = 0
        if not self.rows:
            raise UserError("data.source=hf: a split with no rows")

    @property
    def labels(self) -> list[int]:
        column = self.table[self.label_column]
        return [self.label_of(column[i]) for i in self.rows]

    def label_of(self, value: Any) -> int:
        return int(value) if self.label_index is None else self.label_index[value]

    def __len__(self) -> int:
        return len(self.rows)

    def raw(self, index: int) -> tuple[Image.Image, int]:
        """(the image as stored, decoded; its label index) of item ``index``, without preprocessing."""
        with self._naming_the_row(index):
            row = self.table[self.rows[index]]
            return to_pil(row[self.image_column]), self.label_of(row[self.label_column])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.raw(index)
        with self._naming_the_row(index):
            return self.transform(image), label  # the transform decodes (a training crop of a JPEG cell: reduced)

    @contextlib.contextmanager
    def _naming_the_row(self, index: int) -> Iterator[None]:
        """An image that cannot be read (truncated, a bomb, not an image) as a UserError naming its row."""
        try:
            yield
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, UserError) as e:
            raise UserError(f"{self.where}: row {self.rows[index]}: cannot read its image ({e})") from None


def _unlabelled(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value == -1


def build_hf_parts(
    where: str,
    image_column: str | None,
    label_column: str | None,
    val_fraction: float,
    split_seed: int,
    train_tf: Callable[[Image.Image], torch.Tensor],
    eval_tf: Callable[[Image.Image], torch.Tensor],
) -> tuple[HFImageDataset, HFImageDataset, list[str]]:
    """(train, eval, class names) of ``hf:WHERE`` (see the module docstring for the splits and columns)."""
    train_table, eval_table = pick_splits(load_hf(where), where)
    source = f"data.root={where!r}"
    image, label = image_and_label_columns(train_table.features, image_column, label_column)
    train_labels = list(train_table[label])
    eval_labels = list(eval_table[label]) if eval_table is not None else []
    if eval_labels and all(map(_unlabelled, eval_labels)):  # a test split published without labels: none
        warnings.warn(f"data.root={where!r}: evaluation labels all -1 (no label); holding out of train", stacklevel=2)
        eval_table, eval_labels = None, []
    for split, labels in (("train", train_labels), ("evaluation", eval_labels)):
        if rows := [i for i, v in enumerate(labels) if _unlabelled(v)]:
            raise UserError(f"data.root={where!r}: {split} row {rows[0]} has label -1, no label ({len(rows)} in all)")
    names, index = class_names_of(train_table.features[label], train_labels + eval_labels)
    if index is None and len(found := set(train_labels + eval_labels)) < len(names):  # indices with gaps
        split, labels = ("train", train_labels) if len(names) - 1 in train_labels else ("evaluation", eval_labels)
        raise UserError(
            f"data.root={where!r}: {split} row {labels.index(len(names) - 1)} has label {len(names) - 1}, but only "
            f"{len(found)} of the {len(names)} classes 0..{len(names) - 1} have rows; labels are class indices "
            "0..K-1 (or a ClassLabel column)"
        )
    if eval_table is not None:
        train = HFImageDataset(train_table, None, image, label, train_tf, index, f"{source} train split")
        return train, HFImageDataset(eval_table, None, image, label, eval_tf, index, f"{source} eval split"), names
    if val_fraction <= 0:
        raise UserError(f"data.root={where!r}: no evaluation split; set a data.val_fraction > 0 to hold some out")
    as_index = [int(v) if index is None else index[v] for v in train_labels]
    train_rows, eval_rows = stratified_split(as_index, val_fraction, split_seed)
    if not eval_rows:
        raise UserError(f"data.root={where!r}: too few rows to hold out {val_fraction:.0%} for evaluation")
    train = HFImageDataset(train_table, train_rows, image, label, train_tf, index, f"{source} train split")
    return train, HFImageDataset(train_table, eval_rows, image, label, eval_tf, index, f"{source} train split"), names
