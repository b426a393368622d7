"""What a checkpoint expects as input and what its outputs are called: one record, ``Preprocessing``, and one
function that reads it, ``read_preprocessing(metadata, model_config)``, through which every command and exporter
goes; each format's reader turns its own spelling into the record's names. What no one states is the official
code's: the whole image resized bilinearly to the model's resolution, pixels in [-1, 1] (mean = std = 0.5).

mean / std are per channel in [0, 1] pixel units. ``crop_fraction`` 1 resizes the whole image to the square
input; below 1 the short side is resized to ``img_size / crop_fraction`` and the centre cropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

import torch

from .errors import UserError
from .pixels import unnormalise

HALF = 0.5  # the paper's pixels in [-1, 1]: (x / 255 - 0.5) / 0.5
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
# keys under which older vitkit checkpoints and hand-written ones nest their preprocessing fields
NESTED_KEYS = ("data_info", "dataset_info", "dataset", "info", "data")
ONNX_KEY = "vitkit.preprocessing"
# PIL's resampling codes, as transformers' image processors store them
PIL_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}


@dataclass(frozen=True)
class Preprocessing:
    """How an image file becomes a model input, and what the outputs are called."""

    img_size: int | tuple[int, int]  # an int for a square input, else (height, width)
    mean: list[float] = field(default_factory=lambda: [HALF] * 3)
    std: list[float] = field(default_factory=lambda: [HALF] * 3)
    in_chans: int = 3
    crop_fraction: float = 1.0
    interpolation: str = "bilinear"  # how the source resized; vitkit's evaluation transform resizes bilinearly
    class_names: list[str] | None = None

    def __post_init__(self) -> None:
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise UserError(
                f"preprocessing: mean {self.mean} and std {self.std} need one value per channel ({self.in_chans})"
            )
        if any(s <= 0 for s in self.std):
            raise UserError(f"preprocessing.std: every value must be > 0, got {self.std}")
        if not 0.0 < self.crop_fraction <= 1.0:
            raise UserError(f"preprocessing.crop_fraction: expected a value in (0, 1], got {self.crop_fraction}")
        if self.interpolation not in INTERPOLATIONS:
            raise UserError(
                f"preprocessing.interpolation: expected one of {INTERPOLATIONS}, got {self.interpolation!r}"
            )
        if min(self.size) < 1:
            raise UserError(f"preprocessing.img_size: expected positive integers, got {self.img_size}")

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the input."""
        return (self.img_size, self.img_size) if isinstance(self.img_size, int) else self.img_size

    def square_size(self, source: str = "preprocessing") -> int:
        """The side of a square input; another shape is a UserError (vitkit's image transform makes squares)."""
        h, w = self.size
        if h != w:
            raise UserError(f"{source}: the model takes {h}x{w} inputs; only square inputs are supported here")
        return h

    # ---------------------------------------------------------------------------------------- vitkit's own
    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON (vitkit checkpoint metadata keys); class_names only when known."""
        doc = asdict(self)
        if isinstance(self.img_size, tuple):
            doc["img_size"] = list(self.img_size)
        if doc["class_names"] is None:
            del doc["class_names"]
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], source: str = "preprocessing") -> Preprocessing:
        """The record from ``to_dict``'s keys; an unknown key or a wrong value is a UserError naming source."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise UserError(f"{source}: unknown preprocessing keys {unknown}; expected some of {sorted(known)}")
        if "img_size" not in doc:
            raise UserError(f"{source}: no img_size")
        return read_preprocessing(doc, source=source)

    def to_display(self, x: torch.Tensor) -> torch.Tensor:
        """Undo the normalisation of one input (C, H, W) -> (H, W, C) pixels in [0, 1], for figures."""
        return unnormalise(x, self.mean, self.std).permute(1, 2, 0)

    def data_fields(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of a training config's data section this record sets (img_size, mean, std, eval crop); mean
        / std the metadata does not state stay one value (0.5), so data with another channel count takes them."""
        said = stated(metadata)
        out: dict[str, Any] = {
            "img_size": self.size[0],
            "mean": list(self.mean) if "mean" in said else HALF,
            "std": list(self.std) if "std" in said else HALF,
        }
        if "crop_fraction" in said:
            out["eval_crop_fraction"] = self.crop_fraction
        return out

    def with_classes(self, names: Sequence[str] | None) -> Preprocessing:
        return replace(self, class_names=[str(n) for n in names] if names else None)

    # ----------------------------------------------------------------------------------- other formats
    def to_hf_processor(self) -> dict[str, Any]:
        """preprocessor_config.json for transformers' AutoImageProcessor: ViTImageProcessor, or for a centre crop
        below 384 pixels ConvNextImageProcessor's crop_pct (the same rule, up to the long side's last pixel)."""
        common: dict[str, Any] = dict(
            do_resize=True,
            resample=PIL_RESAMPLE[self.interpolation],
            do_rescale=True,
            rescale_factor=1 / 255,
            do_normalize=True,
            image_mean=list(self.mean),
            image_std=list(self.std),
        )
        h, w = self.size
        if self.crop_fraction == 1.0:
            return dict(image_processor_type="ViTImageProcessor", size={"height": h, "width": w}, **common)
        side = self.square_size("preprocessing: a centre crop")
        if side >= 384:  # ConvNext's processor does not crop from 384 pixels up
            raise UserError(
                f"preprocessing: a {self.crop_fraction} centre crop at {self.img_size} pixels has no transformers "
                "image processor; export at crop fraction 1 or below 384 pixels"
            )
        return dict(
            image_processor_type="ConvNextImageProcessor",
            size={"shortest_edge": side},
            crop_pct=self.crop_fraction,
            **common,
        )

    def to_timm_pretrained_cfg(self, num_classes: int) -> dict[str, Any]:
        """The preprocessing part of timm's pretrained_cfg (input_size, mean, std, crop_pct, interpolation)."""
        cfg: dict[str, Any] = dict(
            input_size=[self.in_chans, *self.size],
            interpolation=self.interpolation,
            mean=list(self.mean),
            std=list(self.std),
            crop_pct=self.crop_fraction,
            num_classes=num_classes,
        )
        if self.class_names:
            cfg["label_names"] = list(self.class_names)
        return cfg

    def to_onnx_metadata(self) -> dict[str, str]:
        """metadata_props of an ONNX file: the record as JSON under one key, the class names as a JSON list."""
        out = {ONNX_KEY: json.dumps(self.to_dict())}
        if self.class_names:
            out["class_names"] = json.dumps(list(self.class_names))
        return out


# ---------------------------------------------------------------------------------------------- reading
_FIELDS = ("class_names", "img_size", "mean", "std", "in_chans", "crop_fraction", "interpolation")


def stated(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The preprocessing fields a metadata dict states: at its top level, else under one of NESTED_KEYS."""
    if any(k in metadata for k in _FIELDS):
        return {k: metadata[k] for k in _FIELDS if k in metadata}
    for key in NESTED_KEYS:
        nested = metadata.get(key)
        if isinstance(nested, Mapping) and any(k in nested for k in _FIELDS):
            return {k: nested[k] for k in _FIELDS if k in nested}
    return {}


def channel_stats(value: Any, in_chans: int, name: str, source: str) -> list[float]:
    """A mean or std given as one number or one per channel -> ``in_chans`` floats."""
    try:
        values = [float(value)] * in_chans if isinstance(value, (int, float)) else [float(v) for v in value]
    except (TypeError, ValueError):
        raise UserError(f"{source}.{name}: expected a number or one per channel, got {value!r}") from None
    if len(values) == 1:
        values = values * in_chans
    if len(values) != in_chans:
        raise UserError(f"{source}.{name}: expected one value or {in_chans} (one per channel), got {values}")
    return values


def _size(size: Any, source: str) -> int | tuple[int, int]:
    """An input size given as an int or (h, w): an int when square, else (h, w)."""
    if isinstance(size, (list, tuple)):
        if len(size) != 2:
            raise UserError(f"{source}: img_size {list(size)}: expected one number or (height, width)")
        h, w = (int(s) for s in size)
        return h if h == w else (h, w)
    return int(size)


def read_preprocessing(
    metadata: Mapping[str, Any] | None,
    model_config: Mapping[str, Any] | None = None,
    source: str = "checkpoint metadata",
) -> Preprocessing:
    """The record of weights: what their metadata states, the defaults for the rest. ``model_config`` gives the
    default size (a ViT's own, without dynamic image size) and the channels (a contradiction is a UserError)."""
    info, config = stated(metadata or {}), model_config or {}
    model_size = None if config.get("img_size") is None else _size(config["img_size"], source)
    size = info.get("img_size", model_size)
    if model_size is not None and config.get("arch", "vit") == "vit" and not config.get("dynamic_img_size", False):
        size = model_size
    if size is None:
        raise UserError(f"{source}: no img_size, and no model to take it from")
    in_chans = config.get("in_chans")
    chans = int(info.get("in_chans", in_chans if in_chans is not None else 3))
    if in_chans is not None and chans != in_chans:
        raise UserError(f"{source}: in_chans={chans} but the model takes {in_chans} channels")
    names = info.get("class_names")
    return Preprocessing(
        img_size=_size(size, source),
        mean=channel_stats(info.get("mean", HALF), chans, "mean", source),
        std=channel_stats(info.get("std", HALF), chans, "std", source),
        in_chans=chans,
        crop_fraction=float(info.get("crop_fraction", 1.0)),
        interpolation=str(info.get("interpolation", "bilinear")),
        class_names=[str(n) for n in names] if names else None,
    )


def class_names_from_labels(labels: Any) -> list[str] | None:
    """Class names from an index -> name mapping (HF id2label, timm label_names) or a list; None when the ids
    have gaps or the names are HF's placeholders LABEL_0, LABEL_1, ..."""
    if isinstance(labels, Mapping):
        ids = [str(i) for i in range(len(labels))]
        by_str = {str(k): v for k, v in labels.items()}
        if set(by_str) != set(ids):
            return None
        labels = [by_str[i] for i in ids]
    if not isinstance(labels, list) or not labels:
        return None
    names = [str(n) for n in labels]
    return None if names == [f"LABEL_{i}" for i in range(len(names))] else names


class DataInfo(Protocol):
    """What a training run knows of its data (vitkit.data.DatasetInfo), as far as preprocessing goes."""

    class_names: list[str]
    in_chans: int
    img_size: int
    mean: list[float]
    std: list[float]
    crop_fraction: float


def from_data_info(info: DataInfo) -> Preprocessing:
    """The record of a training run's data, written into its checkpoint's metadata."""
    return Preprocessing(
        img_size=info.img_size,
        mean=[float(v) for v in info.mean],
        std=[float(v) for v in info.std],
        in_chans=info.in_chans,
        crop_fraction=info.crop_fraction,
        class_names=[str(n) for n in info.class_names] or None,
    )


def from_hf_processor(doc: Mapping[str, Any], source: str = "preprocessor_config.json") -> dict[str, Any]:
    """The fields a transformers preprocessor_config.json states, in the record's names (x / 255 pixels only)."""
    out: dict[str, Any] = {}
    if doc.get("do_rescale", True) and abs(float(doc.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12:
        raise UserError(f"{source}: rescale_factor={doc.get('rescale_factor')}; vitkit's pixels are x / 255")
    size = doc.get("size")
    if isinstance(size, Mapping):
        if "height" in size and "width" in size:
            out["img_size"] = _size((size["height"], size["width"]), source)
        elif "shortest_edge" in size:
            out["img_size"] = int(size["shortest_edge"])
    elif isinstance(size, int):
        out["img_size"] = size
    if doc.get("do_normalize", True):
        for theirs, ours in (("image_mean", "mean"), ("image_std", "std")):
            if doc.get(theirs) is not None:
                out[ours] = [float(v) for v in doc[theirs]]
    else:
        out.update(mean=0.0, std=1.0)
    if doc.get("crop_pct") is not None and doc.get("image_processor_type") == "ConvNextImageProcessor":
        out["crop_fraction"] = float(doc["crop_pct"])
    resample = doc.get("resample", PIL_RESAMPLE["bilinear"])  # a PIL code, or (newer files) its name
    name = resample if resample in INTERPOLATIONS else {c: n for n, c in PIL_RESAMPLE.items()}.get(resample)
    if name is not None:
        out["interpolation"] = name
    return out


def from_timm_config(doc: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields a timm config.json states (its pretrained_cfg and label_names), in the record's names."""
    if not doc:
        return {}
    pretrained = doc.get("pretrained_cfg") or {}
    out: dict[str, Any] = {}
    names = class_names_from_labels(doc.get("label_names", pretrained.get("label_names")))
    if names:
        out["class_names"] = names
    for theirs, ours in (("mean", "mean"), ("std", "std"), ("crop_pct", "crop_fraction")):
        if pretrained.get(theirs) is not None:
            out[ours] = pretrained[theirs]
    size = pretrained.get("input_size")
    if isinstance(size, list) and len(size) == 3:
        out["in_chans"] = int(size[0])
        out["img_size"] = _size(size[1:], "pretrained_cfg.input_size")
    if pretrained.get("interpolation") in INTERPOLATIONS:
        out["interpolation"] = pretrained["interpolation"]
    return out


def from_onnx_metadata(props: Mapping[str, str], source: str = "ONNX metadata_props") -> Preprocessing:
    """The record an ONNX export stored (``to_onnx_metadata``)."""
    if ONNX_KEY not in props:
        raise UserError(f"{source}: no {ONNX_KEY!r} entry; not exported by vitkit with its preprocessing")
    return Preprocessing.from_dict(json.loads(props[ONNX_KEY]), source)
