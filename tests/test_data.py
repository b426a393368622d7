"""The data pipeline: digits split and scaling, image folders, CIFAR pickles, transforms, bad input."""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from vitkit.data import (
    DataConfig,
    DatasetInfo,
    TensorImageDataset,
    augment_images,
    build_datasets,
    eval_transform,
    load_image,
    sample_crop_boxes,
    stratified_split,
    train_transform,
)
from vitkit.data.cifar import load_cifar
from vitkit.data.digits import load_digits_arrays


def _rgb(seed: int, h: int = 20, w: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _write_folder(root: Path, per_class: int = 3) -> None:
    """Two classes of tiny images in assorted formats and modes."""
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            seed = 10 * c + i
            kind = i % 5
            if kind == 0:
                Image.fromarray(_rgb(seed)).save(root / name / f"{i}.png")
            elif kind == 1:
                Image.fromarray(_rgb(seed)).save(root / name / f"{i}.jpg", quality=90)
            elif kind == 2:
                Image.fromarray(_rgb(seed)[..., 0]).save(root / name / f"{i}.png")  # grayscale
            elif kind == 3:
                alpha = np.full((20, 30, 1), 200, np.uint8)
                Image.fromarray(np.concatenate([_rgb(seed), alpha], -1)).save(root / name / f"{i}.png")  # RGBA
            else:
                Image.fromarray(_rgb(seed)).convert("P").save(root / name / f"{i}.gif")  # palette


# ---- digits -------------------------------------------------------------------------------------------------


def test_digits_split_is_fixed_stratified_and_disjoint():
    images, labels, test_mask = load_digits_arrays()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and int(images.max()) == 16
    assert int(test_mask.sum()) == 360 and int((~test_mask).sum()) == 1437
    # The stored split is the documented one: stratified_split(labels, 0.2, seed=0).
    _, held_out = stratified_split(labels.tolist(), 0.2, seed=0)
    assert np.flatnonzero(test_mask).tolist() == held_out
    for digit in range(10):
        n_class = int((labels == digit).sum())
        n_test = int((labels[test_mask] == digit).sum())
        assert abs(n_test - 0.2 * n_class) < 1.0, (digit, n_test, n_class)

    train, test, info = build_datasets(DataConfig(source="digits"))
    assert (len(train), len(test)) == (1437, 360)
    assert info.num_classes == 10 and info.class_names == [str(d) for d in range(10)]
    assert (info.in_chans, info.img_size) == (1, 16)
    assert torch.bincount(test.labels).tolist() == np.bincount(labels[test_mask]).tolist()


def test_digits_pixels_span_minus_one_to_one_and_channels_repeat():
    train, test, _ = build_datasets(DataConfig(source="digits"))
    assert train.images.shape == (1437, 1, 16, 16) and train.images.dtype == torch.float32
    assert train.images.min() == -1.0 and train.images.max() == 1.0
    x, y = test[0]
    assert x.shape == (1, 16, 16) and isinstance(y, int)
    rgb_train, _, info = build_datasets(DataConfig(source="digits", in_chans=3, img_size=24))
    assert rgb_train.images.shape == (1437, 3, 24, 24) and info.mean == [0.5, 0.5, 0.5]
    assert torch.equal(rgb_train.images[:, 0], rgb_train.images[:, 2])


def test_digits_eval_matches_eval_transform_on_the_same_image():
    """A digit saved as an 8-bit PNG and preprocessed by eval_transform (what predict does) matches the dataset."""
    images, _, test_mask = load_digits_arrays()
    _, test, info = build_datasets(DataConfig(source="digits"))
    idx = int(np.flatnonzero(test_mask)[0])
    img = Image.fromarray(np.round(images[idx].astype(np.float64) * 255 / 16).astype(np.uint8), mode="L")
    x = eval_transform(info.img_size, info.mean, info.std, info.crop_fraction, info.in_chans)(img)
    assert x.shape == test.images[0].shape
    assert (x - test.images[0]).abs().max() < 0.02


def test_digits_shift_augmentation_moves_by_whole_pixels_with_black_fill():
    train, _, _ = build_datasets(DataConfig(source="digits"))
    batch = train.images[:32]
    torch.manual_seed(0)
    out = train.augment_batch(batch)
    assert out.shape == batch.shape
    padded = torch.nn.functional.pad(batch, (1, 1, 1, 1), value=-1.0)  # black = -1 after normalising
    moved = 0
    for i in range(len(batch)):
        candidates = [padded[i, :, 1 - dy : 17 - dy, 1 - dx : 17 - dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
        errors = [(out[i] - c).abs().max().item() for c in candidates]
        assert min(errors) < 1e-5, f"item {i} is not a whole-pixel shift of the input"
        moved += errors[4] > 1e-5  # index 4 is (0, 0)
    assert moved > 16  # 8 of 9 shifts move the image


def test_tensor_dataset_batch_indexing_and_identity_eval():
    _, test, _ = build_datasets(DataConfig(source="digits"))
    idx = torch.tensor([3, 1, 4])
    assert torch.equal(test.augment_batch(test.images[idx]), test.images[idx])  # eval: no augmentation
    assert test.labels[idx].dtype == torch.int64


# ---- transforms -----------------------------------------------------------------------------------------------


def test_eval_transform_shape_range_and_centre_crop():
    arr = np.zeros((40, 60, 3), np.uint8)
    arr[4:36, 10:50] = 255  # a white centre rectangle on black
    img = Image.fromarray(arr)
    x = eval_transform(16)(img)
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert x.min() == -1.0 and x.max() == 1.0
    # Short side 40 -> 16 / 0.5 = 32 (image 48 x 32), centre 16 x 16: inside the white rectangle.
    crop = eval_transform(16, crop_fraction=0.5)(img)
    assert crop.shape == (3, 16, 16) and crop.min() == 1.0
    gray = eval_transform(16, mean=[0.5], std=[0.5])(img)
    assert gray.shape == (1, 16, 16)
    with pytest.raises(ValueError, match="data.mean"):
        eval_transform(16, mean=[0.5, 0.5], std=0.5, in_chans=3)


def test_inception_crop_boxes_stay_within_bounds():
    torch.manual_seed(0)
    height, width = 48, 64
    boxes = sample_crop_boxes(2000, height, width, area_min=0.05)
    top, left, h, w = boxes.unbind(1)
    area = h * w / (height * width)
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= height + 1e-4).all() and (left + w <= width + 1e-4).all()
    assert (area >= 0.05 - 1e-5).all() and (area <= 1 + 1e-5).all()
    whole = (h == height) & (w == width)  # the fallback when no draw fits
    ratio = (w / h)[~whole]
    assert (ratio >= 3 / 4 - 1e-5).all() and (ratio <= 4 / 3 + 1e-5).all()
    assert area.min() < 0.1 and area.max() > 0.9  # the range is actually explored


def test_full_area_crop_is_identity_and_flip_mirrors():
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(1)
    same = augment_images(x, augment="inception_crop", crop_area_min=1.0)  # square: only the whole image fits
    assert torch.allclose(same, x, atol=1e-5)
    torch.manual_seed(1)
    flipped = augment_images(x, augment="none", flip=True)
    for i in range(4):
        assert torch.allclose(flipped[i], x[i], atol=1e-5) or torch.allclose(flipped[i], x[i].flip(-1), atol=1e-5)


def test_same_seed_gives_the_same_augmented_item(tmp_path):
    _write_folder(tmp_path / "train")
    train, _, _ = build_datasets(DataConfig(source="folder", root=str(tmp_path / "train"), img_size=16))
    torch.manual_seed(123)
    a, _ = train[0]
    torch.manual_seed(123)
    b, _ = train[0]
    torch.manual_seed(124)
    c, _ = train[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    digits, _, _ = build_datasets(DataConfig(source="digits"))
    torch.manual_seed(5)
    d1 = digits.augment_batch(digits.images[:64])
    torch.manual_seed(5)
    d2 = digits.augment_batch(digits.images[:64])
    assert torch.equal(d1, d2)


def test_train_transform_modes_keep_shape_and_range():
    img = Image.fromarray(_rgb(0, 37, 51))
    torch.manual_seed(0)
    for augment in ("inception_crop", "shift", "none"):
        x = train_transform(20, augment=augment, shift_pixels=2)(img)
        assert x.shape == (3, 20, 20) and x.min() >= -1.0 and x.max() <= 1.0
    with pytest.raises(ValueError, match="train_augment"):
        train_transform(20, augment="rotate")


# ---- image loading and folders ----------------------------------------------------------------------------------


def test_load_image_converts_modes(tmp_path):
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 255  # red, fully transparent on the left half
    rgba[:, 2:, 3] = 255
    Image.fromarray(rgba).save(tmp_path / "rgba.png")
    img = load_image(tmp_path / "rgba.png")
    assert img.mode == "RGB"
    assert np.asarray(img)[0, 0].tolist() == [255, 255, 255]  # composited on white
    assert np.asarray(img)[0, 3].tolist() == [255, 0, 0]
    Image.fromarray(np.full((4, 4), 65535, np.uint16)).save(tmp_path / "gray16.png")
    assert np.asarray(load_image(tmp_path / "gray16.png")).min() == 255  # rescaled, not clipped to 0..255
    Image.fromarray(_rgb(1, 4, 4)).convert("CMYK").save(tmp_path / "cmyk.tiff")
    assert load_image(tmp_path / "cmyk.tiff").mode == "RGB"


def test_image_folder_with_mixed_formats(tmp_path):
    _write_folder(tmp_path / "train", per_class=5)
    cfg = DataConfig(source="folder", root=str(tmp_path / "train"), img_size=16, val_fraction=0.2)
    train, test, info = build_datasets(cfg)
    assert info.class_names == ["cat", "dog"] and info.num_classes == 2 and info.img_size == 16
    assert (len(train), len(test)) == (8, 2)
    assert sorted(test.targets) == [0, 1]  # one held out per class
    for ds in (train, test):
        for i in range(len(ds)):
            x, y = ds[i]
            assert x.shape == (3, 16, 16) and y in (0, 1)
            assert x.min() >= -1.0 and x.max() <= 1.0
    assert DatasetInfo(**info.to_dict()) == info


def test_separate_val_folder_and_unknown_class(tmp_path):
    _write_folder(tmp_path / "train")
    _write_folder(tmp_path / "val", per_class=2)
    train, test, _ = build_datasets(
        DataConfig(source="folder", root=str(tmp_path / "train"), val_root=str(tmp_path / "val"), img_size=8)
    )
    assert (len(train), len(test)) == (6, 4)
    (tmp_path / "val" / "bird").mkdir()
    Image.fromarray(_rgb(0)).save(tmp_path / "val" / "bird" / "x.png")
    with pytest.raises(ValueError, match="bird"):
        build_datasets(DataConfig(source="folder", root=str(tmp_path / "train"), val_root=str(tmp_path / "val")))


def test_truncated_jpeg_names_the_file_or_is_skipped_and_counted(tmp_path):
    _write_folder(tmp_path / "train", per_class=5)
    bad = tmp_path / "train" / "dog" / "bad.jpg"
    Image.fromarray(_rgb(99, 64, 64)).save(bad, quality=95)
    bad.write_bytes(bad.read_bytes()[:400])
    with pytest.raises(ValueError, match="bad.jpg"):
        load_image(bad)
    cfg = DataConfig(source="folder", root=str(tmp_path / "train"), img_size=8, val_root=str(tmp_path / "train"))
    train, _, _ = build_datasets(cfg)
    bad_index = [str(p) for p, _ in train.samples].index(str(bad))
    with pytest.raises(ValueError, match=r"bad\.jpg.*skip_corrupt"):
        train[bad_index]

    cfg = replace(cfg, skip_corrupt=True)
    train, _, _ = build_datasets(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = [train[i] for i in range(len(train))] + [train[bad_index]]
    assert train.num_skipped == 1 and len(items) == len(train) + 1
    assert len([w for w in caught if "bad.jpg" in str(w.message)]) == 1  # warned once
    assert items[bad_index][1] == train.samples[(bad_index + 1) % len(train)][1]  # the next readable image

    cfg = replace(cfg, verify=True)  # the up-front scan finds the same file
    with pytest.warns(RuntimeWarning, match="bad.jpg"):
        train, _, _ = build_datasets(cfg)
    assert train.num_skipped == 1
    assert pickle.loads(pickle.dumps(train)).num_skipped == 1  # picklable for spawned DataLoader workers
    cfg = replace(cfg, skip_corrupt=False)
    with pytest.raises(ValueError, match="bad.jpg"):
        build_datasets(cfg)


def test_bad_folders_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        build_datasets(DataConfig(source="folder", root=str(tmp_path / "does-not-exist")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class folders"):
        build_datasets(DataConfig(source="folder", root=str(tmp_path / "empty")))
    _write_folder(tmp_path / "train")
    (tmp_path / "train" / "zebra").mkdir()
    (tmp_path / "train" / "zebra" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"zebra.*no images"):
        build_datasets(DataConfig(source="folder", root=str(tmp_path / "train")))
    with pytest.raises(ValueError, match="data.root"):
        build_datasets(DataConfig(source="folder"))
    with pytest.raises(FileNotFoundError, match=r"empty: not a cifar10 directory; missing batch files"):
        build_datasets(DataConfig(source="cifar10", root=str(tmp_path / "empty")))


def test_hidden_files_and_folders_are_ignored(tmp_path):
    _write_folder(tmp_path / "train", per_class=2)
    (tmp_path / "train" / ".cache").mkdir()
    Image.fromarray(_rgb(0)).save(tmp_path / "train" / ".cache" / "x.png")
    Image.fromarray(_rgb(0)).save(tmp_path / "train" / "cat" / ".thumb.png")
    (tmp_path / "train" / "cat" / "sub").mkdir()
    Image.fromarray(_rgb(0)).save(tmp_path / "train" / "cat" / "sub" / "nested.PNG")
    train, test, info = build_datasets(DataConfig(source="folder", root=str(tmp_path / "train"), val_fraction=0.25))
    assert info.class_names == ["cat", "dog"] and len(train) + len(test) == 5
    names = sorted(p.name for p, _ in train.samples + test.samples)
    assert ".thumb.png" not in names and "x.png" not in names and "nested.PNG" in names


# ---- CIFAR ------------------------------------------------------------------------------------------------------


def _cifar_batch(n: int, seed: int, label_key: bytes, num_classes: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        label_key: rng.integers(0, num_classes, n).tolist(),
        b"batch_label": b"test batch",
    }


def test_cifar10_round_trip(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    batches = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        batches[name] = _cifar_batch(4, i, b"labels", 10)
        (root / name).write_bytes(pickle.dumps(batches[name], protocol=2 if i % 2 else 4))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": names}))

    data = load_cifar(tmp_path, "cifar10")  # finds the archive's subfolder
    images, labels = data["train"]
    assert images.shape == (20, 32, 32, 3) and labels.tolist()[:4] == batches["data_batch_1"][b"labels"]
    row = batches["data_batch_1"][b"data"][0]
    assert images[0, 0, 1, 0] == row[1] and images[0, 0, 1, 1] == row[1024 + 1] and images[0, 2, 0, 2] == row[2048 + 64]
    assert data["class_names"][3] == "cat"

    train, test, info = build_datasets(DataConfig(source="cifar10", root=str(root), img_size=16))
    assert (len(train), len(test), info.num_classes) == (20, 4, 10)
    x, y = test[0]
    expected = eval_transform(16)(
        Image.fromarray(batches["test_batch"][b"data"][0].reshape(3, 32, 32).transpose(1, 2, 0))
    )
    assert torch.allclose(x, expected) and y == batches["test_batch"][b"labels"][0]


def test_cifar100_round_trip_and_missing_files(tmp_path):
    for name in ("train", "test"):
        (tmp_path / name).write_bytes(pickle.dumps(_cifar_batch(3, len(name), b"fine_labels", 100)))
    (tmp_path / "meta").write_bytes(pickle.dumps({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}))
    data = load_cifar(tmp_path, "cifar100")
    assert data["train"][0].shape == (3, 32, 32, 3) and data["class_names"][42] == "c42"
    with pytest.raises(FileNotFoundError, match=r"data_batch_1.*test_batch"):
        load_cifar(tmp_path, "cifar10")


class _Exploit:
    """Unpickling this with the standard unpickler would run a shell command creating ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar_refuses_a_malicious_pickle(tmp_path):
    marker = tmp_path / "pwned"
    exploit = _Exploit(marker)
    for name in ("train", "test"):
        batch = _cifar_batch(2, 0, b"fine_labels", 100)
        batch[b"extra"] = exploit
        (tmp_path / name).write_bytes(pickle.dumps(batch))
    with pytest.raises(ValueError, match=r"train: refusing to unpickle the global (posix|os|nt)\.system"):
        load_cifar(tmp_path, "cifar100")
    assert not marker.exists()
    # _codecs.encode is let through only as the latin-1 bytes constructor protocol-2 pickles need.
    (tmp_path / "train").write_bytes(b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13\x86R.")
    with pytest.raises(ValueError, match=r"train: refusing _codecs.encode with encoding 'rot13'"):
        load_cifar(tmp_path, "cifar100")


# ---- configuration and synthetic data ---------------------------------------------------------------------------


def test_config_resolves_source_defaults_and_round_trips_yaml():
    digits = DataConfig(source="digits").resolve()
    assert (digits.img_size, digits.in_chans, digits.train_augment, digits.flip, digits.shift_pixels) == (
        16,
        1,
        "shift",
        False,
        1,
    )
    photos = DataConfig(source="folder", root="x", img_size=384).resolve()
    assert (photos.img_size, photos.train_augment, photos.flip) == (384, "inception_crop", True)
    cfg = DataConfig(source="cifar10", root="/data", mean=[0.5, 0.4, 0.3])
    assert DataConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="data.source"):
        DataConfig(source="imagenet").resolve()
    with pytest.raises(ValueError, match="unknown keys"):
        DataConfig.from_dict({"img_sise": 3})


def test_synthetic_source_is_learnable_and_deterministic():
    cfg = DataConfig(source="synthetic", synthetic_size=80, synthetic_classes=4, img_size=16)
    train, test, info = build_datasets(cfg)
    assert isinstance(train, TensorImageDataset) and (len(train), len(test)) == (64, 16)
    assert info.num_classes == 4 and train.images.shape[1:] == (3, 16, 16)
    again, _, _ = build_datasets(cfg)
    assert torch.equal(train.images, again.images)
    # A nearest-class-mean classifier on the raw pixels separates the classes: there is something to learn.
    means = torch.stack([train.images[train.labels == k].flatten(1).mean(0) for k in range(4)])
    pred = torch.cdist(test.images.flatten(1), means).argmin(1)
    assert (pred == test.labels).float().mean() >= 0.75


def test_stratified_split_keeps_every_class_in_training():
    labels = [0] * 10 + [1] * 5 + [2]
    train, held = stratified_split(labels, 0.25, seed=3)
    assert sorted(train + held) == list(range(16)) and not set(train) & set(held)
    assert len(held) == 4 and 15 in train  # the single class-2 example stays in training
    assert stratified_split(labels, 0.25, seed=3) == (train, held)
    assert stratified_split(labels, 0.25, seed=4) != (train, held)
