"""What to load and how to preprocess it: ``DataConfig`` (the user's choice) and ``DatasetInfo`` (the result).

Fields left as ``None`` take the source's default (``SOURCE_DEFAULTS``), filled by ``DataConfig.resolve()``.
``--data`` spells the file-backed sources with a prefix (``source_section``): ``hf:NAME[:CONFIG]``,
``wds:PATTERN`` and ``manifest:FILE.csv|json``. Every field is a plain type, so a config round-trips through
YAML/JSON and can be overridden field by field (``data.img_size=384``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import UserError
from .transforms import channel_stats, check_augment

RANDAUGMENT_MAX_OPS = 15  # the operations of RandAugment's default policy, drawn without replacement
FILE_SOURCES = ("hf", "wds", "manifest")  # named by --data PREFIX:WHERE; data.root holds WHERE
SOURCES: tuple[str, ...] = ("digits", "folder", "cifar10", "cifar100", "synthetic", "shapes", *FILE_SOURCES)

_PHOTO_DEFAULTS = {"img_size": 224, "in_chans": 3, "train_augment": "inception_crop", "flip": True, "shift_pixels": 0}
SOURCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"img_size": 16, "in_chans": 1, "train_augment": "shift", "flip": False, "shift_pixels": 1},
    "synthetic": {"img_size": 32, "in_chans": 3, "train_augment": "none", "flip": False, "shift_pixels": 0},
    "folder": _PHOTO_DEFAULTS,
    "cifar10": _PHOTO_DEFAULTS,
    "cifar100": _PHOTO_DEFAULTS,
    "shapes": {"img_size": 32, "in_chans": 3, "train_augment": "none", "flip": False, "shift_pixels": 0},
}
SOURCE_DEFAULTS.update({name: _PHOTO_DEFAULTS for name in FILE_SOURCES})


def source_section(data: str) -> dict[str, Any] | None:
    """``--data hf:NAME``, ``wds:PATTERN``, ``manifest:FILE`` -> {"source": ..., "root": ...}; None otherwise."""
    prefix, sep, where = data.partition(":")
    if not sep or prefix not in FILE_SOURCES:
        return None
    if not where:
        raise UserError(f"--data {data!r}: expected {prefix}:WHERE (a name, a path or a pattern after the colon)")
    return {"source": prefix, "root": where}


@dataclass(frozen=True)
class DataConfig:
    """The data source and its preprocessing; ``None`` fields take the source default (module docstring)."""

    source: str = "digits"  # one of SOURCES: digits, folder, cifar10/100, synthetic, shapes, hf, wds, manifest
    root: str | None = None  # folder: root/<class>/<images>; cifar: the directory holding the batch files
    val_root: str | None = None  # folder: a separate evaluation tree; None = hold out val_fraction of root
    val_fraction: float = 0.2  # folder (without val_root) and synthetic: stratified held-out fraction
    split_seed: int = 0  # seed of that split (and of the synthetic images, and of train_fraction's subset)
    train_fraction: float = 1.0  # keep this stratified fraction of the training images (scarce labels), in (0, 1]
    img_size: int | None = None  # input size in pixels (None: the source's default)
    in_chans: int | None = None  # 3 = RGB; 1 = grayscale (digits: 3 repeats the single channel)
    mean: float | list[float] = 0.5  # in [0, 1] pixel units; 0.5 / 0.5 maps pixels to [-1, 1] as the paper
    std: float | list[float] = 0.5  # per channel, in [0, 1] pixel units, like mean
    train_augment: str | None = None  # "inception_crop" | "shift" | "none"
    flip: bool | None = None  # random horizontal flip for training
    shift_pixels: int | None = None  # "shift": maximum shift in pixels of the resized image
    crop_area_min: float = 0.05  # "inception_crop": smallest crop, as a fraction of the image area
    randaugment_ops: int = 0  # RandAugment (kornia) on the training device after decoding: ops per image; 0: off
    randaugment_magnitude: int = 10  # RandAugment strength on kornia's scale, 1 to 29 (30: each op's strongest)
    mixup_alpha: float = 0.0  # mixup: images blended by a Beta(alpha, alpha) weight, one per batch; 0: off
    cutmix_alpha: float = 0.0  # cutmix: a box pasted from another image, its share ~ Beta(alpha, alpha); 0: off
    mixup_switch_prob: float = 0.5  # with mixup and cutmix both on: the chance that a batch uses cutmix
    eval_crop_fraction: float = 1.0  # evaluation: 1 = resize the whole image; < 1 = resize larger, centre-crop
    skip_corrupt: bool = False  # folders, manifests: skip (and count) unreadable images instead of an error
    verify: bool = False  # folders, manifests: decode every image when the data is built, to find bad files
    num_workers: int = 0  # DataLoader worker processes
    synthetic_size: int = 256  # synthetic: number of images (train + eval)
    synthetic_classes: int = 4  # synthetic: number of classes
    num_images: int = 10_000  # shapes: training images, drawn on the fly from split_seed (vitkit.data.procedural)
    eval_images: int = 2_000  # shapes: held-out images, from a seed stream of their own
    select_images: int = 0  # shapes: images, a stream of their own, to choose the weights on (early stopping)
    image_column: str | None = None  # hf: the column of images (None: the Image feature, or "image" / "img")
    label_column: str | None = None  # hf: the column of labels (None: the ClassLabel feature, or "label")
    shuffle_buffer: int = 1000  # wds: samples held in the streaming shuffle buffer of each rank (1: no shuffle)

    def resolve(self) -> DataConfig:
        """A copy with every ``None`` replaced by the source default, validated."""
        if self.source not in SOURCES:
            raise UserError(f"data.source: expected one of {SOURCES}, got {self.source!r}")
        filled = {k: v for k, v in SOURCE_DEFAULTS[self.source].items() if getattr(self, k) is None}
        cfg = replace(self, **filled)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.source in ("folder", "cifar10", "cifar100", *FILE_SOURCES) and not self.root:
            raise UserError(f"data.root: required for source {self.source!r} (the directory holding the data)")
        if self.img_size is not None and self.img_size < 1:
            raise UserError(f"data.img_size: expected a positive integer, got {self.img_size}")
        if self.in_chans is not None and self.in_chans not in (1, 3):
            raise UserError(f"data.in_chans: expected 1 or 3, got {self.in_chans}")
        if self.train_augment is not None:
            check_augment(self.train_augment, self.crop_area_min, self.shift_pixels or 0)
        if not 0.0 <= self.val_fraction < 1.0:
            raise UserError(f"data.val_fraction: expected a value in [0, 1), got {self.val_fraction}")
        if not 0.0 < self.train_fraction <= 1.0:
            raise UserError(f"data.train_fraction: expected a value in (0, 1], got {self.train_fraction}")
        if not 0.0 < self.eval_crop_fraction <= 1.0:
            raise UserError(f"data.eval_crop_fraction: expected a value in (0, 1], got {self.eval_crop_fraction}")
        if not 0 <= self.randaugment_ops <= RANDAUGMENT_MAX_OPS:
            raise UserError(
                f"data.randaugment_ops: expected 0 (off) to {RANDAUGMENT_MAX_OPS} (RandAugment's operations), got "
                f"{self.randaugment_ops}"
            )
        if not 0 < self.randaugment_magnitude < 30:
            raise UserError(
                f"data.randaugment_magnitude: expected 1 to 29 (kornia's scale), got {self.randaugment_magnitude}"
            )
        for key in ("mixup_alpha", "cutmix_alpha"):
            if not getattr(self, key) >= 0:
                raise UserError(f"data.{key}: expected >= 0 (0: off), got {getattr(self, key)}")
        if not 0 <= self.mixup_switch_prob <= 1:
            raise UserError(f"data.mixup_switch_prob: expected a probability in [0, 1], got {self.mixup_switch_prob}")
        if self.source == "shapes" and (self.num_images < 1 or self.eval_images < 1):
            raise UserError(
                f"data.num_images={self.num_images}, data.eval_images={self.eval_images}: the shapes source needs "
                "at least one image of each"
            )
        if self.select_images < 0 or (self.select_images and self.source != "shapes"):
            raise UserError(
                f"data.select_images={self.select_images}: expected 0, or a number of images with data.source=shapes "
                f"(source {self.source!r}: hold out an evaluation set of its own instead)"
            )
        if self.shuffle_buffer < 1:
            raise UserError(f"data.shuffle_buffer: expected >= 1 (1: stream order), got {self.shuffle_buffer}")
        if self.num_workers < 0:
            raise UserError(f"data.num_workers: expected >= 0, got {self.num_workers}")
        chans = self.in_chans or 3
        channel_stats(self.mean, chans, "mean")
        channel_stats(self.std, chans, "std")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"data: unknown keys {unknown}; expected some of {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class SourceFields:
    """The fields a source fills in (SOURCE_DEFAULTS) as a resolved DataConfig holds them: never None."""

    img_size: int
    in_chans: int
    train_augment: str
    flip: bool
    shift_pixels: int

    @classmethod
    def of(cls, cfg: DataConfig) -> SourceFields:
        """The fields of a config returned by DataConfig.resolve(); one still None is a bug of the caller."""
        values = {f.name: getattr(cfg, f.name) for f in fields(cls)}
        unresolved = sorted(k for k, v in values.items() if v is None)
        if unresolved:
            raise RuntimeError(f"DataConfig fields {unresolved} are unresolved: call DataConfig.resolve() first")
        return cls(**values)


@dataclass(frozen=True)
class DatasetInfo:
    """The classes and evaluation preprocessing of the data (mean / std in [0, 1] units), saved as metadata."""

    num_classes: int
    class_names: list[str]
    in_chans: int
    img_size: int
    mean: list[float]
    std: list[float]
    source: str = ""
    crop_fraction: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
