"""The model of a training run: the architecture its config names (a registry row, or the one run.init_from
holds) at the data's size, and a fine-tune's starting weights: every weight of the checkpoint, position embeddings
resampled (sec 3.2), then one zero-initialised head for the new classes without pre-logits (sec 3.1).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..checkpoint.loader import Checkpoint
from ..data import DatasetInfo
from ..errors import ConfigError, UserError
from ..hub import load_pretrained, read_checkpoint
from ..models import create_model
from ..models.common import check_fields
from ..models.registry import config_class, model_from_config
from .config import TrainConfig
from .mpp import MPP_PREFIX


def build_model(cfg: TrainConfig, info: DatasetInfo, source: Checkpoint | None = None) -> nn.Module:
    """The configured model (the row model.name, or the architecture run.init_from holds, read from ``source`` when
    given), its image size, channels and classes those of the data."""
    fields = dict(cfg.model.fields)
    for key, data_key, value in (
        ("img_size", "data.img_size", info.img_size),
        ("in_chans", "data.in_chans", info.in_chans),
        ("num_classes", "the data's class count", info.num_classes),
    ):
        given = fields.setdefault(key, value)
        if (tuple(given) if isinstance(given, (list, tuple)) else (given, given)) != (value, value):
            raise UserError(f"model.{key}={given} but the data gives {value} ({data_key}); the model follows the data")
    try:
        if cfg.model.name is not None:
            return create_model(cfg.model.name, **fields)
        if not cfg.run.init_from:
            raise UserError(
                "model.name: not set; give a registered model (`vitkit models`), or run.init_from=CHECKPOINT to "
                "fine-tune the model it holds"
            )
        base = dict((source or read_checkpoint(cfg.run.init_from)).config)
        arch = base.pop("arch", "vit")
        check_fields(config_class(arch), fields)
        return model_from_config({"arch": arch, **base, **fields})
    except ConfigError as e:
        raise ConfigError(f"model: {e}") from None


def init_from_checkpoint(model: nn.Module, source: str | Path | Checkpoint, num_classes: int) -> str:
    """Load a checkpoint into model for fine-tuning; returns a one-paragraph report of what was adapted."""
    try:
        ckpt = source if isinstance(source, Checkpoint) else read_checkpoint(source)
        # strict: weights that do not fit are an error listing them; an MPP head is never a classifier's
        report = load_pretrained(model, ckpt, drop=(MPP_PREFIX,))
    except UserError as e:
        raise type(e)(f"run.init_from: {e} (model.name and its fields describe the model to fine-tune)") from None
    reset_classifier = getattr(model, "reset_classifier", None)
    if reset_classifier is not None:
        reset_classifier(num_classes)  # a zero head, no pre-logits: the paper's fine-tuning head
    lines = [line.strip() for line in str(report).splitlines()]
    return "; ".join([*lines, f"head: a zero-initialised one for {num_classes} classes, no pre-logits"])


def channels_mismatch(source: str, model_chans: int, data_chans: int) -> str:
    """The one-line error for a fine-tune whose data.in_chans is not the source model's."""
    kind = {1: "grey", 3: "RGB"}
    return (
        f"data.in_chans={data_chans}: run.init_from {source} holds a model for {model_chans}-channel "
        f"({kind.get(model_chans, '?')}) images; leave data.in_chans out (the images are then converted to "
        f"{model_chans} channels) or set data.in_chans={model_chans}"
    )
