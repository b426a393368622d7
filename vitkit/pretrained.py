"""Released weights by tag: ``resolve_pretrained("vit_b16.augreg_in21k_ft_in1k")`` -> (local path, its row).

A tag is ``<model>.<weights>``: a model of the registry (vitkit.models.MODELS) and one released file of it.
Each row of PRETRAINED says where the file is (an https URL, or a Hugging Face Hub repository and file names),
its size and sha256 where published (None where not: nothing here is guessed), the evaluation preprocessing
it was trained for, its classes, its licence, and the model config fields it needs beyond the registry row
(``config``: 21843 classes and a pre-logits layer for the original ImageNet-21k files, 384 pixels for most
ImageNet-1k fine-tunes). ``row.preprocessing()`` is the weights' preprocessing record (vitkit.preprocessing) and
``row.metadata()`` that record with the row's provenance, so predict / eval preprocess as the weights expect.

Where the rows come from:
  - the original release (2020), google-research/vision_transformer: README "Available ViT models" and the
    bucket listing in vit_jax.ipynb (``gsutil ls -lh gs://vit_models/imagenet*``, the sizes below). The
    ImageNet-21k files keep their pre-logits layer and a deliberately zeroed head; their pre-logits widths
    are those timm used to load them (its vit_*_in21k models, 2020). The ImageNet-1k fine-tunes are at 384
    pixels, the "-224" ones at 224. Evaluation in vit_jax resizes the whole image to the square input size
    (bilinear, no crop) and scales pixels to [-1, 1].
  - AugReg ("How to train your ViT?", 2021): the README's table of recommended checkpoints (pretrained file,
    size, and its ImageNet-1k fine-tune at 384); the 224-pixel fine-tunes and the B/8 files are those
    timm's default_cfgs point to in the same bucket, from the same pretrained runs.
  - Hub copies: timm's re-fine-tuned "augreg2" weights (on the Hub only; timm fine-tuned them with exact GELU
    and evaluates with a 0.9 centre crop), and Hugging Face transformers conversions of the original
    fine-tunes (config.json with exact GELU and LayerNorm eps 1e-12, as transformers computes them).
The official weights are released with google-research/vision_transformer under Apache-2.0, which the Hub
copies also declare.

Downloads go to one cache directory: ``$VITKIT_CACHE``, else ``$XDG_CACHE_HOME/vitkit``, else
``~/.cache/vitkit``. A URL file is saved under the path of its URL there, downloaded by huggingface_hub's
``http_get`` (its HTTP session and proxies; a dropped connection is resumed with a Range request); it is written
to a temporary name and renamed only when it is checked, resumed or not (its announced length, its size exact
or as listed, its checksum where known, and that it reads as its format: an .npz whose members all read back,
with that format's arrays), under a lock file, so an interrupted, concurrent or bad download never leaves a
file under the final name; what a killed one left is removed by the next, and one download has an overall
deadline (``$VITKIT_DOWNLOAD_DEADLINE`` seconds, 4 hours by default) so a server that trickles bytes cannot
hold it forever. A server (or Hub) that cannot be reached at all (connection refused, no such host) fails at
once, in one line, instead of after retries with backoff; HF_HUB_OFFLINE stops URL downloads as it stops the
Hub's. Hub files go through huggingface_hub (its cache, resume, HF_HUB_OFFLINE and progress bars) into its
own cache, or into ``$VITKIT_CACHE/huggingface`` when VITKIT_CACHE is set; a copy put by hand at
``<cache>/<repo>/<file>`` is used first. A file in the cache is used without any network access.

A tag means one file. A cached file is checked before each use: never verified yet, by its listed size and
that it reads as its format; once verified, against the sha256 recorded then. The first load of a file checks
it against its row (``check_against_row``: every architecture field the registry row and the row's config imply,
its class count and resolution) and refuses another model in one line naming the file and the tag; a file that
fits gets its sha256 recorded beside it (``<file>.verified.json``), so a file changed later is named with how to
download it anew rather than loaded. Sizes: the rows' ``listed_size`` are the hosts' own listings (the
gs://vit_models listing in vit_jax.ipynb, the AugReg README table, the Hub's file pages); a row without one has
no size published where its file is listed (the AugReg ImageNet-1k fine-tunes, the B/8 AugReg files, the BiT
files) and is checked by its format and, once verified, its sha256 only.

ImageNet-1k class names (data/imagenet1k_classes.txt) are the WordNet lemmas of the 1000 synsets in their
standard (sorted) order, as timm's imagenet_synsets.txt and imagenet_synset_to_lemma.txt list them; the one
name that occurs twice ("crane", the bird and the machine) carries its synset id. ImageNet-21k classes are
indices.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fnmatch
import hashlib
import io
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .errors import UserError
from .io import atomic_write, atomic_write_text
from .models.registry import MODELS
from .preprocessing import Preprocessing

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer
    from tqdm import tqdm

    from .checkpoint.base import Checkpoint

__all__ = [
    "PRETRAINED",
    "PretrainedRow",
    "cache_dir",
    "cached_path",
    "class_names",
    "default_pretrained",
    "download_url",
    "get_pretrained",
    "is_tag",
    "list_pretrained",
    "resolve_pretrained",
]

FORMATS = ("official", "big_transfer", "timm", "hf")
CLASS_COUNTS = {"imagenet-1k": 1000, "imagenet-21k": 21843}
_CLASS_FILES = {"imagenet-1k": "imagenet1k_classes.txt"}
HALF = (0.5, 0.5, 0.5)  # the paper's pixels in [-1, 1]: (x / 255 - 0.5) / 0.5


@dataclass(frozen=True)
class PretrainedRow:
    """One released file: where it is, how to check it, what it expects as input and what it predicts."""

    model: str  # a name of vitkit.models.MODELS
    weights: str  # the tag is f"{model}.{weights}"
    format: str  # "official" / "big_transfer" (.npz), "timm" (state dict) or "hf" (transformers directory)
    url: str | None = None  # an https file, or
    hub_repo: str | None = None  # a Hugging Face Hub repository ...
    hub_files: tuple[str, ...] = ()  # ... and its files (for "hf": config.json first, then the weights)
    revision: str = "main"
    sha256: str | None = None  # of the (weights) file, when published; checked after each download
    size: int | None = None  # bytes, when published; checked after each download and before each use
    listed_size: str | None = None  # as the host lists it (rounded); None: no published size. Checked within
    # its rounding (listed_bounds) after each download and before each use
    img_size: int = 224  # evaluation input size
    mean: tuple[float, ...] = HALF
    std: tuple[float, ...] = HALF
    crop_fraction: float = 1.0  # 1.0: resize the whole image (vit_jax); < 1: resize, then centre crop
    interpolation: str = "bilinear"  # as the source evaluates; vitkit's evaluation transform is bilinear
    classes: str = "imagenet-1k"  # a key of CLASS_COUNTS
    config: Mapping[str, Any] = field(default_factory=dict)  # model config fields beyond the registry row
    licence: str = "Apache-2.0"

    @property
    def tag(self) -> str:
        return f"{self.model}.{self.weights}"

    @property
    def repo(self) -> str:
        """The Hub repository of a Hub row (a row with a URL has none: asking is a bug)."""
        if self.hub_repo is None:
            raise ValueError(f"{self.tag}: a URL row has no Hub repository")
        return self.hub_repo

    @property
    def num_classes(self) -> int:
        return int(self.config.get("num_classes", CLASS_COUNTS[self.classes]))

    @property
    def source(self) -> str:
        """Where the file is, in one string: its URL, or hf://<repo>/<weights file>[@revision]."""
        if self.url:
            return self.url
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"hf://{self.hub_repo}/{self.hub_files[-1]}{rev}"

    def preprocessing(self) -> Preprocessing:
        """What the file expects and predicts: the table's one record of it (vitkit.preprocessing)."""
        names = class_names(self.classes)
        return Preprocessing(
            img_size=self.img_size,
            mean=list(self.mean),
            std=list(self.std),
            in_chans=len(self.mean),
            crop_fraction=self.crop_fraction,
            interpolation=self.interpolation,
            class_names=names if names is not None and len(names) == self.num_classes else None,
        )

    def metadata(self) -> dict[str, Any]:
        """The row as checkpoint metadata: its preprocessing record's keys, then its provenance."""
        provenance = dict(classes=self.classes, pretrained_tag=self.tag, source=self.source, licence=self.licence)
        return {**self.preprocessing().to_dict(), **provenance}


# ------------------------------------------------------------------------------------------------ the table
GCS = "https://storage.googleapis.com/vit_models"
# '+' in the bucket's folder and file names is sent percent-encoded, so no server can read it as a space
ORIG_21K = f"{GCS}/imagenet21k"
ORIG_1K = f"{GCS}/imagenet21k%2Bimagenet2012"
AUGREG = f"{GCS}/augreg"


def _in21k(tag: str, url: str, listed: str | None = None, **config: Any) -> PretrainedRow:
    """A file pretrained on ImageNet-21k at 224 pixels (21843 classes), on the official bucket."""
    model, weights = tag.split(".")
    config = {"num_classes": 21843, "img_size": 224, **config}
    return PretrainedRow(model, weights, "official", url=url, listed_size=listed, classes="imagenet-21k", config=config)


def _in1k(tag: str, url: str, img_size: int, listed: str | None = None) -> PretrainedRow:
    """An ImageNet-1k fine-tune (a plain head, no pre-logits) on the official bucket."""
    model, weights = tag.split(".")
    config = {"num_classes": 1000, "img_size": img_size}
    return PretrainedRow(model, weights, "official", url=url, img_size=img_size, listed_size=listed, config=config)


def _augreg(tag: str, run: str, finetune: str | None = None, img_size: int = 224, listed: str | None = None):
    """An AugReg file: the ImageNet-21k run itself, or (finetune given) its ImageNet-1k fine-tune."""
    if finetune is None:
        return _in21k(tag, f"{AUGREG}/{run}.npz", listed)
    return _in1k(tag, f"{AUGREG}/{run}--imagenet2012-{finetune}.npz", img_size, listed)


def _hub(tag: str, repo: str, files: tuple[str, ...], format: str, listed: str, **kw: Any) -> PretrainedRow:
    """A Hub copy of ImageNet-1k weights (the files of one repository)."""
    model, weights = tag.split(".")
    img_size = kw.pop("img_size", 224)
    config = {"num_classes": 1000, "img_size": img_size, **kw.pop("config", {})}
    return PretrainedRow(
        model, weights, format, hub_repo=repo, hub_files=files, listed_size=listed, img_size=img_size,
        config=config, **kw,
    )  # fmt: skip


# the AugReg runs the vision_transformer README recommends (best upstream per model), as file-name stems
RUNS = {
    "vit_ti16": "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0",
    "vit_s16": "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0",
    "vit_s32": "S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0",
    "vit_b16": "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0",
    "vit_b32": "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0",
    "vit_l16": "L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0",
    "r_vit_ti32": "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0",
    "r26_vit_s32": "R26_S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0",
    "r50_vit_l32": "R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1",
    # B/8 (added 2021-07) is not in the README table; this is the run timm's default_cfgs use
    "vit_b8": "B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0",
}
TIMM_AUGREG2 = dict(crop_fraction=0.9, interpolation="bicubic", config={"gelu": "exact"})  # timm's _cfg defaults
HF_NUMERICS = {"gelu": "exact", "ln_eps": 1e-12}  # what the transformers config.json of these copies says

BIT = "https://storage.googleapis.com/bit_models"
BIT_M = ("r50x1", "r50x3", "r101x1", "r101x3", "r152x2", "r152x4")  # R152x2 was added to the release later
BIT_S = ("r50x1", "r50x3", "r101x1", "r101x3", "r152x4")


def _bit(model: str, upstream: str) -> PretrainedRow:
    """A Big Transfer file (google-research/big_transfer README: BiT-M on ImageNet-21k, BiT-S on ImageNet-1k),
    pretrained at 224 pixels; big_transfer's own code feeds it pixels normalised with mean = std = 0.5."""
    classes = "imagenet-21k" if upstream == "M" else "imagenet-1k"
    name = f"BiT-{upstream}-R{model.removeprefix('bit_r')}.npz"
    weights = "bit_m_in21k" if upstream == "M" else "bit_s_in1k"
    config = {"num_classes": CLASS_COUNTS[classes], "img_size": 224}
    return PretrainedRow(model, weights, "big_transfer", url=f"{BIT}/{name}", classes=classes, config=config)


# fmt: off
PRETRAINED: dict[str, PretrainedRow] = {row.tag: row for row in (
    # --- the original release: ImageNet-21k (pre-logits + zeroed head) and its ImageNet-1k fine-tunes
    _in21k("vit_b16.orig_in21k", f"{ORIG_21K}/ViT-B_16.npz", "393.69 MiB", representation_size=768),
    _in21k("vit_b32.orig_in21k", f"{ORIG_21K}/ViT-B_32.npz", "400.01 MiB", representation_size=768),
    _in21k("vit_l16.orig_in21k", f"{ORIG_21K}/ViT-L_16.npz", "1.22 GiB", representation_size=1024),
    _in21k("vit_l32.orig_in21k", f"{ORIG_21K}/ViT-L_32.npz", "1.23 GiB", representation_size=1024),
    _in21k("vit_h14.orig_in21k", f"{ORIG_21K}/ViT-H_14.npz", "2.46 GiB", representation_size=1280),
    _in21k("r50_vit_b16.orig_in21k", f"{ORIG_21K}/R50%2BViT-B_16.npz", "439.85 MiB", representation_size=768),
    _in1k("vit_b16.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-B_16.npz", 384, "331.4 MiB"),
    _in1k("vit_b16.orig_in21k_ft_in1k_224", f"{ORIG_1K}/ViT-B_16-224.npz", 224, "330.29 MiB"),
    _in1k("vit_b32.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-B_32.npz", 384, "336.89 MiB"),
    _in1k("vit_l16.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-L_16.npz", 384, "1.14 GiB"),
    _in1k("vit_l16.orig_in21k_ft_in1k_224", f"{ORIG_1K}/ViT-L_16-224.npz", 224, "1.13 GiB"),
    _in1k("vit_l32.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-L_32.npz", 384, "1.14 GiB"),
    _in1k("r50_vit_b16.orig_in21k_ft_in1k", f"{ORIG_1K}/R50%2BViT-B_16.npz", 384, "377.57 MiB"),
    # --- AugReg: the recommended ImageNet-21k runs (no pre-logits, trained head) and their 384 fine-tunes
    _augreg("vit_ti16.augreg_in21k", RUNS["vit_ti16"], listed="37 MiB"),
    _augreg("vit_ti16.augreg_in21k_ft_in1k", RUNS["vit_ti16"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("vit_ti16.augreg_in21k_ft_in1k_224", RUNS["vit_ti16"], "steps_20k-lr_0.03-res_224"),
    _augreg("vit_s16.augreg_in21k", RUNS["vit_s16"], listed="115 MiB"),
    _augreg("vit_s16.augreg_in21k_ft_in1k", RUNS["vit_s16"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("vit_s16.augreg_in21k_ft_in1k_224", RUNS["vit_s16"], "steps_20k-lr_0.03-res_224"),
    _augreg("vit_s32.augreg_in21k", RUNS["vit_s32"], listed="118 MiB"),
    _augreg("vit_s32.augreg_in21k_ft_in1k", RUNS["vit_s32"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("vit_b16.augreg_in21k", RUNS["vit_b16"], listed="391 MiB"),
    _augreg("vit_b16.augreg_in21k_ft_in1k", RUNS["vit_b16"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("vit_b16.augreg_in21k_ft_in1k_224", RUNS["vit_b16"], "steps_20k-lr_0.01-res_224"),
    _augreg("vit_b32.augreg_in21k", RUNS["vit_b32"], listed="398 MiB"),
    _augreg("vit_b32.augreg_in21k_ft_in1k", RUNS["vit_b32"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("vit_l16.augreg_in21k", RUNS["vit_l16"], listed="1243 MiB"),
    _augreg("vit_l16.augreg_in21k_ft_in1k", RUNS["vit_l16"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("vit_b8.augreg_in21k", RUNS["vit_b8"]),
    _augreg("vit_b8.augreg_in21k_ft_in1k_224", RUNS["vit_b8"], "steps_20k-lr_0.01-res_224"),
    # AugReg hybrids: R+Ti/16 is the ResNet root alone with 8x8 patches; R26 and R50 use four stages (/32)
    _augreg("r_vit_ti32.augreg_in21k", RUNS["r_vit_ti32"], listed="40 MiB"),
    _augreg("r_vit_ti32.augreg_in21k_ft_in1k", RUNS["r_vit_ti32"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("r26_vit_s32.augreg_in21k", RUNS["r26_vit_s32"], listed="170 MiB"),
    _augreg("r26_vit_s32.augreg_in21k_ft_in1k", RUNS["r26_vit_s32"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("r50_vit_l32.augreg_in21k", RUNS["r50_vit_l32"], listed="1337 MiB"),
    _augreg("r50_vit_l32.augreg_in21k_ft_in1k", RUNS["r50_vit_l32"], "steps_20k-lr_0.01-res_384", 384),
    # --- Hub copies: timm's augreg2 re-fine-tunes, transformers conversions of the original fine-tunes
    _hub("vit_b16.augreg2_in21k_ft_in1k", "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k",
         ("model.safetensors",), "timm", "346 MB", **TIMM_AUGREG2),
    _hub("vit_b8.augreg2_in21k_ft_in1k", "timm/vit_base_patch8_224.augreg2_in21k_ft_in1k",
         ("model.safetensors",), "timm", "346 MB", **TIMM_AUGREG2),
    _hub("vit_b16.orig_in21k_ft_in1k_224_hf", "google/vit-base-patch16-224",
         ("config.json", "model.safetensors"), "hf", "346 MB", config=HF_NUMERICS),
    _hub("vit_b16.orig_in21k_ft_in1k_hf", "google/vit-base-patch16-384",
         ("config.json", "model.safetensors"), "hf", "347 MB", img_size=384, config=HF_NUMERICS),
    # --- the paper's CNN baselines: Big Transfer ResNet-v2
    *(_bit(f"bit_{arch}", "M") for arch in BIT_M),
    *(_bit(f"bit_{arch}", "S") for arch in BIT_S),
)}
# fmt: on

# The weights ``pretrained=True`` loads, one per model with released weights: the ImageNet-1k fine-tune of the
# strongest ImageNet-21k pretraining the table holds, from the official bucket (AugReg over the 2020 release, as
# the vision_transformer README recommends; the 384-pixel fine-tune where there are two); a model without an
# ImageNet-1k fine-tune gets its ImageNet-21k weights (ViT-H/14; BiT-M, whose upstream the paper compares with).
DEFAULT_WEIGHTS: dict[str, str] = {
    **{m: "augreg_in21k_ft_in1k" for m in ("vit_ti16", "vit_s16", "vit_s32", "vit_b16", "vit_b32", "vit_l16")},
    **{m: "augreg_in21k_ft_in1k" for m in ("r_vit_ti32", "r26_vit_s32", "r50_vit_l32")},
    "vit_b8": "augreg_in21k_ft_in1k_224",
    "vit_l32": "orig_in21k_ft_in1k",
    "vit_h14": "orig_in21k",
    "r50_vit_b16": "orig_in21k_ft_in1k",
    **{f"bit_{arch}": "bit_m_in21k" for arch in BIT_M},
}


def default_pretrained(model: str) -> PretrainedRow:
    """The row ``pretrained=True`` loads for a registered model (DEFAULT_WEIGHTS), or a UserError when the model
    has no released weights."""
    if model not in DEFAULT_WEIGHTS:
        raise UserError(f"{model} has no released weights; models with weights: {', '.join(DEFAULT_WEIGHTS)}")
    return PRETRAINED[f"{model}.{DEFAULT_WEIGHTS[model]}"]


# ------------------------------------------------------------------------------------------------ look-ups
@cache
def _read_class_names(filename: str) -> tuple[str, ...]:
    return tuple(Path(__file__).with_name("data").joinpath(filename).read_text().splitlines())


def class_names(classes: str) -> list[str] | None:
    """The names of a class set shipped with the package ("imagenet-1k"), or None (indices only)."""
    filename = _CLASS_FILES.get(classes)
    return list(_read_class_names(filename)) if filename else None


def list_pretrained(pattern: str = "", table: Mapping[str, PretrainedRow] | None = None) -> list[str]:
    """Tags matching ``pattern``: a glob (``vit_b16.*``, ``*augreg*``) or, without wildcards, a substring."""
    tags = list(PRETRAINED if table is None else table)
    if not pattern:
        return tags
    glob = pattern if any(c in pattern for c in "*?[") else f"*{pattern}*"
    return [t for t in tags if fnmatch.fnmatchcase(t, glob)]


def is_tag(name: str | os.PathLike) -> bool:
    """Whether a string has the shape of a tag: ``<registered model>.<weights>``, no path separators."""
    if not isinstance(name, str) or "/" in name or os.sep in name:
        return False
    model, dot, weights = name.partition(".")
    return bool(dot and weights) and model in MODELS and "." not in weights


def get_pretrained(tag: str, table: Mapping[str, PretrainedRow] | None = None) -> PretrainedRow:
    """The row of a tag, or a UserError naming the close matches."""
    table = PRETRAINED if table is None else table
    if tag in table:
        return table[tag]
    model = tag.partition(".")[0]
    same_model = [t for t in table if t.partition(".")[0] == model]
    close = difflib.get_close_matches(tag, list(table), n=3, cutoff=0.6)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    elif same_model:
        hint = f"{model} has {', '.join(same_model)}"
    else:
        hint = "see `vitkit models --pretrained`"
    raise UserError(f"unknown pretrained weights {tag!r}; {hint}")


# ------------------------------------------------------------------------------------------------ the cache
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


def _manual_hub_dir(row: PretrainedRow) -> Path:
    """Where a Hub row's files may be put by hand: <cache>/<repo>/ (used before asking the Hub)."""
    return cache_dir().joinpath(*row.repo.split("/"))


def _hub_cache_dir() -> str | None:
    """huggingface_hub's own cache, or <VITKIT_CACHE>/huggingface when VITKIT_CACHE moves vitkit's cache."""
    return str(cache_dir() / "huggingface") if os.environ.get("VITKIT_CACHE") else None


def _hub_offline() -> bool:
    import huggingface_hub.constants as hf_constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return flag or bool(hf_constants.HF_HUB_OFFLINE)


def _hub_url(row: PretrainedRow, filename: str, revision: str | None = None) -> str:
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    return f"{endpoint}/{row.hub_repo}/resolve/{revision or row.revision}/{filename}"


def _checkpoint_path(row: PretrainedRow, files: list[Path]) -> Path:
    """The path the checkpoint readers take: the weights file, or the directory of an HF checkpoint."""
    return files[-1].parent if row.format == "hf" else files[-1]


def cached_path(row: PretrainedRow) -> Path | None:
    """The local checkpoint path of a row if all its files are in the cache (no network access), else None."""
    if row.url:
        path = url_cache_path(row.url)
        return path if path.is_file() else None
    manual = [_manual_hub_dir(row) / f for f in row.hub_files]
    if all(p.is_file() for p in manual):
        return _checkpoint_path(row, manual)
    from huggingface_hub import try_to_load_from_cache

    found = []
    for name in row.hub_files:
        hit = try_to_load_from_cache(row.repo, name, cache_dir=_hub_cache_dir(), revision=row.revision)
        if not isinstance(hit, str):
            return None
        found.append(Path(hit))
    return _checkpoint_path(row, found)


# ------------------------------------------------------------------------------------------------ downloads
def _sha256(path: Path) -> str:
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


def _check_file(path: Path, source: str, sha256: str | None, size: int | None, listed: str | None = None) -> None:
    """A downloaded file against its published size (exact, or as listed) and checksum; a mismatch deletes it."""
    got_size = path.stat().st_size
    if size is not None and got_size != size:
        path.unlink(missing_ok=True)
        raise UserError(f"{source}: expected {size} bytes, got {got_size}; the download was deleted")
    if listed is not None and not fits_listed(got_size, listed):
        path.unlink(missing_ok=True)
        raise UserError(f"{source}: expected about {listed} as listed, got {got_size} bytes; the download was deleted")
    if sha256 is not None:
        got = _sha256(path)
        if got != sha256.lower():
            path.unlink(missing_ok=True)
            raise UserError(f"{source}: sha256 mismatch (expected {sha256}, got {got}); the download was deleted")


# what a readable file of each format holds: an .npz member (official: under any tower prefix) or the file kind
_NPZ_MARKERS = {"official": "embedding/kernel", "big_transfer": "resnet/"}


def unreadable(path: Path, format: str, full: bool = False) -> str | None:
    """Why ``path`` is not a readable file of ``format`` ("official" / "big_transfer" .npz, a "timm" or "hf"
    safetensors / config.json), or None. Cheap: the .npz directory and its names, or the safetensors header and
    its length; ``full`` also checks every .npz member's CRC (a whole read, done once after each download)."""
    import zipfile

    if path.suffix == ".npz" or format in _NPZ_MARKERS:
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
                bad = archive.testzip() if full else None
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"not an .npz archive ({_first_line(e)})"
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
        import json

        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            return f"not a JSON config ({_first_line(e)})"
        return None if isinstance(doc, dict) else "not a JSON object"
    return None


def _bad_safetensors(path: Path) -> str | None:
    """Why a .safetensors file is not whole: its header must parse and its tensors end where the file ends."""
    import json
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


def _lock(path: Path):
    """An inter-process lock for one cache entry, kept apart from the files (<cache>/.locks/...)."""
    from filelock import FileLock

    root = cache_dir()
    try:
        rel = path.relative_to(root)
    except ValueError:  # a destination outside the cache: lock beside it
        return FileLock(str(path.with_name(f".{path.name}.lock")))
    lock = root / ".locks" / rel.with_name(rel.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock))


DEADLINE_ENV = "VITKIT_DOWNLOAD_DEADLINE"
DEFAULT_DEADLINE = 4 * 3600.0  # seconds for one whole file: a 2.5 GiB file at 2 MB/s takes about 20 minutes


def download_deadline() -> float:
    """The overall time one download may take, in seconds: ``$VITKIT_DOWNLOAD_DEADLINE``, else 4 hours."""
    text = os.environ.get(DEADLINE_ENV, "").strip()
    if not text:
        return DEFAULT_DEADLINE
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{DEADLINE_ENV}={text!r}: expected a positive number of seconds")
    return value


def download_url(
    url: str,
    dst: str | Path,
    sha256: str | None = None,
    size: int | None = None,
    progress: bool = True,
    format: str | None = None,
    listed_size: str | None = None,
    deadline: float | None = None,
) -> Path:
    """Download ``url`` to ``dst`` (unless it is there), written through vitkit's ``atomic_write`` under a lock.

    The body is checked before it is renamed onto dst: its announced length, its size (exact, or ``listed_size``
    as the host lists it, rounded), its sha256, and that it is a readable file of ``format`` (an .npz whose
    members all read back, with the arrays of that format; see ``unreadable``). A concurrent download of the
    same file waits on the lock and then uses the first one's result; an interrupted one leaves nothing under
    dst, and what a killed one left (atomic_write's temporary files) is removed by the next. The whole download
    must finish within ``deadline`` seconds (default ``download_deadline()``), so a server that trickles bytes
    does not hold it forever. The body comes through huggingface_hub's ``http_get`` (see ``_fetch``), which
    resumes a dropped connection. Failures are one-line UserErrors naming the URL (or dst, for a full disk): an
    HTTP error, a redirect loop, a body shorter than announced (after http_get's retries), a size / sha256 /
    format mismatch (the download is deleted), the deadline, HF_HUB_OFFLINE, or no network (with where to put
    the file by hand).
    """
    import glob

    dst = Path(dst)
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    limit = download_deadline() if deadline is None else deadline

    def fetch_and_check(tmp: str) -> None:
        _fetch(url, Path(tmp), dst, progress, limit)
        _check_file(Path(tmp), url, sha256, size, listed_size)
        reason = unreadable(Path(tmp), format, full=True) if format else None
        if reason:
            raise UserError(f"{url}: the download is {reason}; it was deleted (run again to retry)")

    if _hub_offline():  # huggingface_hub's session, which downloads it, refuses any request then
        raise UserError(f"{url}: not in the cache and HF_HUB_OFFLINE is set; fetch it elsewhere and put it at {dst}")
    with _lock(dst):
        if not dst.is_file():  # else another process (or an earlier call) finished it while we waited
            for stale in dst.parent.glob(f".{glob.escape(dst.name)}.*.tmp"):  # what a killed download left
                stale.unlink(missing_ok=True)
            atomic_write(dst, fetch_and_check)
    return dst


class _DiskError(Exception):
    """Writing the download failed (a full disk, say): the destination's problem, not the network's."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.errno = error.errno


class _Expired(Exception):
    """The download ran past its overall deadline."""


class _Stalled(Exception):
    """The server dropped the connection again no further into the file than before (see ``_Body.seek``)."""


class _Body(io.RawIOBase, BinaryIO):
    """The file huggingface_hub's ``http_get`` writes a download into: vitkit's temporary file (atomic_write's),
    with the overall deadline checked on each write (so a server that trickles bytes is cut off), and a write
    the system refuses told apart from the network's errors."""

    def __init__(self, file: BinaryIO, ends: float) -> None:
        super().__init__()
        self.file, self.ends = file, ends
        self.reached = 0  # how far the furthest attempt got before the server made http_get start over

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        if time.monotonic() > self.ends:
            raise _Expired
        try:
            return self.file.write(data)
        except OSError as e:
            raise _DiskError(e) from e

    def tell(self) -> int:
        return self.file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        # http_get resumes a dropped connection with a Range request; it seeks only to start over from the first
        # byte when the server ignores Range and sends the whole file again. Starting over is worth it only while
        # each attempt gets further than the last: a connection that always drops at the same byte would loop.
        got = self.file.tell()
        if got <= self.reached:
            raise _Stalled(f"the connection dropped again at byte {got}")
        self.reached = got
        return self.file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        try:
            return self.file.truncate(size)
        except OSError as e:
            raise _DiskError(e) from e


# The chunk size huggingface_hub's http_get hands to its file is a module constant of huggingface_hub (10 MiB,
# buffered before each write), with no argument to pass another. Buffered so, a server trickling less than
# 10 MiB would never reach _Body.write, where the deadline is checked. While vitkit downloads, the constant is
# None: httpx2's iter_bytes(chunk_size=None) yields each network read as it comes (the same bytes, in smaller
# pieces). It is put back when the last of vitkit's downloads in this process ends.
_CHUNKS = threading.Lock()
_chunk_users = 0
_chunk_size = 10 * 2**20  # huggingface_hub's value, read again when the first download starts


@contextlib.contextmanager
def _chunk_per_read() -> Iterator[None]:
    global _chunk_users, _chunk_size
    from huggingface_hub import constants

    with _CHUNKS:
        if _chunk_users == 0:
            _chunk_size = constants.DOWNLOAD_CHUNK_SIZE
            constants.DOWNLOAD_CHUNK_SIZE = None  # type: ignore[assignment]  # declared int; iter_bytes takes None
        _chunk_users += 1
    try:
        yield
    finally:
        with _CHUNKS:
            _chunk_users -= 1
            if _chunk_users == 0:
                constants.DOWNLOAD_CHUNK_SIZE = _chunk_size


def _unreachable(url: str) -> str | None:
    """Why ``url``'s server cannot be reached at all (connection refused, no such host, no answer to connect),
    or None when a connection opens, whatever the answer. One HEAD request through huggingface_hub's session,
    without its retries: its downloads retry a refused connection with backoff (20 s and more), which is right
    for a server that hiccups, not for a machine that is offline."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import http_backoff

    try:
        http_backoff(
            "HEAD", url, max_retries=0, retry_on_exceptions=(), retry_on_status_codes=(), follow_redirects=False,
            timeout=constants.HF_HUB_ETAG_TIMEOUT,
        )  # fmt: skip
    except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:
        return _first_line(e)
    except (httpx2.HTTPError, httpx2.InvalidURL, OSError):
        return None  # anything else is for the download itself to meet and report
    return None


def _fetch(url: str, tmp: Path, dst: Path, progress: bool, deadline: float) -> None:
    """The body of ``url`` into ``tmp`` through huggingface_hub's ``http_get`` (its session, proxies, resume of
    a dropped connection with Range requests); failures as one-line UserErrors (a full disk as one naming dst).
    The UserError is raised outside the except clauses, so no OSError rides along as its context."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.file_download import http_get

    ends = time.monotonic() + deadline
    by_hand = f"fetch this URL elsewhere and put the file at {dst}"
    with _quiet_hub():
        reason = _unreachable(url)
    if reason is not None:
        raise UserError(f"{url}: cannot download ({reason}); without network access, {by_hand}")
    problem: str | None = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_quiet_hub())
            try:
                out = stack.enter_context(open(tmp, "wb"))  # the module's open: a test stands in a full disk
            except OSError as e:
                raise _DiskError(e) from e
            with _chunk_per_read():  # no expected_size: a size that differs is _check_file's to report, with both
                http_get(
                    url, _Body(out, ends), headers={"Accept-Encoding": "identity"}, displayed_filename=dst.name,
                    tqdm_class=_tqdm_class(progress),
                )  # fmt: skip
                try:
                    out.flush()  # so that closing the file has nothing left to write (and fail on)
                except OSError as e:
                    raise _DiskError(e) from e
    except _DiskError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        hint = f"; free space in {dst.parent} or set VITKIT_CACHE to another disk" if full else ""
        problem = f"{dst}: could not be written ({e}){hint}; no file was saved"
    except _Expired:
        problem = (
            f"{url}: the download took over {deadline:g} s (the server is too slow, or stalls); no file was saved; "
            f"set {DEADLINE_ENV} to allow more"
        )
    except HfHubHTTPError as e:
        status = e.response.status_code
        problem = f"{url}: HTTP {status} {e.response.reason_phrase}; no file was saved"
    except httpx2.TooManyRedirects:
        problem = f"{url}: too many redirects (a redirect loop); no file was saved"
    except OfflineModeIsEnabled:
        problem = f"{url}: not in the cache and HF_HUB_OFFLINE is set; {by_hand}"
    except (httpx2.RemoteProtocolError, _Stalled, OSError) as e:
        # the server closed the connection before the announced length, each retry included (http_get says so
        # with an OSError: "Consistency check failed")
        problem = f"{url}: the download ended early ({_first_line(e)}); no file was saved, run again to retry"
    except (httpx2.TransportError, httpx2.InvalidURL) as e:
        problem = f"{url}: cannot download ({_first_line(e)}); without network access, {by_hand}"
    if problem is not None:
        raise UserError(problem)


def _tqdm_class(show: bool) -> type[tqdm]:
    """A byte-counting progress bar class, shown or not, for huggingface_hub's downloads."""
    from tqdm import tqdm

    class Bar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "unit_divisor": 1024, "leave": False, "disable": not show})

    return Bar


def _download_hub(row: PretrainedRow, progress: bool = True) -> Path:
    """The row's files through huggingface_hub: its cache first (no network), then the Hub (or HF_ENDPOINT)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    manual = _manual_hub_dir(row)
    cache = _hub_cache_dir()
    revision = row.revision
    files: list[Path] = []
    for name in row.hub_files:
        url = _hub_url(row, name, revision)
        if len(row.hub_files) == 1:
            by_hand = f"fetch it elsewhere and put it at {manual / name}"
        else:
            by_hand = f"fetch {', '.join(row.hub_files)} elsewhere and put them in {manual}"
        try:
            got = hf_hub_download(row.repo, name, revision=revision, cache_dir=cache, local_files_only=True)
        except LocalEntryNotFoundError:
            if _hub_offline():
                raise UserError(f"{url}: not in the cache and HF_HUB_OFFLINE is set; {by_hand}") from None
            endpoint = os.environ.get("HF_ENDPOINT") or None  # read per call (huggingface_hub reads it at import)
            with _quiet_hub():
                reason = _unreachable(url)
            if reason is not None:
                raise UserError(f"{url}: cannot download ({reason}); without network access, {by_hand}") from None
            try:
                with _quiet_hub():
                    got = hf_hub_download(
                        row.repo, name, revision=revision, cache_dir=cache, endpoint=endpoint,
                        tqdm_class=None if progress else _tqdm_class(False),
                    )  # fmt: skip
            except (HfHubHTTPError, EntryNotFoundError) as e:
                # huggingface_hub reports a failed look-up as LocalEntryNotFoundError, the HTTP answer (if any)
                # as its cause; no answer at all means the Hub cannot be reached
                answer = e if isinstance(e, HfHubHTTPError) else e.__cause__
                status = getattr(getattr(answer, "response", None), "status_code", None)
                if status is not None:
                    raise UserError(f"{url}: HTTP {status}; no file was saved") from None
                cause = _first_line(e.__cause__ or e)
                raise UserError(f"{url}: cannot download ({cause}); without network access, {by_hand}") from None
        path = Path(got)
        if row.sha256 is not None and name == row.hub_files[-1]:
            try:
                _check_file(path.resolve(), url, row.sha256, row.size)
            except UserError:
                path.unlink(missing_ok=True)  # the snapshot's link to the deleted blob
                raise
        # later files of the row from the same commit, so an HF directory never mixes two revisions
        revision = path.parent.name if row.revision == "main" and len(path.parent.name) == 40 else revision
        files.append(path)
    return _checkpoint_path(row, files)


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """huggingface_hub's own log lines and warnings held back for one call (a refused connection is vitkit's one
    line, not theirs too); its logger's level is restored after, so nothing changes for the rest of the process."""
    import logging
    import warnings

    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def resolve_pretrained(
    tag: str, table: Mapping[str, PretrainedRow] | None = None, progress: bool = True
) -> tuple[Path, PretrainedRow]:
    """(local checkpoint path, row) for a tag, downloading the file on first use (see the module docstring).

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
    manual = [_manual_hub_dir(row) / f for f in row.hub_files]
    if all(p.is_file() for p in manual):
        path = _checkpoint_path(row, manual)
        verify_cached(row, path)
        return path, row
    path = _download_hub(row, progress)
    verify_cached(row, path)
    return path, row


# ------------------------------------------------------------------------------------------------ trust
# A tag means one file. After the first load of a cached file fits its row (``check_against_row``), its sha256
# is recorded beside it (<file>.verified.json); every later use compares the file with it, so a file changed
# since (a disk error, an overwrite, another file put in its place) is named instead of loaded.
VERIFIED_SUFFIX = ".verified.json"


def weights_file(row: PretrainedRow, path: Path) -> Path:
    """The weights file of a row's checkpoint path (an HF directory's weights, else the path itself)."""
    return path / row.hub_files[-1] if row.format == "hf" else path


def _sidecar(weights: Path) -> Path:
    return weights.with_name(weights.name + VERIFIED_SUFFIX)


def _remedy(row: PretrainedRow, weights: Path) -> str:
    """How to get a good file again: remove the cached one (the next use downloads it anew)."""
    if row.url:
        return f"remove it (rm '{weights}') and run again to download it anew, or put a good copy there"
    blob = weights.resolve()  # huggingface_hub's snapshot entry is a link to a blob it would link again
    paths = " ".join(f"'{p}'" for p in dict.fromkeys((weights, blob)))
    return f"remove it (rm {paths}) and run again to download it anew"


def verify_cached(row: PretrainedRow, path: Path) -> None:
    """A cached file of ``row`` is what was verified before (its recorded sha256), or, never verified yet, of its
    listed size, readable as its format and of its published sha256; else a one-line UserError naming it and how
    to download it anew."""
    problem = _cache_problem(row, path)
    if problem is not None:
        raise UserError(problem[1])


def _cache_problem(row: PretrainedRow, path: Path) -> tuple[str, str] | None:
    """What is wrong with a cached file, as (status for listings, one-line message), or None. A verified file is
    compared with its record's size, then its sha256 (about a second per gigabyte)."""
    import json

    weights = weights_file(row, path)
    remedy = _remedy(row, weights)
    record = _sidecar(weights)
    if record.is_file():
        try:
            recorded = json.loads(record.read_text(encoding="utf-8"))
            want, size = str(recorded["sha256"]), int(recorded["size"])
        except (ValueError, KeyError, TypeError, OSError):
            record.unlink(missing_ok=True)  # a damaged record proves nothing: the file is checked afresh below
        else:
            if weights.stat().st_size == size and _sha256(weights) == want:
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
    if row.sha256 is not None and (got := _sha256(weights)) != row.sha256.lower():
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
    """A file read for a tag must be the model its row implies (architecture, classes, resolution); a file that
    is not is refused in one line naming the file, the tag and the fields. Fields the file leaves to guess
    (``guessed``) are the row's to say and are not compared. Passing records the file's sha256 beside it."""
    from .models.registry import config_class, model_config

    want = model_config(row.model, **row.config)
    arch = config.get("arch", "vit")
    if arch != want.arch:
        raise UserError(f"{path}: holds a {arch!r} model, but {row.tag} is a {want.arch!r} one; {_remedy(row, path)}")
    cls = config_class(arch)
    got = cls(**{k: v for k, v in config.items() if k != "arch"})
    wrong = [
        f"{name} {getattr(got, name)!r} (the tag: {getattr(want, name)!r})"
        for name in ROW_FIELDS[arch]
        if name not in guessed and getattr(got, name) != getattr(want, name)
    ]
    if wrong:
        raise UserError(
            f"{path}: not the file of {row.tag}: {'; '.join(wrong)}; {_remedy(row, weights_file(row, path))}"
        )
    _record_verified(row, weights_file(row, path))


def _record_verified(row: PretrainedRow, weights: Path) -> None:
    import json

    record = _sidecar(weights)
    if record.is_file():
        return
    doc = {"tag": row.tag, "source": row.source, "size": weights.stat().st_size, "sha256": _sha256(weights)}
    with contextlib.suppress(UserError):  # a read-only cache: the file is still checked by size and format
        atomic_write_text(record, json.dumps(doc, indent=2) + "\n")


def read_pretrained(row: PretrainedRow, progress: bool = True) -> Checkpoint:
    """The Checkpoint of a row's file (downloaded on first use), read as its format and checked against the
    row (``check_against_row``); a cached file that cannot be read is named with how to download it anew."""
    from .checkpoint import loader

    path, _ = resolve_pretrained(row.tag, {row.tag: row}, progress)
    try:
        ckpt = loader.read_checkpoint(path, row.format)
    except UserError as e:
        raise UserError(f"{e}; the cached file of {row.tag}: {_remedy(row, weights_file(row, path))}") from None
    check_against_row(row, path, ckpt.config, ckpt.guessed)
    return ckpt


def cache_status(row: PretrainedRow) -> str:
    """For listings: "no", "cached (verified)" (its sha256 is the one recorded at its first load), "cached
    (unverified)" (not loaded yet), "cached (changed)" (differs from what was verified), "cached (wrong file)"
    (not the published sha256) or "cached (unreadable)" (not of its listed size, or not readable as its format)."""
    path = cached_path(row)
    if path is None:
        return "no"
    problem = _cache_problem(row, path)
    if problem is not None:
        return f"cached ({problem[0]})"
    return "cached (verified)" if _sidecar(weights_file(row, path)).is_file() else "cached (unverified)"
