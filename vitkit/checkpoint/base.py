"""What every checkpoint format shares: the ``Checkpoint`` a reader returns, .npz arrays read without pickle, and the
"config.json + weights" directory layout that vitkit's own, Hugging Face and timm hub files all use. A format is one
module with ``FORMAT``, ``detect(path) -> bool`` (no weights read) and ``read(path, overrides, tower) -> Checkpoint``.
"""

from __future__ import annotations

import json
import os
import re
import tokenize
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..config_of import config_of
from ..errors import UserError, UserFileNotFoundError
from ..models.registry import model_from_config
from ..models.vit import ViTConfig
from ..preprocessing import Preprocessing, read_preprocessing

CONFIG_NAME = "config.json"


def load_tensor_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors or torch file (weights_only=True: no code runs), unwrapped from a dict."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything beyond plain tensors and containers, and others
        cause = _torch_load_cause(e)  # not chained: see _torch_load_cause
        raise UserError(f"{path}: not a plain tensor file readable with weights_only=True ({cause})") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dict of tensors (optionally under 'state_dict' or 'model')")
    return state


def _torch_load_cause(error: Exception) -> str:
    """What torch.load refused, in a few words (its own text advises weights_only=False, which runs code)."""
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
    return read_safetensors(path)[1]


READ_TRIES = 5  # reads of a file that changed under each of them before giving up


def read_safetensors(
    path: str | Path, tensors: bool = True, what: str = "safetensors file"
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a .safetensors file (``tensors=False``: the header alone), from one version of it; a
    corrupt or truncated file is a UserError naming it as ``what``. safetensors opens the file by name twice (its
    header, then torch maps the body), so a file replaced in between (a live run saving atomically) would mix two
    versions: a read the file changed under is done again."""
    path = Path(path)
    for _ in range(READ_TRIES):
        before = _version(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                found = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118 (no __iter__)
        except SafetensorError as e:  # safetensors' own type, for a bad header, a truncated body, a wrong dtype, ...
            raise UserError(f"{path}: not a readable {what} ({' '.join(str(e).split())})") from None
        except RuntimeError:  # torch mapped a body shorter than the header it was given: the file was replaced
            if _version(path) == before:
                raise
            continue
        if _version(path) == before:
            return meta, found
    raise UserError(f"{path}: replaced while being read, {READ_TRIES} times in a row; read it once its writer stops")


def _version(path: Path) -> tuple[int, ...] | None:
    """What tells one version of a file from the next that replaces it: device, inode, size, modification time."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


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


@dataclass
class Checkpoint:
    """A checkpoint read into vitkit's naming, with the model config inferred from (or stored in) the file."""

    path: Path
    format: str
    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)
    guessed: dict[str, str] = field(default_factory=dict)  # config field -> the guess, its reason, its override
    token_merge: int = 0  # an older vitkit's config field, now a speed patch the caller applies; 0: none

    def grid(self) -> tuple[int, int] | None:
        """The token grid of the stored position embedding (None for non-ViT checkpoints)."""
        if self.config.get("arch", "vit") != "vit":
            return None
        fields = {k: v for k, v in self.config.items() if k != "arch"}
        return ViTConfig(**fields).grid()

    @property
    def preprocessing(self) -> Preprocessing:
        """The one record of what the weights expect (size, mean / std, crop, channels, class names)."""
        return read_preprocessing(self.metadata, self.config, source=str(self.path))


def config_path(path: str | Path) -> Path:
    """The config.json of a checkpoint directory, or the one beside a weights file."""
    path = Path(path)
    return path / CONFIG_NAME if path.is_dir() else path.with_name(CONFIG_NAME)


def weights_path(path: str | Path, weight_names: Sequence[str], what: str) -> Path:
    """The weights file of a checkpoint: ``path`` itself, or the first of ``weight_names`` in its directory."""
    path = Path(path)
    if path.is_file() and path.name != CONFIG_NAME:
        return path
    directory = path if path.is_dir() else path.parent
    found = next((directory / n for n in weight_names if (directory / n).is_file()), None)
    if found is None:
        missing = " or ".join(str(directory / n) for n in weight_names)
        raise UserFileNotFoundError(f"{missing}: missing; a {what} checkpoint holds its weights beside {CONFIG_NAME}")
    return found


def read_config_and_weights(
    path: str | Path, weight_names: Sequence[str], what: str
) -> tuple[dict[str, Any], Path, dict[str, torch.Tensor]]:
    """(config.json as a dict, its path, the weights) of a checkpoint directory or a weights file in one."""
    cfg_path = config_path(path)
    if not cfg_path.is_file():
        raise UserFileNotFoundError(f"{cfg_path}: missing; a {what} checkpoint needs {CONFIG_NAME}")
    config = read_config_json(cfg_path)
    return config, cfg_path, load_tensor_file(weights_path(path, weight_names, what))


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """All arrays of an .npz, refusing pickled objects (np.load with allow_pickle=False)."""
    try:
        data = np.load(path, allow_pickle=False)
    except ValueError as e:  # numpy takes anything that is neither zip nor .npy for a pickle, and refuses it
        raise UserError(
            f"{path}: pickled data (or not an .npz at all); refusing to unpickle it (allow_pickle=False)"
        ) from e
    except EOFError:
        raise UserError(f"{path}: empty file, expected an .npz archive") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{path}: not a readable .npz archive ({e})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UserError(f"{path}: a single array, expected an .npz archive of named parameters")
    arrays = {}
    with data:
        for key in data.files:
            try:
                arrays[key] = data[key]
            except ValueError as e:
                if "allow_pickle" in str(e):  # numpy's refusal of an object array: pickled Python objects
                    raise UserError(
                        f"{path}: array {key!r} holds pickled Python objects; refusing to load it (allow_pickle=False)"
                    ) from e
                raise UserError(f"{path}: array {key!r} is corrupt or truncated ({' '.join(str(e).split())})") from None
            # a damaged member fails in zipfile (bad CRC), zlib (compressed data) or numpy's header parser
            except (EOFError, OSError, zipfile.BadZipFile, zlib.error, SyntaxError, tokenize.TokenError) as e:
                cause = f"{type(e).__name__}: {' '.join(str(e).split())}"
                raise UserError(f"{path}: array {key!r} is corrupt or truncated ({cause})") from None
            if not isinstance(arrays[key], np.ndarray):  # NpzFile hands back raw bytes for a member that is no .npy
                raise UserError(f"{path}: member {key!r} is not an .npy array")
    return arrays


def model_state(model: nn.Module, what: str) -> dict[str, torch.Tensor]:
    """model.state_dict() for a writer (``what``), refused when it is not the state of the model its config builds
    (optimize_for_inference packs or quantises Linear layers): a file of it would not load back."""
    state = model.state_dict()
    with torch.device("meta"):  # shapes only
        expected = model_from_config(config_of(model)).state_dict()
    lacking, other = [k for k in expected if k not in state], [k for k in state if k not in expected]
    if lacking or other:
        listed = "; ".join(
            f"{kind} {len(keys)} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
            for kind, keys in (("missing", lacking), ("extra", other))
            if keys
        )
        raise UserError(
            f"{what}: the model's weights are not those of the model its config builds ({listed}): some of its "
            "layers were replaced (optimize_for_inference packs or quantises the Linear layers of the model it "
            "returns: use the model it was made from)"
        )
    return state
