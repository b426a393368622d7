"""Training state for resume: one safetensors file, tensors plus a JSON document in its metadata.

    train_state.safetensors
      tensors:  model.<param name>, averaged.<param name>, optim.<param index>.<state name> (exp_avg, step, ...),
                best.<param name> (the weights data.select_images chose so far: train/select.py)
      metadata: {"vitkit_train_state": JSON with step, optimizer param groups and non-tensor state, GradScaler
                 state and what the engine adds (epoch, last metrics, ...)}

Nothing needs pickle to load, and no RNG state is stored: every random choice is a function of (seed, step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.base import read_safetensors
from ..errors import UserError, UserFileNotFoundError
from ..io import atomic_write

STATE_NAME = "train_state.safetensors"
_META_KEY = "vitkit_train_state"


def save_train_state(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    info: dict[str, Any],
    scaler: torch.amp.GradScaler | None = None,
    averaged: nn.Module | None = None,
    best: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write model, optimizer (and averaged model, best weights) tensors and ``info`` (plain JSON: step, ...)
    atomically."""
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if averaged is not None:
        tensors.update({f"averaged.{k}": v.detach().contiguous().cpu() for k, v in averaged.state_dict().items()})
    tensors.update({f"best.{k}": v.detach().contiguous().cpu() for k, v in (best or {}).items()})
    optim = optimizer.state_dict()
    plain_state: dict[str, dict[str, Any]] = {}
    for idx, entries in optim["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                plain_state.setdefault(str(idx), {})[name] = value
    doc = {
        **info,
        "param_groups": optim["param_groups"],
        "optim_plain_state": plain_state,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
    }
    metadata = {_META_KEY: json.dumps(doc, default=list)}
    atomic_write(
        path, lambda tmp: save_file(tensors, tmp, metadata=metadata), size=sum(t.nbytes for t in tensors.values())
    )


def read_train_state(path: str | Path, tensors: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON document, tensors) of a training state file; a clear error if it is not one. ``tensors=False`` reads
    the header alone (the document, no tensor)."""
    path = Path(path)
    if not path.is_file():
        raise UserFileNotFoundError(f"{path}: no training state to resume from")
    meta, found = read_safetensors(path, tensors, what="training state")
    if _META_KEY not in meta:
        raise UserError(f"{path}: a safetensors file without the {_META_KEY!r} metadata of a vitkit training state")
    try:
        doc = json.loads(meta[_META_KEY])
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: the training state's {_META_KEY!r} metadata is not valid JSON ({e})") from None
    _check_document(path, doc)
    return doc, found


MAX_STEP = 10**10  # far beyond any run; a larger step is an edited or corrupt state, not a long run


def _check_document(path: Path, doc: Any) -> None:
    """The state's JSON document has what a resume reads, of the right kinds (a hand-edited one may not)."""
    where = f"{path}: the training state's {_META_KEY!r} metadata"
    if not isinstance(doc, dict):
        raise UserError(f"{where} is not a JSON object")
    for key in ("step", "param_groups", "optim_plain_state"):
        if key not in doc:
            raise UserError(f"{where} has no {key!r}; this file was not written by vitkit (or was edited)")
    step, total = doc["step"], doc.get("total_steps", MAX_STEP)
    for key, value in (("step", step), ("total_steps", total)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_STEP:
            raise UserError(f"{where}: {key}={value!r}, expected a whole number of steps from 0 to {MAX_STEP:.0e}")
    if step > total:
        raise UserError(f"{where}: step={step} is past the run's total_steps={total}")
    groups = doc["param_groups"]
    ok = isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    if not ok or not groups:
        raise UserError(f"{where}: param_groups={str(groups)[:60]}, expected a list of optimizer groups with params")
    plain = doc["optim_plain_state"]
    if not isinstance(plain, dict) or not all(k.isdigit() and isinstance(v, dict) for k, v in plain.items()):
        raise UserError(f"{where}: optim_plain_state={str(plain)[:60]}, expected an object of parameter indices")
    window = doc.get("loss_window", [])
    if not isinstance(window, list) or not all(isinstance(v, (int, float)) for v in window):
        raise UserError(f"{where}: loss_window={str(window)[:60]}, expected a list of losses")
    if not isinstance(doc.get("time", 0.0), (int, float)) or not isinstance(doc.get("metrics", {}), dict):
        raise UserError(f"{where}: time or metrics is not of the kind vitkit writes (a number, an object)")


def _load_weights(module: nn.Module, saved: dict[str, torch.Tensor], path: str | Path) -> None:
    """Load saved weights strictly, or a one-line UserError saying how they differ from the module's."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    shapes = [
        f"{k} {tuple(saved[k].shape)} not {tuple(v.shape)}"
        for k, v in own.items()
        if k in saved and saved[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        differ = [
            f"{what} {items[:3]}{' ...' if len(items) > 3 else ''}"
            for what, items in (("missing", missing), ("unexpected", unexpected), ("shapes", shapes))
            if items
        ]
        raise UserError(
            f"{path}: the saved model does not fit the configured one ({'; '.join(differ)}); a resume keeps the "
            "run's model, with run.resume_with_changes too: start a new run (run.init_from) to change it"
        )
    module.load_state_dict(saved)


def load_train_state(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    averaged: nn.Module | None = None,
    best: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer, scaler and averaged model in place, and fill ``best`` with the best weights it
    holds (none without data.select_images); returns the JSON document (step, ...)."""
    doc, tensors = read_train_state(path)
    if best is not None:
        best.update({k[len("best.") :]: v for k, v in tensors.items() if k.startswith("best.")})
    if averaged is not None:
        saved = {k[len("averaged.") :]: v for k, v in tensors.items() if k.startswith("averaged.")}
        if not saved:
            raise UserError(f"{path}: no averaged weights to resume optim.polyak from (the run did not average)")
        _load_weights(averaged, saved, path)
    _load_weights(model, {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}, path)
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    for idx, entries in doc["optim_plain_state"].items():
        state.setdefault(int(idx), {}).update(entries)
    groups = doc["param_groups"]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise UserError(f"{path}: the saved optimizer state does not fit this optimizer ({e})") from None
    if scaler is not None and doc.get("scaler"):
        scaler.load_state_dict(doc["scaler"])
    return doc
