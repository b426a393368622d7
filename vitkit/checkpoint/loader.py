"""Reading every checkpoint format: ``read_into(model, path)`` and ``read_model(path)``, under the public names
vitkit.load_pretrained and vitkit.load_model (vitkit.hub, which adds pretrained tags).

Loading adapts the file as the official fine-tuning code does (position embeddings resampled, a head for another
class count left fresh, both reported); anything else that does not fit is an error. It is never quietly partial
nor quietly guessed: what the file and the caller leave unsaid is reported and warned about.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config_of import config_of
from ..errors import ConfigError, UserError, UserFileNotFoundError
from ..io import atomic_write
from ..models import VisionTransformer
from ..models.posemb import resample_pos_embed, resample_relative
from ..models.registry import config_class, model_from_config
from ..preprocessing import read_preprocessing
from . import big_transfer, hf, native, official, timm
from .base import Checkpoint, read_npz

# the order formats are asked: BiT's .npz before the official's, a config.json that says what it is before timm's
READERS = (big_transfer, official, native, hf, timm)
FORMATS = tuple(reader.FORMAT for reader in READERS)
_BY_NAME = {reader.FORMAT: reader for reader in READERS}

__all__ = ["FORMATS", "Checkpoint", "LoadReport", "convert", "detect_format", "read_checkpoint", "read_into"]
__all__ += ["read_model", "read_npz"]


@dataclass
class LoadReport:
    """What load_pretrained did: keys it could not fill, could not place, resampled or left fresh."""

    path: str
    format: str
    missing: list[str] = field(default_factory=list)  # in the model, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the model
    resampled: list[str] = field(default_factory=list)  # position embeddings interpolated to the model's grid
    reinitialised: list[str] = field(default_factory=list)  # left as the model's fresh (zero) head
    dropped: list[str] = field(default_factory=list)  # checkpoint keys deliberately not loaded (e.g. pre_logits)
    metadata: dict[str, Any] = field(default_factory=dict)  # what the checkpoint says about itself (class names...)
    guessed: dict[str, str] = field(default_factory=dict)  # config fields the file does not say and vitkit guessed
    from_caller: dict[str, str] = field(default_factory=dict)  # config fields the file does not say and the caller did
    token_merge: int = 0  # token merging the file's config asks for (Checkpoint.token_merge), for the caller to apply

    @property
    def ok(self) -> bool:
        """Every parameter of the model was filled and every weight of the file placed (fresh heads aside)."""
        return not self.missing and not self.unexpected

    def mismatch(self) -> str:
        """One line: what is missing and what is unexpected (the keys, abbreviated)."""
        kinds = (("missing", self.missing), ("unexpected", self.unexpected))
        return "; ".join(f"{name} {_abbreviated(keys, 6)}" for name, keys in kinds if keys) or "none"

    def __str__(self) -> str:
        lines = [f"loaded {self.path} ({self.format})"]
        for name in ("missing", "unexpected", "resampled", "reinitialised", "dropped"):
            keys = getattr(self, name)
            if keys:
                lines.append(f"  {name}: {_abbreviated(keys, 8)}")
        if len(lines) == 1:
            lines.append("  all keys matched")
        lines += [f"  guessed {text}" for text in self.guessed.values()]
        lines += [f"  {text}" for text in self.from_caller.values()]  # each says it is the caller's
        return "\n".join(lines)


def _abbreviated(keys: list[str], shown: int) -> str:
    return ", ".join(keys[:shown]) + (f", ... ({len(keys)} in all)" if len(keys) > shown else "")


# ------------------------------------------------------------------------------------------------- reading
def detect_format(path: str | Path) -> str:
    """Which of FORMATS a path holds, from names and config.json alone (no weights are read)."""
    path = Path(path)
    if not path.exists():
        raise UserFileNotFoundError(f"{path}: no such file or directory")
    cfg = path / native.CONFIG_NAME if path.is_dir() else path.with_name(native.CONFIG_NAME)
    if (path.is_dir() or path.name in (native.WEIGHTS_NAME, *hf.WEIGHT_NAMES)) and cfg.is_file():
        native.read_config_json(cfg)  # a broken config.json is named as such, not reported as an unknown format
    for reader in READERS:
        if reader.detect(path):
            return reader.FORMAT
    raise UserError(
        f"{path}: unrecognised checkpoint; expected an official .npz, a Hugging Face ViT, timm or vitkit directory "
        f"(config.json + weights), or a timm state dict ({', '.join(timm.SUFFIXES)})"
    )


def read_checkpoint(
    path: str | Path, format: str | None = None, tower: str | None = None, overrides: dict[str, Any] | None = None
) -> Checkpoint:
    """Read any supported checkpoint into vitkit's naming, with its inferred (or stored) config. ``overrides``
    supply what an official file does not say (big_vision's sincos2d: img_size and pos_embed; pool_type '0':
    classifier='first'); ``tower`` (or 'file.npz:img') reads the image tower of an image-text checkpoint."""
    path = Path(path)
    if tower is None and not path.exists() and (m := re.match(r"^(.+\.npz):([\w/]+)$", str(path))):
        path, tower = Path(m.group(1)), m.group(2)
    fmt = format or detect_format(path)
    if fmt not in _BY_NAME:
        raise UserError(f"format={fmt!r}: expected one of {FORMATS}")
    if tower is not None and fmt != "official":
        raise UserError(f"{path}: tower={tower!r} selects a sub-tree of an official .npz, not of a {fmt} checkpoint")
    return _BY_NAME[fmt].read(path, overrides, tower)


# ------------------------------------------------------------------------------------------------- loading
def _adapt_vit(model: VisionTransformer, ckpt: Checkpoint, state: dict[str, torch.Tensor], report: LoadReport) -> None:
    """Resample position embeddings, drop pre-logits the model lacks, leave a mismatched head fresh."""
    target = model.state_dict()
    pe, want = state.get("pos_embed"), target.get("pos_embed")
    # another grid is resampled; another width stays a shape error below
    if pe is not None and want is not None and pe.shape[-1] == want.shape[-1] and ckpt.grid() != model.grid:
        state["pos_embed"] = resample_pos_embed(pe, model.grid, ckpt.grid(), model.num_prefix_tokens)
        report.resampled.append("pos_embed")
    for key in [k for k in state if k.endswith("attn.rel_pos_embed") and k in target]:  # relative attention tables
        if ckpt.grid() != model.grid and state[key].shape[-1] == target[key].shape[-1]:  # 1-D: shapes may agree
            state[key] = resample_relative(state[key], tuple(target[key].shape[:-1]), ckpt.grid(), model.grid)
            report.resampled.append(key)
    after_rep = "pre_logits.weight" in state and "pre_logits.weight" not in target
    if after_rep:  # the stored head reads the representation, not the tokens: it cannot be kept
        for k in ("pre_logits.weight", "pre_logits.bias"):
            state.pop(k, None)
            report.dropped.append(k)
    elif "head.bias" in state and "head.weight" not in state:
        return  # a head's bias without its weight: no head to take or leave but a file lacking a key, reported below
    _adapt_head(target, state, report, keep=not after_rep)


def _adapt_head(
    target: dict[str, torch.Tensor], state: dict[str, torch.Tensor], report: LoadReport, keep: bool
) -> None:
    """Leave the model's fresh (zero) head where the stored one has another class count (or not ``keep``)."""
    stored = [k for k in ("head.weight", "head.bias") if k in state]
    wanted = [k for k in ("head.weight", "head.bias") if k in target]
    if keep and stored and wanted and state["head.weight"].shape == target["head.weight"].shape:
        return
    for k in stored:
        state.pop(k)
        if k not in target:
            report.dropped.append(k)
    report.reinitialised.extend(wanted)


def read_into(
    model: nn.Module,
    path: str | Path | Checkpoint,
    strict: bool = True,
    format: str | None = None,
    drop: tuple[str, ...] | list[str] = (),
) -> LoadReport:
    """Load a checkpoint of any supported format into a model built for it, adapting what the paper adapts. Position
    embeddings are resampled to the model's grid; pre-logits the model lacks are dropped and the head left fresh, as is
    a head for another class count. Any other difference is a UserError listing it (``strict=False``: the report with
    ``ok`` False). Keys under a ``drop`` prefix, or one the file's metadata lists under "drop_on_load", are left out and
    reported as ``dropped``."""
    if isinstance(path, Checkpoint):
        ckpt = path
    else:  # what a file may not say (a sincos table's grid, pool '0') is the model's: it was built for the file
        config = getattr(model, "config", None)
        own = {k: getattr(config, k) for k in ("img_size", "pos_embed", "classifier") if hasattr(config, k)}
        ckpt = read_checkpoint(path, format, overrides=own if getattr(config, "arch", None) == "vit" else None)
    return _load(model, ckpt, strict, guessed={}, drop=tuple(drop))


def _load(
    model: nn.Module, ckpt: Checkpoint, strict: bool, guessed: dict[str, str], drop: tuple[str, ...] = ()
) -> LoadReport:
    """read_into's work; ``guessed``: the fields of ckpt.guessed the model took unchanged from the file."""
    arch = getattr(getattr(model, "config", None), "arch", None)
    if arch not in ("vit", "resnet", "bit"):
        raise UserError(
            f"load_pretrained: expected a vitkit VisionTransformer, ResNet or BiT, got {type(model).__name__}"
        )
    if arch != ckpt.config.get("arch", "vit"):
        stored = ckpt.config.get("arch", "vit")
        # the bit_r* rows were the post-activation ResNet ('resnet') before they became BiT ResNet-v2 ('bit')
        hint = "; 'resnet' is hybrid_resnet_r*, 'bit' is bit_r*" if {arch, stored} == {"resnet", "bit"} else ""
        raise UserError(f"{ckpt.path}: holds a {stored!r} model, the target is {arch!r}{hint}")
    report = LoadReport(
        str(ckpt.path), ckpt.format, metadata=dict(ckpt.metadata), guessed=dict(guessed), token_merge=ckpt.token_merge
    )
    for name in ckpt.guessed:
        if name not in guessed:
            report.from_caller[name] = f"{name}: {getattr(model.config, name)} (the caller's; the file does not say)"
    state = dict(ckpt.state)
    declared = ckpt.metadata.get("drop_on_load") or []
    prefixes = tuple(drop) + tuple(p for p in declared if isinstance(p, str) and p)
    if prefixes:
        for key in [k for k in state if k.startswith(prefixes)]:
            state.pop(key)
            report.dropped.append(key)
    if arch == "vit":
        assert isinstance(model, VisionTransformer)  # the one model whose config says arch 'vit'
        _adapt_vit(model, ckpt, state, report)
    elif arch == "bit":
        _adapt_head(model.state_dict(), state, report, keep=True)
    target = model.state_dict()
    for k, v in state.items():
        if k in target and v.shape != target[k].shape:
            raise UserError(
                f"{ckpt.path}: key {k!r} has shape {tuple(v.shape)} in the checkpoint but {tuple(target[k].shape)} "
                "in the model"
            )
    report.missing = [k for k in target if k not in state and k not in report.reinitialised]
    report.unexpected = [k for k in state if k not in target]
    if strict and not report.ok:
        raise UserError(f"{ckpt.path}: the weights do not fit the model; {report.mismatch()}")
    model.load_state_dict({k: v for k, v in state.items() if k in target}, strict=False)
    return report


def read_model(
    path: str | Path | Checkpoint,
    format: str | None = None,
    drop: tuple[str, ...] | list[str] = (),
    tower: str | None = None,
    **overrides: Any,
) -> tuple[nn.Module, LoadReport]:
    """Build a model from a checkpoint file alone and load it strictly (see read_into); returns it and the report.
    ``read_model("ViT-B_16.npz", img_size=384, num_classes=10)`` gives a 384-px model with resampled position embeddings
    and a fresh zero head; overrides also say what the file does not (see read_checkpoint). What neither says (a bare
    timm state dict's num_heads and gelu) is guessed, named by one UserWarning and the report."""
    ckpt = path if isinstance(path, Checkpoint) else read_checkpoint(path, format, tower=tower, overrides=overrides)
    arch = ckpt.config.get("arch", "vit")
    known = {f.name for f in fields(config_class(arch)) if f.init}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"load_model: unknown {arch} config field(s) {unknown}; known: {sorted(known)}")
    try:
        model = model_from_config({**ckpt.config, **overrides})
    except ConfigError as e:
        raise ConfigError(f"{ckpt.path}: {e}") from None
    guessed = {name: text for name, text in ckpt.guessed.items() if name not in overrides}
    report = _load(model, ckpt, strict=True, guessed=guessed, drop=tuple(drop))
    if guessed:  # a wrong guess loads without a shape error and computes another function: say so once
        text = f"{ckpt.path}: guessed {'; '.join(guessed.values())}"
        warnings.warn(text, UserWarning, stacklevel=3)  # at the caller of vitkit.load_model
    return model, report


# ---------------------------------------------------------------------------------------------- converting
TARGETS = ("vitkit", "hf", "timm", "official")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['img_size=384', 'num_classes=10', 'gelu=tanh'] -> typed values (YAML scalars and lists)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r}: expected key=value (e.g. img_size=384)")
        out[key.strip()] = yaml.safe_load(value)
    return out


def convert(
    src: str | Path | Checkpoint, dst: str | Path, to: str = "vitkit", force: bool = False, **overrides: Any
) -> Path:
    """Convert a checkpoint of any readable format to another; returns what was written. vitkit and hf write a
    directory; timm a .safetensors file (dst, or dst/model.safetensors) with its hub config.json; official an .npz
    (dst, or dst/model.npz). Overrides change the model first (img_size=384, num_heads=3 for bare timm files). Existing
    outputs are replaced only with ``force``."""
    if to not in TARGETS:
        raise UserError(f"to={to!r}: expected one of {TARGETS}")
    dst = Path(dst)
    if to in ("vitkit", "hf"):
        outputs = [dst / native.CONFIG_NAME, dst / native.WEIGHTS_NAME]
    elif to == "timm":
        weights = dst if dst.suffix == ".safetensors" else dst / "model.safetensors"
        outputs = [weights, weights.with_name(timm.CONFIG_NAME)]
    else:
        outputs = [dst if dst.suffix == ".npz" else dst / "model.npz"]
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not force:
        raise UserError(f"{', '.join(existing)}: exists; pass --force (force=True) to replace it")
    model, report = read_model(src, **overrides)
    # a layout the target cannot hold is refused before anything is written (it would read back as another model)
    if to == "timm":
        timm.check_exportable(model)
    elif to == "official":
        official.check_exportable(model)
    metadata = report.metadata
    source = str(src.path if isinstance(src, Checkpoint) else src)
    prep = read_preprocessing(metadata, config_of(model).to_dict(), source)  # the record, at the model's own size
    if to == "vitkit":
        return native.save_pretrained(model, dst, metadata={**metadata, **prep.to_dict()})
    if to == "hf":
        return hf.save_hf(model, dst, preprocessing=prep)
    if to == "timm":
        return timm.save_timm(model, outputs[0], prep)
    out = outputs[0]
    params = official.vitkit_to_official(model)

    def write_npz(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object, so numpy does not append '.npz' to the temp name
            np.savez(f, allow_pickle=False, **params)

    atomic_write(out, write_npz)
    return out
