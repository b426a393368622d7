"""Google's official checkpoints (.npz of flat '/'-joined Flax names) <-> vitkit state dicts. The names of every release
(vit_jax, big_vision, SigLIP's image tower) are first brought to one naming and the layouts to torch's
(flax_layouts.py); the q/k/v kernels (D, heads, head_dim) are fused into one (3D, D) qkv weight. The config is read from
names and shapes; what a file cannot say the caller supplies (``given``). ``vitkit_to_official`` writes the inverse: the
exact names and shapes of the released (or Linen) files."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import UserError
from ..models import ViTConfig
from ..models.common import as_pair
from .base import Checkpoint, model_state, read_npz
from .config_from_weights import infer_vit_config_with_guesses
from .flax_layouts import (
    BLOCK_MAP,
    BLOCK_NAMINGS,
    MAP_HEAD_MAP,
    RESNET_UNIT_MAP,
    Params,
    flax_to_torch,
    has_class_row,
    heads_kernel_to_weight,
    normalize,
    recover_bfloat16,
    select_tower,
    strip_prefix,
    torch_to_flax,
)

FORMAT = "official"


def official_to_vitkit(params: Params, tower: str | None = None) -> dict[str, torch.Tensor]:
    """Official params (any supported naming) -> a vitkit state dict; unknown keys keep their official names."""
    p = normalize(params, tower)
    used: set[str] = set()

    def take(key: str, kind: str) -> torch.Tensor:
        used.add(key)
        return flax_to_torch(p[key], kind)

    sd = {**_embeddings_and_heads(p, take), **_blocks(p, take), **_map_head(p, take), **_hybrid_stem(p, take)}
    sd.update({k: torch.from_numpy(np.asarray(v)) for k, v in p.items() if k not in used})
    return sd


Take = Callable[[str, str], torch.Tensor]  # an official name and its layout kind -> the torch tensor (marked used)


def _embeddings_and_heads(p: Params, take: Take) -> dict[str, torch.Tensor]:
    """Patch embedding, class token, position table, final norm, pre-logits and head."""
    sd: dict[str, torch.Tensor] = {}
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
    return sd


def _blocks(p: Params, take: Take) -> dict[str, torch.Tensor]:
    """The encoder blocks; each (D, heads, hd) q/k/v kernel is flattened, transposed and stacked into qkv."""
    sd: dict[str, torch.Tensor] = {}
    depth = 1 + max((int(m.group(1)) for k in p if (m := re.match(r"Transformer/encoderblock_(\d+)/", k))), default=-1)
    for i in range(depth):
        src, dst = f"Transformer/encoderblock_{i}", f"blocks.{i}"
        for ours, (theirs, kind) in BLOCK_MAP.items():
            if f"{src}/{theirs}" in p:
                sd[f"{dst}.{ours}"] = take(f"{src}/{theirs}", kind)
        qkv = [f"{src}/mha/{n}/kernel" for n in ("query", "key", "value")]
        if all(k in p for k in qkv):
            sd[f"{dst}.attn.qkv.weight"] = torch.cat([heads_kernel_to_weight(take(k, "")) for k in qkv])
            sd[f"{dst}.attn.qkv.bias"] = torch.cat([take(k.replace("/kernel", "/bias"), "vector") for k in qkv])
    return sd


def _map_head(p: Params, take: Take) -> dict[str, torch.Tensor]:
    """big_vision's MAP head: the probe and its attention (q from the probe, k and v from the tokens), LN, MLP."""
    sd: dict[str, torch.Tensor] = {}
    head, pool, mha = "MAPHead_0", "attn_pool", "MAPHead_0/mha"
    if f"{head}/probe" in p:
        sd[f"{pool}.latent"] = take(f"{head}/probe", "")
    if f"{mha}/query/kernel" in p:
        sd[f"{pool}.q.weight"] = heads_kernel_to_weight(take(f"{mha}/query/kernel", ""))
        sd[f"{pool}.q.bias"] = take(f"{mha}/query/bias", "vector")
    kv = [f"{mha}/{n}/kernel" for n in ("key", "value")]
    if all(k in p for k in kv):
        sd[f"{pool}.kv.weight"] = torch.cat([heads_kernel_to_weight(take(k, "")) for k in kv])
        sd[f"{pool}.kv.bias"] = torch.cat([take(k.replace("/kernel", "/bias"), "vector") for k in kv])
    for ours, (theirs, kind) in MAP_HEAD_MAP.items():
        if f"{head}/{theirs}" in p:
            sd[f"{pool}.{ours}"] = take(f"{head}/{theirs}", kind)
    return sd


def _hybrid_stem(p: Params, take: Take) -> dict[str, torch.Tensor]:
    """A hybrid's ResNet stem: the root convolution and its GroupNorm, then each stage's units."""
    if "conv_root/kernel" not in p:
        return {}
    stem = "patch_embed.backbone"
    sd = {
        f"{stem}.stem.conv.weight": take("conv_root/kernel", "conv"),
        f"{stem}.stem.norm.weight": take("gn_root/scale", "vector"),
        f"{stem}.stem.norm.bias": take("gn_root/bias", "vector"),
    }
    for k in p:
        m = re.match(r"block(\d+)/unit(\d+)/", k)
        if not m:
            continue
        s, u = int(m.group(1)) - 1, int(m.group(2)) - 1
        for ours, theirs in RESNET_UNIT_MAP.items():
            if f"block{s + 1}/unit{u + 1}/{theirs}" == k:
                kind = "conv" if theirs.endswith("kernel") else "vector"
                sd[f"{stem}.stages.{s}.blocks.{u}.{ours}"] = take(k, kind)
    return sd


# --------------------------------------------------------------------------------------- config inference
class OfficialRead(NamedTuple):
    """An official checkpoint read: config, state, the fields the caller supplied (-> why) and its metadata."""

    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    from_caller: dict[str, str]
    metadata: dict[str, Any]


# position embeddings a file without a learned table can have been trained with
_TABLELESS = ("sincos_2d", "none")


def read_official_checkpoint(
    params: Params, given: Mapping[str, Any] | None = None, tower: str | None = None
) -> OfficialRead:
    """An official checkpoint's config (tanh GELU) and vitkit state dict, from names and shapes; ``given`` says
    what the file cannot (returned in ``from_caller``): without a learned position table (big_vision's sincos2d),
    ``img_size`` and ``pos_embed``; without a class token or MAP head, ``classifier`` ('first', else GAP)."""
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
    """An official .npz, ``overrides`` giving what it does not say (see read_official_checkpoint)."""
    got = read_official_checkpoint(read_npz(path), overrides, tower)
    return Checkpoint(path, FORMAT, got.config, got.state, got.metadata, got.from_caller)


def infer_official_config(params: Params) -> dict[str, Any]:
    """ViTConfig fields (plus arch='vit') read from an official checkpoint's names and shapes alone."""
    return read_official_checkpoint(params).config


# ------------------------------------------------------------------------------------------ vitkit -> official
def check_exportable(model: torch.nn.Module) -> ViTConfig:
    """The model's config if an official .npz can hold it (reads back as the same model); else a UserError."""
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


def vitkit_to_official(model: torch.nn.Module, naming: str = "released", prefix: str = "") -> dict[str, np.ndarray]:
    """A vitkit VisionTransformer -> official params with the names and shapes of the vit_jax checkpoints, block
    names as the published files' ("released") or Linen's (BLOCK_NAMINGS), ``prefix`` before every name."""
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
    sd = model_state(model, "vitkit_to_official")
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
    if cfg.classifier == "map":
        out.update(_map_head_to_official(sd, cfg))
    out.update(_blocks_to_official(sd, cfg, BLOCK_NAMINGS[naming]))
    for layer in ("pre_logits", "head"):
        if f"{layer}.weight" in sd:
            out[f"{layer}/kernel"] = torch_to_flax(sd[f"{layer}.weight"], "dense")
            out[f"{layer}/bias"] = torch_to_flax(sd[f"{layer}.bias"], "")
    if cfg.resnet_layers is not None:
        out.update(_stem_to_official(sd))
    return {prefix + k: v for k, v in out.items()}


def _attention_to_official(
    mha: str, q: Sequence[torch.Tensor], proj: tuple[torch.Tensor, torch.Tensor], cfg: ViTConfig
) -> dict[str, np.ndarray]:
    """Flax's attention under ``mha``: the query / key / value (weight, bias) pairs in ``q`` as (D, heads, hd)
    kernels and (heads, hd) biases, the output projection ``proj`` as a (heads, hd, D) kernel."""
    D, heads = cfg.width, cfg.num_heads
    hd = D // heads
    out: dict[str, np.ndarray] = {}
    for n, (wi, bi) in zip(("query", "key", "value"), zip(q[0::2], q[1::2])):
        out[f"{mha}/{n}/kernel"] = torch_to_flax(wi, "dense").reshape(D, heads, hd)
        out[f"{mha}/{n}/bias"] = torch_to_flax(bi, "").reshape(heads, hd)
    out[f"{mha}/out/kernel"] = torch_to_flax(proj[0], "dense").reshape(heads, hd, D)
    out[f"{mha}/out/bias"] = torch_to_flax(proj[1], "")
    return out


def _map_head_to_official(sd: dict[str, torch.Tensor], cfg: ViTConfig) -> dict[str, np.ndarray]:
    """big_vision's MAPHead names (Linen-era: the same for either block naming)."""
    head, pool = "MAPHead_0", "attn_pool"
    (k, v), (kb, vb) = sd[f"{pool}.kv.weight"].chunk(2), sd[f"{pool}.kv.bias"].chunk(2)
    qkv = (sd[f"{pool}.q.weight"], sd[f"{pool}.q.bias"], k, kb, v, vb)
    proj = (sd[f"{pool}.proj.weight"], sd[f"{pool}.proj.bias"])
    out = {
        f"{head}/probe": torch_to_flax(sd[f"{pool}.latent"], ""),
        **_attention_to_official(f"{head}/MultiHeadDotProductAttention_0", qkv, proj, cfg),
        f"{head}/LayerNorm_0/scale": torch_to_flax(sd[f"{pool}.norm.weight"], ""),
        f"{head}/LayerNorm_0/bias": torch_to_flax(sd[f"{pool}.norm.bias"], ""),
    }
    for j, fc in enumerate(("fc1", "fc2")):
        out[f"{head}/MlpBlock_0/Dense_{j}/kernel"] = torch_to_flax(sd[f"{pool}.mlp.{fc}.weight"], "dense")
        out[f"{head}/MlpBlock_0/Dense_{j}/bias"] = torch_to_flax(sd[f"{pool}.mlp.{fc}.bias"], "")
    return out


def _blocks_to_official(sd: dict[str, torch.Tensor], cfg: ViTConfig, names: dict[str, str]) -> dict[str, np.ndarray]:
    """The encoder blocks under Transformer/encoderblock_i, their sub-modules named as ``names`` says."""
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.depth):
        src, dst = f"blocks.{i}", f"Transformer/encoderblock_{i}"
        for ln in ("ln1", "ln2"):
            out[f"{dst}/{names[ln]}/scale"] = torch_to_flax(sd[f"{src}.norm{ln[-1]}.weight"], "")
            out[f"{dst}/{names[ln]}/bias"] = torch_to_flax(sd[f"{src}.norm{ln[-1]}.bias"], "")
        w, b = sd[f"{src}.attn.qkv.weight"].chunk(3), sd[f"{src}.attn.qkv.bias"].chunk(3)  # 3 x (D_out, D_in)
        qkv = (w[0], b[0], w[1], b[1], w[2], b[2])
        proj = (sd[f"{src}.attn.proj.weight"], sd[f"{src}.attn.proj.bias"])
        out.update(_attention_to_official(f"{dst}/{names['mha']}", qkv, proj, cfg))
        for j, fc in enumerate(("fc1", "fc2")):
            out[f"{dst}/{names['mlp']}/Dense_{j}/kernel"] = torch_to_flax(sd[f"{src}.mlp.{fc}.weight"], "dense")
            out[f"{dst}/{names['mlp']}/Dense_{j}/bias"] = torch_to_flax(sd[f"{src}.mlp.{fc}.bias"], "")
    return out


def _stem_to_official(sd: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A hybrid's ResNet stem: conv_root, gn_root and block{s}/unit{u}/... (1-based, as the released files)."""
    stem = "patch_embed.backbone"
    out = {
        "conv_root/kernel": torch_to_flax(sd[f"{stem}.stem.conv.weight"], "conv"),
        "gn_root/scale": torch_to_flax(sd[f"{stem}.stem.norm.weight"], ""),
        "gn_root/bias": torch_to_flax(sd[f"{stem}.stem.norm.bias"], ""),
    }
    for key, value in sd.items():
        if m := re.match(rf"{re.escape(stem)}\.stages\.(\d+)\.blocks\.(\d+)\.(.*)$", key):
            theirs = RESNET_UNIT_MAP[m.group(3)]
            kind = "conv" if theirs.endswith("kernel") else ""
            out[f"block{int(m.group(1)) + 1}/unit{int(m.group(2)) + 1}/{theirs}"] = torch_to_flax(value, kind)
    return out
