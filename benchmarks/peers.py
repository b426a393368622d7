"""timm as a peer of the benchmark scripts (bench_vit.py, bench_gpu.py). It lives here, beside them, not in the
vitkit package: timm imports torchvision, which vitkit does not depend on."""

from __future__ import annotations

from torch import nn

from vitkit.checkpoint.timm import timm_kwargs, vitkit_to_timm


def timm_peer(model: nn.Module) -> nn.Module:
    """timm's VisionTransformer with vitkit's weights, dtype and device."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    ref = next(model.parameters())
    peer = TimmViT(**timm_kwargs(model))
    peer.load_state_dict(vitkit_to_timm(model))
    return peer.to(device=ref.device, dtype=ref.dtype)
