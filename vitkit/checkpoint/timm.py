"""timm VisionTransformer state dicts <-> vitkit. vitkit's parameter names are timm's, so conversion is mostly
unwrapping. A bare timm state dict says no head count nor GELU (both guessed and reported); timm's hub config.json
beside the weights says them, and vitkit writes one with every timm file and reads it when there. A config.json that
contradicts the weights or asks for another function is refused rather than half-followed, as is a file with fc_norm
(timm's GAP normalises after pooling)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config_of import pair, vit_config_of
from ..errors import UserError
from ..io import atomic_write, atomic_write_text
from ..models import ViTConfig
from ..preprocessing import Preprocessing, from_timm_config, read_preprocessing
from . import big_transfer
from .base import Checkpoint, config_path, load_tensor_file, model_state, read_config_json, weights_path
from .config_from_weights import infer_vit_config_with_guesses

FORMAT = "timm"
SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".ckpt")
CONFIG_NAME = "config.json"
# the weights of a hub directory, in the order timm's load_state_dict_from_path prefers them
HUB_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")

# timm's plain ViT constructors vit_{size}_patch{P}_{img} (mlp_ratio 4, class token, exact GELU): their sizes
TIMM_SIZES = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}
TIMM_ARCHS = frozenset(
    f"vit_{size}_patch{patch}_{img}"
    for size, patches in (("tiny", (16,)), ("small", (32, 16)), ("base", (32, 16)), ("large", (32, 16)))
    for patch in patches
    for img in (224, 384)
) | {"vit_small_patch8_224", "vit_base_patch8_224", "vit_large_patch14_224", "vit_huge_patch14_224"}
_ARCH_NAME = re.compile(r"vit_(tiny|small|base|large|huge)_patch(\d+)_(\d+)")
# what a config names when no timm constructor has the model's shape: timm's module of the generic class
GENERIC_ARCH = "vision_transformer"
HYBRID_ARCH = "vision_transformer_hybrid"

TIMM_ACTS = {"gelu": "exact", "gelu_tanh": "tanh"}  # timm's act_layer names -> vitkit gelu
TIMM_EPS = 1e-6  # timm's ViT LayerNorm eps, vitkit's default
# VisionTransformer arguments that only act in training (vitkit's dropout is a training setting too)
_TRAINING_ARGS = frozenset(
    ("drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate")
) | {"weight_init", "fix_init"}
# VisionTransformer arguments at the value that computes what vitkit computes; another value is another model
_NEUTRAL_ARGS: dict[str, Any] = dict(
    qkv_bias=True,
    qk_norm=False,
    scale_attn_norm=False,
    scale_mlp_norm=False,
    proj_bias=True,
    init_values=None,
    pos_embed="learn",
    no_embed_class=False,
    reg_tokens=0,
    pre_norm=False,
    final_norm=True,
    pool_include_prefix=False,
    dynamic_img_pad=False,
    embed_norm_layer=None,
    norm_layer=None,
)


def is_timm_config(doc: dict[str, Any]) -> bool:
    """A config.json as timm's hub writes it: an architecture name and its arguments, no HF model_type."""
    return (
        isinstance(doc.get("architecture"), str)
        and "model_type" not in doc  # Hugging Face transformers
        and "format" not in doc  # vitkit's own
        and any(k in doc for k in ("model_args", "num_classes", "pretrained_cfg"))
    )


def hub_config_path(path: str | Path) -> Path | None:
    """The timm config.json of a hub directory or of a weights file inside one; None when there is none."""
    cfg = config_path(path)
    if not cfg.is_file():
        return None
    try:
        return cfg if is_timm_config(read_config_json(cfg)) else None
    except UserError:
        return None


def detect(path: str | Path) -> bool:
    """A timm hub directory (its config.json names an architecture), or any torch / safetensors weights file."""
    path = Path(path)
    if path.is_dir():
        return hub_config_path(path) is not None
    return path.is_file() and path.suffix in SUFFIXES


def read(path: Path, overrides: dict[str, Any] | None = None, tower: str | None = None) -> Checkpoint:
    """A timm ViT (or BiT ResNetV2) state dict; config and preprocessing from its hub config.json when there is one."""
    hub_path = hub_config_path(path)
    raw = load_tensor_file(weights_path(path, HUB_WEIGHTS, "timm hub"))
    hub = read_config_json(hub_path) if hub_path else None
    source = str(hub_path or path)
    metadata = from_timm_config(hub)
    if big_transfer.is_timm_resnetv2(raw):  # resnetv2_*_bit: a BiT, not a ViT
        config, state = big_transfer.read_timm_resnetv2(raw, hub, source)
        return Checkpoint(path, FORMAT, config, state, metadata)
    state = timm_to_vitkit(raw)
    config, guessed = infer_timm_config(state, hub, source)
    return Checkpoint(path, FORMAT, config, state, metadata, guessed)


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


def infer_timm_config(
    state: dict[str, torch.Tensor], hub: dict[str, Any] | None = None, source: str = "timm checkpoint"
) -> tuple[dict[str, Any], dict[str, str]]:
    """(ViTConfig fields, what was guessed) for a vitkit-named timm state dict and its hub config.json, if any."""
    if hub is None:
        return infer_vit_config_with_guesses(state, "timm checkpoint")
    args = _model_args(hub, source)
    act = args.get("act_layer")
    if act is not None and act not in TIMM_ACTS:
        raise UserError(f"{source}: act_layer={act!r}; vitkit computes {' or '.join(map(repr, TIMM_ACTS))}")
    # a named timm constructor uses timm's default, exact GELU; a generic name leaves it unsaid
    gelu = TIMM_ACTS[act] if act is not None else ("exact" if _arch_args(hub) else None)
    img = args.get("img_size")  # the weights hold the token count only, not the grid's shape nor a border
    img = (img, img) if isinstance(img, int) else None if img is None else tuple(img)
    config, guessed = infer_vit_config_with_guesses(state, source, gelu, args.get("num_heads"), img)
    _check_against_weights(args, config, source)
    config["ln_eps"] = args.get("norm_eps", TIMM_EPS)
    config["dynamic_img_size"] = bool(args.get("dynamic_img_size", False))
    return config, guessed


def _arch_args(hub: dict[str, Any]) -> dict[str, Any]:
    """The arguments a named timm constructor fixes (patch, width, depth, heads, image size); {} for others."""
    name = str(hub.get("architecture", "")).split(".")[0]  # 'vit_base_patch16_224.augreg_in21k': the tag is no arch
    m = _ARCH_NAME.fullmatch(name)
    if name not in TIMM_ARCHS or m is None:
        return {}
    width, depth, heads = TIMM_SIZES[m.group(1)]
    return dict(patch_size=int(m.group(2)), embed_dim=width, depth=depth, num_heads=heads, img_size=int(m.group(3)))


def _model_args(hub: dict[str, Any], source: str) -> dict[str, Any]:
    """The constructor's arguments as timm's create_model would pass them; any vitkit does not compute refused."""
    given = hub.get("model_args") or {}
    if not isinstance(given, dict):
        raise UserError(f"{source}: 'model_args' must be a JSON object, found {type(given).__name__}")
    args = {**_arch_args(hub), **given}
    if "num_classes" not in args and isinstance(hub.get("num_classes"), int):
        args["num_classes"] = hub["num_classes"]
    for key, value in args.items():
        if key in _NEUTRAL_ARGS and value != _NEUTRAL_ARGS[key]:
            raise UserError(f"{source}: model_args {key}={value!r} computes another function than vitkit's ViT")
    known = {"img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio"}
    known |= {"class_token", "global_pool", "fc_norm", "act_layer", "representation_size", "norm_eps"}
    known |= {"dynamic_img_size", *_NEUTRAL_ARGS, *_TRAINING_ARGS}
    unknown = sorted(set(args) - known)
    if unknown:
        raise UserError(f"{source}: model_args {unknown} have no counterpart in vitkit's ViT")
    return args


def _check_against_weights(args: dict[str, Any], config: dict[str, Any], source: str) -> None:
    """A config.json that describes another model than its weights (a stale or borrowed one) is an error."""
    pool, class_token, fc_norm = args.get("global_pool", "token"), args.get("class_token", True), args.get("fc_norm")
    if pool == "token" and class_token:
        classifier = "token"
    elif pool == "avg" and not class_token and fc_norm is False:
        classifier = "gap"
    else:
        raise UserError(
            f"{source}: global_pool={pool!r}, class_token={class_token}, fc_norm={fc_norm}; vitkit classifies the "
            "class token (global_pool 'token') or the mean of the normalised patch tokens (global_pool 'avg', "
            "class_token false, fc_norm false), as the official code does"
        )
    patch = args.get("patch_size")
    said = dict(
        embed_dim=(args.get("embed_dim"), config["width"]),
        depth=(args.get("depth"), config["depth"]),
        patch_size=(
            None if patch is None else tuple(patch) if isinstance(patch, list) else (patch, patch),
            tuple(config["patch_size"]),
        ),
        in_chans=(args.get("in_chans"), config["in_chans"]),
        num_classes=(args.get("num_classes"), config["num_classes"]),
        representation_size=(args.get("representation_size"), config["representation_size"]),
        global_pool=(classifier, config["classifier"]),
    )
    if args.get("mlp_ratio") is not None:
        said["mlp_ratio"] = (round(args["mlp_ratio"] * config["width"]), config["mlp_dim"])
    wrong = [f"{k} {a!r} (the weights: {b!r})" for k, (a, b) in said.items() if a is not None and a != b]
    if wrong:
        raise UserError(f"{source}: describes another model than the weights beside it: {'; '.join(wrong)}")


def vitkit_to_timm(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict timm's VisionTransformer(**timm_kwargs(model)) loads (pre-logits as timm < 0.9's)."""
    check_exportable(model)
    return {
        re.sub(r"^pre_logits\.", "pre_logits.fc.", k): v.detach().clone().contiguous()
        for k, v in model_state(model, "vitkit_to_timm").items()
    }


def check_exportable(model: nn.Module) -> ViTConfig:
    """The model's config if timm's VisionTransformer and hub config.json can hold the model; else a UserError."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ViTConfig):
        raise UserError(f"only VisionTransformer models have a timm layout, not {type(model).__name__}")
    if (cfg.pos_embed, cfg.pos_embed_where) != ("learned", "input"):
        raise UserError(
            f"timm export: pos_embed={cfg.pos_embed!r}, pos_embed_where={cfg.pos_embed_where!r}; timm's ViT holds "
            "learned 1-D position embeddings at the input only"
        )
    if cfg.classifier not in ("token", "gap"):
        raise UserError(
            f"timm export: classifier={cfg.classifier!r}; timm's ViT as vitkit writes it pools the class token "
            "('token') or the mean of the normalised patch tokens ('gap') only"
        )
    return cfg


def timm_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for timm's VisionTransformer that reproduce this model's numerics (LayerNorm eps other
    than 1e-6 needs norm_layer=partial(nn.LayerNorm, eps=...); hybrids need timm's ResNetV2 as embed_layer)."""
    cfg = check_exportable(model)
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


def hub_config(model: nn.Module, preprocessing: Preprocessing | None = None) -> dict[str, Any]:
    """The config.json timm's hub format keeps beside the weights: ``model_args`` (with what timm's current ViT
    refuses rather than computing another function) and the preprocessing record as ``pretrained_cfg``."""
    cfg = check_exportable(model)
    args = timm_kwargs(model)
    for key in ("img_size", "patch_size"):  # timm's spelling of a square size is one int
        h, w = args[key]
        args[key] = h if h == w else [h, w]
    if cfg.representation_size:
        args["representation_size"] = cfg.representation_size
    if cfg.ln_eps != TIMM_EPS:
        args["norm_eps"] = cfg.ln_eps
    if cfg.dynamic_img_size:
        args["dynamic_img_size"] = True
    prep = preprocessing or read_preprocessing({}, cfg.to_dict(), source="the model")
    if prep.class_names and len(prep.class_names) != cfg.num_classes:
        prep = prep.with_classes(None)  # names of another head
    pretrained: dict[str, Any] = dict(
        **prep.to_timm_pretrained_cfg(cfg.num_classes),
        fixed_input_size=not cfg.dynamic_img_size,
        first_conv="patch_embed.backbone.stem.conv" if cfg.resnet_layers is not None else "patch_embed.proj",
        classifier="head",
    )
    doc: dict[str, Any] = dict(
        architecture=architecture_name(model),
        num_classes=cfg.num_classes,
        num_features=cfg.representation_size or cfg.width,
        global_pool=args["global_pool"],
        model_args=args,
        pretrained_cfg=pretrained,
    )
    if prep.class_names:
        doc["label_names"] = list(prep.class_names)
    return doc


def architecture_name(model: nn.Module) -> str:
    """The timm constructor with this model's shape (vit_base_patch16_224, ...), else timm's generic module name."""
    cfg = vit_config_of(model, "architecture_name")
    if cfg.resnet_layers is not None:
        return HYBRID_ARCH
    (ph, pw), (h, w) = pair(cfg.patch_size), pair(cfg.img_size)
    if ph != pw or h != w or cfg.mlp_dim != 4 * cfg.width:
        return GENERIC_ARCH
    for size, row in TIMM_SIZES.items():
        name = f"vit_{size}_patch{ph}_{h}"
        if row == (cfg.width, cfg.depth, cfg.num_heads) and name in TIMM_ARCHS:
            return name
    return GENERIC_ARCH


def save_timm(model: nn.Module, path: str | Path, preprocessing: Preprocessing | None = None) -> Path:
    """Write the timm state dict to ``path`` (.safetensors) and timm's hub config.json beside it; returns path."""
    from safetensors.torch import save_file

    path = Path(path)
    state = vitkit_to_timm(model)
    text = json.dumps(hub_config(model, preprocessing), indent=2) + "\n"
    atomic_write(
        path, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}), size=sum(t.nbytes for t in state.values())
    )
    atomic_write_text(path.with_name(CONFIG_NAME), text)
    return path
