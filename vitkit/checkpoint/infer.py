"""The model configuration a ViT state dict implies, read from vitkit-named keys and shapes alone.

Written once for every reader whose file carries no config (official .npz and timm state dicts, both first
renamed to vitkit's keys). What the weights cannot say is the reader's to supply: the head count (official
files keep it in the query kernel's shape; timm files do not have it) and the GELU the weights were trained
with (tanh for the official code, exact erf for timm).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import UserError
from ..models.registry import SIZES
from ..models.resnet import stem_reduction

State = dict[str, torch.Tensor]
_STAGE_UNIT = re.compile(r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.")


def default_heads(width: int) -> int:
    """The registry's head count for this width (Ti 3, S 6, B 12, L 16), else width // 64."""
    for w, _, _, heads in SIZES.values():
        if w == width:
            return heads
    return max(width // 64, 1)


def block_count(state: State) -> int:
    """1 + the highest block index (a missing block in between is left for the strict load to report)."""
    return 1 + max((int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)


def resnet_layers(state: State, source: str) -> tuple[int, ...]:
    """Units per stage of a hybrid stem; () for a root-only stem."""
    units: dict[int, int] = {}
    for k in state:
        if m := _STAGE_UNIT.match(k):
            s, u = int(m.group(1)), int(m.group(2))
            units[s] = max(units.get(s, 0), u + 1)
    if sorted(units) != list(range(len(units))):
        raise UserError(f"{source}: ResNet stages {sorted(units)} are not numbered consecutively from the first")
    return tuple(units[s] for s in sorted(units))


def infer_vit_config(state: State, source: str, gelu: str, num_heads: int | None = None) -> dict[str, Any]:
    """ViTConfig fields (plus arch='vit') for a vitkit-named ViT state dict.

    ``source`` names the file in errors; ``num_heads`` defaults to the registry's row of that width.
    img_size is the position embedding's (square) grid times the pixels per token.
    """
    required = ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight")
    absent = [k for k in required if k not in state]
    if absent:
        raise UserError(f"{source}: no {', '.join(absent)}; not a ViT (first keys: {sorted(state)[:5]})")
    width, in_chs, ph, pw = state["patch_embed.proj.weight"].shape
    cfg: dict[str, Any] = dict(
        arch="vit",
        patch_size=(ph, pw),
        in_chans=in_chs,
        width=width,
        depth=block_count(state),
        num_heads=num_heads or default_heads(width),
        mlp_dim=state["blocks.0.mlp.fc1.weight"].shape[0],
        classifier="token" if "cls_token" in state else "gap",
        representation_size=state["pre_logits.weight"].shape[0] if "pre_logits.weight" in state else None,
        num_classes=state["head.weight"].shape[0] if "head.weight" in state else 0,
        resnet_layers=None,
        ln_eps=1e-6,
        gelu=gelu,
    )
    reduction = 1
    root = state.get("patch_embed.backbone.stem.conv.weight")  # (64 * width_factor, C, 7, 7)
    if root is not None:
        cfg["resnet_layers"] = resnet_layers(state, source)
        factor = root.shape[0] / 64
        cfg["resnet_width"] = int(factor) if factor == int(factor) else factor
        cfg["in_chans"] = root.shape[1]
        reduction = stem_reduction(cfg["resnet_layers"])
    if "pos_embed" not in state:
        raise UserError(f"{source}: no learned position embedding; cannot infer the token grid")
    rows = state["pos_embed"].shape[1] - (1 if "cls_token" in state else 0)
    side = int(round(rows**0.5))
    if side * side != rows:
        raise UserError(
            f"{source}: the position embedding has {rows} grid rows, not a square grid; cannot infer the image size"
        )
    cfg["img_size"] = (side * ph * reduction, side * pw * reduction)
    return cfg
