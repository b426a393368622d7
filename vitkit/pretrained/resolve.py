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
    """(local checkpoint path, row) for a tag, downloading the file on first use (vitkit.pretrained.download).

    A file already in the cache is checked before it is handed over (``verify_cached``): against the sha256
    recorded when it was first verified, else its listed size and that it reads as its format.
    """
    row = get_pretrained(tag, table)
    if row.url:
        dst = url_cache_path(row.url)
        if dst.is_file():
            verify_cached(row, dst)
            return dst, row
        fmt, listed = row.format, row.listed_size
        return download_url(row.url, dst, row.sha256, row.size, progress, fmt, listed), row
    manual = [manual_hub_dir(row) / f for f in row.hub_files]
    if all(p.is_file() for p in manual):
        path = checkpoint_path(row, manual)
        verify_cached(row, path)
        return path, row
    path = download_hub_files(row, progress)
    verify_cached(row, path)
    return path, row


def read_pretrained(row: PretrainedRow, progress: bool = True) -> Checkpoint:
    """The Checkpoint of a row's file (downloaded on first use), read as its format and checked against the
    row (``check_against_row``); a cached file that cannot be read is named with how to download it anew."""
    path, _ = resolve_pretrained(row.tag, {row.tag: row}, progress)
    try:
        ckpt = loader.read_checkpoint(path, row.format)
    except UserError as e:
        raise UserError(f"{e}; the cached file of {row.tag}: {refetch_hint(row, weights_file(row, path))}") from None
    check_against_row(row, path, ckpt.config, ckpt.guessed)
    return ckpt
