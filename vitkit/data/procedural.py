"""Procedural shapes (``data.source=shapes``): a labelled image set of any size, drawn on the fly, stored nowhere.

Image ``i`` of a split is a pure function of (``data.split_seed``, split, ``i``): the same in any process, growing
subsets nested, training and evaluation on generators of their own. Each holds a low-contrast texture, a few
distractor strokes, the object (disc, square, triangle, cross or ring, placed, turned, sized and coloured at
random) and a marker in its colour above or below it. The class is (shape, where the marker is), ``i % 10``:
the shape is local work inside a patch or two, the marker a relation several patches apart, so a model needs both.

Where ``$VITKIT_SHAPES_CACHE`` names a directory (a sweep sets it for its cells), the drawn images are kept there in
files of ``CHUNK`` images (``ChunkFiles``), so the runs of a sweep on one set draw each image once between them.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UserError
from ..io import atomic_write
from .transforms import augment_images

SHAPES = ("disc", "square", "triangle", "cross", "ring")
RELATIONS = ("above", "below")
CLASS_NAMES = [f"{shape}_{where}" for shape in SHAPES for where in RELATIONS]  # label = 2 * shape + relation
# the label's factors, each a function of a label tensor: which shape, and on which side of it the marker is
LABEL_PARTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "shape": lambda label: label // len(RELATIONS),
    "side": lambda label: label % len(RELATIONS),
}
TRAIN_STREAM, EVAL_STREAM, SELECT_STREAM = 0, 1, 2  # training, held-out evaluation, checkpoint selection
CACHE_ENV = "VITKIT_SHAPES_CACHE"  # a directory for drawn images, shared by processes; unset or empty: none
CHUNK = 1024  # images per cache file
_BACKGROUNDS = 4


def _generator(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, stream, index))))


@functools.lru_cache(maxsize=8)
def _pixel_centres(size: int) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    yy.flags.writeable = xx.flags.writeable = False  # shared by every image of this size
    return yy, xx


def _colour(rng: np.random.Generator) -> np.ndarray:
    return rng.random(3, dtype=np.float32)


def _background(rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((S, S, 3) float32 in [0, 1], its base colour): a texture within 0.3 of the base, for the object to stand out."""
    size = yy.shape[0]
    kind = int(rng.integers(_BACKGROUNDS))
    base = _colour(rng) * 0.7
    a, b = base, base + 0.3 * _colour(rng)
    if kind == 0:
        return (a + 0.3 * rng.random((size, size, 3), dtype=np.float32)).astype(np.float32), base
    if kind == 1:
        angle, period = rng.random() * math.pi, size * (0.12 + 0.25 * rng.random())
        phase = (xx * math.cos(angle) + yy * math.sin(angle)) / period
        t = (np.floor(phase * 2) % 2)[..., None]  # (S, S, 1) in {0, 1}
        return (a * t + b * (1 - t)).astype(np.float32), base
    if kind == 2:
        angle = rng.random() * 2 * math.pi
        t = ((xx * math.cos(angle) + yy * math.sin(angle)) / (size * 1.42) + 0.5)[..., None]
        noise = 0.1 * rng.standard_normal((size, size, 3), dtype=np.float32)
        return np.clip(a * t + b * (1 - t) + noise, 0, 1).astype(np.float32), base
    cell = int(rng.integers(max(2, size // 16), max(3, size // 5) + 1))
    t = (((yy // cell) + (xx // cell)) % 2)[..., None]
    return (a * t + b * (1 - t)).astype(np.float32), base


def _segment_mask(yy: np.ndarray, xx: np.ndarray, p: np.ndarray, q: np.ndarray, width: float) -> np.ndarray:
    """Pixels within ``width`` of the segment p-q ((y, x) points)."""
    d = q - p
    t = np.clip(((yy - p[0]) * d[0] + (xx - p[1]) * d[1]) / max(float(d @ d), 1e-6), 0, 1)
    return (yy - p[0] - t * d[0]) ** 2 + (xx - p[1] - t * d[1]) ** 2 <= width**2


def shape_mask(shape: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside-mask of shape ``SHAPES[shape]`` in unit object coordinates (u, v): radius 1 around the origin."""
    if shape == 0:  # disc
        return u * u + v * v <= 1.0
    if shape == 1:  # square, inscribed in the unit circle
        return np.maximum(np.abs(u), np.abs(v)) <= 0.75
    if shape == 2:  # equilateral triangle, vertices on the unit circle
        inside = np.ones(u.shape, dtype=bool)
        for k in range(3):
            a = math.pi / 2 + k * 2 * math.pi / 3 + math.pi / 3  # outward normal of the edge between two vertices
            inside &= u * math.cos(a) + v * math.sin(a) <= 0.5
        return inside
    if shape == 3:  # cross
        return ((np.abs(u) <= 0.3) & (np.abs(v) <= 1.0)) | ((np.abs(v) <= 0.3) & (np.abs(u) <= 1.0))
    if shape == 4:  # ring
        r2 = u * u + v * v
        return (r2 <= 1.0) & (r2 >= 0.5**2)
    raise ValueError(f"shape index {shape} not in 0..{len(SHAPES) - 1}")


def render_shape_image(seed: int, stream: int, index: int, size: int = 32) -> tuple[np.ndarray, int]:
    """Image ``index`` of split ``stream``: (uint8 (size, size, 3), label); see the module docstring."""
    rng = _generator(seed, stream, index)
    label = index % len(CLASS_NAMES)
    shape, below = divmod(label, len(RELATIONS))
    yy, xx = _pixel_centres(size)  # (S, S) each
    img, base = _background(rng, yy, xx)

    for _ in range(int(rng.integers(0, 3))):  # distractor strokes
        p = rng.random(2) * size
        angle, length = rng.random() * 2 * math.pi, size * (0.2 + 0.4 * rng.random())
        q = p + length * np.array([math.sin(angle), math.cos(angle)])
        img[_segment_mask(yy, xx, p, q, max(0.5, size / 48))] = _colour(rng)

    radius = size * (0.18 + 0.1 * rng.random())
    marker_r = max(1.5, size * 0.08)
    gap = marker_r + size * (0.06 + 0.1 * rng.random())  # from the object's edge to the marker's centre
    reach = radius + gap + marker_r  # the object and its marker fit inside the image
    cx = rng.uniform(radius + 1, size - radius - 1)
    cy_lo, cy_hi = (reach, size - radius - 1) if not below else (radius + 1, size - reach)  # room for the marker
    cy = rng.uniform(min(cy_lo, cy_hi), max(cy_lo, cy_hi))
    theta = rng.random() * 2 * math.pi
    c, s = math.cos(theta), math.sin(theta)
    u, v = ((xx - cx) * c + (yy - cy) * s) / radius, (-(xx - cx) * s + (yy - cy) * c) / radius
    colour = (base + 0.3 + 0.4 * _colour(rng)) % 1.0  # each channel 0.3 or more from the base, on the colour circle
    mask = shape_mask(shape, u, v)
    if rng.random() < 0.5:  # striped fill: the colour and a darker shade of it
        stripes = np.floor((u[mask] + v[mask]) * (1.5 + 2 * rng.random())) % 2  # (M,)
        img[mask] = colour * (1 - 0.45 * stripes)[:, None]
    else:
        img[mask] = colour

    # the marker: a cone of 120 degrees around straight up (image y grows downwards) or straight down
    phi = (rng.random() - 0.5) * (2 * math.pi / 3) + (math.pi / 2 if below else -math.pi / 2)
    dist = radius + gap
    my = min(max(cy + dist * math.sin(phi), marker_r), size - marker_r)
    mx = min(max(cx + dist * math.cos(phi), marker_r), size - marker_r)
    img[(yy - my) ** 2 + (xx - mx) ** 2 <= marker_r**2] = colour
    return (img * 255 + 0.5).astype(np.uint8), label


def _renderer_key() -> str:
    """What a drawn image depends on besides its seeds: this module's source and numpy (its generators' streams)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(np.__version__.encode())
    return digest.hexdigest()[:16]


RENDERER_KEY = _renderer_key()  # read once, as the module is imported: the code that draws in this process


class ChunkFiles:
    """The images of one split and size, kept in ``root/<RENDERER_KEY>/seed<S>-stream<T>-<size>px/<k>.npy``: file k
    holds images k * CHUNK to (k + 1) * CHUNK as uint8 (CHUNK, size, size, 3). The first process to need a file draws
    it and writes it atomically, holding a lock beside it (``.<k>.lock``); others needing it draw the other files they
    need meanwhile, then wait on the lock before they read it. Every reader maps it, checking its shape and its first
    image against one drawn anew."""

    def __init__(self, root: str | Path, seed: int, stream: int, size: int) -> None:
        self.dir = Path(root) / RENDERER_KEY / f"seed{seed}-stream{stream}-{size}px"
        self.seed, self.stream, self.size = seed, stream, size
        self._chunks: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_chunks": {}}  # a DataLoader worker maps the files itself

    def pixels(self, index: int) -> np.ndarray:
        """Image ``index`` as read-only uint8 (size, size, 3)."""
        return self.pixels_at([index])[0]

    def pixels_at(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Images ``indices``, as ``pixels`` gives each. The files they need that no other process is drawing are
        drawn or read first, then those being drawn are waited for: processes that need the same files at once (a
        sweep's cells of one seed) divide the drawing between them rather than queue for each file in turn."""
        drawn_elsewhere = []
        for k in dict.fromkeys(i // CHUNK for i in indices):
            if k not in self._chunks:
                chunk = self._read(k, wait=False)
                if chunk is None:
                    drawn_elsewhere.append(k)
                else:
                    self._chunks[k] = chunk
        for k in drawn_elsewhere:
            chunk = self._read(k, wait=True)
            assert chunk is not None  # it waited for the file
            self._chunks[k] = chunk
        return [self._chunks[i // CHUNK][i % CHUNK] for i in indices]

    def _read(self, k: int, wait: bool) -> np.ndarray | None:
        """File ``k``, drawn and written by this process if no file holds it; None if another process is drawing
        it and ``wait`` is false (else this one waits for it, then reads it)."""
        path = self.dir / f"{k:06d}.npy"
        if not path.exists():
            from filelock import FileLock, Timeout

            self.dir.mkdir(parents=True, exist_ok=True)
            lock = FileLock(self.dir / f".{k:06d}.lock")
            try:
                lock.acquire(timeout=-1 if wait else 0)
            except Timeout:
                return None
            try:
                if not path.exists():
                    drawn = np.stack([self._draw(i) for i in range(k * CHUNK, (k + 1) * CHUNK)])
                    atomic_write(path, lambda tmp: _save(tmp, drawn), size=drawn.nbytes)
                    return drawn
            finally:
                lock.release()
        first, expected = self._draw(k * CHUNK), (CHUNK, self.size, self.size, 3)
        try:
            chunk = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise UserError(f"{path}: not a drawn-shapes file ({e}); delete it and its images are drawn again") from e
        if chunk.dtype != np.uint8 or chunk.shape != expected or not np.array_equal(chunk[0], first):
            raise UserError(
                f"{path}: holds other images than images {k * CHUNK}-{(k + 1) * CHUNK - 1} of {self.dir.name} "
                f"(expected uint8 {expected}, got {chunk.dtype} {chunk.shape}); delete it and they are drawn again"
            )
        return chunk

    def _draw(self, index: int) -> np.ndarray:
        return render_shape_image(self.seed, self.stream, index, self.size)[0]


def _save(tmp: str, pixels: np.ndarray) -> None:
    with open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to a name
        np.save(f, pixels, allow_pickle=False)


class ProceduralShapes(Dataset):
    """``num_images`` shape images of split ``stream``, drawn in ``__getitem__`` (kept once drawn: in the files of
    ``$VITKIT_SHAPES_CACHE`` where it is set, else per process up to ``CACHE_BYTES``): (float (C, S, S) normalised by
    ``(x - mean) / std``, label). ``augment`` (flip, shift), for a subset seen several times, keeps the label: the
    marker stays above or below its object."""

    CACHE_BYTES = 512 * 2**20
    label_parts = LABEL_PARTS  # what the sweep's parts probe scores apart

    def __init__(
        self,
        num_images: int,
        *,
        seed: int = 0,
        stream: int = TRAIN_STREAM,
        img_size: int = 32,
        in_chans: int = 3,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.5, 0.5, 0.5),
        augment: dict[str, Any] | None = None,
    ) -> None:
        if num_images < 1:
            raise UserError(f"data.num_images: expected a positive number of images, got {num_images}")
        if img_size < 8:
            raise UserError(f"data.img_size={img_size}: the shapes source draws images of 8 pixels or more")
        self.num_images, self.seed, self.stream = num_images, seed, stream
        self.img_size, self.in_chans = img_size, in_chans
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(list(std), dtype=torch.float32).view(-1, 1, 1)
        self.class_names = list(CLASS_NAMES)
        self.num_skipped = 0
        self.augment = augment or {}  # augment_images' keywords: augment, flip, shift_pixels, fill
        root = os.environ.get(CACHE_ENV)
        self._files = ChunkFiles(root, seed, stream, img_size) if root else None
        fits = self._files is None and num_images * img_size * img_size * 3 <= self.CACHE_BYTES
        self._cache: dict[int, np.ndarray] | None = {} if fits else None  # index -> pixels

    def __len__(self) -> int:
        return self.num_images

    @property
    def labels(self) -> torch.Tensor:
        """(N,) int64: the labels, known without drawing an image."""
        return torch.arange(self.num_images) % len(CLASS_NAMES)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_images:
            raise IndexError(f"index {index} out of range for {self.num_images} images")
        x = self._normalised([self._pixels(int(index))])
        return self.augment_batch(x)[0], int(index) % len(CLASS_NAMES)

    def images_at(self, indices: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S): the images at ``indices``, normalised and not augmented (a batch for augment_batch)."""
        if self._files is not None:
            return self._normalised(self._files.pixels_at(indices.tolist()))
        return self._normalised([self._pixels(int(i)) for i in indices])

    def augment_batch(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> (B, C, S, S) with this set's flips and shifts, in one resampling; identity without."""
        return augment_images(images, **self.augment) if self.augment else images

    def _pixels(self, index: int) -> np.ndarray:
        if self._files is not None:
            return self._files.pixels(index)
        pixels = self._cache.get(index) if self._cache is not None else None
        if pixels is None:
            pixels = render_shape_image(self.seed, self.stream, index, self.img_size)[0]
            if self._cache is not None:
                self._cache[index] = pixels
        return pixels

    def _normalised(self, pixels: list[np.ndarray]) -> torch.Tensor:
        """B uint8 (S, S, 3) images -> float (B, C, S, S), contiguous like every other source's batches (a
        channels-last batch would take other convolution kernels: the same values, other rounding)."""
        x = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).contiguous().float().div_(255.0)
        if self.in_chans == 1:
            x = x.mean(1, keepdim=True)
        return (x - self.mean) / self.std


def sample_grid(path: str | Path, per_class: int = 8, seed: int = 0, size: int = 32, scale: int = 3) -> Path:
    """A PNG of ``per_class`` training images of every class, a row per class in CLASS_NAMES' order."""
    from PIL import Image

    n = len(CLASS_NAMES)
    pad = 2
    cell = size * scale + pad
    grid = np.full((n * cell + pad, per_class * cell + pad, 3), 255, dtype=np.uint8)
    for label in range(n):
        for k in range(per_class):
            pixels, got = render_shape_image(seed, TRAIN_STREAM, label + n * k, size)
            assert got == label
            big = pixels.repeat(scale, 0).repeat(scale, 1)
            y0, x0 = pad + label * cell, pad + k * cell
            grid[y0 : y0 + size * scale, x0 : x0 + size * scale] = big
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid, mode="RGB").save(path)
    return path
