"""How Google's Flax checkpoints lay out a ViT: their namings brought to one (``normalize``) before the official
reader maps them, and each tensor's layout against torch's (``flax_to_torch``). Handled as big_vision's own loader
handles them: pre-Linen and Linen block names, wrapper prefixes and training state, old places of the position
table and the MAP head, bfloat16 stored as 2-byte void, "scanned" blocks, and image towers (SigLIP).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np
import torch

from ..errors import UserError

Params = Mapping[str, np.ndarray]

PREFIXES = ("opt/target/", "params/", "target/", "model/")
TRAINING_TREES = ("params/", "opt/target/")


def strip_prefix(params: Params) -> dict[str, np.ndarray]:
    """Drop a wrapper prefix; as big_vision's load_params, a 'params/' (else 'opt/target/') tree is the model."""
    out = dict(params)
    for tree in TRAINING_TREES:
        if any(k.startswith(tree) for k in out):
            out = {k[len(tree) :]: v for k, v in out.items() if k.startswith(tree)}
            break
    for prefix in PREFIXES:
        if out and all(k.startswith(prefix) for k in out):
            out = {k[len(prefix) :]: v for k, v in out.items()}
    return out


def recover_bfloat16(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """numpy stores bfloat16 as 2-byte void (big_vision's recover_dtype): widen those to float32, exactly."""
    out = {}
    for k, v in params.items():
        if v.dtype.type is np.void and v.dtype.itemsize == 2:
            v = (v.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        out[k] = v
    return out


def towers(params: Mapping[str, np.ndarray]) -> list[str]:
    """The sub-trees that hold a ViT (their own embedding/kernel): ['img'] for a SigLIP checkpoint."""
    return sorted({k[: -len("/embedding/kernel")] for k in params if k.endswith("/embedding/kernel")})


def select_tower(params: dict[str, np.ndarray], tower: str | None) -> tuple[dict[str, np.ndarray], str | None]:
    """(the model's params, the sub-tree they came from or None): big_vision's 'file.npz:img' sub-model selector.
    Without ``tower``, a model in exactly one sub-tree (SigLIP's 'img') is read from it; several are an error."""
    if tower is None:
        if "embedding/kernel" in params:
            return params, None
        found = towers(params)
        if len(found) > 1:
            raise UserError(f"official checkpoint: several ViT sub-trees {found}; pass tower=... to choose one")
        if not found:
            return params, None
        tower = found[0]
    tower = tower.strip("/")
    sub = {k[len(tower) + 1 :]: v for k, v in params.items() if k.startswith(tower + "/")}
    if not sub:
        tops = sorted({k.split("/")[0] for k in params})
        raise UserError(f"official checkpoint: no sub-tree {tower!r}; its top-level names are {tops[:12]}")
    return sub, tower


def fix_old_checkpoints(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """big_vision's fix_old_checkpoints, on flat names: a position table kept in the encoder (before 2022) moves
    to the top level, and a MAP head stored inline (a top-level probe) under MAPHead_0."""
    out = dict(params)
    if "Transformer/pos_embedding" in out and "pos_embedding" not in out:
        out["pos_embedding"] = out.pop("Transformer/pos_embedding")
    if "probe" in out and not any(k.startswith("MAPHead_") for k in out):
        inline = ("probe", "MlpBlock_0/", "MultiHeadDotProductAttention_0/", "LayerNorm_0/")
        for k in [k for k in out if k == "probe" or k.startswith(inline[1:])]:
            out[f"MAPHead_0/{k}"] = out.pop(k)
    return out


def has_class_row(rows: int) -> bool:
    """Whether a class-token model's big_vision pos_embedding holds a class row first: a square grid + 1 rows."""
    return rows > 0 and math.isqrt(rows - 1) ** 2 + 1 == rows and math.isqrt(rows) ** 2 != rows


def canonical_block_names(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename each block's sub-modules to ln1, ln2, mha, mlp, whatever their Flax counters (BLOCK_NAMINGS) were."""
    out: dict[str, np.ndarray] = {}
    ln_pat = re.compile(r"^(Transformer/encoderblock(?:_\d+)?)/LayerNorm_(\d+)/(.*)$")
    ln_indices: dict[str, set[int]] = {}
    for k in params:
        m = ln_pat.match(k)
        if m:
            ln_indices.setdefault(m.group(1), set()).add(int(m.group(2)))
    for k, v in params.items():
        m = ln_pat.match(k)
        if m:
            order = sorted(ln_indices[m.group(1)])
            k = f"{m.group(1)}/ln{order.index(int(m.group(2))) + 1}/{m.group(3)}"
        k = re.sub(r"/MultiHeadDotProductAttention_\d+/", "/mha/", k)
        k = re.sub(r"/MlpBlock_\d+/", "/mlp/", k)
        k = re.sub(r"^MAPHead_0/LayerNorm_\d+/", "MAPHead_0/ln/", k)  # its one LayerNorm, whatever its counter
        out[k] = v
    return out


def unscan(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Split 'scanned' blocks (Transformer/encoderblock/... with a leading depth axis) into encoderblock_i."""
    scanned = {k: v for k, v in params.items() if k.startswith("Transformer/encoderblock/")}
    if not scanned:
        return params
    out = {k: v for k, v in params.items() if k not in scanned}
    depth = next(iter(scanned.values())).shape[0]
    for k, v in scanned.items():
        for i in range(depth):
            out[k.replace("Transformer/encoderblock/", f"Transformer/encoderblock_{i}/")] = v[i]
    return out


def normalize(params: Params, tower: str | None = None) -> dict[str, np.ndarray]:
    """Any supported official layout -> one canonical naming (no prefix, one tower, unscanned, ln1/ln2/mha/mlp)."""
    p, _ = select_tower(recover_bfloat16(strip_prefix(params)), tower)
    return canonical_block_names(unscan(fix_old_checkpoints(p)))


# Tensors whose layout differs between Flax and torch, and how: an explicit list, checked by the round trip.
#   dense   : (in, out) -> (out, in)              conv : (H, W, I, O) -> (O, I, H, W)
#   qkv     : 3 x (D, heads, hd) -> (3D, D)         qkv_bias: 3 x (heads, hd) -> (3D,)
#   attn_out: (heads, hd, D) -> (D, D)              gn   : (1, 1, 1, C) or (C,) -> (C,)
BLOCK_MAP = {
    "norm1.weight": ("ln1/scale", "vector"),
    "norm1.bias": ("ln1/bias", "vector"),
    "norm2.weight": ("ln2/scale", "vector"),
    "norm2.bias": ("ln2/bias", "vector"),
    "attn.proj.weight": ("mha/out/kernel", "attn_out"),
    "attn.proj.bias": ("mha/out/bias", "vector"),
    "mlp.fc1.weight": ("mlp/Dense_0/kernel", "dense"),
    "mlp.fc1.bias": ("mlp/Dense_0/bias", "vector"),
    "mlp.fc2.weight": ("mlp/Dense_1/kernel", "dense"),
    "mlp.fc2.bias": ("mlp/Dense_1/bias", "vector"),
}
RESNET_UNIT_MAP = {
    "conv1.weight": "conv1/kernel",
    "norm1.weight": "gn1/scale",
    "norm1.bias": "gn1/bias",
    "conv2.weight": "conv2/kernel",
    "norm2.weight": "gn2/scale",
    "norm2.bias": "gn2/bias",
    "conv3.weight": "conv3/kernel",
    "norm3.weight": "gn3/scale",
    "norm3.bias": "gn3/bias",
    "downsample.conv.weight": "conv_proj/kernel",
    "downsample.norm.weight": "gn_proj/scale",
    "downsample.norm.bias": "gn_proj/bias",
}
# big_vision's MAP head (under MAPHead_0): vitkit's attn_pool.* beyond the probe and its q / kv projections
MAP_HEAD_MAP = {
    "proj.weight": ("mha/out/kernel", "attn_out"),
    "proj.bias": ("mha/out/bias", "vector"),
    "norm.weight": ("ln/scale", "vector"),
    "norm.bias": ("ln/bias", "vector"),
    "mlp.fc1.weight": ("mlp/Dense_0/kernel", "dense"),
    "mlp.fc1.bias": ("mlp/Dense_0/bias", "vector"),
    "mlp.fc2.weight": ("mlp/Dense_1/kernel", "dense"),
    "mlp.fc2.bias": ("mlp/Dense_1/bias", "vector"),
}


def flax_to_torch(x: np.ndarray, kind: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    if kind == "dense":
        return t.T.contiguous()
    if kind == "conv":
        return t.permute(3, 2, 0, 1).contiguous()
    if kind == "attn_out":  # (heads, hd, D) -> (D_out, D_in)
        return t.reshape(-1, t.shape[-1]).T.contiguous()
    if kind == "vector":
        return t.reshape(-1)
    return t


def heads_kernel_to_weight(x: torch.Tensor) -> torch.Tensor:
    """A q/k/v kernel (D, heads, hd) -> torch's (heads * hd, D) weight."""
    return x.reshape(x.shape[0], -1).T


def torch_to_flax(t: torch.Tensor, kind: str) -> np.ndarray:
    """The inverse of flax_to_torch for 'dense' (out, in) -> (in, out) and 'conv' OIHW -> HWIO."""
    t = t.detach().cpu().float()
    if kind == "dense":
        t = t.T
    elif kind == "conv":
        t = t.permute(2, 3, 1, 0)
    return np.ascontiguousarray(t.numpy())


# Names of each block's sub-modules: the released checkpoints (pre-Linen, one counter across types) and Linen.
BLOCK_NAMINGS = {
    "released": {
        "ln1": "LayerNorm_0",
        "mha": "MultiHeadDotProductAttention_1",
        "ln2": "LayerNorm_2",
        "mlp": "MlpBlock_3",
    },
    "linen": {"ln1": "LayerNorm_0", "mha": "MultiHeadDotProductAttention_0", "ln2": "LayerNorm_1", "mlp": "MlpBlock_0"},
}
