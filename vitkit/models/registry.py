"""The model family as rows of one table: ``create_model("vit_b16")``, ``list_models()``.

A ViT name decodes as big_vision's "B/16": a size row (width, depth, MLP width, heads) and a patch size.
Hybrids add a ResNet stem (stage depths; () is the root alone) and use a 1x1 patch on its feature map.
``bit_r50x1`` ... ``bit_r152x4`` are Big Transfer's pre-activation ResNet-v2 (bit.py), the six sizes BiT
released; the hybrids' post-activation ResNet as a classifier is ``hybrid_resnet_r50x1`` etc. (resnet.py).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from ..errors import UserError, did_you_mean
from .bit import BiT, BiTConfig
from .common import check_fields
from .resnet import ResNet, ResNetConfig
from .vit import VisionTransformer, ViTConfig

# size -> (width, depth, mlp_dim, num_heads); Ti and S are the widely used extras to the paper's Table 1
SIZES: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "H": (1280, 32, 5120, 16),
}

R26, R50, R101, R152 = (2, 2, 2, 2), (3, 4, 6, 3), (3, 4, 23, 3), (3, 8, 36, 3)


def vit_variant(spec: str, **extra: Any) -> dict[str, Any]:
    """'B/16' -> ViTConfig fields. Extra fields (classifier, resnet_layers, ...) are passed through."""
    size, patch = spec.split("/")
    width, depth, mlp_dim, heads = SIZES[size]
    return dict(arch="vit", width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads, patch_size=int(patch), **extra)


def bit_variant(layers: tuple[int, ...], width_factor: int) -> dict[str, Any]:
    """Big Transfer's ResNet-v2 (pre-activation, GroupNorm + weight standardisation): BiT-R50x1 is (R50, 1)."""
    return dict(arch="bit", layers=layers, width_factor=width_factor)


def hybrid_resnet_variant(layers: tuple[int, ...], width_factor: int) -> dict[str, Any]:
    """The hybrid ViT's post-activation ResNet (vit_jax models_resnet) as a classifier on its own."""
    return dict(arch="resnet", layers=layers, width_factor=width_factor)


# name -> config fields. Hybrid names follow the paper: R50+ViT-B/16 is r50_vit_b16 (its tokens are /16).
MODELS: dict[str, dict[str, Any]] = {
    "vit_ti16": vit_variant("Ti/16"),
    "vit_s16": vit_variant("S/16"),
    "vit_s32": vit_variant("S/32"),
    "vit_b8": vit_variant("B/8"),
    "vit_b16": vit_variant("B/16"),
    "vit_b32": vit_variant("B/32"),
    "vit_l16": vit_variant("L/16"),
    "vit_l32": vit_variant("L/32"),
    "vit_h14": vit_variant("H/14"),
    "vit_s16_gap": vit_variant("S/16", classifier="gap"),
    "vit_b16_gap": vit_variant("B/16", classifier="gap"),
    "vit_s32_gap": vit_variant("S/32", classifier="gap"),
    "vit_b32_gap": vit_variant("B/32", classifier="gap"),
    # hybrids: ResNet root (/4) + stages; 3 stages -> /16, 4 stages -> /32, root alone + 8x8 patches -> /32
    "r_vit_ti32": vit_variant("Ti/8", resnet_layers=()),  # the official R+Ti/16: root (/4) + 8x8 patches = /32
    "r50_vit_b16": vit_variant("B/1", resnet_layers=(3, 4, 9)),
    "r50_vit_l32": vit_variant("L/1", resnet_layers=R50),
    "r26_vit_s32": vit_variant("S/1", resnet_layers=R26),
    "r26_vit_b32": vit_variant("B/1", resnet_layers=R26),
    # BiT ResNet-v2 baselines: the six architectures Big Transfer released (BiT-S / BiT-M weights)
    "bit_r50x1": bit_variant(R50, 1),
    "bit_r50x3": bit_variant(R50, 3),
    "bit_r101x1": bit_variant(R101, 1),
    "bit_r101x3": bit_variant(R101, 3),
    "bit_r152x2": bit_variant(R152, 2),
    "bit_r152x4": bit_variant(R152, 4),
    # the hybrids' post-activation ResNet as a classifier (named bit_r* before the BiT rows above existed)
    "hybrid_resnet_r26x1": hybrid_resnet_variant(R26, 1),
    "hybrid_resnet_r50x1": hybrid_resnet_variant(R50, 1),
    "hybrid_resnet_r50x3": hybrid_resnet_variant(R50, 3),
    "hybrid_resnet_r101x1": hybrid_resnet_variant(R101, 1),
    "hybrid_resnet_r101x3": hybrid_resnet_variant(R101, 3),
    "hybrid_resnet_r152x2": hybrid_resnet_variant(R152, 2),
    "hybrid_resnet_r152x4": hybrid_resnet_variant(R152, 4),
}

# Names that are not registered but that a user may well type: a renamed row, and the names Big Transfer and timm
# give the BiT architectures. unknown_model points at the row.
# names that meant something else before: an error naming the row that has it now, never a silent new meaning
RENAMED: dict[str, tuple[str, str]] = {
    "bit_r26x1": (
        "hybrid_resnet_r26x1",
        "the post-activation ResNet it named; bit_r* names are Big Transfer's ResNet-v2 (bit_r50x1 ... bit_r152x4)",
    ),
    "r_vit_ti16": ("r_vit_ti32", "R+Ti/16 in the official configs, but its tokens are 1/32 of the image (root /4 x 8)"),
}
KNOWN_AS: dict[str, str] = {
    alias: name
    for name, row in MODELS.items()
    if row["arch"] == "bit"
    for depth, width in [name.removeprefix("bit_r").split("x")]
    for alias in (f"resnetv2_{depth}x{width}_bit", f"bit-m-r{depth}x{width}", f"bit-s-r{depth}x{width}")
}


def list_models(pattern: str = "") -> list[str]:
    """Registered names matching ``pattern``: a glob (``vit_b*``, ``*gap``) or, without wildcards, a substring."""
    if not pattern:
        return list(MODELS)
    glob = pattern if any(c in pattern for c in "*?[") else f"*{pattern}*"
    return [n for n in MODELS if fnmatch.fnmatchcase(n, glob)]


def unknown_model(name: str) -> UserError:
    """The error for a name that is not registered: the row a renamed or foreign name means, else close matches."""
    if name in RENAMED:
        new_name, why = RENAMED[name]
        return UserError(f"unknown model {name!r}: it is now {new_name!r} ({why})")
    alias = KNOWN_AS.get(name.lower().split(".")[0])  # timm tags carry '.weights' after the architecture
    if alias is not None:
        return UserError(f"unknown model {name!r}; vitkit names this architecture {alias!r}")
    hint = did_you_mean(name, list(MODELS), "see vitkit.list_models() or `vitkit models`")
    return UserError(f"unknown model {name!r}; {hint}")


_ARCHS = {"vit": (VisionTransformer, ViTConfig), "resnet": (ResNet, ResNetConfig), "bit": (BiT, BiTConfig)}


def config_class(arch: str) -> type:
    """ViTConfig, ResNetConfig or BiTConfig for an ``arch`` value."""
    if arch not in _ARCHS:
        raise UserError(f"unknown architecture {arch!r} in model config (expected one of {', '.join(_ARCHS)})")
    return _ARCHS[arch][1]


def model_config(name: str, **overrides: Any) -> ViTConfig | ResNetConfig | BiTConfig:
    """The config of a registered model with some fields changed, checked by the config class itself."""
    if name not in MODELS:
        raise unknown_model(name)
    row = dict(MODELS[name])
    cls = config_class(row.pop("arch"))
    check_fields(cls, overrides)
    return cls(**{**row, **overrides})


def model_from_config(config: dict[str, Any] | ViTConfig | ResNetConfig | BiTConfig) -> nn.Module:
    """Build a model from its config, or a plain dict of it (a saved ``config.json``; ``arch`` selects the class)."""
    if not isinstance(config, dict):
        return _ARCHS[config.arch][0](config)
    config = dict(config)
    cls = config_class(config.pop("arch", "vit"))
    check_fields(cls, config)
    return model_from_config(cls(**config))


def create_model(name: str, **overrides: Any) -> nn.Module:
    """A registered model with random (official) initialisation, optionally with config fields changed
    (``num_classes=10``, ``img_size=384``, ``dropout=0.1``). Weights by name or path: ``vitkit.create_model``."""
    return model_from_config(model_config(name, **overrides))
