"""Dataset classes: images held as tensors in memory, decoded arrays, or files in a class-per-folder tree. Every item is
``(float tensor (C, H, W), int label)``, its augmentation drawn from torch's global RNG. Corrupt files in an image
folder are found when an item is loaded (``verify()`` scans them all on demand); with ``skip_corrupt`` an unreadable
file is replaced by the next readable one, counted and warned about once."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from ..errors import UserError, UserFileNotFoundError
from .transforms import augment_images, check_augment, load_image, open_image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class ImageReadError(UserError):
    """An image of a folder dataset that cannot be read. A DataLoader worker's error reaches the main process
    re-created from its traceback's text: the constructor recovers the one-line message from it."""

    def __init__(self, message: str) -> None:
        prefix = f"{type(self).__module__}.{type(self).__qualname__}: "
        original = [line[len(prefix) :] for line in message.splitlines() if line.startswith(prefix)]
        super().__init__(original[-1] if "\n" in message and original else message)


class TensorImageDataset(Dataset):
    """Preprocessed images kept in memory as one tensor, with vectorised batch augmentation: ``images`` (N, C, H, W)
    float, already normalised; ``labels`` (N,) int64. A training loop can skip the DataLoader entirely::

        idx = torch.randperm(len(ds))[:batch_size]
        x, y = ds.augment_batch(ds.images[idx]), ds.labels[idx]

    ``__getitem__`` returns the same kind of item one at a time (augmented as a batch of one)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        augment: str = "none",
        flip: bool = False,
        shift_pixels: int = 0,
        crop_area_min: float = 0.05,
        fill: float | Sequence[float] = 0.0,
    ) -> None:
        if images.ndim != 4 or labels.shape != (images.shape[0],):
            raise UserError(
                f"expected images (N, C, H, W) and labels (N,), got {tuple(images.shape)} and {tuple(labels.shape)}"
            )
        check_augment(augment, crop_area_min, shift_pixels)
        self.images = images.float().contiguous()
        self.labels = labels.long()
        self.augment, self.flip = augment, flip
        self.shift_pixels, self.crop_area_min = shift_pixels, crop_area_min
        self.fill = fill
        self.num_skipped = 0

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.augment_batch(self.images[index : index + 1])[0], int(self.labels[index])

    def images_at(self, indices: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W): the images at ``indices``, not augmented (a batch for augment_batch)."""
        return self.images[indices]

    def augment_batch(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W) with this dataset's augmentation; identity for an eval dataset."""
        return augment_images(
            images,
            augment=self.augment,
            flip=self.flip,
            shift_pixels=self.shift_pixels,
            crop_area_min=self.crop_area_min,
            fill=self.fill,
        )


class ArrayImageDataset(Dataset):
    """Decoded 8-bit images (N, H, W, 3) in memory, preprocessed per item by a PIL transform (CIFAR)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Callable[[Image.Image], torch.Tensor]):
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8 or len(labels) != len(images):
            raise UserError(
                f"expected uint8 images (N, H, W, 3) and N labels, got {images.dtype} "
                f"{images.shape} and {len(labels)} labels"
            )
        self.images, self.labels, self.transform = images, np.asarray(labels, dtype=np.int64), transform
        self.num_skipped = 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.images[index], mode="RGB")), int(self.labels[index])


class ImageFolderDataset(Dataset):
    """Image files with labels, decoded and preprocessed per item; see the module docstring for corrupt files."""

    def __init__(
        self,
        samples: Sequence[tuple[Path, int]],
        transform: Callable[[Image.Image], torch.Tensor],
        skip_corrupt: bool = False,
    ) -> None:
        if not samples:
            raise UserError("ImageFolderDataset: no samples")
        self.samples = list(samples)
        self.transform = transform
        self.skip_corrupt = skip_corrupt
        self.skipped: set[int] = set()  # indices found unreadable in this process
        self._warned = False

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def targets(self) -> list[int]:
        return [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        for offset in range(len(self.samples)):
            i = (index + offset) % len(self.samples)
            if i in self.skipped:
                continue
            path, label = self.samples[i]
            try:  # opened here, decoded by the transform (a training crop of a JPEG: at a reduced size)
                return self.transform(open_image(path)), label
            except UserError as e:  # the file's: not found, not an image, or truncated (a bug keeps its traceback)
                self._skip(i, e)
        raise ImageReadError(
            f"{self.samples[0][0].parent.parent}: none of the {len(self.samples)} images could be read (all skipped)"
        )

    def verify(self) -> list[Path]:
        """Decode every file now; return the unreadable ones (raising on the first unless skip_corrupt)."""
        bad = []
        for i, (path, _) in enumerate(self.samples):
            try:
                load_image(path)
            except (ValueError, FileNotFoundError) as e:
                self._skip(i, e)
                bad.append(path)
        return bad

    def _skip(self, index: int, error: Exception) -> None:
        """Count an unreadable file, or (without skip_corrupt) raise its error."""
        if not self.skip_corrupt:
            raise ImageReadError(f"{error}; set data.skip_corrupt=true to skip unreadable images") from None
        self.skipped.add(index)
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"skipping unreadable image {error} (further ones are skipped silently and counted in num_skipped)",
                RuntimeWarning,
                stacklevel=3,
            )


def scan_image_folder(root: str | Path, class_names: Sequence[str] | None = None) -> tuple[list[str], list]:
    """``root/<class>/**/*.<image ext>`` -> (sorted class names, [(path, label)]), hidden files ignored; with
    ``class_names`` (the training classes, for a separate val folder) every class folder must be one of them."""
    root = Path(root)
    if not root.exists():
        raise UserFileNotFoundError(f"{root}: data directory does not exist")
    if not root.is_dir():
        raise UserError(f"{root}: expected a directory of class folders, found a file")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise UserError(f"{root}: no class folders; expected {root}/<class name>/<image files>")
    if class_names is None:
        class_names = [p.name for p in folders]
    unknown = [p.name for p in folders if p.name not in class_names]
    if unknown:
        raise UserError(f"{root}: class folders {unknown} are not among the training classes {list(class_names)}")
    index = {name: i for i, name in enumerate(class_names)}
    samples = []
    for folder in folders:
        files = sorted(
            p
            for p in folder.rglob("*")
            if p.suffix.lower() in IMAGE_EXTENSIONS
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        )
        if not files:
            raise UserError(
                f"{folder}: class folder has no images (expected files ending in {', '.join(IMAGE_EXTENSIONS)})"
            )
        samples += [(path, index[folder.name]) for path in files]
    return list(class_names), samples


def stratified_split(labels: Sequence[int], fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices (train, held_out), ceil(fraction * N) held out (as scikit-learn) by largest remainder per class,
    each class keeping one training example at least; from a private generator seeded by ``seed``."""
    if not 0.0 <= fraction < 1.0:
        raise UserError(f"data.val_fraction: expected a value in [0, 1), got {fraction}")
    labels_t = torch.as_tensor(list(labels), dtype=torch.long)
    classes = sorted(set(labels_t.tolist()))
    counts = {c: int((labels_t == c).sum()) for c in classes}
    exact = {c: fraction * counts[c] for c in classes}
    quota = {c: min(math.floor(exact[c]), counts[c] - 1) for c in classes}
    missing = math.ceil(fraction * len(labels_t) - 1e-9) - sum(quota.values())
    for c in sorted(classes, key=lambda c: (-(exact[c] - math.floor(exact[c])), c)):
        if missing <= 0:
            break
        if quota[c] < counts[c] - 1:
            quota[c] += 1
            missing -= 1
    gen = torch.Generator().manual_seed(seed)
    train: list[int] = []
    held_out: list[int] = []
    for c in classes:
        members = torch.nonzero(labels_t == c).flatten()
        order: list[int] = members[torch.randperm(len(members), generator=gen)].tolist()
        held_out += order[: quota[c]]
        train += order[quota[c] :]
    return sorted(train), sorted(held_out)


def synthetic_images(num_images: int, num_classes: int, img_size: int, in_chans: int, seed: int = 0):
    """Learnable random images (N, C, H, W) in [0, 1]: a smooth template per class plus noise; and (N,) labels."""
    if num_images < 1 or num_classes < 1:
        raise UserError(f"data.synthetic_size and data.synthetic_classes must be >= 1, got {num_images}, {num_classes}")
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(num_classes, in_chans, 4, 4, generator=gen)  # (K, C, 4, 4)
    templates = F.interpolate(coarse, size=(img_size, img_size), mode="bilinear", align_corners=False)
    labels = torch.arange(num_images) % num_classes  # (N,)
    noise = 0.15 * torch.randn(num_images, in_chans, img_size, img_size, generator=gen)
    return (templates[labels] + noise).clamp(0, 1), labels
