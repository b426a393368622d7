"""A released file by tag, on this machine: ``resolve_pretrained(tag)`` gives its local path (fetched on first
use, checked before each use) and ``read_pretrained(row)`` its Checkpoint, checked against the row."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..checkpoint import loader
from ..checkpoint.base import Checkpoint
from ..errors import UserError
from .cache import (
    check_against_row,
    checkpoint_path,
    manual_hub_dir,
    refetch_hint,
    url_cache_path,
    verify_cached,
    weights_file,
)
from .download import download_hub_files, download_url
from .names import get_pretrained
from .row import PretrainedRow


def resolve_pretrained(
    tag: str, table: Mapping[str, PretrainedRow] | None = None, progress: bool = True
) -> tuple[Path, PretrainedRow]:
    """(local checkpoint path, row) for a tag, downloaded on first use, else checked (``verify_cached``)."""
    row = get_pretrained(tag, table)
    manual = [manual_hub_dir(row) / f for f in row.hub_files]
    if row.url:
        path = url_cache_path(row.url)
        if not path.is_file():
            return download_url(row.url, path, row.sha256, row.size, progress, row.format, row.listed_size), row
    elif all(p.is_file() for p in manual):
        path = checkpoint_path(row, manual)
    else:
        path = download_hub_files(row, progress)
    verify_cached(row, path)
    return path, row


def read_pretrained(row: PretrainedRow, progress: bool = True) -> Checkpoint:
    """The Checkpoint of a row's file (downloaded on first use), checked against the row."""
    path, _ = resolve_pretrained(row.tag, {row.tag: row}, progress)
    try:
        ckpt = loader.read_checkpoint(path, row.format)
    except UserError as e:
        raise UserError(f"{e}; the cached file of {row.tag}: {refetch_hint(row, weights_file(row, path))}") from None
    check_against_row(row, path, ckpt.config, ckpt.guessed)
    return ckpt
