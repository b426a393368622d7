"""Models by name, with weights, the way timm and Hugging Face users expect them: THE public loader, joining the
model table (vitkit.models) to the checkpoint readers (vitkit.checkpoint) and the released weights.

``create_model("vit_b16", pretrained=True)`` builds a model with its default weights, ``load_model(name_or_path)``
one from a tag or a checkpoint in any format, ``preprocess(model, images)`` the batch its weights expect. A name is
a registered model, a tag ``<model>.<weights>`` or a timm / Hugging Face name of either; weights vitkit has no
row for are an error, never another file. A loaded model carries its preprocessing as ``model.preprocessing``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
from PIL import Image
from torch import nn

from .checkpoint import loader
from .checkpoint.loader import Checkpoint, LoadReport
from .config_of import config_of
from .data import IMAGE_EXTENSIONS, image_transform, load_image
from .data.transforms import decode_image, image_from_pixels
from .errors import UserError, UserFileNotFoundError
from .models import VisionTransformer, registry
from .preprocessing import Preprocessing, read_preprocessing
from .pretrained import PretrainedRow, get_pretrained, is_tag, read_pretrained
from .pretrained.names import HF_NAMES, TIMM_ARCHS, Resolved, name_hint, resolve_name

PREPROCESSING_ATTR = "preprocessing"  # where a loaded model keeps its weights' record (timm: pretrained_cfg)


def _is_known_name(text: str) -> bool:
    """Whether vitkit resolves (or explains) this name: a registered or renamed model, a tag, a timm / HF name."""
    arch = text.partition(".")[0]
    known = (*registry.MODELS, *registry.RENAMED, *HF_NAMES, *TIMM_ARCHS)
    return text in known or arch in known or arch.lower() in registry.KNOWN_AS or is_tag(text)


def _reads_as_name(text: str) -> bool:
    """Whether an unknown string that is no path reads as a misspelt name: a Hub name, or a bare word."""
    if text.startswith(("google/", "timm/")):
        return True
    return "/" not in text and os.sep not in text and not Path(text).suffix


def _row_for(name_or_path: str | Path, model: str | None = None) -> PretrainedRow | None:
    """The pretrained row a tag, a timm / HF name or a model name (its default weights) names, or with ``model``
    a weights name of it; None for a path. An unknown string that reads as a name is a UserFileNotFoundError."""
    if not isinstance(name_or_path, str) or Path(name_or_path).exists():
        return None
    if model is not None and is_tag(f"{model}.{name_or_path}"):
        return get_pretrained(f"{model}.{name_or_path}")
    if _is_known_name(name_or_path):
        resolved = resolve_name(name_or_path, pretrained=True)
        tag = resolved.tag or resolved.default_tag
        assert tag is not None, f"{name_or_path}: resolve_name(pretrained=True) gave no weights"
        return get_pretrained(tag)
    if not _reads_as_name(name_or_path):
        return None
    hint = name_hint(name_or_path, otherwise="see vitkit.list_models() and vitkit.list_pretrained()")
    raise UserFileNotFoundError(f"{name_or_path!r} is neither a file nor a model name; {hint}")


def resolve_checkpoint(name_or_path: str | Path) -> str | Path | Checkpoint:
    """What a command that takes a checkpoint reads: a path as it is, a tag or alias as its row's Checkpoint."""
    row = _row_for(name_or_path)
    return name_or_path if row is None else _read_row(row)


def create_model(
    name: str, pretrained: bool | str | Path | None = False, *, token_merge: int = 0, **overrides: Any
) -> nn.Module:
    """Build a model by name, with random (official) initialisation or with released weights.

    Args:
        name: a registered model (``"vit_b16"``), a tag (``"vit_b16.augreg_in21k"``: the architecture those
            weights need, their class count and resolution), or a timm / Hugging Face name
            (``"vit_base_patch16_384"``: vit_b16 at 384 pixels; ``"google/vit-base-patch16-224"``).
        pretrained: ``False`` (or None) for random weights; ``True`` for the weights the name gives, else the
            model's default (``vitkit.pretrained.DEFAULT_WEIGHTS``: the recommended ImageNet-1k fine-tune); or a
            weights name of this model (``"augreg_in21k_ft_in1k"``), a full tag, or a checkpoint path.
        token_merge: tokens merged in each block (token merging, ToMe), a speed patch applied from outside
            (vitkit.accel.tome); 0 leaves the model as the paper's.
        **overrides: config fields to change (``num_classes=10``, ``img_size=384``, ``dropout=0.1``).

    Returns:
        The model (in training mode). With weights, it is built the way they need, then changed by the
        overrides: position embeddings are resampled and, for another class count, the head is fresh; any other
        difference is an error listing the keys. It carries the weights' preprocessing as ``model.preprocessing``.

    Raises:
        UserError: an unknown name (with the closest names), weights of another model, or weights the table
            does not hold.

    Example:
        >>> model = vitkit.create_model("vit_s16", pretrained=True)  # doctest: +SKIP
        >>> batch = vitkit.preprocess(model, ["cat.jpg"])  # doctest: +SKIP
    """
    resolved = resolve_name(name, pretrained=pretrained is True)
    row, weights = _weights_of(name, resolved, pretrained)
    built = dict(row.config) if row is not None else {}
    if resolved.img_size is not None and resolved.tag is None:  # an alias of an architecture: its resolution
        built["img_size"] = resolved.img_size
    model = registry.create_model(resolved.model, **{**built, **overrides})
    if weights is not None:
        report = load_pretrained(model, weights)
        _keep_preprocessing(model, report.metadata, str(weights))
    _merge_tokens(model, token_merge)
    return model


def _weights_of(
    name: str, resolved: Resolved, pretrained: bool | str | Path | None
) -> tuple[PretrainedRow | None, str | Path | None]:
    """(the row of the weights create_model loads, what to load: a tag or a path), each None when there is none."""
    if not isinstance(pretrained, (str, Path)):
        tag = resolved.tag or (resolved.default_tag if pretrained else None)
        return (None if tag is None else get_pretrained(tag)), (tag if pretrained else None)
    if resolved.tag is not None:
        raise UserError(f"{name!r} already names weights ({resolved.tag}); pass pretrained=True, not {pretrained!r}")
    row = _row_for(pretrained, model=resolved.model)
    if row is not None and row.model != resolved.model:
        raise UserError(f"pretrained={pretrained!r} holds weights of {row.model}, not of {resolved.model}")
    return row, (row.tag if row is not None else pretrained)


def _merge_tokens(model: nn.Module, token_merge: int) -> None:
    """Token merging (vitkit.accel.tome, imported only when asked for), ``token_merge`` tokens a block; 0: none."""
    if not token_merge:
        return
    if not isinstance(model, VisionTransformer):
        raise UserError(f"token_merge={token_merge}: merging needs a VisionTransformer, not {type(model).__name__}")
    from .accel.tome import apply_token_merging

    apply_token_merging(model, token_merge)


def _keep_preprocessing(model: nn.Module, metadata: Mapping[str, Any], source: str) -> None:
    """Keep the weights' preprocessing record on the model just built, without class names that miss its head."""
    prep = read_preprocessing(metadata, config_of(model).to_dict(), source)
    if prep.class_names is not None and len(prep.class_names) != config_of(model).num_classes:
        prep = replace(prep, class_names=None)
    setattr(model, PREPROCESSING_ATTR, prep)


def read_checkpoint(name_or_path: str | Path) -> Checkpoint:
    """A checkpoint by path or pretrained tag (the table's word over the file's), read into vitkit's naming."""
    row = _row_for(name_or_path)
    return loader.read_checkpoint(name_or_path) if row is None else _read_row(row)


# config fields a weights file may leave unsaid (a bare timm state dict's), for a tag the table's: never guessed
_UNSTATED = ("num_heads", "gelu", "ln_eps")


def _read_row(row: PretrainedRow) -> Checkpoint:
    """A row's file with the config fields it leaves unsaid, and the row's metadata over the file's own."""
    ckpt = read_pretrained(row)  # the row's file, checked against the row
    ckpt.config.update({k: v for k, v in row.config.items() if k in _UNSTATED})
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
    """Load a checkpoint into a model built for it.

    Args:
        model: the model to load into (changed in place).
        source: a checkpoint path in any format, a tag or a timm / Hugging Face name of released weights
            (downloaded on first use), or a read Checkpoint.
        strict: refuse any key that neither fits nor is reported as adapted.
        format: the checkpoint format, when it cannot be told from the file.
        drop: parameter names to leave out of the load.

    Returns:
        The LoadReport: what was resampled and reset (see vitkit.checkpoint.loader.read_into).
    """
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
    token_merge: int | None = None,
    **overrides: Any,
) -> (
    nn.Module
    | tuple[nn.Module, dict[str, Any]]
    | tuple[nn.Module, LoadReport]
    | tuple[nn.Module, dict[str, Any], LoadReport]
):
    """Build a model from weights alone: a tag, a timm / Hugging Face name, a model name, or a checkpoint file.

    Args:
        name_or_path: a tag (``"vit_b16.augreg_in21k_ft_in1k"``, downloaded on first use), a timm or Hugging
            Face name of released weights (``"vit_base_patch16_224.augreg_in21k"``,
            ``"google/vit-base-patch16-224"``), a registered model (its default weights, as
            ``create_model(name, pretrained=True)``), a checkpoint path in any supported format
            (``"ViT-B_16.npz"``, ``"runs/digits"``), or a read Checkpoint.
        return_metadata: also return the checkpoint's metadata (for released weights, the table's over the file's).
        format: the checkpoint format, when it cannot be told from the file.
        return_report: also return the LoadReport (what was resampled, reset or dropped).
        token_merge: tokens merged in each block (as ``create_model``'s); None: what the file says, else none.
        **overrides: config fields to change (``img_size=384``, ``num_classes=10``); ``drop`` and ``tower``
            pass through to vitkit.checkpoint.loader.read_model.

    Returns:
        The model (its config from the file, loaded strictly, its preprocessing as ``model.preprocessing``), then
        the metadata with return_metadata, then the LoadReport with return_report (a tuple when either is asked).

    Raises:
        UserError: an unknown name (with the closest names), weights the table does not hold, or a checkpoint
            that does not fit; UserFileNotFoundError (also a FileNotFoundError) for a missing path.
    """
    row = None if isinstance(name_or_path, Checkpoint) else _row_for(name_or_path)
    source = _read_row(row) if row is not None else name_or_path
    model, report = loader.read_model(source, format=format, **overrides)
    metadata = report.metadata
    if row is not None and len(metadata.get("class_names") or ()) != config_of(model).num_classes:
        metadata.pop("class_names", None)  # another head was asked for: the released names do not apply
    if row is not None and "img_size" in overrides:
        metadata["img_size"] = overrides["img_size"]
    label = row.tag if row is not None else getattr(name_or_path, "path", name_or_path)
    _keep_preprocessing(model, metadata, str(label))
    _merge_tokens(model, report.token_merge if token_merge is None else token_merge)
    if return_metadata and return_report:
        return model, metadata, report
    if return_metadata:
        return model, metadata
    if return_report:
        return model, report
    return model


# ------------------------------------------------------------------------------------------- images -> tensors
def preprocessing_of(source: nn.Module | str | Path | Checkpoint | Preprocessing) -> Preprocessing:
    """The preprocessing record of a model or of weights: what images the weights expect.

    Args:
        source: a model (its ``model.preprocessing``, else the paper's [-1, 1] pixels at its resolution), a tag or
            a timm / Hugging Face name (the table's record, nothing downloaded), a checkpoint path or a read
            Checkpoint (the file's record), or a Preprocessing itself.

    Returns:
        The one record (vitkit.preprocessing.Preprocessing).
    """
    if isinstance(source, Preprocessing):
        return source
    if isinstance(source, nn.Module):
        kept = getattr(source, PREPROCESSING_ATTR, None)
        return kept if isinstance(kept, Preprocessing) else read_preprocessing(None, config_of(source).to_dict())
    if isinstance(source, Checkpoint):
        return source.preprocessing
    row = _row_for(source)
    return row.preprocessing() if row is not None else loader.read_checkpoint(source).preprocessing


ImageInput = Image.Image | np.ndarray | torch.Tensor | str | Path
Pixels = (Image.Image, np.ndarray, torch.Tensor)


def _image_list(images: ImageInput | Sequence[ImageInput]) -> list[Image.Image | np.ndarray | torch.Tensor | Path]:
    """PIL images, arrays, tensors and files, in order; a folder stands for its image files, sorted by name."""
    items = [images] if isinstance(images, (*Pixels, str, Path)) else list(images)
    out: list[Image.Image | np.ndarray | torch.Tensor | Path] = []
    for item in items:
        if isinstance(item, Pixels):
            out.append(item)
            continue
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
            if not files:
                raise UserError(
                    f"{path}: folder has no images (expected files ending in {', '.join(IMAGE_EXTENSIONS)})"
                )
            out.extend(files)
        else:
            out.append(path)
    if not out:
        raise UserError("preprocess: no images given")
    return out


def preprocess(
    source: nn.Module | str | Path | Checkpoint | Preprocessing, images: ImageInput | Sequence[ImageInput]
) -> torch.Tensor:
    """Turn images into the batch a model's weights expect, with the weights' own preprocessing.

    Args:
        source: what the images are for: a model from ``create_model`` / ``load_model``, a tag or a timm /
            Hugging Face name, a checkpoint path, a Checkpoint or a Preprocessing (see ``preprocessing_of``).
        images: a PIL image, an (H, W, C) array or (C, H, W) tensor of uint8 pixels or floats in [0, 1], an image
            file, a folder (its image files, sorted by name), or a sequence of these. Each is decoded as 8-bit RGB
            (EXIF orientation applied, alpha composited onto white); the caller's images stay open and unchanged.

    Returns:
        A float32 tensor (B, C, H, W): each image resized bilinearly (and centre-cropped for a crop fraction
        below 1), scaled to [0, 1] and normalised with the record's mean and std.

    Raises:
        UserError: an unreadable image, an array of another shape or dtype, an empty folder, or a record whose
            input is not square.

    Example:
        >>> model = vitkit.load_model("vit_b16.augreg_in21k_ft_in1k")  # doctest: +SKIP
        >>> logits = model.eval()(vitkit.preprocess(model, ["cat.jpg", "dog.png"]))  # doctest: +SKIP
    """
    prep = preprocessing_of(source)
    prep.square_size(str(source) if isinstance(source, (str, Path)) else "preprocess")
    transform = image_transform(prep)
    return torch.stack([transform(_decoded(item, i)) for i, item in enumerate(_image_list(images))])  # (B, C, H, W)


def _decoded(item: Image.Image | np.ndarray | torch.Tensor | Path, i: int) -> Image.Image:
    if isinstance(item, Image.Image):
        return decode_image(item, close=False)  # the caller's image, left open
    if isinstance(item, (np.ndarray, torch.Tensor)):
        return image_from_pixels(item, f"preprocess: image {i}")
    return load_image(item)
