"""Hugging Face transformers ViT <-> vitkit.

HF keeps q, k and v as three Linear layers (vitkit fuses them into one qkv); the rest is a renaming. ViTModel's optional
pooler (Dense + tanh on the class token) is vitkit's pre-logits; HF has no GAP ViT and no hybrid stem. HF's defaults are
exact GELU and LayerNorm eps 1e-12; official weights need hidden_act="gelu_pytorch_tanh" and layer_norm_eps=1e-6.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config_of import pair
from ..errors import UserError
from ..io import atomic_write, atomic_write_text
from ..models import ViTConfig
from ..optional import require
from ..preprocessing import Preprocessing, class_names_from_labels, from_hf_processor, read_preprocessing
from .base import Checkpoint, config_path, model_state, read_config_and_weights, read_config_json

if TYPE_CHECKING:  # transformers is a development / benchmark dependency, imported only when used
    import transformers

FORMAT = "hf"
CONFIG_NAME = "config.json"
PROCESSOR_NAME = "preprocessor_config.json"  # transformers' image processor: the preprocessing
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin")

# HF hidden_act -> vitkit gelu. 'gelu_new' and 'gelu_fast' are further spellings of the tanh approximation.
HF_ACTS = {"gelu": "exact", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh"}
VITKIT_ACTS = {"exact": "gelu", "tanh": "gelu_pytorch_tanh"}


def _params(modules: dict[str, str]) -> dict[str, str]:
    """vitkit module -> HF module, as the names of their parameters: each has a weight and a bias."""
    return {f"{ours}.{p}": f"{theirs}.{p}" for ours, theirs in modules.items() for p in ("weight", "bias")}


# vitkit -> HF names (a renaming, nothing transposed) in the "legacy" layout published checkpoints use and in
# transformers >= 5's module names ("v5"), which its from_pretrained renames on load
NORMS = {"norm1": "layernorm_before", "norm2": "layernorm_after"}
LAYOUTS: dict[str, dict[str, Any]] = {
    "legacy": {
        "layer": "encoder.layer.{}",
        "qkv": ("attention.attention.query", "attention.attention.key", "attention.attention.value"),
        "blocks": _params(
            {**NORMS, "attn.proj": "attention.output.dense", "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
        ),
    },
    "v5": {
        "layer": "layers.{}",
        "qkv": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
        "blocks": _params({**NORMS, "attn.proj": "attention.o_proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}),
    },
}
TOP_MAP = {
    "cls_token": "embeddings.cls_token",
    "pos_embed": "embeddings.position_embeddings",
    **_params({"patch_embed.proj": "embeddings.patch_embeddings.projection", "norm": "layernorm"}),
    **_params({"pre_logits": "pooler.dense"}),
}
HEAD_MAP = _params({"head": "classifier"})
LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma: PIL's convert("L"), how a 1-channel model's images are made grey


# --------------------------------------------------------------------------------------------------- reading
def detect(path: str | Path) -> bool:
    """A directory (or a weights file inside one) whose config.json says model_type 'vit'."""
    try:
        return read_config_json(config_path(path)).get("model_type") == "vit"
    except (OSError, UserError):
        return False


def read(path: Path, overrides: dict[str, Any] | None = None, tower: str | None = None) -> Checkpoint:
    """An HF ViT: config from config.json, class names from id2label, preprocessing from preprocessor_config.json."""
    config, _, state = read_config_and_weights(path, WEIGHT_NAMES, "Hugging Face ViT")
    processor = config_path(path).with_name(PROCESSOR_NAME)
    metadata = hf_metadata(config, read_config_json(processor) if processor.is_file() else None, str(processor))
    return Checkpoint(path, FORMAT, hf_config_to_vitkit(config, state), hf_to_vitkit(state), metadata)


def hf_config_to_vitkit(config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ViTConfig fields for an HF config; whether there is a pooler / classifier is read from the weights."""
    act = config.get("hidden_act", "gelu")
    if act not in HF_ACTS:
        raise UserError(f"HF config hidden_act={act!r}: expected one of {sorted(HF_ACTS)}")
    src = {_strip(k): v for k, v in state.items()}
    return dict(
        arch="vit",
        img_size=config.get("image_size", 224),
        patch_size=config.get("patch_size", 16),
        in_chans=config.get("num_channels", 3),
        num_classes=src["classifier.weight"].shape[0] if "classifier.weight" in src else 0,
        width=config.get("hidden_size", 768),
        depth=config.get("num_hidden_layers", 12),
        num_heads=config.get("num_attention_heads", 12),
        mlp_dim=config.get("intermediate_size", 3072),
        classifier="token",
        representation_size=src["pooler.dense.weight"].shape[0] if "pooler.dense.weight" in src else None,
        ln_eps=config.get("layer_norm_eps", 1e-12),  # HF's default, when config.json does not say
        gelu=HF_ACTS[act],
    )


def hf_metadata(
    config: dict[str, Any], processor: dict[str, Any] | None = None, source: str = PROCESSOR_NAME
) -> dict[str, Any]:
    """The preprocessing fields an HF directory states: its id2label and its preprocessor_config.json's."""
    out = from_hf_processor(processor, source) if processor else {}
    names = class_names_from_labels(config.get("id2label"))
    if names:
        out["class_names"] = names
    return out


def _strip(key: str) -> str:
    return key[len("vit.") :] if key.startswith("vit.") else key


def hf_layout(keys: Any) -> str:
    """'v5' when the keys use transformers >= 5 module names (layers.i), else 'legacy' (encoder.layer.i)."""
    return "v5" if any(re.match(r"(vit\.)?layers\.\d+\.", k) for k in keys) else "legacy"


def hf_to_vitkit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF ViT state dict (either layout) -> vitkit's; missing q/k/v biases are zeros, unknown keys kept as they are."""
    src = {_strip(k): v for k, v in state.items()}
    layout = LAYOUTS[hf_layout(src)]
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in {**TOP_MAP, **HEAD_MAP}.items():
        if theirs in src:
            out[ours] = src[theirs]
            used.add(theirs)
    pattern = re.escape(layout["layer"]).replace(r"\{\}", r"(\d+)")
    layers = sorted({int(m.group(1)) for k in src if (m := re.match(pattern + r"\.", k))})
    for i in layers:
        hf = layout["layer"].format(i)
        for ours, theirs in layout["blocks"].items():
            if f"{hf}.{theirs}" in src:
                out[f"blocks.{i}.{ours}"] = src[f"{hf}.{theirs}"]
                used.add(f"{hf}.{theirs}")
        w = [f"{hf}.{n}.weight" for n in layout["qkv"]]
        if all(k in src for k in w):
            out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([src[k] for k in w])  # 3 x (D, D) -> (3D, D)
            b = [f"{hf}.{n}.bias" for n in layout["qkv"]]
            zeros = src[w[0]].new_zeros(src[w[0]].shape[0])
            out[f"blocks.{i}.attn.qkv.bias"] = torch.cat([src.get(k, zeros) for k in b])
            used.update(w + [k for k in b if k in src])
    out.update({k: v for k, v in src.items() if k not in used})
    return out


# --------------------------------------------------------------------------------------------------- writing
def _check_exportable(model: nn.Module) -> ViTConfig:
    """The model's config, if HF's ViT can hold the model; else a UserError saying what it cannot hold."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ViTConfig):
        raise UserError(f"only VisionTransformer models convert to Hugging Face ViT, not {type(model).__name__}")
    if cfg.classifier != "token":
        raise UserError(f"Hugging Face ViT pools its class token only, not classifier={cfg.classifier!r}")
    if cfg.resnet_layers is not None:
        raise UserError("Hugging Face ViT has no ResNet stem: cannot export a hybrid model")
    if (cfg.pos_embed, cfg.pos_embed_where) != ("learned", "input"):
        raise UserError(
            "Hugging Face ViT has learned 1-D position embeddings added at the input only, not "
            f"pos_embed={cfg.pos_embed!r}, pos_embed_where={cfg.pos_embed_where!r}"
        )
    return cfg


def hf_config_for(model: nn.Module, id2label: dict[int, str] | None = None) -> transformers.ViTConfig:
    """The transformers.ViTConfig that reproduces a vitkit ViT's numerics (GELU variant, LayerNorm eps)."""
    require("transformers", "a transformers ViTConfig (convert --to hf)")
    import transformers

    cfg = _check_exportable(model)
    h, w = pair(cfg.img_size)
    num_classes = cfg.num_classes
    if id2label is None and num_classes:
        id2label = {i: f"LABEL_{i}" for i in range(num_classes)}
    return transformers.ViTConfig(
        hidden_size=cfg.width,
        num_hidden_layers=cfg.depth,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim,
        hidden_act=VITKIT_ACTS[cfg.gelu],
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attn_dropout,
        layer_norm_eps=cfg.ln_eps,
        image_size=[h, w] if h != w else h,
        patch_size=pair(cfg.patch_size)[0],
        num_channels=cfg.in_chans,
        qkv_bias=True,
        pooler_output_size=cfg.representation_size,
        pooler_act="tanh",
        id2label=id2label,
    )


def vitkit_to_hf(
    model: nn.Module, id2label: dict[int, str] | None = None, layout: str = "legacy"
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers.ViTConfig, state dict) for a vitkit ViT, in the published ('legacy') or 'v5' key layout:
    ViTForImageClassification's keys, or ViTModel's without a head or with pre-logits (its pooler)."""
    cfg = _check_exportable(model)
    if layout not in LAYOUTS:
        raise UserError(f"layout={layout!r}: expected one of {sorted(LAYOUTS)}")
    if pair(cfg.patch_size)[0] != pair(cfg.patch_size)[1]:
        raise UserError(f"Hugging Face ViT needs square patches, got patch_size={cfg.patch_size}")
    if cfg.representation_size and cfg.num_classes:
        raise UserError(
            "Hugging Face ViT has no classifier after a pre-logits layer (ViTModel's pooler is the pre-logits): "
            "call model.reset_classifier(0, keep_pre_logits=True) to export the features, or drop pre-logits"
        )
    hf_config = hf_config_for(model, id2label)
    lay = LAYOUTS[layout]
    state = model_state(model, "vitkit_to_hf")
    prefix = "vit." if cfg.num_classes else ""
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in TOP_MAP.items():
        if ours in state:
            out[prefix + theirs] = state[ours]
    for i in range(cfg.depth):
        hf = prefix + lay["layer"].format(i)
        for ours, theirs in lay["blocks"].items():
            out[f"{hf}.{theirs}"] = state[f"blocks.{i}.{ours}"]
        w = state[f"blocks.{i}.attn.qkv.weight"].chunk(3)  # (3D, D) -> 3 x (D, D): q, k, v
        b = state[f"blocks.{i}.attn.qkv.bias"].chunk(3)
        for name, wi, bi in zip(lay["qkv"], w, b):
            out[f"{hf}.{name}.weight"] = wi
            out[f"{hf}.{name}.bias"] = bi
    if cfg.num_classes:
        for ours, theirs in HEAD_MAP.items():
            out[theirs] = state[ours]
    return hf_config, {k: v.detach().clone().contiguous() for k, v in out.items()}


def to_hf_model(model: nn.Module) -> transformers.ViTForImageClassification:
    """A transformers ViTForImageClassification (eager, eval) with the same weights and numerics as a vitkit ViT."""
    require("transformers", "a transformers ViTForImageClassification")
    import transformers

    cfg = _check_exportable(model)
    if cfg.representation_size:
        raise UserError("ViTForImageClassification has no pre-logits layer: call model.reset_classifier(n) first")
    if not cfg.num_classes:
        raise UserError("ViTForImageClassification needs a head: the model has num_classes=0")
    hf_config = hf_config_for(model)
    hf_config._attn_implementation = "eager"
    hf = transformers.ViTForImageClassification(hf_config)
    _, state = vitkit_to_hf(model, layout=hf_layout(hf.state_dict()))
    hf.load_state_dict(state, strict=True)
    ref = next(model.parameters())
    # nn.Module.to itself: transformers wraps its override in a decorator whose type hides the method
    return nn.Module.to(hf, device=ref.device, dtype=ref.dtype).eval()


def save_hf(
    model: nn.Module,
    directory: str | Path,
    class_names: list[str] | None = None,
    preprocessing: Preprocessing | None = None,
) -> Path:
    """Write the files transformers' from_pretrained and pipelines read: config.json (class names as id2label),
    model.safetensors and the preprocessing record (default: the model's own) as preprocessor_config.json.

    A 1-channel model is written as a 3-channel one, since transformers' image processors and pipelines give RGB
    pixels: its patch embedding weights R, G and B as PIL's ``convert("L")`` does (LUMA), each channel normalised as
    the grey one was, so that it gives the grey model's outputs on the image's luma (exactly on a grey image)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    cfg = _check_exportable(model)
    prep = preprocessing or read_preprocessing({}, cfg.to_dict(), source="the model")
    names = class_names or prep.class_names
    id2label = dict(enumerate(names)) if names and len(names) == cfg.num_classes else None
    hf_config, state = vitkit_to_hf(model, id2label)
    if cfg.in_chans == 1:
        key = ("vit." if cfg.num_classes else "") + TOP_MAP["patch_embed.proj.weight"]
        state[key] = state[key] * torch.tensor(LUMA, dtype=state[key].dtype).view(1, 3, 1, 1)
        hf_config.num_channels = 3
        prep = dataclasses.replace(prep, in_chans=3, mean=prep.mean * 3, std=prep.std * 3)
    architectures = ["ViTForImageClassification"] if cfg.num_classes else ["ViTModel"]
    doc = {**hf_config.to_dict(), "architectures": architectures, "model_type": "vit"}
    processor = prep.to_hf_processor()
    atomic_write(
        directory / "model.safetensors",
        lambda tmp: save_file(state, tmp, metadata={"format": "pt"}),
        size=sum(t.nbytes for t in state.values()),
    )
    atomic_write_text(directory / PROCESSOR_NAME, json.dumps(processor, indent=2) + "\n")
    atomic_write_text(directory / CONFIG_NAME, json.dumps(doc, indent=2, default=str) + "\n")
    return directory
