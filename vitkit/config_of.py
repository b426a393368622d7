"""The config of a vitkit model, typed (``nn.Module`` attributes are typed as tensors or modules): a model
without a vitkit config is a UserError naming its type rather than an AttributeError later."""

from __future__ import annotations

from torch import nn

from .errors import UserError
from .models import BiTConfig, ResNetConfig, ViTConfig

ModelConfig = ViTConfig | ResNetConfig | BiTConfig


def config_of(model: nn.Module) -> ModelConfig:
    """The model's config (a ViT, ResNet or BiT one)."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, (ViTConfig, ResNetConfig, BiTConfig)):
        raise UserError(f"expected a vitkit VisionTransformer, ResNet or BiT, got {type(model).__name__}")
    return cfg


def vit_config_of(model: nn.Module, what: str = "this") -> ViTConfig:
    """The config of a VisionTransformer; ``what`` names the operation that needs one, in the error."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ViTConfig):
        raise UserError(f"{what} needs a vitkit VisionTransformer, not {type(model).__name__}")
    return cfg


def pair(value: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) of a size or patch a config field holds as one int or a pair (configs store pairs)."""
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))
