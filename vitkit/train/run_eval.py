"""Which data a checkpoint is scored on (``checkpoint_data``, for eval, fewshot and inspect alike), and ``vitkit
eval``: top-1, top-5 and cross-entropy on it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..data import DataConfig, build_datasets
from ..errors import UserError
from ..models import BiTConfig, ResNetConfig, ViTConfig
from ..predict import Preprocessing, load_for_inference
from .config_files import data_section
from .distributed import pick_device
from .objectives import evaluate
from .recipe import config_from_dict

NO_DATA = "the checkpoint does not record its data; name it with --data (e.g. digits)"


def untrained_head(path: str | Path, metadata: dict[str, Any]) -> str | None:
    """The warning for a checkpoint whose classifier head was never trained (objective=mpp), or None."""
    if metadata.get("objective") != "mpp":
        return None
    return (
        f"{path} is a masked patch prediction run (run.objective=mpp): its classifier head was never trained, so "
        f"its class scores are chance; fine-tune it first (vitkit finetune {path} --data DATA), or score its "
        f"features with vitkit fewshot {path}"
    )


def records_data(path: str | Path, metadata: dict[str, Any]) -> bool:
    """Whether a checkpoint says which data it belongs to (a run's config.yaml, or a files-free source)."""
    run_yaml = (Path(path) if Path(path).is_dir() else Path(path).parent) / "config.yaml"
    return run_yaml.is_file() or metadata.get("source") in ("digits", "synthetic")


def checkpoint_data(
    path: str | Path,
    metadata: dict[str, Any],
    prep: Preprocessing,
    data: str | None = None,
    overrides: Sequence[str] = (),
) -> DataConfig:
    """The data a checkpoint is evaluated on, preprocessed as the model expects and never augmented. ``data`` is what
    the commands' ``--data`` names (config_files.data_section), by default the checkpoint's own: the data section of its
    run's config.yaml, or a source that needs no files recorded in its metadata. ``overrides`` are ``data.key=value``
    strings, applied next; the preprocessing is then the checkpoint's own."""
    if data is not None:
        doc = data_section(data)
    elif records_data(path, metadata):
        run_yaml = (Path(path) if Path(path).is_dir() else Path(path).parent) / "config.yaml"
        doc = data_section(str(run_yaml)) if run_yaml.is_file() else {"source": metadata["source"]}
    else:
        raise UserError(f"{path}: {NO_DATA}")
    bad = [o for o in overrides if not o.strip().startswith("data.")]
    if bad:
        raise UserError(f"overrides {bad}: only data.key=value overrides apply here")
    doc = config_from_dict({"data": doc}, list(overrides)).data.to_dict()
    doc.update(img_size=prep.img_size, in_chans=prep.in_chans, mean=prep.mean, std=prep.std)
    doc.update(eval_crop_fraction=prep.crop_fraction, train_augment="none", flip=False, shift_pixels=0)
    return DataConfig.from_dict(doc)


def evaluate_checkpoint(
    path: str | Path,
    data: str | None = None,
    overrides: Sequence[str] = (),
    device: str = "auto",
    batch_size: int = 512,
    **model_overrides: Any,
) -> dict[str, Any]:
    """Metrics of the checkpoint at path (a run directory or any format load_model reads) on its data;
    ``model_overrides`` change the checkpoint's model config (what a bare state dict does not say)."""
    model, prep, metadata = load_for_inference(path, **model_overrides)
    if untrained := untrained_head(path, metadata):
        raise UserError(f"eval: {untrained}")
    data_cfg = checkpoint_data(path, metadata, prep, data, overrides)
    _, eval_ds, info = build_datasets(data_cfg)
    config = model.config
    assert isinstance(config, (ViTConfig, ResNetConfig, BiTConfig)), f"not a registered model: {type(model)}"
    num_classes = config.num_classes
    if info.num_classes != num_classes:
        raise UserError(f"{path}: the model has {num_classes} classes but the data has {info.num_classes}")
    names = metadata.get("class_names")
    if names and list(names) != list(info.class_names):
        raise UserError(f"{path}: the model's classes {names[:5]}... differ from the data's {info.class_names[:5]}...")
    dev = pick_device(device)
    with torch.inference_mode():
        metrics = evaluate(model.to(dev), eval_ds, dev, batch_size, num_workers=data_cfg.num_workers)
    return {**metrics, "data": data_cfg.source, "num_classes": num_classes}
