"""vitkit's own format: a directory with model.safetensors (weights) and config.json (how to rebuild the model).

config.json holds {"format": "vitkit", "model": <config fields incl. "arch">, "metadata": {...}}; metadata is
free-form plain JSON (class names, training info). Tensors that are not the model's (a pretraining head, saved
with ``extra``) sit beside its weights under their own prefix, which metadata["drop_on_load"] lists: every
loader drops them and reports them as dropped (see loader.load_pretrained). Both files are written atomically
(temp file + rename), so an interrupted save never leaves a half-written checkpoint in place of a good one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import UserError, UserFileNotFoundError
from ..io import atomic_write, atomic_write_text

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FORMAT = "vitkit"


def load_tensor_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A dict of tensors from .safetensors or a torch file; torch files load with weights_only=True (no code runs).

    A dict wrapped under 'state_dict' or 'model' (training scripts' habit) is unwrapped. A file that cannot be
    read so is a UserError naming it.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything beyond plain tensors and containers, and others
        cause = _torch_load_cause(e)  # not chained: torch's text would advise weights_only=False
        raise UserError(f"{path}: not a plain tensor file readable with weights_only=True ({cause})") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dict of tensors (optionally under 'state_dict' or 'model')")
    return state


def _torch_load_cause(error: Exception) -> str:
    """What torch.load refused, in a few words.

    torch's own text is not shown: it is many lines long and advises loading with weights_only=False, which runs
    whatever code the file names, the very thing a weights file from elsewhere must not be allowed to do.
    """
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if found:
        return f"it holds a pickled Python object, {found.group(1)}, beyond tensors and plain containers"
    if isinstance(error, EOFError):
        return "the file is empty or truncated"
    if isinstance(error, RuntimeError) and "zip archive" in str(error):
        return "a corrupt or truncated torch zip archive"
    return f"corrupt, truncated or not a torch file: {type(error).__name__}"


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file; a corrupt or truncated one is a UserError naming it."""
    try:
        return load_file(str(path))
    except SafetensorError as e:  # safetensors' own type, for a bad header, a truncated body, a wrong dtype, ...
        raise UserError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in a config.json; a file that is not JSON, or JSON that is not an object, is a UserError."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        kind = "null" if doc is None else f"a JSON {_JSON_KINDS.get(type(doc), type(doc).__name__)}"
        raise UserError(f"{path}: expected a JSON object {{...}}, found {kind}")
    return doc


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    metadata: dict[str, Any] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write model.safetensors + config.json into directory; returns the directory. ``extra`` tensors are saved
    beside the model's (their keys must not be the model's; list their prefix in metadata["drop_on_load"])."""
    directory = Path(directory)
    config = model.config.to_dict()  # type: ignore[operator]
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
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


def is_native(path: str | Path) -> bool:
    path = Path(path)
    cfg = path / CONFIG_NAME if path.is_dir() else path.with_name(CONFIG_NAME)
    if not cfg.is_file() or not (cfg.parent / WEIGHTS_NAME).is_file():
        return False
    try:
        return read_config_json(cfg).get("format") == FORMAT
    except UserError:
        return False


def read_native(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(model config dict, state dict, metadata) from a vitkit directory (or its model.safetensors)."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    cfg_path = directory / CONFIG_NAME
    if not cfg_path.is_file():
        raise UserFileNotFoundError(f"{cfg_path}: missing; a vitkit checkpoint needs {CONFIG_NAME} + {WEIGHTS_NAME}")
    doc = read_config_json(cfg_path)
    if doc.get("format") != FORMAT or not isinstance(doc.get("model"), dict):
        raise UserError(f"{cfg_path}: expected a vitkit config with keys 'format': 'vitkit' and 'model': {{...}}")
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise UserError(f"{cfg_path}: 'metadata' must be a JSON object, found {type(metadata).__name__}")
    return doc["model"], load_safetensors(directory / WEIGHTS_NAME), metadata
