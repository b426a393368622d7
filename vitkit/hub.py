"""Models by name, with weights: ``create_model("vit_b16", pretrained="augreg_in21k_ft_in1k")``,
``load_model("vit_b16.orig_in21k")`` or ``load_model("runs/digits")``.

The model table (vitkit.models) builds models with random weights and knows nothing of files; this module
joins it to the checkpoint readers (vitkit.checkpoint) and to the table of released weights
(vitkit.pretrained), one floor up. A pretrained tag is downloaded on first use (network access needed once),
then read from the cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, overload

from torch import nn

from . import pretrained as released
from .checkpoint import loader
from .checkpoint.loader import Checkpoint, LoadReport
from .config_of import config_of
from .errors import UserError
from .models import registry

__all__ = ["create_model", "load_model", "load_pretrained", "read_checkpoint", "resolve_checkpoint"]


def _row_for(name_or_path: str | Path, model: str | None = None) -> released.PretrainedRow | None:
    """The pretrained row a string names, or None when it is a path.

    An existing path is a path. Otherwise a tag ``<model>.<weights>`` of a registered model is a tag (an
    unknown one is an error naming the known ones); given ``model``, a bare weights name of it is too.
    """
    if not isinstance(name_or_path, str) or Path(name_or_path).exists():
        return None
    if released.is_tag(name_or_path):
        return released.get_pretrained(name_or_path)
    if model is not None and released.is_tag(f"{model}.{name_or_path}"):
        return released.get_pretrained(f"{model}.{name_or_path}")
    return None


def resolve_checkpoint(name_or_path: str | Path) -> str | Path | Checkpoint:
    """What a command that takes a checkpoint reads: a path as it is (read later, with the command's overrides),
    a pretrained tag as its file read with its row's settings (downloaded on first use)."""
    row = _row_for(name_or_path)
    return name_or_path if row is None else _read_row(row)


def create_model(name: str, pretrained: str | Path | None = None, **overrides: Any) -> nn.Module:
    """A registered model, optionally with overrides (``num_classes=10``, ``img_size=384``, ``dropout=0.1``).

    ``pretrained`` is a weights name of this model (``"augreg_in21k_ft_in1k"``, see ``vitkit models
    --pretrained``), a full tag (``"vit_b16.augreg_in21k_ft_in1k"``) or a checkpoint path in any format
    ``vitkit.load_pretrained`` reads. For released weights the model is first built the way they need
    (their class count, pre-logits layer and resolution), then changed by the overrides. Loading is strict:
    position embeddings are resampled to the model's resolution and, for another class count, the head is
    fresh (both reported by ``load_pretrained``); any other difference is an error listing the keys.
    """
    row = None if pretrained is None else _row_for(pretrained, model=name)
    if row is not None and row.model != name:
        raise UserError(f"pretrained={pretrained!r} holds weights of {row.model}, not of {name}")
    model = registry.create_model(name, **{**(row.config if row else {}), **overrides})
    if pretrained is not None:
        load_pretrained(model, row.tag if row is not None else pretrained)
    return model


def read_checkpoint(name_or_path: str | Path) -> Checkpoint:
    """A checkpoint by path or pretrained tag, read into vitkit's naming: for a tag, with what the table says of
    its weights (config fields the file leaves unsaid, class names, preprocessing) over what the file says."""
    row = _row_for(name_or_path)
    return loader.read_checkpoint(name_or_path) if row is None else _read_row(row)


# config fields a weights file may leave unsaid (a bare timm state dict: its head count and GELU); for a tag
# the table's values are passed, so nothing is guessed and load_model builds what create_model builds
_UNSTATED = ("num_heads", "gelu", "ln_eps")


def _read_row(row: released.PretrainedRow) -> Checkpoint:
    """The one place a pretrained row's settings meet its file: the config fields the file leaves unsaid (no
    longer guessed), and the row's preprocessing, classes and provenance over the file's own metadata."""
    ckpt = released.read_pretrained(row)  # the row's file, checked against the row
    stated = {k: v for k, v in row.config.items() if k in _UNSTATED}
    ckpt.config.update(stated)
    ckpt.guessed = {k: v for k, v in ckpt.guessed.items() if k not in row.config}
    ckpt.metadata = {**ckpt.metadata, **row.metadata()}
    return ckpt


def load_pretrained(
    model: nn.Module,
    source: str | Path | Checkpoint,
    strict: bool = True,
    format: str | None = None,
    drop: tuple[str, ...] | list[str] = (),
) -> LoadReport:
    """Load a checkpoint (a path in any format, a pretrained tag, downloaded on first use, or a read Checkpoint)
    into a model built for it; see vitkit.checkpoint.loader.read_into for what is adapted and what is an error."""
    row = None if isinstance(source, Checkpoint) else _row_for(source)
    ckpt = _read_row(row) if row is not None else source
    return loader.read_into(model, ckpt, strict=strict, format=format, drop=drop)


@overload
def load_model(
    name_or_path: str | Path | Checkpoint,
    return_metadata: Literal[False] = False,
    format: str | None = None,
    return_report: Literal[False] = False,
    **overrides: Any,
) -> nn.Module: ...
@overload
def load_model(
    name_or_path: str | Path | Checkpoint,
    return_metadata: Literal[True],
    format: str | None = None,
    return_report: Literal[False] = False,
    **overrides: Any,
) -> tuple[nn.Module, dict[str, Any]]: ...
@overload
def load_model(
    name_or_path: str | Path | Checkpoint,
    return_metadata: Literal[False] = False,
    format: str | None = None,
    *,
    return_report: Literal[True],
    **overrides: Any,
) -> tuple[nn.Module, LoadReport]: ...
@overload
def load_model(
    name_or_path: str | Path | Checkpoint,
    return_metadata: Literal[True],
    format: str | None = None,
    *,
    return_report: Literal[True],
    **overrides: Any,
) -> tuple[nn.Module, dict[str, Any], LoadReport]: ...
def load_model(
    name_or_path: str | Path | Checkpoint,
    return_metadata: bool = False,
    format: str | None = None,
    return_report: bool = False,
    **overrides: Any,
) -> (
    nn.Module
    | tuple[nn.Module, dict[str, Any]]
    | tuple[nn.Module, LoadReport]
    | tuple[nn.Module, dict[str, Any], LoadReport]
):
    """Build a model from a pretrained tag or a checkpoint file alone and load it; overrides change its config.

    ``load_model("vit_b16.augreg_in21k_ft_in1k")`` downloads the released file on first use;
    ``load_model("ViT-B_16.npz", img_size=384, num_classes=10)`` reads a file (see
    vitkit.checkpoint.loader.read_model: the configuration comes from the file, loading is strict; ``drop`` and
    ``tower`` pass through to it). Returns the model, then the metadata with return_metadata, then the LoadReport
    with return_report, as a tuple when either is asked for. For a tag the metadata is what the table says of
    the weights (class names, preprocessing, source, licence) over what the file says of itself.
    """
    row = None if isinstance(name_or_path, Checkpoint) else _row_for(name_or_path)
    source = _read_row(row) if row is not None else name_or_path
    model, report = loader.read_model(source, format=format, **overrides)
    metadata = report.metadata
    if row is not None:
        if len(metadata.get("class_names") or ()) != config_of(model).num_classes:
            metadata.pop("class_names", None)  # another head was asked for: the released names do not apply
        if "img_size" in overrides:
            metadata["img_size"] = overrides["img_size"]
    if return_metadata and return_report:
        return model, metadata, report
    if return_metadata:
        return model, metadata
    if return_report:
        return model, report
    return model
