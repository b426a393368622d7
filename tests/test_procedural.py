"""The procedural shapes source: deterministic per (seed, split, index), a held-out split of its own, balanced
classes, wired into build_datasets and the training engine."""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.data import DataConfig, build_datasets
from vitkit.data.procedural import (
    CLASS_NAMES,
    EVAL_STREAM,
    TRAIN_STREAM,
    ProceduralShapes,
    render_shape_image,
    sample_grid,
)
from vitkit.errors import UserError
from vitkit.train import config_from_dict, train


def _digest(pixels: np.ndarray) -> str:
    return hashlib.sha1(pixels.tobytes()).hexdigest()


def test_same_seed_and_index_give_the_same_image_and_others_differ():
    a, label_a = render_shape_image(3, TRAIN_STREAM, 17)
    b, label_b = render_shape_image(3, TRAIN_STREAM, 17)
    assert a.dtype == np.uint8 and a.shape == (32, 32, 3)
    assert np.array_equal(a, b) and label_a == label_b
    assert not np.array_equal(a, render_shape_image(3, TRAIN_STREAM, 27)[0])  # same class, another index
    assert not np.array_equal(a, render_shape_image(4, TRAIN_STREAM, 17)[0])  # another seed
    # the dataset draws the same pixels in any instance, whatever was drawn before and whatever torch's RNG holds
    first, second = ProceduralShapes(100, seed=3), ProceduralShapes(1000, seed=3)
    torch.manual_seed(0)
    x1, y1 = first[17]
    _ = second[5], second[99]
    torch.manual_seed(1)
    x2, y2 = second[17]
    assert torch.equal(x1, x2) and y1 == y2 == label_a
    expected = (torch.from_numpy(a).permute(2, 0, 1).float() / 255 - 0.5) / 0.5  # an independent normalisation
    assert torch.allclose(x1, expected, atol=1e-6)


def test_growing_subsets_are_nested():
    small, large = ProceduralShapes(50, seed=1), ProceduralShapes(5000, seed=1)
    assert all(torch.equal(small[i][0], large[i][0]) for i in (0, 13, 49))


def test_held_out_images_are_disjoint_from_the_training_images():
    train_hashes = {_digest(render_shape_image(0, TRAIN_STREAM, i)[0]) for i in range(2000)}
    eval_hashes = [_digest(render_shape_image(0, EVAL_STREAM, i)[0]) for i in range(400)]
    assert len(train_hashes) == 2000 and len(set(eval_hashes)) == 400  # no repeats within a split either
    assert not train_hashes & set(eval_hashes)


def test_classes_are_balanced_and_named():
    ds = ProceduralShapes(1000)
    counts = Counter(ds[i][1] for i in range(0, 1000, 7)) + Counter()
    assert sorted(Counter(ds.labels.tolist()).values()) == [100] * 10
    assert set(counts) == set(range(10))
    assert CLASS_NAMES[:2] == ["disc_above", "disc_below"] and len(CLASS_NAMES) == 10


def test_shape_masks_have_the_areas_of_their_shapes():
    """Each shape's area in its unit box, against the closed form (a 600 x 600 sampling of [-1, 1]^2)."""
    from vitkit.data.procedural import SHAPES, shape_mask

    yy, xx = np.mgrid[-1:1:600j, -1:1:600j]
    expected = {
        "disc": math.pi / 4,
        "square": 1.5**2 / 4,
        "triangle": 3 * math.sqrt(3) / 4 / 4,  # equilateral, inscribed in the unit circle
        "cross": (2 * 0.6 * 2 - 0.6**2) / 4,
        "ring": math.pi * (1 - 0.5**2) / 4,
    }
    for k, name in enumerate(SHAPES):
        assert shape_mask(k, xx, yy).mean() == pytest.approx(expected[name], abs=0.01), name


def test_build_datasets_serves_shapes_with_their_info():
    train_ds, eval_ds, info = build_datasets(DataConfig(source="shapes", num_images=300, eval_images=40))
    assert len(train_ds) == 300 and len(eval_ds) == 40
    assert info.num_classes == 10 and info.class_names == CLASS_NAMES and info.img_size == 32 and info.in_chans == 3
    x, y = eval_ds[3]
    assert x.shape == (3, 32, 32) and y == 3
    assert torch.equal(x, ProceduralShapes(40, stream=EVAL_STREAM)[3][0])
    grey, _, info1 = build_datasets(DataConfig(source="shapes", num_images=10, in_chans=1, img_size=24))
    assert grey[0][0].shape == (1, 24, 24) and info1.in_chans == 1
    with pytest.raises(UserError, match="num_images"):
        build_datasets(DataConfig(source="shapes", num_images=0))
    with pytest.raises(UserError, match="train_augment=inception_crop"):
        build_datasets(DataConfig(source="shapes", train_augment="inception_crop"))
    with pytest.raises(UserError, match="train_fraction"):
        build_datasets(DataConfig(source="shapes", train_fraction=0.5))


def _move_of(x: torch.Tensor, base: torch.Tensor, black: float = -1.0) -> tuple[bool, int, int] | None:
    """(mirrored, dy, dx) of the move that makes x from base with a black border, or None (black: (0 - 0.5) / 0.5)."""
    h, w = base.shape[1:]
    for flipped in (False, True):
        image = base.flip(-1) if flipped else base
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                moved = torch.full_like(image, black)
                moved[:, max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = image[
                    :, max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
                ]
                if torch.allclose(x, moved, atol=1e-5):
                    return flipped, dy, dx
    return None


def test_flips_and_shifts_of_a_shape_subset_move_the_image_and_keep_its_label():
    """Each draw is the image mirrored left-right or not, moved by at most one pixel (the exposed border black), item
    by item or a batch at a time (the training loop's path, from the same images); the marker stays above or below
    its object, so the label is the drawn one; the held-out images are never moved."""
    plain = ProceduralShapes(40, img_size=16)
    train_ds, eval_ds, _ = build_datasets(
        DataConfig(
            source="shapes", num_images=40, eval_images=8, img_size=16, flip=True, train_augment="shift", shift_pixels=1
        )  # fmt: skip
    )
    torch.manual_seed(0)
    assert torch.equal(train_ds.images_at(torch.arange(40)), torch.stack([plain[i][0] for i in range(40)]))
    by_item = [train_ds[i] for i in range(40)]
    assert [y for _, y in by_item] == [plain[i][1] for i in range(40)]
    by_batch = train_ds.augment_batch(train_ds.images_at(torch.arange(40)))  # the training loop's path
    for moved in ([x for x, _ in by_item], by_batch):
        seen = {_move_of(x, plain[i][0]) for i, x in enumerate(moved)}
        assert None not in seen
        assert {f for f, _, _ in seen} == {False, True} and len(seen) > 6  # both mirrors, several shifts
    assert torch.equal(eval_ds[3][0], ProceduralShapes(8, stream=EVAL_STREAM, img_size=16)[3][0])


def test_sample_grid_writes_one_row_per_class(tmp_path):
    path = sample_grid(tmp_path / "grid.png", per_class=3, scale=2)
    img = np.asarray(Image.open(path))
    assert img.shape == (10 * (64 + 2) + 2, 3 * (64 + 2) + 2, 3)
    first = render_shape_image(0, TRAIN_STREAM, 0)[0].repeat(2, 0).repeat(2, 1)
    assert np.array_equal(img[2:66, 2:66], first)


def test_a_small_vit_fits_shape_images_through_the_engine(tmp_path):
    """Overfit check: 40 shape images, drawn on the fly through the DataLoader path, are learned by a small ViT;
    its evaluation on those same images (the held-out split set to them by seed and stream) is far above chance."""
    doc = {
        "model": {"name": "vit_ti16", "patch_size": 8, "width": 64, "depth": 2, "num_heads": 4, "mlp_dim": 128},
        "data": {"source": "shapes", "num_images": 40, "eval_images": 40},
        "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.0, "batch_size": 40, "grad_clip": 1.0},
        "schedule": {"steps": 40, "warmup_steps": 3, "decay": "cosine"},
        "run": {"out_dir": str(tmp_path), "progress": False, "plots": False, "eval_every": 0, "threads": 1},
    }
    result = train(config_from_dict(doc))
    assert result.metrics["eval_images"] == 40
    model_dir = result.run_dir
    from vitkit.hub import load_model

    model = load_model(model_dir).eval()
    ds = ProceduralShapes(40)
    x = torch.stack([ds[i][0] for i in range(40)])
    with torch.no_grad():
        train_acc = (model(x).argmax(-1) == ds.labels).float().mean().item()
    assert train_acc > 0.8  # chance is 0.1


def test_a_cached_image_is_the_image_drawn_and_a_large_set_is_not_cached(monkeypatch):
    from vitkit.data.procedural import ProceduralShapes

    ds = ProceduralShapes(50, seed=2, img_size=16, mean=(0.0,) * 3, std=(1.0,) * 3)
    first = [ds[i] for i in (3, 7, 3)]
    assert ds._cache is not None and sorted(ds._cache) == [3, 7]
    pixels, label = render_shape_image(2, TRAIN_STREAM, 3, 16)
    expected = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    assert torch.equal(first[0][0], expected) and torch.equal(first[2][0], expected) and first[0][1] == label == 3
    monkeypatch.setattr(ProceduralShapes, "CACHE_BYTES", 50 * 16 * 16 * 3 - 1)
    big = ProceduralShapes(50, seed=2, img_size=16, mean=(0.0,) * 3, std=(1.0,) * 3)
    assert big._cache is None and torch.equal(big[3][0], expected)


@pytest.mark.parametrize("in_chans", [3, 1])
def test_a_batch_is_the_images_drawn_one_by_one_normalised_in_a_contiguous_tensor(in_chans):
    data = ProceduralShapes(50, seed=2, img_size=16, in_chans=in_chans, mean=(0.5,) * in_chans, std=(0.25,) * in_chans)
    indices = torch.tensor([7, 0, 49, 7, 23])
    expected = []
    for i in indices.tolist():
        x = torch.from_numpy(render_shape_image(2, TRAIN_STREAM, i, 16)[0]).double().permute(2, 0, 1) / 255
        expected.append((x.mean(0, keepdim=True) if in_chans == 1 else x) * 4 - 2)
    batch = data.images_at(indices)
    torch.testing.assert_close(batch, torch.stack(expected).float(), rtol=0, atol=1e-6)
    # the layout every other source gives: a channels-last batch would run other kernels, with other rounding
    assert batch.is_contiguous() and data[23][0].is_contiguous()
    torch.testing.assert_close(data[23][0], batch[4], rtol=0, atol=0)
