"""Released weights by tag: ``resolve_pretrained("vit_b16.augreg_in21k_ft_in1k")`` -> (local path, its row).

A tag is ``<model>.<weights>``: a registered model and one released file of it, a row of the table.

    row.py       the row type and the class names shipped with the package
    table.py     the rows (PRETRAINED) and each model's default weights (DEFAULT_WEIGHTS)
    names.py     tags, timm's and Hugging Face's names for them, and the one did-you-mean
    cache.py     where files are kept, and whether a cached file is the one its row names
    download.py  fetching a file into the cache, checked before it is kept
    resolve.py   a tag to its local file (fetched on first use) and its Checkpoint
"""

from .cache import (
    VERIFIED_SUFFIX,
    cache_dir,
    cache_status,
    cached_path,
    check_against_row,
    listed_bounds,
    url_cache_path,
    verify_cached,
)
from .download import DEADLINE_ENV, download_url
from .names import default_pretrained, get_pretrained, is_tag, list_pretrained
from .resolve import read_pretrained, resolve_pretrained
from .row import CLASS_COUNTS, FORMATS, PretrainedRow, class_names
from .table import DEFAULT_WEIGHTS, PRETRAINED

__all__ = [
    "CLASS_COUNTS",
    "DEADLINE_ENV",
    "DEFAULT_WEIGHTS",
    "FORMATS",
    "PRETRAINED",
    "VERIFIED_SUFFIX",
    "PretrainedRow",
    "cache_dir",
    "cache_status",
    "cached_path",
    "check_against_row",
    "class_names",
    "default_pretrained",
    "download_url",
    "get_pretrained",
    "is_tag",
    "list_pretrained",
    "listed_bounds",
    "read_pretrained",
    "resolve_pretrained",
    "url_cache_path",
    "verify_cached",
]
