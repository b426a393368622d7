"""Fine-tuning: the paper's recipe for starting from a pretrained model, and ``vitkit finetune`` in one command.

``init_from_checkpoint`` loads every weight a checkpoint holds (any format vitkit.load_pretrained reads, or a
pretrained tag), with the position embeddings resampled to the configured resolution (sec 3.2); then it
replaces the whole head by one zero-initialised Dense for the new classes, dropping the pre-logits layer
(sec 3.1). A pretraining head that is no part of a classifier (masked patch prediction's ``mpp.*`` keys) is
dropped and reported. Anything else that does not fit (another width, depth, patch size) is an error.

``finetune_config`` writes the whole recipe from a checkpoint and a data set: the architecture is the
checkpoint's (never restated), the resolution and preprocessing are the weights' own, the optimizer is the
paper's fine-tuning one (SGD, momentum 0.9, no weight decay, global-norm clip 1, warmup + cosine decay, Table 4),
and the length is the paper's for the data's size (``default_steps``). Every choice can be overridden.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ..checkpoint.loader import Checkpoint
from ..data import build_datasets
from ..errors import UserError
from ..hub import load_pretrained
from ..hub import read_checkpoint as read_source  # a path or a pretrained tag (downloaded once)
from .config import TrainConfig, config_from_dict, data_section
from .mpp import MPP_PREFIX

# The paper's fine-tuning lengths (appendix B.1.1, Table 4) at batch 512: 500 steps for the small sets (Pets,
# Flowers), 10k for CIFAR, 20k for ImageNet; as samples seen, so that another batch size sees as many.
PAPER_BATCH = 512
PAPER_STEPS = ((20_000, 500), (500_000, 10_000), (math.inf, 20_000))  # (training images below, steps)
# small data is not passed over thousands of times: never more passes than the paper's CIFAR fine-tune made
MAX_EPOCHS = 10_000 * PAPER_BATCH / 50_000  # 102.4
MIN_STEPS = 10
WARMUP_FRACTION = 0.05  # 500 of the paper's 10k steps
RECIPE = {  # Table 4's fine-tuning optimiser; lr 0.01 is in every one of its sweeps
    "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "grad_clip": 1.0},
    "schedule": {"decay": "cosine"},
}


def default_steps(num_train: int, batch_size: int) -> int:
    """The paper's fine-tuning length for a training set of num_train images, in steps of batch_size."""
    paper = next(steps for limit, steps in PAPER_STEPS if num_train < limit)
    samples = min(paper * PAPER_BATCH, MAX_EPOCHS * num_train)
    return max(MIN_STEPS, math.ceil(samples / batch_size))


def default_batch_size(num_train: int) -> int:
    """The paper's 512, or for fewer images the largest power of two that leaves every step a full batch."""
    return min(PAPER_BATCH, 2 ** max(int(math.log2(max(num_train, 1))), 0))


# ------------------------------------------------------------------------------------------------ sources
def init_from_checkpoint(model: nn.Module, source: str | Path | Checkpoint, num_classes: int) -> str:
    """Load a checkpoint into model for fine-tuning; returns a one-paragraph report of what was adapted."""
    try:
        ckpt = source if isinstance(source, Checkpoint) else read_source(source)
        # strict: weights that do not fit are an error listing them; an MPP head is never a classifier's
        report = load_pretrained(model, ckpt, drop=(MPP_PREFIX,))
    except UserError as e:
        raise type(e)(f"run.init_from: {e} (model.name and its fields describe the model to fine-tune)") from None
    if hasattr(model, "reset_classifier"):
        model.reset_classifier(num_classes)  # a zero head, no pre-logits: the paper's fine-tuning head
    lines = [line.strip() for line in str(report).splitlines()]
    return "; ".join([*lines, f"head: a zero-initialised one for {num_classes} classes, no pre-logits"])


# ------------------------------------------------------------------------------------------- one command
def preprocessing_fields(ckpt: Checkpoint) -> dict[str, Any]:
    """The data fields the weights expect: their resolution, mean / std and eval crop (the checkpoint's record)."""
    return ckpt.preprocessing.data_fields(ckpt.metadata)


def _given(overrides: Sequence[str]) -> set[str]:
    return {item.partition("=")[0].strip() for item in overrides}


def finetune_config(source: str, data: str, overrides: Sequence[str] = ()) -> TrainConfig:
    """The whole fine-tuning run of ``vitkit finetune SOURCE --data DATA key=value ...`` (module docstring).

    The batch is the paper's 512 (or less for a small data set) and the length the paper's for the data's
    size unless optim.batch_size / schedule.steps / schedule.epochs are given; the warmup is 5% of the run.
    """
    ckpt = read_source(source)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(source).rstrip("/")).name) or "model"
    doc = {
        **RECIPE,
        "data": {**data_section(data), **preprocessing_fields(ckpt)},
        "run": {"init_from": str(source), "name": f"finetune-{name}"},
    }
    cfg = config_from_dict(doc, overrides)
    given = _given(overrides)
    if {"optim.batch_size", "schedule.steps", "schedule.epochs", "schedule.warmup_steps"} <= given:
        return cfg
    train_set, _, _ = build_datasets(cfg.data)
    extra = []
    batch = cfg.optim.batch_size
    if "optim.batch_size" not in given:
        batch = default_batch_size(len(train_set))
        accum = cfg.optim.accum_steps if batch % cfg.optim.accum_steps == 0 else 1
        extra += [f"optim.batch_size={batch}", f"optim.accum_steps={accum}"]
    steps = cfg.schedule.steps
    if not {"schedule.steps", "schedule.epochs"} & given:
        steps = default_steps(len(train_set), batch)
        extra.append(f"schedule.steps={steps}")
    if "schedule.warmup_steps" not in given and steps:
        extra.append(f"schedule.warmup_steps={round(WARMUP_FRACTION * steps)}")
    return config_from_dict(doc, [*extra, *overrides])
