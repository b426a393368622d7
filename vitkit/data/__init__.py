"""Data for training and evaluation: the embedded digits, image folders, CIFAR-10/100, synthetic images,
procedural shapes of any size (procedural.py), Hugging Face datasets (hf.py), WebDataset shards (wds.py; written
by shard.py) and CSV / JSON manifests (manifest.py).

    train_ds, eval_ds, info = build_datasets(DataConfig(source="folder", root="photos/"))

Items are ``(float tensor (C, H, W), int label)`` with pixels normalised by ``(x - mean) / std`` ([-1, 1] by
default, as the paper). Training augmentation (inception crop + flip for photos, small shifts for digits) draws
from torch's global RNG inside ``__getitem__`` / ``augment_batch`` -- never from Python's ``random`` or numpy's
global RNG -- so a loop that seeds torch per step or per item replays it exactly, also after a resume.
In-memory sources (digits, synthetic) are ``TensorImageDataset``s: index ``.images`` / ``.labels`` by batch and
call ``.augment_batch`` to train without a DataLoader. ``DatasetInfo`` (JSON-able) records classes and
preprocessing; ``eval_transform(info.img_size, info.mean, info.std, info.crop_fraction, info.in_chans)``
prepares a new image for a trained model.
"""

from .build import build_datasets
from .config import SOURCE_DEFAULTS, SOURCES, DataConfig, DatasetInfo
from .datasets import (
    IMAGE_EXTENSIONS,
    ArrayImageDataset,
    ImageFolderDataset,
    TensorImageDataset,
    scan_image_folder,
    stratified_split,
)
from .transforms import (
    augment_images,
    eval_transform,
    image_transform,
    load_image,
    sample_crop_boxes,
    train_transform,
)
from .wds import WebDatasetStream

__all__ = [
    "IMAGE_EXTENSIONS",
    "SOURCES",
    "SOURCE_DEFAULTS",
    "ArrayImageDataset",
    "DataConfig",
    "DatasetInfo",
    "ImageFolderDataset",
    "TensorImageDataset",
    "WebDatasetStream",
    "augment_images",
    "build_datasets",
    "eval_transform",
    "image_transform",
    "load_image",
    "sample_crop_boxes",
    "scan_image_folder",
    "stratified_split",
    "train_transform",
]
