"""Image loading and the paper's preprocessing, with Pillow and torch only: 8-bit RGB pixels scaled to [0, 1] and
normalised with ``(x - mean) / std`` ([-1, 1] for the default mean = std = 0.5).

- Evaluation (``eval_transform``; ``image_transform`` for a Preprocessing record): resize the whole image, as the
  official fine-tuning code does, or with ``crop_fraction < 1`` the short side, then centre-crop.
- Training (``train_transform``): the inception crop plus an optional flip, a random shift for small images such
  as the digits, or ``"none"``. A JPEG not decoded yet is decoded at the smallest DCT scale the crop allows.

Randomness comes from torch's global RNG, drawn in a fixed count per call whatever the outcome, so seeding torch
before a call reproduces it. ``augment_images`` augments a whole batch of tensors in one ``grid_sample`` call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from .. import preprocessing
from ..errors import UserError, UserFileNotFoundError
from ..preprocessing import Preprocessing

AUGMENTS = ("inception_crop", "shift", "none")
ASPECT_RATIO_RANGE = (3 / 4, 4 / 3)
ORIENTATION_TAG = 0x0112  # EXIF
CROP_ATTEMPTS = 10  # boxes drawn per image; if none fits, the whole image is used (tf's sampler does the same)


def load_image(path: str | Path) -> Image.Image:
    """Open an image file fully decoded as 8-bit RGB (alpha onto white, 16-bit and float rescaled, EXIF
    orientation applied); any failure is a ValueError naming the file."""
    return decode_image(open_image(path))


def open_image(path: str | Path) -> Image.Image:
    """An image file with its header read, for the transforms to decode at the size they need (decode_image)."""
    path = Path(path)
    try:
        return Image.open(path)
    except FileNotFoundError:
        raise UserFileNotFoundError(f"{path}: image file not found") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise UserError(f"{path}: cannot read image ({type(e).__name__}: {e})") from None


def is_undecoded(img: Image.Image) -> bool:
    """An image opened from a file or bytes whose pixels have not been decoded yet."""
    return bool(getattr(img, "tile", None))


def upright_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) of the image once its EXIF orientation is applied (read from the header alone)."""
    if is_undecoded(img) and img.getexif().get(ORIENTATION_TAG, 1) in (5, 6, 7, 8):  # a quarter turn: swapped
        return img.height, img.width
    return img.width, img.height


def decode_image(img: Image.Image, reduce: int = 1, close: bool = True) -> Image.Image:
    """The image as 8-bit RGB (see ``load_image``); a JPEG not decoded yet at 1/``reduce`` of its size (DCT). A file
    opened for it is closed once decoded, unless ``close`` is False (an image the caller opened stays theirs)."""
    if not is_undecoded(img):
        return to_rgb(img)
    try:
        if reduce > 1 and img.format == "JPEG":
            img.draft("RGB", (math.ceil(img.width / reduce), math.ceil(img.height / reduce)))
        img.load()  # a truncated file fails here, not later
        return to_rgb(ImageOps.exif_transpose(img))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        name = getattr(img, "filename", "") or "an image"
        raise UserError(f"{name}: cannot read image ({type(e).__name__}: {e})") from None
    finally:
        if close:
            img.close()  # the decoded copy is returned


def image_from_pixels(pixels: np.ndarray | torch.Tensor, what: str) -> Image.Image:
    """A copy of an (H, W, C) or (H, W) array, or a (C, H, W) tensor, of uint8 pixels or floats in [0, 1] (C: 1, 3
    or 4), as a PIL image; anything else is a UserError naming ``what`` and what is accepted."""
    tensor = isinstance(pixels, torch.Tensor)
    arr = pixels.detach().cpu().numpy() if isinstance(pixels, torch.Tensor) else np.asarray(pixels)
    if tensor and arr.ndim == 3:
        arr = arr.transpose(1, 2, 0)  # (C, H, W) -> (H, W, C)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    unit = arr.dtype.kind == "f" and arr.size > 0 and bool(np.isfinite(arr).all() and arr.min() >= 0 and arr.max() <= 1)
    if arr.size and (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))) and (arr.dtype == np.uint8 or unit):
        return Image.fromarray((arr * 255).round().astype(np.uint8) if unit else arr.copy())
    layout = "(C, H, W) or (H, W) tensor" if tensor else "(H, W, C) or (H, W) array"
    raise UserError(
        f"{what} is {'a tensor' if tensor else 'an array'} of shape {tuple(pixels.shape)} and dtype {pixels.dtype}; "
        f"expected a PIL image, an image file or an {layout} (C = 1, 3 or 4) of uint8 pixels or floats in [0, 1]"
    )


def jpeg_reduction(crop: tuple[float, float], size: int) -> int:
    """The largest DCT scale-down (8, 4, 2 or 1) that keeps a crop of (w, h) pixels at least ``size`` on a side."""
    return next((s for s in (8, 4, 2) if min(crop) >= size * s), 1)


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert a decoded image of any Pillow mode to 8-bit RGB (see ``load_image``)."""
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        img = Image.fromarray(_high_depth_to_uint8(np.asarray(img)), mode="L")
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    return img if img.mode == "RGB" else img.convert("RGB")


def _high_depth_to_uint8(arr: np.ndarray) -> np.ndarray:
    """(H, W) 16/32-bit integer or float pixels -> uint8: integers read as 16-bit, floats as [0, 1] or [0, 255]."""
    if arr.dtype.kind == "f":
        arr = np.nan_to_num(arr.astype(np.float64))
        arr = arr * 255.0 if arr.size and arr.max() <= 1.0 else arr
    else:
        arr = arr.astype(np.float64) / 257.0  # 65535 -> 255
    return np.clip(arr, 0, 255).round().astype(np.uint8)


def channel_stats(value: float | Sequence[float], in_chans: int, name: str, where: str = "data") -> list[float]:
    """A mean or std given as one number or one per channel -> a list of ``in_chans`` floats (``where`` in errors)."""
    values = preprocessing.channel_stats(value, in_chans, name, where)
    if name == "std" and any(v <= 0 for v in values):
        raise UserError(f"{where}.std: every value must be > 0, got {values}")
    return values


def _stats(
    mean: float | Sequence[float], std: float | Sequence[float], in_chans: int | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std; without ``in_chans``, as many channels as a sequence ``mean`` has (1 or 3), else 3."""
    if in_chans is None:
        in_chans = len(mean) if isinstance(mean, Sequence) and len(mean) in (1, 3) else 3
    return tuple(channel_stats(mean, in_chans, "mean")), tuple(channel_stats(std, in_chans, "std"))


def to_tensor(img: Image.Image, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """PIL image (RGB, or L for one channel) -> normalised float tensor (C, H, W)."""
    arr = np.asarray(img, dtype=np.uint8)
    x = torch.from_numpy(arr.copy()).float().div_(255.0)  # (H, W) or (H, W, C)
    x = x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)  # (C, H, W)
    m = torch.tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return (x - m) / s


def _to_mode(img: Image.Image, in_chans: int) -> Image.Image:
    if in_chans == 1:
        return img.convert("L")
    if in_chans == 3:
        return to_rgb(img)
    raise UserError(f"in_chans: images can be loaded with 1 or 3 channels, got {in_chans}")


@dataclass(frozen=True)
class EvalTransform:
    """Resize (and optionally centre-crop), to tensor, normalise; a picklable callable for DataLoader workers."""

    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_fraction: float = 1.0

    def __call__(self, img: Image.Image) -> torch.Tensor:
        img = _to_mode(decode_image(img), len(self.mean))  # a file not decoded yet: decoded whole
        if self.crop_fraction == 1.0:
            img = img.resize((self.img_size, self.img_size), Image.Resampling.BILINEAR)
        else:
            img = _resize_short_side_and_crop(img, round(self.img_size / self.crop_fraction), self.img_size)
        return to_tensor(img, self.mean, self.std)  # (C, img_size, img_size)


@dataclass(frozen=True)
class TrainTransform:
    """Random crop or resize, to tensor, normalise, then shift / flip; see ``train_transform``."""

    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: str = "inception_crop"
    flip: bool = True
    crop_area_min: float = 0.05
    shift_pixels: int = 0

    def __call__(self, img: Image.Image) -> torch.Tensor:
        size = (self.img_size, self.img_size)
        if self.augment == "inception_crop":
            # the box is drawn from the header's size first, so a JPEG not decoded yet is decoded at the smallest
            # DCT scale that keeps the crop at least img_size pixels; the box is then scaled to what was decoded
            width, height = upright_size(img)
            top, left, h, w = sample_crop_boxes(1, height, width, self.crop_area_min)[0].tolist()
            img = _to_mode(decode_image(img, jpeg_reduction((w, h), self.img_size)), len(self.mean))
            fx, fy = img.width / width, img.height / height
            box = (left * fx, top * fy, (left + w) * fx, (top + h) * fy)
            img = img.resize(size, Image.Resampling.BILINEAR, box=box)
        else:
            img = _to_mode(decode_image(img), len(self.mean)).resize(size, Image.Resampling.BILINEAR)
        shift = self.shift_pixels if self.augment == "shift" else 0
        if not shift:  # a flip alone: mirrored in Pillow, from the same draw augment_images makes for it
            if self.flip and bool(torch.rand(1) < 0.5):
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            return to_tensor(img, self.mean, self.std)
        x = to_tensor(img, self.mean, self.std)[None]  # (1, C, H, W)
        fill = black_level(self.mean, self.std)
        return augment_images(x, augment="shift", flip=self.flip, shift_pixels=shift, fill=fill)[0]


def eval_transform(
    img_size: int,
    mean: float | Sequence[float] = 0.5,
    std: float | Sequence[float] = 0.5,
    crop_fraction: float = 1.0,
    in_chans: int | None = None,
) -> Callable[[Image.Image], torch.Tensor]:
    """Deterministic preprocessing: PIL image -> float tensor (in_chans, img_size, img_size); 1 channel is grey."""
    if not 0.0 < crop_fraction <= 1.0:
        raise UserError(f"crop_fraction: expected a value in (0, 1], got {crop_fraction}")
    return EvalTransform(img_size, *_stats(mean, std, in_chans), crop_fraction)


def image_transform(prep: Preprocessing) -> Callable[[Image.Image], torch.Tensor]:
    """The evaluation transform a preprocessing record describes (a square input, else a UserError)."""
    return eval_transform(prep.square_size(), prep.mean, prep.std, prep.crop_fraction, prep.in_chans)


def train_transform(
    img_size: int,
    mean: float | Sequence[float] = 0.5,
    std: float | Sequence[float] = 0.5,
    *,
    augment: str = "inception_crop",
    flip: bool = True,
    crop_area_min: float = 0.05,
    shift_pixels: int = 0,
    in_chans: int | None = None,
) -> Callable[[Image.Image], torch.Tensor]:
    """Random preprocessing for training: PIL image -> float tensor (in_chans, img_size, img_size). ``augment``:
    "inception_crop" (a box of [crop_area_min, 1] of the area, resized), "shift" (resize, then move by up to
    ``shift_pixels``, filling with black) or "none"; ``flip`` adds a random horizontal flip."""
    check_augment(augment, crop_area_min, shift_pixels)
    return TrainTransform(img_size, *_stats(mean, std, in_chans), augment, flip, crop_area_min, shift_pixels)


def check_augment(augment: str, crop_area_min: float, shift_pixels: int) -> None:
    if augment not in AUGMENTS:
        raise UserError(f"data.train_augment: expected one of {AUGMENTS}, got {augment!r}")
    if not 0.0 < crop_area_min <= 1.0:
        raise UserError(f"data.crop_area_min: expected a value in (0, 1], got {crop_area_min}")
    if shift_pixels < 0:
        raise UserError(f"data.shift_pixels: expected >= 0, got {shift_pixels}")


def black_level(mean: Sequence[float], std: Sequence[float]) -> list[float]:
    """The normalised value of a black pixel per channel: what shifted-in borders are filled with."""
    return [(0.0 - m) / s for m, s in zip(mean, std)]


def sample_crop_boxes(
    n: int,
    height: float,
    width: float,
    area_min: float = 0.05,
    ratio_range: tuple[float, float] = ASPECT_RATIO_RANGE,
    attempts: int = CROP_ATTEMPTS,
) -> torch.Tensor:
    """Inception-crop boxes (n, 4) as float (top, left, h, w) in pixels, drawn from torch's global RNG. Each covers a
    uniform fraction in [area_min, 1] of the image with a log-uniform aspect ratio; a draw that does not fit is retried
    up to ``attempts`` times, then the box is the whole image (as tf's sampler does)."""
    area = height * width * torch.empty(n, attempts).uniform_(area_min, 1.0)  # (n, attempts)
    log_lo, log_hi = math.log(ratio_range[0]), math.log(ratio_range[1])
    ratio = torch.exp(torch.empty(n, attempts).uniform_(log_lo, log_hi))
    w, h = torch.sqrt(area * ratio), torch.sqrt(area / ratio)
    fits = (w <= width) & (h <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # index of the first fitting attempt
    found = fits.any(dim=1)
    w = torch.where(found, w.gather(1, first).squeeze(1), torch.tensor(float(width)))  # (n,)
    h = torch.where(found, h.gather(1, first).squeeze(1), torch.tensor(float(height)))
    top = torch.rand(n) * (height - h)
    left = torch.rand(n) * (width - w)
    return torch.stack([top, left, h, w], dim=1)


def augment_images(
    images: torch.Tensor,
    *,
    augment: str = "none",
    flip: bool = False,
    shift_pixels: int = 0,
    crop_area_min: float = 0.05,
    fill: float | Sequence[float] = 0.0,
) -> torch.Tensor:
    """Augment a batch (N, C, H, W) -> (N, C, H, W) in one vectorised resampling, from torch's global RNG. ``augment``
    as in ``train_transform``; ``fill`` for borders a shift exposes. A fixed number of draws per N."""
    check_augment(augment, crop_area_min, shift_pixels)
    n, _, height, width = images.shape
    moves = augment == "inception_crop" or (augment == "shift" and shift_pixels > 0)
    if not moves and not flip:
        return images
    # Affine map from output to input in grid_sample's normalised coordinates (align_corners=False):
    # x_in = sx * x_out + tx, y_in = sy * y_out + ty.
    sx, sy = torch.ones(n), torch.ones(n)
    tx, ty = torch.zeros(n), torch.zeros(n)
    if augment == "inception_crop":
        top, left, h, w = sample_crop_boxes(n, height, width, crop_area_min).unbind(1)
        sx, sy = w / width, h / height
        tx, ty = (2 * left + w) / width - 1, (2 * top + h) / height - 1
    elif augment == "shift" and shift_pixels > 0:
        shifts = torch.randint(-shift_pixels, shift_pixels + 1, (n, 2)).float()  # (n, [dy, dx]) in pixels
        ty, tx = -2 * shifts[:, 0] / height, -2 * shifts[:, 1] / width
    if flip:
        sx = torch.where(torch.rand(n) < 0.5, -sx, sx)
    # The draws above come from the CPU generator whatever the images' device, so results do not depend on it.
    sx, sy, tx, ty = (t.to(images.device, torch.float32) for t in (sx, sy, tx, ty))
    # Pixel centres in normalised coordinates; the grid is built by broadcasting (cheaper than affine_grid).
    xs = (2 * torch.arange(width, device=images.device) + 1) / width - 1  # (W,)
    ys = (2 * torch.arange(height, device=images.device) + 1) / height - 1  # (H,)
    grid_x = (sx[:, None] * xs + tx[:, None])[:, None, :].expand(n, height, width)  # (N, H, W)
    grid_y = (sy[:, None] * ys + ty[:, None])[:, :, None].expand(n, height, width)
    grid = torch.stack([grid_x, grid_y], dim=-1).to(images.dtype)  # (N, H, W, 2)
    fill_t = torch.as_tensor(fill, dtype=images.dtype, device=images.device).reshape(1, -1, 1, 1)
    # grid_sample pads with zeros: resample (x - fill) and add fill back, so the border takes the fill value.
    out = F.grid_sample(images - fill_t, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out + fill_t


def _resize_short_side_and_crop(img: Image.Image, short: int, size: int) -> Image.Image:
    """Resize so that the short side is ``short`` pixels, then take the centred ``size`` x ``size`` square."""
    scale = short / min(img.width, img.height)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.BILINEAR)
    left, top = (img.width - size) // 2, (img.height - size) // 2
    return img.crop((left, top, left + size, top + size))
