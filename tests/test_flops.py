"""Analytic FLOPs (vitkit.models.flops) of models as built, against torch's FlopCounterMode on the meta device. The
counts of patched forwards (first token, token merging) are tested beside the patches, in tests/accel/."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitkit.models import ResNet, VisionTransformer, ViTConfig
from vitkit.models.flops import model_flops, vit_flops

TINY = dict(width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10, patch_size=8, img_size=32)


def counted_flops(model: torch.nn.Module, img_size: tuple[int, int]) -> int:
    """FlopCounterMode's count for one image, on the meta device (shapes only)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, *img_size, device="meta"))
    return counter.get_total_flops()


def test_vit_b16_flops_golden():
    # 12 x (qkv 697.0M + attention 119.2M + proj 232.3M + MLP 1859.2M) + patch 231.2M + head 1.5M
    assert vit_flops(ViTConfig())["total"] == 35_127_656_448


@pytest.mark.parametrize(
    "overrides, img_size",
    [
        (dict(), (32, 32)),
        (dict(classifier="gap", representation_size=24), (32, 32)),
        (dict(img_size=(48, 32), patch_size=(8, 4), num_classes=0), (48, 32)),
        (dict(resnet_layers=(1,), patch_size=1), (32, 32)),  # hybrid: ResNet stem convs counted too
        (dict(pos_embed="relative_2d"), (32, 32)),
    ],
)
@pytest.mark.parametrize("attn_impl", ["explicit", "sdpa"])
def test_vit_flops_match_flop_counter(overrides, img_size, attn_impl):
    with torch.device("meta"):
        model = VisionTransformer(**{**TINY, **overrides, "attn_impl": attn_impl})
    assert vit_flops(model.config, img_size)["total"] == counted_flops(model, img_size)


def test_resnet_flops_match_flop_counter():
    with torch.device("meta"):
        model = ResNet(layers=(1, 1), num_classes=7, img_size=64)
    assert model_flops(model, 64) == counted_flops(model, (64, 64))
