"""vitkit's own format: a directory with model.safetensors (weights) and config.json (how to rebuild the model).
config.json holds {"format": "vitkit", "model": <config fields incl. "arch">, "metadata": {...}}; metadata is free-form
plain JSON. Tensors that are not the model's (``extra``: a pretraining head) sit beside its weights under a prefix
metadata["drop_on_load"] lists, which every loader drops. Both files are written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..config_of import config_of
from ..errors import UserError
from ..io import atomic_write, atomic_write_text
from .base import CONFIG_NAME, Checkpoint, config_path, model_state, read_config_and_weights, read_config_json

WEIGHTS_NAME = "model.safetensors"
FORMAT = "vitkit"


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    metadata: dict[str, Any] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write model.safetensors + config.json into directory; returns the directory. ``extra`` tensors are saved
    beside the model's (their keys must not be the model's; list their prefix in metadata["drop_on_load"])."""
    directory = Path(directory)
    config = config_of(model).to_dict()
    if getattr(model, "token_merge", 0):  # a token-merging patch (vitkit.accel.tome): load_model applies it again
        config["token_merge"] = model.token_merge
    state = {k: v.detach().contiguous().cpu() for k, v in model_state(model, "save_pretrained").items()}
    clash = sorted(set(state) & set(extra or {}))
    if clash:
        raise ValueError(f"save_pretrained: extra tensors {clash} have the names of model weights")
    state.update({k: v.detach().contiguous().cpu() for k, v in (extra or {}).items()})
    atomic_write(
        directory / WEIGHTS_NAME,
        lambda tmp: save_file(state, tmp, metadata={"format": "pt"}),
        size=sum(t.nbytes for t in state.values()),
    )
    doc = {"format": FORMAT, "model": config, "metadata": metadata or {}}
    atomic_write_text(directory / CONFIG_NAME, json.dumps(doc, indent=2, default=list) + "\n")
    return directory


def detect(path: str | Path) -> bool:
    """A directory (or its model.safetensors) whose config.json says format 'vitkit', weights present or not."""
    cfg = config_path(path)
    if not cfg.is_file():
        return False
    try:
        return read_config_json(cfg).get("format") == FORMAT
    except UserError:
        return False


def read_native(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(model config dict, state dict, metadata) from a vitkit directory (or its model.safetensors)."""
    ckpt = read(Path(path))
    return ckpt.config, ckpt.state, ckpt.metadata


def read(path: Path, overrides: dict[str, Any] | None = None, tower: str | None = None) -> Checkpoint:
    """A vitkit checkpoint as written; a saved ``token_merge`` leaves the config for the Checkpoint's own field."""
    doc, cfg_path, state = read_config_and_weights(path, (WEIGHTS_NAME,), "vitkit")
    if doc.get("format") != FORMAT or not isinstance(doc.get("model"), dict):
        raise UserError(f"{cfg_path}: expected a vitkit config with keys 'format': 'vitkit' and 'model': {{...}}")
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise UserError(f"{cfg_path}: 'metadata' must be a JSON object, found {type(metadata).__name__}")
    config = dict(doc["model"])
    token_merge = config.pop("token_merge", None) or 0
    if not isinstance(token_merge, int) or token_merge < 0:
        raise UserError(f"{cfg_path}: model.token_merge={token_merge!r}; expected tokens per block, >= 0")
    return Checkpoint(path, FORMAT, config, state, metadata, token_merge=token_merge)
