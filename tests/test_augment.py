"""Batch augmentation (RandAugment, mixup / cutmix with label smoothing) and TensorBoard logging."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch
from test_train import stopped_and_resumed, tiny, weights

from vitkit import ViTConfig
from vitkit.data.augment import BatchAugment, cutmix_box
from vitkit.errors import UserError
from vitkit.train import Trainer, train
from vitkit.train.objectives import Classification
from vitkit.train.recipe import config_from_dict

K = 5


def distinct_images(b: int = 8, h: int = 12, w: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Image i is the constant i + 1 in every pixel: any pixel of a mixed image tells what went into it."""
    x = torch.arange(1, b + 1, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 1, h, w).clone()
    return x, torch.arange(b) % K


def test_mixup_targets_sum_to_one_and_match_the_pixels():
    x, y = distinct_images()
    aug = BatchAugment(K, [0.0], [1.0], mixup_alpha=0.4, label_smoothing=0.1)
    for seed in range(5):
        torch.manual_seed(seed)
        mixed, t = aug(x, y)
        assert t.shape == (len(y), K) and torch.allclose(t.sum(1), torch.ones(len(y)))
        # pixel = lam * a + (1 - lam) * b with a, b the images' constants: recover lam from the pixels
        a, b = x[:, 0, 0, 0], x.flip(0)[:, 0, 0, 0]
        rows = a != b
        lam = ((mixed[:, 0, 0, 0] - b) / (a - b))[rows]
        assert torch.allclose(lam, lam[0].expand_as(lam), atol=1e-5)  # one lambda per batch
        lam0 = float(lam[0])
        expected = smoothed(y, K, 0.1) * lam0 + smoothed(y.flip(0), K, 0.1) * (1 - lam0)
        np.testing.assert_allclose(t.double().numpy(), expected, atol=1e-6)


def smoothed(y: torch.Tensor, k: int, eps: float) -> np.ndarray:
    """Label smoothing of hard labels, in float64: (1 - eps) on the label plus eps / K on every class."""
    t = np.full((len(y), k), eps / k)
    t[np.arange(len(y)), y.numpy()] += 1 - eps
    return t


def mixup_weights(alpha: float, draws: int) -> np.ndarray:
    """The mixing weight of ``draws`` batches, read from the pixels: image 0 is 0 everywhere, image 1 is 1, so
    mixed image 0 = lam * 0 + (1 - lam) * 1."""
    x, y = torch.tensor([0.0, 1.0]).view(2, 1, 1, 1), torch.tensor([0, 1])
    aug = BatchAugment(2, [0.0], [1.0], mixup_alpha=alpha)
    torch.manual_seed(0)
    return np.array([1 - float(aug(x, y)[0][0, 0, 0, 0]) for _ in range(draws)])


@pytest.mark.parametrize("alpha", [0.4, 2.0])
def test_the_mixup_weight_is_drawn_from_beta_alpha_alpha(alpha):
    lam = mixup_weights(alpha, 4000)
    n = len(lam)
    # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)), excess kurtosis -6 / (2a + 3); 4 standard errors allowed
    var = 1 / (4 * (2 * alpha + 1))
    m4 = (3 - 6 / (2 * alpha + 3)) * var**2
    assert abs(lam.mean() - 0.5) < 4 * math.sqrt(var / n)
    assert abs(lam.var() - var) < 4 * math.sqrt((m4 - var**2) / n)
    # and the whole distribution, against scipy's Beta (seeded: the same draws every run)
    assert scipy.stats.kstest(lam, scipy.stats.beta(alpha, alpha).cdf).pvalue > 1e-3


def test_label_smoothing_of_hard_labels_matches_an_independent_computation():
    eps, y = 0.1, torch.tensor([0, 3, 4, 1, 1, 2])
    aug = BatchAugment(K, [0.0], [1.0], label_smoothing=eps)
    np.testing.assert_allclose(aug.soft_targets(y).double().numpy(), smoothed(y, K, eps), atol=1e-7)
    # the training loss smooths hard labels the same way, and does not smooth mixed (soft) targets again
    logits = torch.randn(len(y), K, generator=torch.Generator().manual_seed(0))
    log_p = torch.log_softmax(logits.double(), dim=1).numpy()
    objective = Classification(eps)
    hard = float(objective.loss(lambda _: logits, logits, y))
    assert hard == pytest.approx(-(smoothed(y, K, eps) * log_p).sum(1).mean(), rel=1e-6)
    soft = torch.from_numpy(smoothed(y.flip(0), K, 0.3)).float()
    assert float(objective.loss(lambda _: logits, logits, soft)) == pytest.approx(
        -(soft.double().numpy() * log_p).sum(1).mean(), rel=1e-6
    )


def test_cutmix_targets_match_the_pasted_box_area():
    x, y = distinct_images(h=10, w=14)
    aug = BatchAugment(K, [0.0], [1.0], cutmix_alpha=1.0)
    for seed in range(20):
        torch.manual_seed(seed)
        mixed, t = aug(x, y)
        assert torch.allclose(t.sum(1), torch.ones(len(y)))
        for i in range(len(y)):
            j = len(y) - 1 - i
            if y[i] == y[j]:
                continue
            own = (mixed[i] == x[i]).float().mean()  # the share of image i's own pixels
            assert torch.isclose(t[i, y[i]], own, atol=1e-6), (seed, i)
            assert torch.isclose(t[i, y[j]], 1 - own, atol=1e-6), (seed, i)
    # a box whose centre lies near the border is clipped: lambda follows the clipped area
    (y0, y1, x0, x1), lam = cutmix_box((10, 10), 0.36, torch.tensor([0.0, 0.95]))
    assert (y0, y1, x0, x1) == (0, 4, 5, 10) and lam == pytest.approx(1 - 20 / 100)


def test_mix_with_cutmix_and_mixup_uses_both():
    x, y = distinct_images()
    aug = BatchAugment(K, [0.0], [1.0], mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5)
    kinds = set()
    for seed in range(20):
        torch.manual_seed(seed)
        mixed, _ = aug(x, y)
        kinds.add("cutmix" if bool(torch.isin(mixed, x).all()) else "mixup")
    assert kinds == {"cutmix", "mixup"}


def test_randaugment_changes_images_and_is_reproducible():
    torch.manual_seed(0)
    x = torch.rand(32, 3, 16, 16) * 2 - 1  # normalised with mean = std = 0.5
    aug = BatchAugment(K, [0.5] * 3, [0.5] * 3, randaugment_ops=2, randaugment_magnitude=15)
    y = torch.zeros(32, dtype=torch.long)
    torch.manual_seed(1)
    a, ya = aug(x, y)
    torch.manual_seed(1)
    b, _ = aug(x, y)
    torch.manual_seed(2)
    c, _ = aug(x, y)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(ya, y) and a.shape == x.shape
    changed = (a - x).abs().flatten(1).amax(1) > 1e-3
    assert changed.float().mean() > 0.5
    assert a.min() >= -1 - 1e-5 and a.max() <= 1 + 1e-5  # still in the normalised pixel range


def test_randaugment_on_grey_images():
    x = torch.rand(8, 1, 16, 16) * 2 - 1
    aug = BatchAugment(K, [0.5], [0.5], randaugment_ops=2, randaugment_magnitude=10)
    torch.manual_seed(0)
    out, _ = aug(x, torch.zeros(8, dtype=torch.long))
    assert out.shape == x.shape and not torch.equal(out, x)


def test_levers_are_off_by_default_and_checked(tmp_path):
    cfg = config_from_dict(tiny(tmp_path))
    assert cfg.data.randaugment_ops == 0 and cfg.data.mixup_alpha == 0 and cfg.data.cutmix_alpha == 0
    assert cfg.run.tensorboard is False
    for override in ("data.randaugment_ops=16", "data.randaugment_magnitude=30", "data.mixup_alpha=-1"):
        with pytest.raises(UserError):
            Trainer(config_from_dict(tiny(tmp_path), [override])).close()
    with pytest.raises(UserError, match="objective"):
        Trainer(config_from_dict(tiny(tmp_path), ["data.mixup_alpha=0.2", "run.objective=mpp"])).close()


def test_missing_kornia_is_a_user_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_kornia(name, *args, **kwargs):
        if name.startswith("kornia"):
            raise ImportError("No module named 'kornia'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kornia)
    with pytest.raises(UserError, match=r"pip install 'vitkit\[augment\]'"):
        Trainer(config_from_dict(tiny(tmp_path), ["data.randaugment_ops=2"])).close()


def every_lever(tmp_path) -> dict:
    model = {"drop_path": 0.1} if "drop_path" in ViTConfig.__dataclass_fields__ else {}
    return tiny(
        tmp_path,
        model=model,
        data={
            **{"randaugment_ops": 2, "randaugment_magnitude": 12, "train_augment": "shift", "shift_pixels": 1},
            **{"mixup_alpha": 0.2, "cutmix_alpha": 1.0},
        },
        optim={"label_smoothing": 0.1, "batch_size": 16, "accum_steps": 2},
        schedule={"steps": 6, "warmup_steps": 2},
    )


def test_resume_is_exact_with_every_lever_on(tmp_path):
    reference, resumed = stopped_and_resumed(every_lever(tmp_path))
    a, b = weights(reference.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and the levers did something: the same run without them ends elsewhere
    plain = train(config_from_dict(tiny(tmp_path, schedule={"steps": 6, "warmup_steps": 2}), ["run.name=plain"]))
    c = weights(plain.run_dir)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_tensorboard_writes_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(config_from_dict(tiny(tmp_path), ["run.tensorboard=true", "run.log_every=2"]))
    folder = result.run_dir / "tensorboard"
    assert list(folder.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(folder))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/images_per_s", "eval/top1", "eval/loss"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert events.Scalars("eval/top1")[-1].value == pytest.approx(result.metrics["eval_top1"])
