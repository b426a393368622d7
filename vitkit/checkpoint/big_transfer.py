"""Big Transfer (BiT) ResNet-v2 checkpoints -> vitkit: the released .npz files and timm's resnetv2_*_bit state dicts.
The released files hold flat TF names under 'resnet/', as bit_pytorch's ``ResNetV2.load_from`` reads them
(block{s}/unit{uu}/..., counted from 1; a 1x1 conv head); timm's carry vitkit's names but for that head. Keys without a
name pass through, for the strict load to report."""

from __future__ import annotations

import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .base import Checkpoint, read_npz
from .config_from_weights import resnet_layers
from .flax_layouts import flax_to_torch

FORMAT = "big_transfer"
PREFIX = "resnet/"
# released sub-names of one unit -> vitkit's, with the layout change: conv HWIO -> OIHW, GN (C,) or (1,1,1,C) -> (C,)
UNIT_MAP = {
    "a/group_norm/gamma": ("norm1.weight", "vector"),
    "a/group_norm/beta": ("norm1.bias", "vector"),
    "a/standardized_conv2d/kernel": ("conv1.weight", "conv"),
    "b/group_norm/gamma": ("norm2.weight", "vector"),
    "b/group_norm/beta": ("norm2.bias", "vector"),
    "b/standardized_conv2d/kernel": ("conv2.weight", "conv"),
    "c/group_norm/gamma": ("norm3.weight", "vector"),
    "c/group_norm/beta": ("norm3.bias", "vector"),
    "c/standardized_conv2d/kernel": ("conv3.weight", "conv"),
    "a/proj/standardized_conv2d/kernel": ("downsample.conv.weight", "conv"),
}
TOP_MAP = {
    "root_block/standardized_conv2d/kernel": ("stem.conv.weight", "conv"),
    "group_norm/gamma": ("norm.weight", "vector"),
    "group_norm/beta": ("norm.bias", "vector"),
    "head/conv2d/kernel": ("head.weight", "head"),
    "head/conv2d/bias": ("head.bias", "vector"),
}
_UNIT = re.compile(r"block(\d+)/unit(\d+)/(.+)$")


def is_big_transfer_npz(path: str | Path) -> bool:
    """An .npz whose arrays are named 'resnet/...', from its member names alone (no array is read)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.startswith(PREFIX) and n.endswith(".npy") for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False  # not a zip: the .npz reader says what is wrong with it


def detect(path: str | Path) -> bool:
    """A BiT .npz (google-research/big_transfer): arrays named resnet/..."""
    path = Path(path)
    return path.is_file() and path.suffix == ".npz" and is_big_transfer_npz(path)


def read(path: Path, overrides: dict[str, Any] | None = None, tower: str | None = None) -> Checkpoint:
    """A released BiT .npz: config from names and shapes."""
    state = big_transfer_to_vitkit(read_npz(path))
    return Checkpoint(path, FORMAT, infer_bit_config(state, str(path)), state)


def big_transfer_to_vitkit(params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Released big_transfer arrays -> vitkit state dict (a renaming plus the layout changes in UNIT_MAP / TOP_MAP)."""
    state: dict[str, torch.Tensor] = {}
    for key, value in params.items():
        name = key.removeprefix(PREFIX) if key.startswith(PREFIX) else None
        target = None
        if name in TOP_MAP:
            target = TOP_MAP[name]
        elif name is not None and (m := _UNIT.match(name)) and m.group(3) in UNIT_MAP:
            vit_name, kind = UNIT_MAP[m.group(3)]
            target = (f"stages.{int(m.group(1)) - 1}.blocks.{int(m.group(2)) - 1}.{vit_name}", kind)
        if target is None:  # not a BiT weight: kept under its own name, so the strict load lists it
            state[key] = torch.from_numpy(np.array(value))
            continue
        vit_name, kind = target
        if kind == "head":  # a 1x1 conv on the pooled features: (1, 1, C, K) -> Linear (K, C)
            value = np.asarray(value).reshape(value.shape[-2], value.shape[-1])
            kind = "dense"
        state[vit_name] = flax_to_torch(value, kind)
    return state


def timm_resnetv2_to_vitkit(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm resnetv2_*_bit state dict -> vitkit: the head's 1x1 conv (K, C, 1, 1) becomes a Linear (K, C)."""
    out = {}
    for k, v in state.items():
        if k == "head.fc.weight":
            out["head.weight"] = v.reshape(v.shape[0], v.shape[1])
        elif k == "head.fc.bias":
            out["head.bias"] = v
        else:
            out[k] = v
    return out


def is_timm_resnetv2(state: Mapping[str, torch.Tensor]) -> bool:
    """A timm ResNetV2 state dict (bare, or under DataParallel's 'module.'): its first unit's pre-activation GN."""
    return any(k.removeprefix("module.") == "stages.0.blocks.0.norm1.weight" for k in state)


def infer_bit_config(state: Mapping[str, torch.Tensor], source: str) -> dict[str, Any]:
    """BiTConfig fields (plus arch='bit') from a vitkit-named BiT state dict's names and shapes."""
    stem = state.get("stem.conv.weight")
    if stem is None or stem.ndim != 4:
        raise UserError(f"{source}: no BiT root conv (stem.conv.weight / resnet/root_block/standardized_conv2d)")
    layers = resnet_layers(state, source, prefix="", what="BiT")
    if not layers:
        raise UserError(f"{source}: BiT stages [] are not numbered consecutively from the first")
    width = stem.shape[0]  # (64w, Cin, 7, 7)
    head = state.get("head.weight")
    return dict(
        arch="bit",
        layers=layers,
        width_factor=width // 64 if width % 64 == 0 else width / 64,
        num_classes=0 if head is None else int(head.shape[0]),
        in_chans=int(stem.shape[1]),
    )


def read_timm_resnetv2(
    raw: Mapping[str, torch.Tensor], hub: dict[str, Any] | None = None, source: str = "timm checkpoint"
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(BiTConfig fields, vitkit state dict) of a timm resnetv2_*_bit state dict; other ResNetV2s are refused."""
    if raw and all(k.startswith("module.") for k in raw):
        raw = {k.removeprefix("module."): v for k, v in raw.items()}
    arch = str((hub or {}).get("architecture", "")).split(".")[0]
    if arch and not arch.endswith("_bit"):
        raise UserError(
            f"{source}: timm architecture {arch!r} is a ResNetV2 but not BiT's (resnetv2_*_bit); vitkit reads only "
            "BiT's root, padding and normalisation"
        )
    if any(k.endswith(".running_mean") for k in raw) or "stem.conv.weight" not in raw:
        raise UserError(
            f"{source}: a timm ResNetV2 without BiT's layout (BatchNorm, or a deep stem); vitkit reads only "
            "resnetv2_*_bit state dicts"
        )
    state = timm_resnetv2_to_vitkit(raw)
    config = infer_bit_config(state, source)
    stated = (hub or {}).get("num_classes")
    if isinstance(stated, int) and stated != config["num_classes"]:
        raise UserError(f"{source}: config.json says num_classes={stated}, the head has {config['num_classes']}")
    return config, state
