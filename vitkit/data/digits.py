"""The embedded dataset: scikit-learn's handwritten digits (8x8 images, values 0..16, 10 classes). The arrays ship as
package data in ``digits.npz`` (licence: digits_LICENSE.txt), so training needs neither scikit-learn nor a download; its
``test_mask`` is the fixed 20% held-out split, stored so that it stays the same whatever the torch version. Augmentation
is random shifts, no flip (a mirrored digit is a different symbol). Regenerate the file with ``write_digits_npz()``
(needs scikit-learn, a development dependency)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserError, UserFileNotFoundError
from ..optional import require
from .datasets import stratified_split

DIGITS_PATH = Path(__file__).with_name("digits.npz")
NUM_IMAGES, NATIVE_SIZE, MAX_VALUE = 1797, 8, 16
TEST_FRACTION, SPLIT_SEED = 0.2, 0
CLASS_NAMES = [str(d) for d in range(10)]


def load_digits_arrays(path: str | Path = DIGITS_PATH) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images uint8 (N, 8, 8), labels (N,), test_mask bool (N,)) from the package file, checked."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            images, labels, test_mask = z["images"], z["labels"], z["test_mask"]
    except FileNotFoundError:
        raise UserFileNotFoundError(f"{path}: the digits data file is missing from the package") from None
    except KeyError as e:
        raise UserError(f"{path}: expected arrays images, labels, test_mask ({e})") from None
    n = len(images)
    if images.shape != (n, NATIVE_SIZE, NATIVE_SIZE) or labels.shape != (n,) or test_mask.shape != (n,):
        raise UserError(
            f"{path}: unexpected shapes images {images.shape}, labels {labels.shape}, test_mask {test_mask.shape}"
        )
    return images, labels.astype(np.int64), test_mask.astype(bool)


def digits_to_unit_range(images: np.ndarray, img_size: int) -> torch.Tensor:
    """uint8 (N, 8, 8) in 0..16 -> float (N, 1, img_size, img_size) in [0, 1], resized bilinearly."""
    x = torch.from_numpy(images.astype(np.float32) / MAX_VALUE)[:, None]  # (N, 1, 8, 8)
    if img_size != NATIVE_SIZE:
        size = (img_size, img_size)
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=img_size < NATIVE_SIZE)
    return x


def write_digits_npz(path: str | Path = DIGITS_PATH) -> None:
    """Regenerate digits.npz from scikit-learn (development only; the result is committed)."""
    require("sklearn", "write_digits_npz")
    from sklearn.datasets import load_digits  # development dependency, imported only here

    bunch = load_digits()
    images = bunch.images.astype(np.uint8)  # float 0..16 integers -> uint8
    if not np.array_equal(images, bunch.images) or images.shape != (NUM_IMAGES, NATIVE_SIZE, NATIVE_SIZE):
        raise UserError("scikit-learn's load_digits no longer returns 1797 8x8 integer images")
    labels = bunch.target.astype(np.uint8)
    _, test_idx = stratified_split(labels.tolist(), TEST_FRACTION, SPLIT_SEED)
    test_mask = np.zeros(len(labels), dtype=bool)
    test_mask[test_idx] = True
    np.savez_compressed(path, images=images, labels=labels, test_mask=test_mask)
