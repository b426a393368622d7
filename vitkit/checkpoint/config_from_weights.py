"""The model configuration a ViT state dict implies, read from vitkit-named keys and shapes alone. For every reader
whose file carries no config (official .npz and timm state dicts, renamed to vitkit's keys). The head count and the GELU
are the reader's to supply where its format says them; what none says is guessed here, each guess returned as one line
naming the value, its reason and the override, so that loading says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UserError
from ..models.registry import SIZES
from ..models.resnet import stem_reduction

State = Mapping[str, torch.Tensor]


def default_heads(width: int) -> int:
    """The registry's head count for this width (Ti 3, S 6, B 12, L 16), else width // 64."""
    return _heads_guess(width)[0]


def _heads_guess(width: int) -> tuple[int, str]:
    """(head count, where it comes from) for a width whose weights do not say."""
    for w, _, _, heads in SIZES.values():
        if w == width:
            return heads, f"the registry's head count for width {width}"
    return max(width // 64, 1), f"width {width} // 64, as no registry row has this width"


# what is assumed of a file that does not say which GELU it was trained with: torch's and timm's default
GELU_GUESS = "exact"


def block_count(state: State) -> int:
    """1 + the highest block index (a missing block in between is left for the strict load to report)."""
    return 1 + max((int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)


def resnet_layers(
    state: State, source: str, prefix: str = "patch_embed.backbone.", what: str = "ResNet"
) -> tuple[int, ...]:
    """Units per stage from the names ``{prefix}stages.S.blocks.U.`` (a hybrid stem's by default); () for none."""
    pattern = re.compile(rf"{re.escape(prefix)}stages\.(\d+)\.blocks\.(\d+)\.")
    units: dict[int, int] = {}
    for k in state:
        if m := pattern.match(k):
            s, u = int(m.group(1)), int(m.group(2))
            units[s] = max(units.get(s, 0), u + 1)
    if sorted(units) != list(range(len(units))):
        raise UserError(f"{source}: {what} stages {sorted(units)} are not numbered consecutively from the first")
    return tuple(units[s] for s in sorted(units))


def infer_vit_config_with_guesses(
    state: State,
    source: str,
    gelu: str | None = None,
    num_heads: int | None = None,
    img_size: tuple[int, int] | None = None,
    pos_embed: str | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """(ViTConfig fields plus arch='vit', what was guessed) for a vitkit-named ViT state dict: ``gelu`` and
    ``num_heads`` None are guessed; ``img_size`` (which must give the position table's grid) and ``pos_embed`` are
    needed where the file has no learned table. ``source`` names the file in errors."""
    width = _vit_width(state, source)
    guessed: dict[str, str] = {}
    if num_heads is None:
        num_heads, why = _heads_guess(width)
        guessed["num_heads"] = (
            f"num_heads: {num_heads} ({why}; pass num_heads=... if the weights were trained with another)"
        )
    if gelu is None:
        gelu = GELU_GUESS
        guessed["gelu"] = f"gelu: {gelu} (timm's default; pass gelu=tanh for weights from the official code)"
    cfg = _fields_from_shapes(state, source, num_heads, gelu)
    cfg.update(_image_fields(state, source, cfg, img_size, pos_embed))
    return cfg, guessed


def _vit_width(state: State, source: str) -> int:
    """The width of a ViT state dict; a state dict that is no ViT's is a UserError naming ``source``."""
    required = ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight")
    absent = [k for k in required if k not in state]
    if absent:
        raise UserError(f"{source}: no {', '.join(absent)}; not a ViT (first keys: {sorted(state)[:5]})")
    if "cls_token" in state and "attn_pool.latent" in state:  # big_vision pools by one or the other, never both
        raise UserError(f"{source}: both a class token and a MAP head (classifier='map' has no class token)")
    return int(state["patch_embed.proj.weight"].shape[0])


def _fields_from_shapes(state: State, source: str, num_heads: int, gelu: str) -> dict[str, Any]:
    """The config fields the weights' names and shapes say, a hybrid's ResNet stem included."""
    width, in_chs, ph, pw = state["patch_embed.proj.weight"].shape
    cfg: dict[str, Any] = dict(
        arch="vit",
        patch_size=(ph, pw),
        in_chans=in_chs,
        width=width,
        depth=block_count(state),
        num_heads=num_heads,
        mlp_dim=state["blocks.0.mlp.fc1.weight"].shape[0],
        classifier="token" if "cls_token" in state else "map" if "attn_pool.latent" in state else "gap",
        representation_size=state["pre_logits.weight"].shape[0] if "pre_logits.weight" in state else None,
        num_classes=state["head.weight"].shape[0] if "head.weight" in state else 0,
        resnet_layers=None,
        ln_eps=1e-6,
        gelu=gelu,
    )
    root = state.get("patch_embed.backbone.stem.conv.weight")  # (64 * width_factor, C, 7, 7)
    if root is not None:
        cfg["resnet_layers"] = resnet_layers(state, source)
        factor = root.shape[0] / 64
        cfg["resnet_width"] = int(factor) if factor == int(factor) else factor
        cfg["in_chans"] = root.shape[1]
    return cfg


def _image_fields(
    state: State, source: str, cfg: dict[str, Any], img_size: tuple[int, int] | None, pos_embed: str | None
) -> dict[str, Any]:
    """img_size (and pos_embed): from the position table's grid, checked against what the reader passes."""
    if "pos_embed" not in state:
        if img_size is None or pos_embed is None:
            raise UserError(
                f"{source}: no learned position embedding, so the file does not say the token grid: pass img_size=... "
                "and pos_embed='sincos_2d' (a fixed sin-cos table, as big_vision's posemb='sincos2d') or 'none'"
            )
        return dict(img_size=tuple(img_size), pos_embed=pos_embed)
    (ph, pw), layers = cfg["patch_size"], cfg["resnet_layers"]
    reduction = 1 if layers is None else stem_reduction(layers)
    rows = state["pos_embed"].shape[1] - (1 if "cls_token" in state else 0)
    if img_size is not None:
        h, w = img_size
        grid = (-(-h // reduction) // ph, -(-w // reduction) // pw)  # the stem rounds up, the patch conv down
        if grid[0] * grid[1] != rows:
            raise UserError(
                f"{source}: img_size {h}x{w} gives a {grid[0]}x{grid[1]} token grid, but the position embedding "
                f"has {rows} grid rows"
            )
        return {"img_size": (h, w)}
    side = int(round(rows**0.5))
    if side * side != rows:
        raise UserError(
            f"{source}: the position embedding has {rows} grid rows, not a square grid; cannot infer the image size"
        )
    return {"img_size": (side * ph * reduction, side * pw * reduction)}
