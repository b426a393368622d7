"""Input pipeline throughput: JPEG decode + random-resized crop + flip at 224 px, images/s on ONE core.

    OMP_NUM_THREADS=1 python benchmarks/input_pipeline.py                 # 300 images of 500x375, 3 passes
    python benchmarks/input_pipeline.py --images 100 --passes 1           # quick
    python benchmarks/input_pipeline.py --target-rate 3000 --cores 16     # can 16 cores feed the GPU?

Synthetic JPEGs of ImageNet's typical size (~500x375, quality 90, smooth colour fields plus noise so the files
are photo-sized, ~60-110 KB) are made in memory with PIL, then each decode path runs the same augmentation:

    pil          Image.open + full decode, crop box, resize to 224 (bilinear), flip
    pil-draft    the crop box drawn from the header size first, then Image.draft: libjpeg decodes at 1/2,
                 1/4 or 1/8 scale when the crop is at least that many times larger than 224 (DCT scaling)
    simplejpeg   libjpeg-turbo via simplejpeg (fastdct, scaled decode as above) -- if installed
    vitkit       vitkit's own train_transform on the opened file, as its readers hand it over (the crop box from the
                 header size, a draft decode as pil-draft, inception crop, flip, to a normalised float tensor)

Figures are per core (one process, one thread). The feed check divides the GPU's training rate by the best
per-core rate: the cores a node needs for decoding alone (DataLoader workers also collate and copy).

--target-rate default, 3000 img/s: an ESTIMATE of ViT-B/16 training (bf16, 224 px) on one H100, from FLOPs:
a training step costs ~3 x 17.6 GFLOPs = 53 GFLOPs per image (forward + backward, the paper's Table 6 counts
17.6 GFLOPs forward); the H100 SXM's dense bf16 peak is ~989 TFLOP/s; at a model-FLOPs utilisation of ~16%
that is ~3,000 img/s. Measure the real rate on the GPU with `python benchmarks/bench_vit.py --model vit_b16
--mode train --dtype bf16-autocast --batch-size 128` and pass it here.
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import random
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
from PIL import Image

Path = Callable[[bytes, random.Random], np.ndarray]
OUT = 224


def synthetic_jpegs(count: int, width: int, height: int, seed: int = 0) -> list[bytes]:
    """JPEG bytes of smooth random colour fields plus noise (compress like photos, not like flat colour)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
        pixels = np.clip(field + rng.normal(0, 12, size=field.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def crop_box(width: int, height: int, rng: random.Random, area_min: float = 0.05) -> tuple[int, int, int, int]:
    """Inception-style random-resized crop: area in [area_min, 1], aspect ratio log-uniform in [3/4, 4/3]."""
    for _ in range(10):
        area = width * height * rng.uniform(area_min, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            return x, y, x + w, y + h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, (width + side) // 2, (height + side) // 2


def scale_for(box: tuple[int, int, int, int]) -> int:
    """The largest DCT scale-down (1, 2, 4, 8) that keeps the crop at least 224 px on both sides."""
    w, h = box[2] - box[0], box[3] - box[1]
    return next((s for s in (8, 4, 2) if w >= OUT * s and h >= OUT * s), 1)


def finish(img: Image.Image, box: tuple[float, float, float, float], rng: random.Random) -> np.ndarray:
    out = img.resize((OUT, OUT), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)  # (224, 224, 3) uint8


def pil_path(data: bytes, rng: random.Random) -> np.ndarray:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return finish(img, crop_box(*img.size, rng), rng)


def draft_path(data: bytes, rng: random.Random) -> np.ndarray:
    jpeg = Image.open(io.BytesIO(data))  # header only: the size is known before decoding
    box = crop_box(*jpeg.size, rng)
    scale = scale_for(box)
    full = jpeg.size
    if scale > 1:
        jpeg.draft("RGB", (math.ceil(full[0] / scale), math.ceil(full[1] / scale)))
    img = jpeg.convert("RGB")
    fx, fy = img.size[0] / full[0], img.size[1] / full[1]
    return finish(img, (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy), rng)


def simplejpeg_path(module: ModuleType) -> Path:
    decode_header, decode_jpeg = module.decode_jpeg_header, module.decode_jpeg

    def run(data: bytes, rng: random.Random) -> np.ndarray:
        height, width = decode_header(data)[:2]
        box = crop_box(width, height, rng)
        scale = scale_for(box)
        pixels = decode_jpeg(
            data,
            colorspace="RGB",
            fastdct=True,
            min_width=math.ceil(width / scale),
            min_height=math.ceil(height / scale),
        )
        fx, fy = pixels.shape[1] / width, pixels.shape[0] / height
        return finish(Image.fromarray(pixels), (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy), rng)

    return run


def vitkit_path() -> Path:
    from vitkit.data import train_transform

    transform = train_transform(OUT, [0.5] * 3, [0.5] * 3, augment="inception_crop", flip=True)

    def run(data: bytes, rng: random.Random) -> np.ndarray:
        return transform(Image.open(io.BytesIO(data))).numpy()  # opened, not decoded: vitkit's readers do the same

    return run


def rate(path: Path, jpegs: list[bytes], passes: int) -> float:
    """Images/s of the best of ``passes`` passes over the images (after one warm-up image)."""
    rng = random.Random(0)
    path(jpegs[0], rng)
    best = 0.0
    for _ in range(passes):
        t0 = time.perf_counter()
        for data in jpegs:
            path(data, rng)
        best = max(best, len(jpegs) / (time.perf_counter() - t0))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=300, help="synthetic JPEGs (300)")
    p.add_argument("--size", default="500x375", help="their width x height (500x375, ImageNet's typical size)")
    p.add_argument("--passes", type=int, default=3, help="timed passes; the best is reported (3)")
    p.add_argument("--target-rate", type=float, default=3000.0, help="the GPU's training rate, img/s (estimate)")
    p.add_argument("--cores", type=int, default=16, help="CPU cores of the node (16)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    width, height = (int(v) for v in args.size.split("x"))
    jpegs = synthetic_jpegs(args.images, width, height)
    kb = sum(map(len, jpegs)) / len(jpegs) / 1024
    print(f"{len(jpegs)} synthetic JPEGs {width}x{height}, {kb:.0f} KB on average; one thread; -> {OUT}x{OUT}")
    paths: dict[str, Path] = {"pil": pil_path, "pil-draft": draft_path}
    try:
        paths["simplejpeg"] = simplejpeg_path(importlib.import_module("simplejpeg"))
    except ImportError:
        print("simplejpeg: not installed (pip install simplejpeg) -- skipped")
    paths["vitkit"] = vitkit_path()
    rates = {}
    for name, path in paths.items():
        rates[name] = rate(path, jpegs, args.passes)
        print(f"  {name:<11} {rates[name]:8.0f} img/s per core")
    best = max(rates, key=lambda k: rates[k])
    need = args.target_rate / rates[best]
    verdict = "yes" if need <= args.cores else "no"
    print(
        f"feed check: {args.target_rate:.0f} img/s (--target-rate; default an estimate for ViT-B/16 bf16 on one "
        f"H100) needs {need:.1f} cores of {best} decoding; {args.cores} cores can feed it: {verdict} "
        f"({args.cores * rates[best]:.0f} img/s at most, before collation and transfer)"
    )


if __name__ == "__main__":
    main()
