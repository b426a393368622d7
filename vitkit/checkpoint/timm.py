"""timm VisionTransformer state dicts <-> vitkit.

vitkit's parameter names are timm's (cls_token, pos_embed, patch_embed.proj, blocks.i.{norm1, attn.qkv,
attn.proj, norm2, mlp.fc1, mlp.fc2}, norm, head; hybrids under patch_embed.backbone.* as timm's ResNetV2), so
conversion is mostly unwrapping: a 'state_dict' / 'model' wrapper, a 'module.' prefix (DataParallel / DDP),
and the pre-logits layer that older timm called pre_logits.fc.

A timm file carries no config. Shapes give width, depth, patch, grid, MLP width, classes and the hybrid
stages; the head count is not in the weights and defaults to the registry's row with that width. timm
computes exact (erf) GELU, so files read here default to gelu="exact"; pass gelu="tanh" for weights converted
from the official code when you want its numerics rather than timm's.

timm's own GAP models normalise after pooling (fc_norm); vitkit, like the official code, normalises the
tokens before pooling. Those two are different functions, so a file with fc_norm weights is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .infer import infer_vit_config
from .native import load_tensor_file

SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".ckpt")


def read_timm(path: str | Path) -> dict[str, torch.Tensor]:
    """A timm state dict from .safetensors or a torch file (loaded with weights_only=True: no pickled code)."""
    return load_tensor_file(path)


def timm_to_vitkit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm ViT state dict -> vitkit state dict (a renaming; unknown keys pass through to be reported)."""
    if any(k.startswith("module.") for k in state) and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    if "fc_norm.weight" in state:
        raise UserError(
            "timm checkpoint has fc_norm (LayerNorm after global average pooling); vitkit's GAP normalises the "
            "tokens before pooling as the official code does, so these weights would compute another function"
        )
    return {re.sub(r"^pre_logits\.fc\.", "pre_logits.", k): v for k, v in state.items()}


def infer_timm_config(state: dict[str, torch.Tensor], num_heads: int | None = None) -> dict[str, Any]:
    """ViTConfig fields from a (vitkit-named) timm state dict; heads from num_heads or the registry; exact GELU."""
    return infer_vit_config(state, "timm checkpoint", gelu="exact", num_heads=num_heads)


def vitkit_to_timm(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict timm's VisionTransformer loads; build it with ``timm_kwargs(model)`` to match numerics.

    A pre-logits layer is written as pre_logits.fc.* (timm < 0.9's representation_size layout).
    """
    cfg = model.config
    if getattr(cfg, "arch", None) != "vit" or cfg.pos_embed != "learned":
        raise UserError("only VisionTransformer models with learned 1-D position embeddings have a timm layout")
    return {
        re.sub(r"^pre_logits\.", "pre_logits.fc.", k): v.detach().clone().contiguous()
        for k, v in model.state_dict().items()
    }


def timm_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for timm's VisionTransformer that reproduce this model's numerics.

    act_layer 'gelu_tanh' (official) or 'gelu'; LayerNorm eps 1e-6 is timm's ViT default (other eps values
    need norm_layer=partial(nn.LayerNorm, eps=...)); class_token / global_pool 'token' or 'avg' with
    fc_norm=False so GAP pools normalised tokens. Hybrids additionally need timm's ResNetV2 backbone as
    embed_layer (timm's vit_*_r50_* constructors).
    """
    cfg = model.config
    return dict(
        img_size=cfg.img_size,
        patch_size=cfg.patch_size,
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        embed_dim=cfg.width,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        mlp_ratio=cfg.mlp_dim / cfg.width,
        qkv_bias=True,
        class_token=cfg.classifier == "token",
        global_pool="token" if cfg.classifier == "token" else "avg",
        fc_norm=False,
        act_layer="gelu_tanh" if cfg.gelu == "tanh" else "gelu",
    )
