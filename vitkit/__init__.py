"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words", faithful to the official code."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import UserError
from .models import (
    MODELS,
    BiT,
    BiTConfig,
    ResNet,
    ResNetConfig,
    VisionTransformer,
    ViTConfig,
    count_params,
    list_models,
    resample_pos_embed,
)

__version__ = "0.1.0"

# Heavier subsystems load on first use, so `import vitkit` stays fast.
_LAZY = {
    "create_model": "vitkit.hub",
    "load_pretrained": "vitkit.hub",
    "load_model": "vitkit.hub",
    "save_pretrained": "vitkit.checkpoint",
    "optimize_for_inference": "vitkit.fast",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vitkit' has no attribute {name!r}")


__all__ = [
    "MODELS",
    "BiT",
    "BiTConfig",
    "ResNet",
    "ResNetConfig",
    "UserError",
    "ViTConfig",
    "VisionTransformer",
    "count_params",
    "list_models",
    "resample_pos_embed",
    *_LAZY,
]
