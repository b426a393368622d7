"""A manifest of image files for data that is neither a class-per-folder tree nor a dataset: ``--data manifest:FILE``.

FILE is a CSV with a header row, or JSON (a list of objects, or JSON lines), with the columns

    path   the image file, relative to the manifest's own directory (or absolute)
    label  the class name (a string; numbers are names too: classes are sorted as strings, "10" after "1")
    split  optional: train, val / validation / eval, or test; rows without one are training rows

Evaluation uses the val (else test) rows; with none, a stratified data.val_fraction of the training rows is held
out by the folder source's rule (``stratified_split`` with data.split_seed).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from ..errors import UserError, UserFileNotFoundError
from .datasets import stratified_split

EVAL_NAMES = {"val": "val", "valid": "val", "validation": "val", "eval": "val", "test": "test"}


def read_image_manifest(path: str | Path) -> list[dict[str, str]]:
    """The rows of a CSV / JSON / JSON-lines manifest as dicts of strings, checked for path and label."""
    path = Path(path)
    if not path.is_file():
        raise UserFileNotFoundError(f"{path}: manifest file not found")
    try:  # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise UserError(
            f"{path}: line {line} is not UTF-8 (byte {e.object[e.start]:#x}); save the manifest as UTF-8"
        ) from None
    rows: list[Any]
    if path.suffix.lower() in (".json", ".jsonl"):
        try:
            stripped = text.lstrip()
            rows = json.loads(text) if stripped.startswith("[") else [json.loads(x) for x in text.splitlines() if x]
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
    else:
        rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise UserError(f"{path}: the manifest has no rows")
    out = []
    for n, row in enumerate(rows, start=2 if path.suffix.lower() == ".csv" else 1):
        if not isinstance(row, dict) or not row.get("path") or row.get("label") in (None, ""):
            raise UserError(f"{path}: row {n} needs a path and a label (columns path,label[,split]), got {row}")
        out.append({k: str(v).strip() for k, v in row.items() if v is not None})
    return out


def manifest_samples(path: str | Path) -> tuple[list[str], dict[str, list[tuple[Path, int]]]]:
    """(class names, {"train": [(file, label)], "val": [...], "test": [...]}) of a manifest; files checked."""
    path = Path(path)
    rows = read_image_manifest(path)
    names = sorted({row["label"] for row in rows})
    index = {name: i for i, name in enumerate(names)}
    parts: dict[str, list[tuple[Path, int]]] = {"train": [], "val": [], "test": []}
    missing = []
    for row in rows:
        split = row.get("split", "").lower() or "train"
        part = "train" if split == "train" else EVAL_NAMES.get(split)
        if part is None:
            raise UserError(f"{path}: split {row['split']!r} of {row['path']}: expected train, val or test")
        file = Path(row["path"]) if Path(row["path"]).is_absolute() else path.parent / row["path"]
        if not file.is_file():
            missing.append(row["path"])
        parts[part].append((file, index[row["label"]]))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserFileNotFoundError(f"{path}: image files not found: {', '.join(missing[:3])}{more}")
    return names, parts


def split_manifest(
    path: str | Path, val_fraction: float, split_seed: int
) -> tuple[list[str], list[tuple[Path, int]], list[tuple[Path, int]]]:
    """(class names, training samples, evaluation samples): the val rows, else the test rows, else held out."""
    names, parts = manifest_samples(path)
    train = parts["train"]
    if not train:
        raise UserError(f"{path}: no training rows (split empty or train)")
    held = parts["val"] or parts["test"]
    if held:
        return names, train, held
    if val_fraction <= 0:
        raise UserError(f"{path}: no val or test rows; set a data.val_fraction > 0 to hold some out")
    keep, out = stratified_split([label for _, label in train], val_fraction, split_seed)
    if not out:
        raise UserError(f"{path}: too few rows to hold out {val_fraction:.0%} for evaluation")
    return names, [train[i] for i in keep], [train[i] for i in out]
