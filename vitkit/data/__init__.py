"""Data for training and evaluation: the embedded digits, image folders, CIFAR-10/100, synthetic images,
procedural shapes, Hugging Face datasets, WebDataset shards and CSV / JSON manifests.

    train_ds, eval_ds, info = build_datasets(DataConfig(source="folder", root="photos/"))

Items are ``(float tensor (C, H, W), int label)``, normalised by ``(x - mean) / std`` ([-1, 1] by default, as the
paper). Augmentation draws from torch's global RNG only, so a loop that seeds torch per step or item replays it
exactly, also after a resume. ``DatasetInfo`` records the classes and the evaluation preprocessing.
"""

from .build import build_datasets, build_selection
from .config import SOURCE_DEFAULTS, SOURCES, DataConfig, DatasetInfo
from .datasets import (
    IMAGE_EXTENSIONS,
    ArrayImageDataset,
    ImageFolderDataset,
    TensorImageDataset,
    scan_image_folder,
    stratified_split,
)
from .transforms import augment_images, eval_transform, image_transform, load_image, sample_crop_boxes, train_transform
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
    "build_selection",
    "eval_transform",
    "image_transform",
    "load_image",
    "sample_crop_boxes",
    "scan_image_folder",
    "stratified_split",
    "train_transform",
]
