"""vitkit's own format: a directory with model.safetensors (weights) and config.json (how to rebuild the model).

config.json holds {"format": "vitkit", "model": <config fields incl. "arch">, "metadata": {...}}; metadata is
free-form plain JSON (class names, training info). Both files are written atomically (temp file + rename),
so an interrupted save never leaves a half-written checkpoint in place of a good one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import UserError, UserFileNotFoundError
from ..io import atomic_write, atomic_write_text

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FORMAT = "vitkit"


def load_tensor_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A dict of tensors from .safetensors or a torch file; torch files load with weights_only=True (no code runs).

    A dict wrapped under 'state_dict' or 'model' (training scripts' habit) is unwrapped.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything beyond plain tensors and containers, and others
        raise UserError(f"{path}: not a plain tensor file loadable with weights_only=True ({e})") from e
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dict of tensors (optionally under 'state_dict' or 'model')")
    return state


def save_pretrained(model: nn.Module, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write model.safetensors + config.json into directory; returns the directory."""
    directory = Path(directory)
    config = model.config.to_dict()  # type: ignore[operator]
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    doc = {"format": FORMAT, "model": config, "metadata": metadata or {}}
    atomic_write_text(directory / CONFIG_NAME, json.dumps(doc, indent=2, default=list) + "\n")
    return directory


def is_native(path: str | Path) -> bool:
    path = Path(path)
    cfg = path / CONFIG_NAME if path.is_dir() else path.with_name(CONFIG_NAME)
    if not cfg.is_file() or not (cfg.parent / WEIGHTS_NAME).is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def read_native(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(model config dict, state dict, metadata) from a vitkit directory (or its model.safetensors)."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    cfg_path = directory / CONFIG_NAME
    try:
        doc = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise UserFileNotFoundError(
            f"{cfg_path}: missing; a vitkit checkpoint needs {CONFIG_NAME} + {WEIGHTS_NAME}"
        ) from None
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path}: not valid JSON ({e})") from None
    if doc.get("format") != FORMAT or "model" not in doc:
        raise UserError(f"{cfg_path}: expected a vitkit config with keys 'format': 'vitkit' and 'model'")
    return doc["model"], load_file(str(directory / WEIGHTS_NAME)), doc.get("metadata", {})
