"""One released file as a row of the pretrained table: where it is, how to check it, what it expects as input
(its preprocessing record) and what it predicts (its classes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ..preprocessing import Preprocessing

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


# ImageNet-1k class names: the WordNet lemmas of the 1000 sorted synsets, as timm's imagenet_synsets.txt lists
# them (the one name found twice, "crane", carries its synset id); ImageNet-21k classes are indices.
PACKAGE_DATA = Path(__file__).parents[1] / "data"


@cache
def _read_class_names(filename: str) -> tuple[str, ...]:
    return tuple(PACKAGE_DATA.joinpath(filename).read_text().splitlines())


def class_names(classes: str) -> list[str] | None:
    """The names of a class set shipped with the package ("imagenet-1k"), or None (indices only)."""
    filename = _CLASS_FILES.get(classes)
    return list(_read_class_names(filename)) if filename else None
