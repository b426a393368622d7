"""Google's official checkpoints (.npz of flat '/'-joined Flax names) <-> vitkit state dicts.

Layouts: Flax Dense kernels are (in, out) and torch Linear weights (out, in); Flax convs are HWIO and torch
convs OIHW; attention q/k/v kernels are (D, heads, head_dim) and are fused here into one (3D, D) qkv weight;
the attention output kernel is (heads, head_dim, D). Handles the released (pre-Linen) block names
(LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3), current Flax / big_vision names
(LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0), 'opt/target/' and 'params/'
prefixes, GroupNorm parameters stored (1, 1, 1, C), big_vision's top-level pos_embedding without a class row,
and "scanned" files that stack every block under Transformer/encoderblock/ with a leading depth axis.

big_vision's own loader (models/vit.py ``load`` / ``fix_old_checkpoints``, utils.py ``load_params``) accepts more,
and so does this reader: a checkpoint whose model sits under 'params/' (optax) or 'opt/target/' (flax.optim)
beside training state (only that sub-tree is the model); the position embedding under Transformer/posembed_input
or Transformer/pos_embedding; a combined class + grid table (the class row is the class token's position); a MAP
head stored inline (top-level probe) or as MAPHead_0; bfloat16 arrays that numpy stores as 2-byte void; and
image-text checkpoints (SigLIP), whose image tower is a sub-tree ('img/...'): chosen by ``tower=`` (big_vision's
'file.npz:img'), or taken when the file holds exactly one ViT sub-tree.

What a file cannot say the caller supplies (``given``): big_vision's posemb='sincos2d' stores no table, so the
image size (and pos_embed='sincos_2d') must be passed; a file without class token or MAP head pools by the mean
(GAP) unless classifier='first' (big_vision's pool_type '0') is passed.

``infer_official_config`` reads the model's configuration from the names and shapes alone, and
``vitkit_to_official`` writes the inverse: the exact names and shapes of the released (or Linen) files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import UserError
from ..models import ViTConfig
from ..models.common import as_pair
from .base import Checkpoint, model_state, read_npz
from .infer import infer_vit_config_with_guesses

Params = Mapping[str, np.ndarray]
FORMAT = "official"

PREFIXES = ("opt/target/", "params/", "target/", "model/")
# big_vision's load_params: a checkpoint with a "params" tree (optax) or an "opt/target" tree (flax.optim) keeps the
# model there, beside optimizer state and counters that are not part of the model
TRAINING_TREES = ("params/", "opt/target/")

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


def strip_prefix(params: Params) -> dict[str, np.ndarray]:
    """Drop a wrapper prefix such as 'opt/target/' or 'params/' (whatever stands before the model's names).

    As big_vision's load_params: when a 'params/' (else 'opt/target/') tree is there, it is the model and the
    rest (optimizer state) is left out; the other prefixes are dropped when every name has them.
    """
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

    Without ``tower``, a file whose model is not at the top level but in exactly one sub-tree (SigLIP: 'img',
    beside the text tower 'txt' and the scalars 't', 'b') is read from that sub-tree; several are an error
    that names them.
    """
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
    """big_vision's fix_old_checkpoints, on flat names: the position embedding kept in the encoder
    (Transformer/pos_embedding, before 2022) moves to the top level, a top-level table whose rows are a square
    grid + 1 holds the class token's position first (the class row is kept as such when there is a class
    token), and a MAP head stored inline (a top-level probe, ViT-G's development) moves under MAPHead_0."""
    out = dict(params)
    if "Transformer/pos_embedding" in out and "pos_embedding" not in out:
        out["pos_embedding"] = out.pop("Transformer/pos_embedding")
    if "probe" in out and not any(k.startswith("MAPHead_") for k in out):
        inline = ("probe", "MlpBlock_0/", "MultiHeadDotProductAttention_0/", "LayerNorm_0/")
        for k in [k for k in out if k == "probe" or k.startswith(inline[1:])]:
            out[f"MAPHead_0/{k}"] = out.pop(k)
    return out


def has_class_row(rows: int) -> bool:
    """Whether a big_vision top-level pos_embedding of a class-token model holds a class row first (old big_vision
    added the table after prepending the class token): its rows are a square grid + 1, as fix_old_checkpoints
    tells them apart."""
    return rows > 0 and math.isqrt(rows - 1) ** 2 + 1 == rows and math.isqrt(rows) ** 2 != rows


def canonical_block_names(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename each block's sub-modules to ln1, ln2, mha, mlp, whatever their Flax counters were.

    Pre-Linen names share one counter across types (LayerNorm_0, ..._1, LayerNorm_2, MlpBlock_3); Linen names
    count per type (LayerNorm_0, ..._0, LayerNorm_1, MlpBlock_0). Within a block, the LayerNorm with the
    lower index is the one before attention.
    """
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


def _heads_kernel(x: torch.Tensor) -> torch.Tensor:
    """A q/k/v kernel (D, heads, hd) -> torch's (heads * hd, D) weight."""
    return x.reshape(x.shape[0], -1).T


def official_to_vitkit(params: Params, tower: str | None = None) -> dict[str, torch.Tensor]:
    """Official params (any supported naming) -> a vitkit VisionTransformer state dict.

    Keys the mapping does not know are returned under their official names, so the loader reports them.
    """
    p = normalize(params, tower)
    sd: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str, kind: str) -> torch.Tensor:
        used.add(key)
        return flax_to_torch(p[key], kind)

    if "embedding/kernel" in p:
        sd["patch_embed.proj.weight"] = take("embedding/kernel", "conv")
    if "embedding/bias" in p:
        sd["patch_embed.proj.bias"] = take("embedding/bias", "vector")
    if "cls" in p:
        sd["cls_token"] = take("cls", "")
    if "Transformer/posembed_input/pos_embedding" in p:
        sd["pos_embed"] = take("Transformer/posembed_input/pos_embedding", "")
    elif "pos_embedding" in p:  # big_vision: no class row; its class token gets no position embedding
        pe = take("pos_embedding", "")
        if "cls" in p and not has_class_row(p["pos_embedding"].shape[1]):
            pe = torch.cat([torch.zeros_like(pe[:, :1]), pe], dim=1)
        sd["pos_embed"] = pe
    for name, key in (("norm.weight", "encoder_norm/scale"), ("norm.bias", "encoder_norm/bias")):
        if f"Transformer/{key}" in p:
            sd[name] = take(f"Transformer/{key}", "vector")
    for layer in ("pre_logits", "head"):
        if f"{layer}/kernel" in p:
            sd[f"{layer}.weight"] = take(f"{layer}/kernel", "dense")
            sd[f"{layer}.bias"] = take(f"{layer}/bias", "vector")

    depth = 1 + max((int(m.group(1)) for k in p if (m := re.match(r"Transformer/encoderblock_(\d+)/", k))), default=-1)
    for i in range(depth):
        src, dst = f"Transformer/encoderblock_{i}", f"blocks.{i}"
        for ours, (theirs, kind) in BLOCK_MAP.items():
            if f"{src}/{theirs}" in p:
                sd[f"{dst}.{ours}"] = take(f"{src}/{theirs}", kind)
        qkv = [f"{src}/mha/{n}/kernel" for n in ("query", "key", "value")]
        if all(k in p for k in qkv):
            # each (D, heads, hd) -> (D, D) -> transposed to (out, in); stacked along out
            sd[f"{dst}.attn.qkv.weight"] = torch.cat([take(k, "").reshape(take(k, "").shape[0], -1).T for k in qkv])
            sd[f"{dst}.attn.qkv.bias"] = torch.cat([take(k.replace("/kernel", "/bias"), "vector") for k in qkv])

    # big_vision's MAP head: the probe and its attention (q from the probe, k and v from the tokens), LN, MLP
    head, pool = "MAPHead_0", "attn_pool"
    if f"{head}/probe" in p:
        sd[f"{pool}.latent"] = take(f"{head}/probe", "")
    mha = f"{head}/mha"
    if f"{mha}/query/kernel" in p:
        sd[f"{pool}.q.weight"] = _heads_kernel(take(f"{mha}/query/kernel", ""))
        sd[f"{pool}.q.bias"] = take(f"{mha}/query/bias", "vector")
    kv = [f"{mha}/{n}/kernel" for n in ("key", "value")]
    if all(k in p for k in kv):
        sd[f"{pool}.kv.weight"] = torch.cat([_heads_kernel(take(k, "")) for k in kv])
        sd[f"{pool}.kv.bias"] = torch.cat([take(k.replace("/kernel", "/bias"), "vector") for k in kv])
    for ours, (theirs, kind) in {
        "proj.weight": ("mha/out/kernel", "attn_out"),
        "proj.bias": ("mha/out/bias", "vector"),
        "norm.weight": ("ln/scale", "vector"),
        "norm.bias": ("ln/bias", "vector"),
        "mlp.fc1.weight": ("mlp/Dense_0/kernel", "dense"),
        "mlp.fc1.bias": ("mlp/Dense_0/bias", "vector"),
        "mlp.fc2.weight": ("mlp/Dense_1/kernel", "dense"),
        "mlp.fc2.bias": ("mlp/Dense_1/bias", "vector"),
    }.items():
        if f"{head}/{theirs}" in p:
            sd[f"{pool}.{ours}"] = take(f"{head}/{theirs}", kind)

    # hybrid stem
    if "conv_root/kernel" in p:
        stem = "patch_embed.backbone"
        sd[f"{stem}.stem.conv.weight"] = take("conv_root/kernel", "conv")
        sd[f"{stem}.stem.norm.weight"] = take("gn_root/scale", "vector")
        sd[f"{stem}.stem.norm.bias"] = take("gn_root/bias", "vector")
        for k in p:
            m = re.match(r"block(\d+)/unit(\d+)/", k)
            if not m:
                continue
            s, u = int(m.group(1)) - 1, int(m.group(2)) - 1
            for ours, theirs in RESNET_UNIT_MAP.items():
                key = f"block{s + 1}/unit{u + 1}/{theirs}"
                if key == k:
                    kind = "conv" if theirs.endswith("kernel") else "vector"
                    sd[f"{stem}.stages.{s}.blocks.{u}.{ours}"] = take(key, kind)
    for k in p:
        if k not in used:
            sd[k] = torch.from_numpy(np.asarray(p[k]))
    return sd


# --------------------------------------------------------------------------------------- config inference
class OfficialRead(NamedTuple):
    """An official checkpoint read: config, state, the fields the caller supplied (field -> why the file cannot
    say it) and what the file says of itself (``tower``: the sub-tree the model was read from)."""

    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    from_caller: dict[str, str]
    metadata: dict[str, Any]


# position embeddings a file without a learned table can have been trained with
_TABLELESS = ("sincos_2d", "none")


def read_official(
    params: Params, given: Mapping[str, Any] | None = None, tower: str | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(ViTConfig fields plus arch='vit', vitkit state dict) of an official checkpoint; see read_official_checkpoint."""
    read = read_official_checkpoint(params, given, tower)
    return read.config, read.state


def read_official_checkpoint(
    params: Params, given: Mapping[str, Any] | None = None, tower: str | None = None
) -> OfficialRead:
    """An official checkpoint's config and vitkit state dict, from names and shapes and what the caller gives.

    Heads come from the query kernel (D, heads, hd); the rest is read from the renamed weights by
    ``infer.infer_vit_config_with_guesses``, as for every format without a config; GELU is the official tanh.
    ``given`` (the caller's config fields) settles what the file cannot say: without a learned position table
    (big_vision's posemb='sincos2d') the token grid comes from ``img_size`` and the table from ``pos_embed``
    (both required); without a class token or MAP head, ``classifier`` tells GAP from 'first' (pool_type '0').
    Those fields are returned in ``from_caller``. ``tower`` selects an image tower (see select_tower). Unknown
    structures (no patch embedding) are errors rather than guesses.
    """
    given = dict(given or {})
    params, chosen = select_tower(recover_bfloat16(strip_prefix(params)), tower)  # the model's sub-tree
    p = normalize(params)
    required = ("embedding/kernel", "Transformer/encoder_norm/scale", "Transformer/encoderblock_0/mha/query/kernel")
    absent = [k for k in required if k not in p]
    if absent:
        raise UserError(
            f"official checkpoint: missing {absent}; not a ViT in the vit_jax / big_vision layout "
            f"(first keys: {sorted(p)[:5]})"
        )
    width = p["embedding/kernel"].shape[-1]  # HWIO
    width_q, heads, head_dim = p["Transformer/encoderblock_0/mha/query/kernel"].shape  # (D, heads, hd)
    if width_q != width or heads * head_dim != width:
        raise UserError(
            f"official checkpoint: query kernel {(width_q, heads, head_dim)} does not match the width {width}"
        )
    state = official_to_vitkit(params)
    source, from_caller = "official checkpoint", {}
    img_size = pos_embed = None
    if "pos_embed" not in state:  # big_vision's posemb='sincos2d' (or none): the file has no grid to read
        absent = [f for f in ("img_size", "pos_embed") if f not in given]
        if absent or given["pos_embed"] not in _TABLELESS:
            raise UserError(
                f"{source}: no learned position embedding (big_vision's posemb='sincos2d' stores none), so the file "
                "does not say the image size: pass img_size=... and pos_embed='sincos_2d' (or pos_embed='none' for a "
                "model trained without position embedding)"
            )
        img_size, pos_embed = given["img_size"], given["pos_embed"]
        from_caller["img_size"] = "img_size: a file without a learned position table does not say the token grid"
        from_caller["pos_embed"] = "pos_embed: a file without a learned position table does not say which it used"
    if "cls_token" not in state and "attn_pool.latent" not in state and "classifier" in given:
        from_caller["classifier"] = "classifier: a file without class token or MAP head pools by mean or first token"
    if img_size is not None:
        img_size = as_pair("ViTConfig", "img_size", img_size)
    config, _ = infer_vit_config_with_guesses(
        state, source, gelu="tanh", num_heads=int(heads), img_size=img_size, pos_embed=pos_embed
    )
    return OfficialRead(config, state, from_caller, {} if chosen is None else {"tower": chosen})


def detect(path: str | Path) -> bool:
    """An .npz file (the BiT ones, named resnet/..., are big_transfer's: asked first)."""
    path = Path(path)
    return path.is_file() and path.suffix == ".npz"


def read(path: Path, overrides: dict[str, Any] | None = None, tower: str | None = None) -> Checkpoint:
    """An official .npz: config from names and shapes, ``overrides`` for what the file does not say (see
    read_official_checkpoint), ``tower`` for an image-text checkpoint's image tower."""
    got = read_official_checkpoint(read_npz(path), overrides, tower)
    return Checkpoint(path, FORMAT, got.config, got.state, got.metadata, got.from_caller)


def infer_official_config(params: Params) -> dict[str, Any]:
    """ViTConfig fields (plus arch='vit') read from an official checkpoint's names and shapes alone."""
    return read_official(params)[0]


# ------------------------------------------------------------------------------------------ vitkit -> official
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


def check_exportable(model: torch.nn.Module) -> ViTConfig:
    """The model's config if an official .npz can hold it, so that reading the file back (names and shapes
    alone, tanh GELU and LayerNorm eps 1e-6 as the official code computes) gives the same model; else a one-line
    UserError naming the field and value the file cannot carry."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ViTConfig):
        raise UserError(f"only VisionTransformer models have an official layout, not {type(model).__name__}")
    (h, w), (ph, pw) = cfg.img_size, cfg.patch_size  # pairs: ViTConfig normalises them
    why = {
        "pos_embed": (cfg.pos_embed, "learned", "the file of any other table does not say its grid or kind"),
        "pos_embed_where": (cfg.pos_embed_where, "input", "the official layout has one table at the input"),
        "gelu": (cfg.gelu, "tanh", "the official code computes tanh GELU and the file cannot say another"),
        "ln_eps": (cfg.ln_eps, 1e-6, "the official code's LayerNorm eps is 1e-6 and the file cannot say another"),
        "dynamic_img_size": (cfg.dynamic_img_size, False, "the file cannot say it"),
        "token_merge": (cfg.token_merge, 0, "the file cannot say it; the same weights export with token_merge=0"),
    }
    for name, (value, held, reason) in why.items():
        if value != held:
            raise UserError(f"official export: {name}={value!r}; an .npz holds {held!r} only ({reason})")
    if cfg.classifier == "first":
        raise UserError(
            "official export: classifier='first'; an .npz without class token or MAP head reads back as 'gap'"
        )
    if h != w or ph != pw:
        raise UserError(
            f"official export: img_size={cfg.img_size}, patch_size={cfg.patch_size}; an .npz holds a square "
            "token grid only (its size is read from the position table's length)"
        )
    return cfg


def torch_to_flax(t: torch.Tensor, kind: str) -> np.ndarray:
    """The inverse of flax_to_torch for 'dense' (out, in) -> (in, out) and 'conv' OIHW -> HWIO."""
    t = t.detach().cpu().float()
    if kind == "dense":
        t = t.T
    elif kind == "conv":
        t = t.permute(2, 3, 1, 0)
    return np.ascontiguousarray(t.numpy())


def vitkit_to_official(model: torch.nn.Module, naming: str = "released", prefix: str = "") -> dict[str, np.ndarray]:
    """A vitkit VisionTransformer -> official params with the names and shapes of the vit_jax checkpoints.

    naming="released" uses the published files' block names (LayerNorm_0, MultiHeadDotProductAttention_1,
    LayerNorm_2, MlpBlock_3), "linen" the current Flax ones (_0, _0, _1, _0). prefix is prepended to every
    name (e.g. 'opt/target/' as in the oldest releases). GAP models have no 'cls'; the position embedding keeps
    the class row first when there is a class token. A MAP head is written as big_vision's MAPHead_0; a sincos_2d
    model, as big_vision stores one, has no position table (reading it back takes img_size and pos_embed).
    """
    if naming not in BLOCK_NAMINGS:
        raise UserError(f"naming={naming!r}: expected one of {sorted(BLOCK_NAMINGS)}")
    cfg = getattr(model, "config", None)
    if (
        not isinstance(cfg, ViTConfig)
        or cfg.pos_embed_where != "input"
        or cfg.pos_embed not in ("learned", *_TABLELESS)
    ):
        raise UserError(
            "only VisionTransformer models with learned 1-D or sincos_2d position embeddings (or none) at the input "
            "have an official layout"
        )
    names = BLOCK_NAMINGS[naming]
    sd = model_state(model, "vitkit_to_official")
    D, heads = cfg.width, cfg.num_heads
    hd = D // heads
    out: dict[str, np.ndarray] = {
        "embedding/kernel": torch_to_flax(sd["patch_embed.proj.weight"], "conv"),
        "embedding/bias": torch_to_flax(sd["patch_embed.proj.bias"], ""),
        "Transformer/encoder_norm/scale": torch_to_flax(sd["norm.weight"], ""),
        "Transformer/encoder_norm/bias": torch_to_flax(sd["norm.bias"], ""),
    }
    if "pos_embed" in sd:
        out["Transformer/posembed_input/pos_embedding"] = torch_to_flax(sd["pos_embed"], "")
    if "cls_token" in sd:
        out["cls"] = torch_to_flax(sd["cls_token"], "")
    if cfg.classifier == "map":  # big_vision's MAPHead names (Linen-era: the same for either block naming)
        head, pool = "MAPHead_0", "attn_pool"
        out[f"{head}/probe"] = torch_to_flax(sd[f"{pool}.latent"], "")
        mha = f"{head}/MultiHeadDotProductAttention_0"
        k, v = sd[f"{pool}.kv.weight"].chunk(2)
        kb, vb = sd[f"{pool}.kv.bias"].chunk(2)
        for n, wi, bi in (("query", sd[f"{pool}.q.weight"], sd[f"{pool}.q.bias"]), ("key", k, kb), ("value", v, vb)):
            out[f"{mha}/{n}/kernel"] = torch_to_flax(wi, "dense").reshape(D, heads, hd)
            out[f"{mha}/{n}/bias"] = torch_to_flax(bi, "").reshape(heads, hd)
        out[f"{mha}/out/kernel"] = torch_to_flax(sd[f"{pool}.proj.weight"], "dense").reshape(heads, hd, D)
        out[f"{mha}/out/bias"] = torch_to_flax(sd[f"{pool}.proj.bias"], "")
        out[f"{head}/LayerNorm_0/scale"] = torch_to_flax(sd[f"{pool}.norm.weight"], "")
        out[f"{head}/LayerNorm_0/bias"] = torch_to_flax(sd[f"{pool}.norm.bias"], "")
        for j, fc in enumerate(("fc1", "fc2")):
            out[f"{head}/MlpBlock_0/Dense_{j}/kernel"] = torch_to_flax(sd[f"{pool}.mlp.{fc}.weight"], "dense")
            out[f"{head}/MlpBlock_0/Dense_{j}/bias"] = torch_to_flax(sd[f"{pool}.mlp.{fc}.bias"], "")
    for i in range(cfg.depth):
        src, dst = f"blocks.{i}", f"Transformer/encoderblock_{i}"
        for ln in ("ln1", "ln2"):
            ours = f"{src}.norm{ln[-1]}"
            out[f"{dst}/{names[ln]}/scale"] = torch_to_flax(sd[f"{ours}.weight"], "")
            out[f"{dst}/{names[ln]}/bias"] = torch_to_flax(sd[f"{ours}.bias"], "")
        mha = f"{dst}/{names['mha']}"
        w = sd[f"{src}.attn.qkv.weight"].chunk(3)  # (3D, D) -> 3 x (D_out, D_in)
        b = sd[f"{src}.attn.qkv.bias"].chunk(3)
        for n, wi, bi in zip(("query", "key", "value"), w, b):
            out[f"{mha}/{n}/kernel"] = torch_to_flax(wi, "dense").reshape(D, heads, hd)
            out[f"{mha}/{n}/bias"] = torch_to_flax(bi, "").reshape(heads, hd)
        out[f"{mha}/out/kernel"] = torch_to_flax(sd[f"{src}.attn.proj.weight"], "dense").reshape(heads, hd, D)
        out[f"{mha}/out/bias"] = torch_to_flax(sd[f"{src}.attn.proj.bias"], "")
        for j, fc in enumerate(("fc1", "fc2")):
            out[f"{dst}/{names['mlp']}/Dense_{j}/kernel"] = torch_to_flax(sd[f"{src}.mlp.{fc}.weight"], "dense")
            out[f"{dst}/{names['mlp']}/Dense_{j}/bias"] = torch_to_flax(sd[f"{src}.mlp.{fc}.bias"], "")
    for layer in ("pre_logits", "head"):
        if f"{layer}.weight" in sd:
            out[f"{layer}/kernel"] = torch_to_flax(sd[f"{layer}.weight"], "dense")
            out[f"{layer}/bias"] = torch_to_flax(sd[f"{layer}.bias"], "")
    if cfg.resnet_layers is not None:
        stem = "patch_embed.backbone"
        out["conv_root/kernel"] = torch_to_flax(sd[f"{stem}.stem.conv.weight"], "conv")
        out["gn_root/scale"] = torch_to_flax(sd[f"{stem}.stem.norm.weight"], "")
        out["gn_root/bias"] = torch_to_flax(sd[f"{stem}.stem.norm.bias"], "")
        for key, value in sd.items():
            if m := re.match(rf"{re.escape(stem)}\.stages\.(\d+)\.blocks\.(\d+)\.(.*)$", key):
                theirs = RESNET_UNIT_MAP[m.group(3)]
                kind = "conv" if theirs.endswith("kernel") else ""
                out[f"block{int(m.group(1)) + 1}/unit{int(m.group(2)) + 1}/{theirs}"] = torch_to_flax(value, kind)
    return {prefix + k: v for k, v in out.items()}
