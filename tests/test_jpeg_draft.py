"""Training crops of large JPEGs decode at a reduced size: the crop box is drawn from the header's size, the file
is decoded at 1/2, 1/4 or 1/8 where the crop stays at least img_size pixels, and the result matches the full
decode's crop; evaluation and small crops decode in full, exactly as before; EXIF orientation and file errors
are handled on that road as on the full one."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from PIL.JpegImagePlugin import JpegImageFile

from vitkit.data import DataConfig, build_datasets
from vitkit.data.transforms import (
    eval_transform,
    jpeg_reduction,
    load_image,
    open_image,
    train_transform,
)
from vitkit.errors import UserError


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth colour field with mild noise (compresses and downsamples like a photograph)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
    return np.clip(field + rng.normal(0, 4, size=field.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def big_jpeg(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("jpeg") / "big.jpg"
    Image.fromarray(photo(2000, 1500)).save(path, quality=92)
    return str(path)


def _drafts(monkeypatch) -> list[tuple[int, int]]:
    asked: list[tuple[int, int]] = []
    real = JpegImageFile.draft

    def spy(self, mode, size):
        asked.append(tuple(size))
        return real(self, mode, size)

    monkeypatch.setattr(JpegImageFile, "draft", spy)
    return asked


def test_the_reduction_is_the_largest_that_keeps_the_crop_at_least_img_size():
    for crop, size, expected in [
        ((2000, 1500), 224, 4),  # 1500 / 4 = 375 >= 224; / 8 = 187 < 224
        ((1792, 1792), 224, 8),
        ((1791, 1792), 224, 4),
        ((448, 900), 224, 2),
        ((447, 900), 224, 1),
        ((100, 100), 224, 1),  # a crop smaller than the output: enlarged from the full decode
        ((300, 300), 32, 8),
    ]:
        assert jpeg_reduction(crop, size) == expected, (crop, size)


def test_a_large_crop_decodes_at_a_reduced_size_and_matches_the_full_decode(big_jpeg, monkeypatch):
    asked = _drafts(monkeypatch)
    tf = train_transform(224, augment="inception_crop", flip=True, crop_area_min=0.9)
    torch.manual_seed(0)
    reduced = tf(open_image(big_jpeg))
    assert asked == [(500, 375)]  # a crop of >= 90% of 2000x1500: the shorter side > 4 x 224, < 8 x 224
    torch.manual_seed(0)
    full = tf(load_image(big_jpeg))  # the same draws (box, flip) on the fully decoded image
    assert len(asked) == 1 and reduced.shape == full.shape == (3, 224, 224)
    assert (reduced - full).abs().mean() < 0.01  # normalised units (2 / 255 per 8-bit level)
    assert (reduced - full).abs().max() < 0.2


def test_small_crops_and_evaluation_decode_in_full_exactly_as_before(big_jpeg, monkeypatch):
    asked = _drafts(monkeypatch)
    tf = train_transform(1024, augment="inception_crop", flip=True)  # no crop is 2 x 1024 on both sides
    torch.manual_seed(3)
    lazy = tf(open_image(big_jpeg))
    torch.manual_seed(3)
    assert torch.equal(lazy, tf(load_image(big_jpeg)))
    ev = eval_transform(224, crop_fraction=0.875)
    assert torch.equal(ev(open_image(big_jpeg)), ev(load_image(big_jpeg)))
    assert asked == []


def test_exif_orientation_is_applied_on_the_reduced_road(tmp_path):
    """A portrait photo stored landscape with orientation 6 (rotate 90 degrees clockwise to view): the box is drawn
    in the upright frame, so the reduced decode's crop is the full decode's."""
    upright = photo(1200, 1800, seed=1)  # (H, W) = (1800, 1200): portrait
    stored = np.rot90(upright, k=1)  # what the camera wrote; orientation 6 turns it back clockwise
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "portrait.jpg"
    Image.fromarray(np.ascontiguousarray(stored)).save(path, quality=92, exif=exif)
    assert load_image(path).size == (1200, 1800)
    tf = train_transform(224, augment="inception_crop", flip=False, crop_area_min=0.3)
    for seed in range(4):
        torch.manual_seed(seed)
        reduced = tf(open_image(path))
        torch.manual_seed(seed)
        full = tf(load_image(path))
        assert (reduced - full).abs().mean() < 0.01, seed


def test_a_truncated_jpeg_fails_on_the_reduced_road_naming_the_file_and_the_sample(tmp_path, big_jpeg):
    data = Path(big_jpeg).read_bytes()
    for label in ("a", "b"):
        (tmp_path / "tree" / label).mkdir(parents=True)
        Image.fromarray(photo(600, 500, seed=2)).save(tmp_path / "tree" / label / "ok.jpg")
    (tmp_path / "tree" / "a" / "cut.jpg").write_bytes(data[: len(data) // 3])
    cfg = DataConfig(source="folder", root=str(tmp_path / "tree"), val_root=str(tmp_path / "tree"), img_size=224)
    train, _, _ = build_datasets(cfg)
    cut = next(i for i, (p, _) in enumerate(train.samples) if p.name == "cut.jpg")
    with pytest.raises(UserError, match=r"cut\.jpg: cannot read image.*skip_corrupt"):
        train[cut]
    skipping, _, _ = build_datasets(DataConfig(**{**cfg.to_dict(), "skip_corrupt": True}))
    with pytest.warns(RuntimeWarning, match=r"cut\.jpg"):
        assert skipping[cut][0].shape == (3, 224, 224) and skipping.num_skipped == 1
    shard = tmp_path / "shards" / "train-000000.tar"  # the same bytes in a WebDataset shard
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        for name, payload in (("s0.jpg", data[: len(data) // 3]), ("s0.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    from vitkit.data.wds import decode, read_shard, transformed

    (sample,) = list(read_shard(str(shard)))
    image, label = decode(sample)  # the header reads
    with pytest.raises(UserError, match=r"train-000000\.tar: cannot read sample 's0'"):
        transformed(train_transform(224), image, sample)


def test_the_training_flip_is_the_batch_paths_flip_from_the_same_draw():
    """The per-image transform mirrors in Pillow; the batch path (augment_images) by resampling: same draws, same
    pixels."""
    from vitkit.data.transforms import augment_images, sample_crop_boxes, to_tensor

    img = Image.fromarray(photo(70, 50, seed=4))
    tf = train_transform(32, augment="inception_crop", flip=True)
    flipped = 0
    for seed in range(8):
        torch.manual_seed(seed)
        got = tf(img)
        torch.manual_seed(seed)
        top, left, h, w = sample_crop_boxes(1, 50, 70)[0].tolist()
        crop = img.resize((32, 32), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        plain = to_tensor(crop, [0.5] * 3, [0.5] * 3)
        expected = augment_images(plain[None], augment="none", flip=True)[0]
        assert torch.equal(got, expected), seed
        flipped += not torch.equal(got, plain)
    assert 0 < flipped < 8
