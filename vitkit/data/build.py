"""``build_datasets``: a DataConfig -> (train dataset, eval dataset, DatasetInfo), one builder per source
(``BUILDERS``); the file-backed sources import their optional packages only when one is built."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import UserError
from .cifar import load_cifar
from .config import DataConfig, DatasetInfo, SourceFields
from .datasets import (
    ArrayImageDataset,
    ImageFolderDataset,
    TensorImageDataset,
    scan_image_folder,
    stratified_split,
    synthetic_images,
)
from .digits import CLASS_NAMES as DIGIT_NAMES
from .digits import digits_to_unit_range, load_digits_arrays
from .hf import HFImageDataset, build_hf_parts
from .manifest import split_manifest
from .procedural import CLASS_NAMES as SHAPE_NAMES
from .procedural import EVAL_STREAM, SELECT_STREAM, TRAIN_STREAM, ProceduralShapes
from .transforms import black_level, channel_stats, eval_transform, train_transform
from .wds import build_wds_parts

Transform = Callable[[Image.Image], torch.Tensor]  # a PIL image -> a normalised (C, H, W) tensor


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset, DatasetInfo]:
    """(train, eval, info) for ``cfg``, resolved first (``None`` fields take the source defaults)."""
    cfg = cfg.resolve()
    built = BUILDERS[cfg.source](cfg)
    info = built[2]
    if cfg.train_fraction < 1:
        built = (keep_fraction(built[0], cfg.train_fraction, cfg.split_seed), *built[1:])
    if info.num_classes == 1:  # legal, but almost always a folder one level too deep or too shallow
        where = cfg.root if cfg.source == "folder" else f"data.source={cfg.source}"
        hint = f" (expected {cfg.root}/<class>/<images>, a folder per class)" if cfg.source == "folder" else ""
        warnings.warn(
            f"{where}: only one class, {info.class_names[0]!r}; a classifier over a single class learns nothing{hint}",
            UserWarning,
            stacklevel=2,
        )
    return built


def build_hf(cfg: DataConfig) -> tuple[Dataset, Dataset, DatasetInfo]:
    """A Hugging Face dataset (``vitkit.data.hf``): its train / validation splits, or a held-out fraction."""
    _no_file_checks(cfg)
    train, test, names = build_hf_parts(
        _root(cfg), cfg.image_column, cfg.label_column, cfg.val_fraction, cfg.split_seed, *_transforms(cfg)
    )
    return train, test, _info(cfg, names)


def build_wds(cfg: DataConfig) -> tuple[Dataset, Dataset, DatasetInfo]:
    """WebDataset shards (``vitkit.data.wds``): a stream for training, the val shards for evaluation."""
    if cfg.train_fraction < 1:
        raise UserError("data.train_fraction < 1 is not available for a stream (data.source=wds); shard a subset")
    _no_file_checks(cfg)
    train, test, names = build_wds_parts(_root(cfg), cfg.val_root, cfg.shuffle_buffer, *_transforms(cfg))
    return train, test, _info(cfg, names)


def build_manifest(cfg: DataConfig) -> tuple[ImageFolderDataset, ImageFolderDataset, DatasetInfo]:
    """Files listed in a CSV / JSON manifest (``vitkit.data.manifest``), read like an image folder."""
    names, train_samples, eval_samples = split_manifest(_root(cfg), cfg.val_fraction, cfg.split_seed)
    train_tf, test_tf = _transforms(cfg)
    train = ImageFolderDataset(train_samples, train_tf, skip_corrupt=cfg.skip_corrupt)
    test = ImageFolderDataset(eval_samples, test_tf, skip_corrupt=cfg.skip_corrupt)
    if cfg.verify:
        train.verify()
        test.verify()
    return train, test, _info(cfg, names)


def _no_file_checks(cfg: DataConfig) -> None:
    """data.skip_corrupt and data.verify act on image files (a folder, a manifest): refused where there are none."""
    for key in ("skip_corrupt", "verify"):
        if getattr(cfg, key):
            raise UserError(
                f"data.{key}=true: for image folders and manifests; data.source={cfg.source} names an unreadable "
                "image by its row or sample when it is read"
            )


def keep_fraction(train: Dataset, fraction: float, seed: int) -> Dataset:
    """A stratified ``fraction`` of a training set, the same for every run with this seed (scarce labels)."""
    if isinstance(train, ImageFolderDataset):
        keep, _ = stratified_split([label for _, label in train.samples], 1 - fraction, seed)
        train.samples = [train.samples[i] for i in sorted(keep)]
    elif isinstance(train, HFImageDataset):
        keep, _ = stratified_split(train.labels, 1 - fraction, seed)
        train.rows = [train.rows[i] for i in sorted(keep)]
    elif isinstance(train, (TensorImageDataset, ArrayImageDataset)):  # images and labels in memory
        keep, _ = stratified_split([int(label) for label in train.labels], 1 - fraction, seed)
        train.images, train.labels = train.images[sorted(keep)], train.labels[sorted(keep)]
    else:
        raise TypeError(f"keep_fraction: no images to subsample in a {type(train).__name__}")
    return train


def _stats(cfg: DataConfig) -> tuple[list[float], list[float]]:
    chans = SourceFields.of(cfg).in_chans
    return channel_stats(cfg.mean, chans, "mean"), channel_stats(cfg.std, chans, "std")


def _info(cfg: DataConfig, class_names: list[str]) -> DatasetInfo:
    mean, std = _stats(cfg)
    src = SourceFields.of(cfg)
    return DatasetInfo(
        num_classes=len(class_names),
        class_names=list(class_names),
        in_chans=src.in_chans,
        img_size=src.img_size,
        mean=mean,
        std=std,
        source=cfg.source,
        crop_fraction=cfg.eval_crop_fraction,
    )


def _transforms(cfg: DataConfig) -> tuple[Transform, Transform]:
    mean, std = _stats(cfg)
    src = SourceFields.of(cfg)
    train = train_transform(
        src.img_size,
        mean,
        std,
        augment=src.train_augment,
        flip=src.flip,
        crop_area_min=cfg.crop_area_min,
        shift_pixels=src.shift_pixels,
        in_chans=src.in_chans,
    )
    test = eval_transform(src.img_size, mean, std, crop_fraction=cfg.eval_crop_fraction, in_chans=src.in_chans)
    return train, test


def build_digits(cfg: DataConfig) -> tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """The embedded digits with their fixed 1,437 / 360 split (see ``vitkit.data.digits``)."""
    images, labels, test_mask = load_digits_arrays()
    x = digits_to_unit_range(images, SourceFields.of(cfg).img_size)  # (N, 1, H, W)
    train_idx, test_idx = np.flatnonzero(~test_mask).tolist(), np.flatnonzero(test_mask).tolist()
    return _in_memory(cfg, x, torch.from_numpy(labels), train_idx, test_idx, DIGIT_NAMES)


def build_synthetic(cfg: DataConfig) -> tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """Random class templates plus noise (see ``synthetic_images``), split by val_fraction."""
    if cfg.val_fraction <= 0:
        raise UserError("data.val_fraction: the synthetic source needs a held-out fraction > 0")
    src = SourceFields.of(cfg)
    x, labels = synthetic_images(cfg.synthetic_size, cfg.synthetic_classes, src.img_size, src.in_chans, cfg.split_seed)
    train_idx, test_idx = stratified_split(labels.tolist(), cfg.val_fraction, cfg.split_seed)
    if not test_idx:
        raise UserError(
            f"data.synthetic_size={cfg.synthetic_size} is too small to hold out "
            f"{cfg.val_fraction:.0%} of each of {cfg.synthetic_classes} classes"
        )
    names = [f"class_{k}" for k in range(cfg.synthetic_classes)]
    return _in_memory(cfg, x, labels, train_idx, test_idx, names)


def build_shapes(cfg: DataConfig) -> tuple[ProceduralShapes, ProceduralShapes, DatasetInfo]:
    """Procedural shapes drawn on the fly: data.num_images to train on (flipped or shifted as the data section says),
    data.eval_images held out."""
    src = SourceFields.of(cfg)
    if cfg.train_fraction < 1:
        raise UserError("data.source=shapes: no data.train_fraction; set data.num_images to the size you want")
    if src.train_augment not in ("none", "shift"):
        raise UserError(
            f"data.train_augment={src.train_augment}: the shapes take none or shift (a crop may cut a marker)"
        )
    # augment_images leaves the images as they are where nothing moves them
    augment = {"augment": src.train_augment, "flip": src.flip, "shift_pixels": src.shift_pixels}
    train = _shapes(cfg, cfg.num_images, TRAIN_STREAM, {**augment, "fill": black_level(*_stats(cfg))})
    return train, _shapes(cfg, cfg.eval_images, EVAL_STREAM), _info(cfg, SHAPE_NAMES)


def build_selection(cfg: DataConfig) -> ProceduralShapes | None:
    """The images a run chooses its weights on (data.select_images, shapes only), apart from both of build_datasets'
    sets; None where the data section asks for none."""
    cfg = cfg.resolve()
    return _shapes(cfg, cfg.select_images, SELECT_STREAM) if cfg.select_images else None


def _shapes(cfg: DataConfig, count: int, stream: int, augment: dict[str, Any] | None = None) -> ProceduralShapes:
    mean, std = _stats(cfg)
    src = SourceFields.of(cfg)
    return ProceduralShapes(
        count,
        seed=cfg.split_seed,
        stream=stream,
        img_size=src.img_size,
        in_chans=src.in_chans,
        mean=mean,
        std=std,
        augment=augment,
    )


def _in_memory(
    cfg: DataConfig,
    images: torch.Tensor,
    labels: torch.Tensor,
    train_idx: list[int],
    test_idx: list[int],
    class_names: list[str],
) -> tuple[TensorImageDataset, TensorImageDataset, DatasetInfo]:
    """Normalise images in [0, 1] (N, 1 or C, H, W), split them, and wrap both parts as tensor datasets."""
    mean, std = _stats(cfg)
    src = SourceFields.of(cfg)
    x = images.expand(-1, src.in_chans, -1, -1) if images.shape[1] == 1 else images  # (N, C, H, W)
    x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    fill = black_level(mean, std)  # what a shift exposes: black, like the digits' background
    train = TensorImageDataset(
        x[train_idx],
        labels[train_idx],
        augment=src.train_augment,
        flip=src.flip,
        shift_pixels=src.shift_pixels,
        crop_area_min=cfg.crop_area_min,
        fill=fill,
    )
    test = TensorImageDataset(x[test_idx], labels[test_idx], fill=fill)
    return train, test, _info(cfg, class_names)


def _root(cfg: DataConfig) -> str:
    if not cfg.root:  # DataConfig.validate() requires it of the sources that read files
        raise UserError(f"data.root: required for source {cfg.source!r} (the directory holding the data)")
    return cfg.root


def build_cifar(cfg: DataConfig) -> tuple[ArrayImageDataset, ArrayImageDataset, DatasetInfo]:
    """The standard train / test batches; ``val_root`` and ``val_fraction`` do not apply."""
    data = load_cifar(_root(cfg), cfg.source)
    train_tf, test_tf = _transforms(cfg)
    train = ArrayImageDataset(data["train"][0], data["train"][1], transform=train_tf)
    test = ArrayImageDataset(data["test"][0], data["test"][1], transform=test_tf)
    return train, test, _info(cfg, data["class_names"])


def build_folder(cfg: DataConfig) -> tuple[ImageFolderDataset, ImageFolderDataset, DatasetInfo]:
    """``root/<class>/<images>``; evaluation on ``val_root`` or on a stratified ``val_fraction`` of root."""
    root = _root(cfg)
    class_names, samples = scan_image_folder(root)
    if cfg.val_root:
        _, eval_samples = scan_image_folder(cfg.val_root, class_names)
        train_samples = samples
    else:
        if cfg.val_fraction <= 0:
            raise UserError(f"{root}: set data.val_root or a data.val_fraction > 0 to have evaluation images")
        train_idx, eval_idx = stratified_split([label for _, label in samples], cfg.val_fraction, cfg.split_seed)
        if not eval_idx:
            raise UserError(
                f"{Path(root)}: too few images to hold out {cfg.val_fraction:.0%} for evaluation "
                "(every class keeps at least one training image); add images or set data.val_root"
            )
        train_samples, eval_samples = [samples[i] for i in train_idx], [samples[i] for i in eval_idx]
    train_tf, test_tf = _transforms(cfg)
    train = ImageFolderDataset(train_samples, train_tf, skip_corrupt=cfg.skip_corrupt)
    test = ImageFolderDataset(eval_samples, test_tf, skip_corrupt=cfg.skip_corrupt)
    if cfg.verify:
        train.verify()
        test.verify()
    return train, test, _info(cfg, class_names)


BUILDERS: dict[str, Callable[[DataConfig], tuple[Dataset, Dataset, DatasetInfo]]] = {
    "digits": build_digits,
    "synthetic": build_synthetic,
    "cifar10": build_cifar,
    "cifar100": build_cifar,
    "shapes": build_shapes,
    "folder": build_folder,
    "hf": build_hf,
    "wds": build_wds,
    "manifest": build_manifest,
}
