"""Pixels from model inputs, for masked patch prediction, RandAugment and figures: the data's normalisation
undone, and an image cut into its patches."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def unnormalise(
    x: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Normalised images (..., C, H, W) -> pixels in [0, 1] (float32): x * std + mean per channel, clamped."""
    mean_ = torch.as_tensor(mean, dtype=torch.float32, device=x.device).reshape(-1, 1, 1)  # (C, 1, 1)
    std_ = torch.as_tensor(std, dtype=torch.float32, device=x.device).reshape(-1, 1, 1)
    return (x.float() * std_ + mean_).clamp(0, 1)


def patches_of(images: torch.Tensor, patch: tuple[int, int]) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C, ph, pw) in the patch embedding's token order, dropping a partial border as it."""
    B, C, H, W = images.shape
    ph, pw = patch
    gh, gw = H // ph, W // pw
    x = images[:, :, : gh * ph, : gw * pw].reshape(B, C, gh, ph, gw, pw)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C, ph, pw)
