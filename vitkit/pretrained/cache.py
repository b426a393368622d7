"""The download cache: where each released file is kept, and whether the file there is the one its row names.

A URL's file is kept under its URL's path in ``cache_dir()``, Hub files in huggingface_hub's cache (a copy put by
hand at ``<cache>/<repo>/<file>`` first); a cached file is used without network access. The first load of a file
checks it against its row and records its sha256 beside it (``<file>.verified.json``); every later use compares
the file with that record, so a file changed since is named, with how to download it anew, instead of loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..io import atomic_write_text
from ..models.registry import config_class, model_config
from .row import PretrainedRow


def cache_dir() -> Path:
    """``$VITKIT_CACHE``, else ``$XDG_CACHE_HOME/vitkit``, else ``~/.cache/vitkit`` (read on every call)."""
    if os.environ.get("VITKIT_CACHE"):
        return Path(os.environ["VITKIT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "vitkit"


def url_cache_path(url: str) -> Path:
    """Where a URL's file is kept: its path under the cache (so equal file names in two folders never meet)."""
    parts = [p for p in urllib.parse.unquote(urllib.parse.urlsplit(url).path).split("/") if p not in ("", ".", "..")]
    if not parts:
        raise UserError(f"{url}: the URL names no file")
    return cache_dir().joinpath(*parts)


def manual_hub_dir(row: PretrainedRow) -> Path:
    """Where a Hub row's files may be put by hand: <cache>/<repo>/ (used before asking the Hub)."""
    return cache_dir().joinpath(*row.repo.split("/"))


def hub_cache_dir() -> str | None:
    """huggingface_hub's own cache, or <VITKIT_CACHE>/huggingface when VITKIT_CACHE moves vitkit's cache."""
    return str(cache_dir() / "huggingface") if os.environ.get("VITKIT_CACHE") else None


def checkpoint_path(row: PretrainedRow, files: list[Path]) -> Path:
    """The path the checkpoint readers take: the weights file, or the directory of an HF checkpoint."""
    return files[-1].parent if row.format == "hf" else files[-1]


def cached_path(row: PretrainedRow) -> Path | None:
    """The local checkpoint path of a row if all its files are in the cache (no network access), else None."""
    if row.url:
        path = url_cache_path(row.url)
        return path if path.is_file() else None
    manual = [manual_hub_dir(row) / f for f in row.hub_files]
    if all(p.is_file() for p in manual):
        return checkpoint_path(row, manual)
    from huggingface_hub import try_to_load_from_cache

    found = []
    for name in row.hub_files:
        hit = try_to_load_from_cache(row.repo, name, cache_dir=hub_cache_dir(), revision=row.revision)
        if not isinstance(hit, str):
            return None
        found.append(Path(hit))
    return checkpoint_path(row, found)


# ------------------------------------------------------------------------------------------------ checks
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def listed_bounds(listed: str) -> tuple[int, int]:
    """The byte range a size as a host lists it (rounded: '393.69 MiB', '37 MiB', '346 MB') stands for: one unit
    of its last digit either way, so a listing that rounds and one that truncates are both covered."""
    number, _, unit = listed.strip().partition(" ")
    if unit not in _UNITS:
        raise ValueError(f"listed size {listed!r}: expected '<number> <{'|'.join(_UNITS)}>'")
    decimals = len(number.partition(".")[2])
    step = 10.0**-decimals
    value = float(number)
    return int((value - step) * _UNITS[unit]), int(round((value + step) * _UNITS[unit]))


def fits_listed(size: int, listed: str) -> bool:
    """Whether a file of ``size`` bytes is the size a host lists (within the listing's rounding)."""
    lo, hi = listed_bounds(listed)
    return lo <= size <= hi


def check_file(path: Path, source: str, sha256: str | None, size: int | None, listed: str | None = None) -> None:
    """A downloaded file against its published size (exact, or as listed) and checksum; a mismatch deletes it."""
    got_size = path.stat().st_size
    problem: str | None = None
    if size is not None and got_size != size:
        problem = f"expected {size} bytes, got {got_size}"
    elif listed is not None and not fits_listed(got_size, listed):
        problem = f"expected about {listed} as listed, got {got_size} bytes"
    elif sha256 is not None and (got := sha256_of(path)) != sha256.lower():
        problem = f"sha256 mismatch (expected {sha256}, got {got})"
    if problem is not None:
        path.unlink(missing_ok=True)
        raise UserError(f"{source}: {problem}; the download was deleted")


# what a readable file of each format holds: an .npz member (official: under any tower prefix) or the file kind
_NPZ_MARKERS = {"official": "embedding/kernel", "big_transfer": "resnet/"}


def unreadable(path: Path, format: str, full: bool = False) -> str | None:
    """Why ``path`` is not a readable file of ``format``, or None; ``full`` also checks every .npz member's CRC."""
    import zipfile

    if path.suffix == ".npz" or format in _NPZ_MARKERS:
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                bad = archive.testzip() if full else None
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"not an .npz archive ({first_line(e)})"
        if bad is not None:
            return f"member {bad!r} is corrupt"
        if not names or not all(n.endswith(".npy") for n in names):
            return "not an .npz of arrays"
        marker = _NPZ_MARKERS.get(format)
        if marker and not any(marker in n for n in names):
            return f"no {marker!r} array, so not a {format} checkpoint"
        return None
    if path.suffix == ".safetensors":
        return _bad_safetensors(path)
    if path.name == "config.json":
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            return f"not a JSON config ({first_line(e)})"
        return None if isinstance(doc, dict) else "not a JSON object"
    return None


def _bad_safetensors(path: Path) -> str | None:
    """Why a .safetensors file is not whole: its header must parse and its tensors end where the file ends."""
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        total = path.stat().st_size
        if n > total - 8:
            return "not a safetensors file (its header length exceeds the file)"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (KeyError, IndexError, TypeError, ValueError):
        return "not a safetensors file (a tensor entry without data_offsets)"
    if 8 + n + max(ends, default=0) != total:
        return f"truncated or padded: the tensors end at byte {8 + n + max(ends, default=0)}, the file at {total}"
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# ------------------------------------------------------------------------------------------------ trust
VERIFIED_SUFFIX = ".verified.json"


def weights_file(row: PretrainedRow, path: Path) -> Path:
    """The weights file of a row's checkpoint path (an HF directory's weights, else the path itself)."""
    return path / row.hub_files[-1] if row.format == "hf" else path


def _sidecar(weights: Path) -> Path:
    return weights.with_name(weights.name + VERIFIED_SUFFIX)


def refetch_hint(row: PretrainedRow, weights: Path) -> str:
    """How to get a good file again: remove the cached one (the next use downloads it anew)."""
    if row.url:
        return f"remove it (rm '{weights}') and run again to download it anew, or put a good copy there"
    blob = weights.resolve()  # huggingface_hub's snapshot entry is a link to a blob it would link again
    paths = " ".join(f"'{p}'" for p in dict.fromkeys((weights, blob)))
    return f"remove it (rm {paths}) and run again to download it anew"


def verify_cached(row: PretrainedRow, path: Path) -> None:
    """A cached file of ``row`` must be the one verified before (else of its size, format and sha256)."""
    problem = _cache_problem(row, path)
    if problem is not None:
        raise UserError(problem[1])


def _cache_problem(row: PretrainedRow, path: Path) -> tuple[str, str] | None:
    """What is wrong with a cached file, as (status for listings, one-line message), or None."""
    weights = weights_file(row, path)
    remedy = refetch_hint(row, weights)
    record = _sidecar(weights)
    if record.is_file():
        try:
            recorded = json.loads(record.read_text(encoding="utf-8"))
            want, size = str(recorded["sha256"]), int(recorded["size"])
        except (ValueError, KeyError, TypeError, OSError):
            record.unlink(missing_ok=True)  # a damaged record proves nothing: the file is checked afresh below
        else:
            if weights.stat().st_size == size and sha256_of(weights) == want:
                return None
            return "changed", (
                f"{weights}: the cached file of {row.tag} changed since it was first verified (sha256 {want[:12]}... "
                f"recorded); {remedy}"
            )
    problems = []
    got_size = weights.stat().st_size
    if row.size is not None and got_size != row.size:
        problems.append(f"{got_size} bytes, expected {row.size}")
    elif row.listed_size is not None and not fits_listed(got_size, row.listed_size):
        problems.append(f"{got_size} bytes, listed as {row.listed_size}")
    reason = unreadable(weights, row.format)
    if reason:
        problems.append(reason)
    if problems:
        return "unreadable", f"{weights}: the cached file of {row.tag} is unreadable ({'; '.join(problems)}); {remedy}"
    if row.sha256 is not None and (got := sha256_of(weights)) != row.sha256.lower():
        return "wrong file", (
            f"{weights}: not the published file of {row.tag} (sha256 {got}, published {row.sha256}); {remedy}"
        )
    return None


# the config fields a row implies (registry row + row.config) that its file must agree with
ROW_FIELDS = {
    "vit": ("patch_size", "in_chans", "width", "depth", "num_heads", "mlp_dim", "classifier", "representation_size",
            "resnet_layers", "resnet_width", "pos_embed", "num_classes", "img_size", "gelu", "ln_eps"),
    "bit": ("layers", "width_factor", "in_chans", "num_classes"),
    "resnet": ("layers", "width_factor", "in_chans", "num_classes"),
}  # fmt: skip


def check_against_row(row: PretrainedRow, path: Path, config: Mapping[str, Any], guessed: Mapping[str, Any]) -> None:
    """Refuse a file that is not the model its row implies; record the sha256 of one that is."""
    want = model_config(row.model, **row.config)
    arch = config.get("arch", "vit")
    if arch != want.arch:
        hint = refetch_hint(row, path)
        raise UserError(f"{path}: holds a {arch!r} model, but {row.tag} is a {want.arch!r} one; {hint}")
    cls = config_class(arch)
    got = cls(**{k: v for k, v in config.items() if k != "arch"})
    wrong = [
        f"{name} {getattr(got, name)!r} (the tag: {getattr(want, name)!r})"
        for name in ROW_FIELDS[arch]
        if name not in guessed and getattr(got, name) != getattr(want, name)
    ]
    if wrong:
        raise UserError(
            f"{path}: not the file of {row.tag}: {'; '.join(wrong)}; {refetch_hint(row, weights_file(row, path))}"
        )
    _record_verified(row, weights_file(row, path))


def _record_verified(row: PretrainedRow, weights: Path) -> None:
    record = _sidecar(weights)
    if record.is_file():
        return
    doc = {"tag": row.tag, "source": row.source, "size": weights.stat().st_size, "sha256": sha256_of(weights)}
    with contextlib.suppress(UserError):  # a read-only cache: the file is still checked by size and format
        atomic_write_text(record, json.dumps(doc, indent=2) + "\n")


def cache_status(row: PretrainedRow) -> str:
    """For listings: "no", or "cached (...)": what of the file was checked against its release (CHECKS: sha256,
    size, arch), "not checked yet" before its first use, or changed, wrong file or unreadable."""
    path = cached_path(row)
    if path is None:
        return "no"
    problem = _cache_problem(row, path)
    if problem is not None:
        return f"cached ({problem[0]})"
    if not _sidecar(weights_file(row, path)).is_file():
        return "cached (not checked yet)"
    published = (("sha256", row.sha256), ("size", row.size or row.listed_size), ("arch", True))
    return f"cached ({'+'.join(name for name, given in published if given)})"


CHECKS = (
    "cached (checked against the release): sha256 = the exact file; size = its byte count; arch = the architecture "
    "its tag names. Without a published sha256, a file of that architecture and size with other weights is not "
    "detected; its sha256 is recorded at its first use, so a later change is."
)
