"""Models by name, with weights: ``create_model("vit_b16", pretrained="ViT-B_16.npz", num_classes=10)``.

The model table (vitkit.models) builds models with random weights and knows nothing of files; this module
joins it to the checkpoint readers (vitkit.checkpoint), one floor up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint.loader import load_model, load_pretrained
from .models import registry

__all__ = ["create_model", "load_model"]


def create_model(name: str, pretrained: str | Path | None = None, **overrides: Any) -> nn.Module:
    """A registered model, optionally with overrides (``num_classes=10``, ``img_size=384``, ``dropout=0.1``).

    ``pretrained`` is a checkpoint path in any format ``vitkit.load_pretrained`` reads. Loading is strict: its
    position embeddings are resampled to the model's resolution and, for another class count, the head is
    fresh (both reported by ``load_pretrained``); any other difference is an error listing the keys.
    """
    model = registry.create_model(name, **overrides)
    if pretrained is not None:
        load_pretrained(model, pretrained)
    return model
