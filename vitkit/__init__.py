"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words", faithful to the official code.

The public API, in the order a newcomer meets it::

    import vitkit
    vitkit.list_models("vit_b*")                      # registered models
    vitkit.list_pretrained("vit_b16.*")               # released weights, as tags
    model = vitkit.create_model("vit_b16", pretrained=True)     # or a tag, or timm's / HF's name
    model = vitkit.load_model("google/vit-base-patch16-224")    # weights alone: tag, alias or path
    batch = vitkit.preprocess(model, ["cat.jpg"])     # (B, C, H, W), the weights' own preprocessing
    vitkit.save_pretrained(model, "out/")             # safetensors + config.json
    fast = vitkit.optimize_for_inference(model)

User mistakes raise ``vitkit.UserError`` (a ValueError) with a one-line message.
"""

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
    "preprocess": "vitkit.hub",
    "preprocessing_of": "vitkit.hub",
    "Preprocessing": "vitkit.preprocessing",
    "list_pretrained": "vitkit.pretrained",
    "save_pretrained": "vitkit.checkpoint",
    "optimize_for_inference": "vitkit.accel.inference",
    "optimize_for_training": "vitkit.accel.training",
}


def __getattr__(name: str) -> Any:
    """The lazily imported public names (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vitkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API, lazy names included, so ``dir(vitkit)`` and completion show it."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


__all__ = [
    "MODELS",
    "BiT",
    "BiTConfig",
    "ResNet",
    "ResNetConfig",
    "UserError",
    "ViTConfig",
    "__version__",
    "VisionTransformer",
    "count_params",
    "list_models",
    "resample_pos_embed",
    *_LAZY,
]
