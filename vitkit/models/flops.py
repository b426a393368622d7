"""Model FLOPs, counted analytically from the config: the numerator of utilisation.

Matmuls and convolutions only, 2 FLOPs per multiply-add; norms, softmax and GELU are left out, as
torch.utils.flop_counter.FlopCounterMode does (tests check the two agree). A training step counts 3x the forward. By
default the count is the model's as built, every token through every block. Two arguments count what a patched model
executes instead: ``first_token``, the last block computing the class token alone (what vitkit.accel.first_token swaps
in under optimize_for_inference and optimize_for_training), and ``token_merge``, r pairs of tokens merged in every block
(vitkit.accel.tome; a patched model says its r in ``model.token_merge``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .bit import BiTConfig
from .common import as_pair
from .config import ViTConfig
from .heads import FIRST_TOKEN
from .posemb import relative_table_shape
from .registry import model_from_config
from .resnet import ResNetBackbone, ResNetConfig


def vit_flops(
    config: ViTConfig,
    img_size: int | tuple[int, int] | None = None,
    first_token: bool = False,
    token_merge: int = 0,
) -> dict[str, int]:
    """Forward FLOPs per image of a ViT, by part, from its config alone (2 FLOPs per multiply-add). Keys: stem (hybrid
    ResNet), patch_embed, qkv, attention (q k^T and probs @ v), relative (relative position attention: each patch query
    against every offset's embedding), proj, mlp, merge (token merging's key similarities), pre_logits, head, total.
    ViT-B/16 at 224 as built: 35.1 GFLOP. ``first_token``: a class-token model's last block computes the class token
    alone (its keys and values still of every token), as vitkit.accel.first_token runs it (32.7 GFLOP); ``token_merge``:
    r pairs merged after each block's attention, so later layers run on fewer tokens (vitkit.accel.tome)."""
    size = as_pair("vit_flops", "img_size", img_size if img_size is not None else config.img_size)
    gh, gw = config.grid(size)
    n = gh * gw
    prefix = 1 if config.classifier == "token" else 0  # the class token, which has no relative position
    t = n + prefix  # tokens through the encoder
    d, m, L = config.width, config.mlp_dim, config.depth
    ph, pw = as_pair("ViTConfig", "patch_size", config.patch_size)
    stem, in_chs = _stem_flops(config, size)
    feats = config.representation_size or d
    # relative positions: (queries x hd) @ (hd x E) per head for the patch queries, E offsets
    offsets = math.prod(relative_table_shape((gh, gw), config.relative_dims)) if config.relative_dims else 0
    parts = dict.fromkeys(("qkv", "attention", "relative", "proj", "mlp", "merge"), 0)
    class_only = first_token and config.classifier in FIRST_TOKEN and not config.grad_checkpointing
    for i in range(L):
        q = 1 if class_only and i == L - 1 else t  # queries, and so projection and MLP rows; keys: all t
        # pairs merged after attention: r, capped at half the unprotected tokens (accel.tome.merged_away)
        r = max(0, min(token_merge, (t - 1) // 2)) if q == t else 0
        parts["qkv"] += 2 * (q + 2 * t) * d * d
        parts["attention"] += 2 * 2 * q * t * d  # (q x hd) @ (hd x t) and (q x t) @ (t x hd), summed over heads
        parts["relative"] += 2 * max(q - prefix, 0) * offsets * d  # a 'first' model's one query is a patch
        parts["proj"] += 2 * q * d * d
        parts["merge"] += 2 * ((t + 1) // 2) * (t // 2) * (d // config.num_heads) if r else 0  # key similarities
        t = q - r
        parts["mlp"] += 2 * 2 * t * d * m
    parts.update(
        stem=stem,
        patch_embed=2 * n * in_chs * ph * pw * d,
        pre_logits=2 * d * config.representation_size if config.representation_size else 0,
        head=2 * feats * config.num_classes,
    )
    parts["total"] = sum(parts.values())
    return parts


def _stem_flops(config: ViTConfig, size: tuple[int, int]) -> tuple[int, int]:
    """(a hybrid's ResNet stem FLOPs per image, the channels it gives the patch embedding); (0, in_chans) if none."""
    if config.resnet_layers is None:
        return 0, config.in_chans
    with torch.device("meta"):
        backbone = ResNetBackbone(config.resnet_layers, config.resnet_width, config.in_chans)
    return layer_flops(backbone, (1, config.in_chans, *size)), backbone.out_chs


def layer_flops(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Conv and Linear FLOPs of one forward, read from the layer shapes on the meta device (no compute)."""
    total = 0

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            total += 2 * out.numel() * k
        elif isinstance(module, nn.Linear):
            total += 2 * out.numel() * module.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model.to("meta")(torch.empty(input_shape, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return total // input_shape[0]


def model_flops(model: nn.Module, img_size: int, first_token: bool = False, token_merge: int = 0) -> int:
    """Forward FLOPs per image: analytic for a ViT (``first_token`` and ``token_merge`` as in vit_flops), from
    layer shapes for other models (BiT ResNets)."""
    config = model.config
    if isinstance(config, ViTConfig):
        return vit_flops(config, img_size, first_token, token_merge)["total"]
    assert isinstance(config, (ResNetConfig, BiTConfig)), f"no FLOP count for a {type(model).__name__}"
    with torch.device("meta"):
        twin = model_from_config(config.to_dict())
    return layer_flops(twin, (1, getattr(config, "in_chans", 3), img_size, img_size))


def training_flops(model: nn.Module, img_size: int, images: int) -> float:
    """Training compute: 3 x the forward FLOPs an image (the forward and a backward of twice its cost) x the images
    trained on (batch x steps)."""
    return 3.0 * model_flops(model, img_size) * images
