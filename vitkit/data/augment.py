"""Batch augmentation on the training device, after decoding: RandAugment, then mixup / cutmix. ``build_augment`` builds
the ``BatchAugment`` that maps a training micro-batch ``(x, y)`` to the images and targets the loss sees; each lever is
off by default. RandAugment is kornia's, on [0, 1] pixels. mixup / cutmix draw one Beta(alpha, alpha) weight per batch
and mix each image with its mirror, as timm does, and the targets in the proportion of the mixed pixels. All randomness
comes from torch's global RNG, seeded by the engine."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..optional import require
from ..pixels import unnormalise
from .config import DataConfig

RANDAUGMENT_GROUPS = 16  # kornia picks one op sequence per call: this many calls per batch give images variety


def load_randaugment(num_ops: int, magnitude: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """kornia's RandAugment(n=num_ops, m=magnitude), or a UserError with the install hint."""
    require("kornia", f"data.randaugment_ops={num_ops}")
    from kornia.augmentation.auto import RandAugment

    return RandAugment(n=num_ops, m=magnitude)


class BatchAugment:
    """RandAugment and mixup / cutmix for one run; ``enabled`` is False when every lever is off."""

    def __init__(
        self,
        num_classes: int,
        mean: list[float],
        std: list[float],
        *,
        randaugment_ops: int = 0,
        randaugment_magnitude: int = 10,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        switch_prob: float = 0.5,
        label_smoothing: float = 0.0,
    ) -> None:
        self.num_classes = num_classes
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.randaugment: Callable[[torch.Tensor], torch.Tensor] | None = None
        if randaugment_ops:
            self.randaugment = load_randaugment(randaugment_ops, randaugment_magnitude)
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.switch_prob, self.label_smoothing = switch_prob, label_smoothing

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def enabled(self) -> bool:
        return self.randaugment is not None or self.mixes

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C, H, W) normalised images and (B,) labels -> augmented images and (B,) labels or (B, K) targets."""
        if self.randaugment is not None:
            x = self.apply_randaugment(x)
        if self.mixes:
            x, y = self.mix(x, y)
        return x, y

    def apply_randaugment(self, x: torch.Tensor) -> torch.Tensor:
        """RandAugment on normalised images (B, C, H, W): un-normalised to [0, 1], augmented, normalised again."""
        if self.randaugment is None:
            return x
        randaugment = self.randaugment
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        pixels = unnormalise(x, mean, std)
        channels = pixels.shape[1]
        if channels == 1:  # kornia's colour operations want RGB; grey in, grey out
            pixels = pixels.expand(-1, 3, -1, -1)
        groups = pixels.chunk(min(RANDAUGMENT_GROUPS, len(pixels)))
        out = torch.cat([randaugment(g) for g in groups])
        if channels == 1:
            out = out.mean(dim=1, keepdim=True)
        return ((out - mean) / std).to(x.dtype)

    def soft_targets(self, y: torch.Tensor) -> torch.Tensor:
        """Label-smoothed one-hot targets: 1 - s + s / K on the label, s / K elsewhere (sums to 1)."""
        off = self.label_smoothing / self.num_classes
        return F.one_hot(y, self.num_classes).float() * (1 - self.label_smoothing) + off

    def mix(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One mixing weight for the batch; each image mixed with its mirror ``x.flip(0)``; soft targets."""
        # a fixed count of draws whatever the outcome keeps the RNG stream the same from one batch to the next
        switch = float(torch.rand(()))
        centre = torch.rand(2)
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or switch < self.switch_prob)
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = float(torch.distributions.Beta(alpha, alpha).sample())
        other = x.flip(0)
        if use_cutmix:
            (y0, y1, x0, x1), lam = cutmix_box(x.shape[-2:], lam, centre)
            x = x.clone()
            x[..., y0:y1, x0:x1] = other[..., y0:y1, x0:x1]
        else:
            x = x * lam + other * (1 - lam)
        targets = self.soft_targets(y)
        return x, targets * lam + targets.flip(0) * (1 - lam)


def cutmix_box(
    size: tuple[int, int] | torch.Size, lam: float, centre: torch.Tensor
) -> tuple[tuple[int, int, int, int], float]:
    """The pasted box (top, bottom, left, right) for a share 1 - lam of the image, centred at ``centre`` (two
    numbers in [0, 1)), clipped to the image; and lam corrected to the share the box leaves, 1 - its area."""
    h, w = int(size[0]), int(size[1])
    ratio = math.sqrt(1 - lam)
    cut_h, cut_w = int(h * ratio), int(w * ratio)
    cy, cx = int(centre[0] * h), int(centre[1] * w)
    y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
    x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
    return (y0, y1, x0, x1), 1 - (y1 - y0) * (x1 - x0) / (h * w)


def build_augment(
    data: DataConfig, num_classes: int, mean: list[float], std: list[float], *, label_smoothing: float, objective: str
) -> BatchAugment:
    """The BatchAugment a run's data section asks for; ``label_smoothing`` (optim's) goes into mixed targets."""
    if (data.mixup_alpha > 0 or data.cutmix_alpha > 0) and objective != "classification":
        raise UserError(
            f"data.mixup_alpha / data.cutmix_alpha mix class labels; run.objective={objective} has none (set both to 0)"
        )
    return BatchAugment(
        num_classes,
        mean,
        std,
        randaugment_ops=data.randaugment_ops,
        randaugment_magnitude=data.randaugment_magnitude,
        mixup_alpha=data.mixup_alpha,
        cutmix_alpha=data.cutmix_alpha,
        switch_prob=data.mixup_switch_prob,
        label_smoothing=label_smoothing,
    )
