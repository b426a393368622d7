"""A training config as a run uses it: ``load_config`` (a file) or ``config_from_dict`` (a mapping) under the command
line's overrides, then for a fine-tune (run.init_from) the recipe (``recipe_values``, its one resolution) in every key
the user or the file left open, so ``vitkit finetune`` and ``vitkit train`` with run.init_from give the same config.

The recipe: the source's preprocessing; for a source of ImageNet scale the paper's optimizer (Table 4: SGD momentum
0.9, lr 0.01, no weight decay, clip 1, batch 512), for one below SMALL_SOURCE parameters the digits config's AdamW
in batches that make several steps an epoch, since SGD at lr 0.01 cannot teach a small source what it does not
already do (benchmarks/finetune_digits.py), and a named optimizer its own; cosine decay after a 5% warmup; the
paper's length for the data's size; EVALUATIONS over the run; and the machine settings of a source run directory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence, Sized
from pathlib import Path
from typing import Any

from ..checkpoint.loader import Checkpoint
from ..data import build_datasets
from ..errors import UserError
from ..hub import read_checkpoint
from .config import TrainConfig
from .config_files import data_section, read_config_file, resolve_config_path
from .model import channels_mismatch
from .mpp import MPP_PREFIX
from .overrides import GivenValues, labelled
from .state import STATE_NAME

# The paper's fine-tuning lengths (appendix B.1.1, Table 4) at batch 512: 500 steps for the small sets (Pets,
# Flowers), 10k for CIFAR, 20k for ImageNet; as samples seen, so that another batch size sees as many.
PAPER_BATCH = 512
PAPER_STEPS = ((20_000, 500), (500_000, 10_000), (math.inf, 20_000))  # (training images below, steps)
# small data is not passed over thousands of times: never more passes than the paper's CIFAR fine-tune made
MAX_EPOCHS = 10_000 * PAPER_BATCH / 50_000  # 102.4
MIN_STEPS = 10
WARMUP_FRACTION = 0.05  # 500 of the paper's 10k steps
SMALL_SOURCE = 1_000_000  # parameters; a smaller source takes the AdamW recipe (module docstring)
SMALL_SOURCE_STEPS_PER_EPOCH = 4
OPTIMIZER_RECIPES: dict[str, dict[str, Any]] = {
    # Table 4's fine-tuning optimiser; lr 0.01 is in every one of its sweeps
    "sgd": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "grad_clip": 1.0},
    # the digits config's (vitkit/configs/digits.yaml)
    "adamw": {"lr": 1.5e-3, "weight_decay": 0.05, "label_smoothing": 0.1, "grad_clip": 1.0},
}
SCHEDULE = {"decay": "cosine"}
PREPROCESSING_KEYS = ("img_size", "mean", "std", "eval_crop_fraction")
EVALUATIONS = 10  # a fine-tune's evaluations over the run (run.eval_every), so its accuracy plot is a curve
# What a fine-tune of a run directory keeps of that run's settings: those a user set for their machine. Not the
# seed (a fine-tune is its own experiment), the objective, nor cadences in steps of the source's length.
CARRIED_RUN_KEYS = (
    "threads",
    "device",
    "amp",
    "compile",
    "log_every",
    "eval_batch_size",
    "progress",
    "plots",
    "tensorboard",
)
CHECKPOINT_SUFFIXES = (".npz", ".safetensors", ".pth", ".pt", ".bin", ".ckpt")
DEFAULT_EPOCHS = 10  # a run from scratch that gives no length


def default_steps(num_train: int, batch_size: int) -> int:
    """The paper's fine-tuning length for a training set of num_train images, in steps of batch_size."""
    paper = next(steps for limit, steps in PAPER_STEPS if num_train < limit)
    samples = min(paper * PAPER_BATCH, MAX_EPOCHS * num_train)
    return max(MIN_STEPS, math.ceil(samples / batch_size))


def default_batch_size(num_train: int, steps_per_epoch: int = 1) -> int:
    """The paper's 512, or for fewer images the largest power of two that gives every one of steps_per_epoch
    steps an epoch a full batch."""
    return min(PAPER_BATCH, 2 ** max(int(math.log2(max(num_train // steps_per_epoch, 1))), 0))


def source_params(ckpt: Checkpoint) -> int:
    """Parameters of the network a checkpoint holds, without a pretraining head (MPP's)."""
    return sum(t.numel() for k, t in ckpt.state.items() if not k.startswith(MPP_PREFIX))


def is_small(ckpt: Checkpoint) -> bool:
    """Whether the source is below ImageNet scale, where the paper's recipe does not hold."""
    return source_params(ckpt) < SMALL_SOURCE


def default_optimizer(ckpt: Checkpoint) -> str:
    """The paper's SGD for a source of ImageNet scale, AdamW for a small one."""
    return "adamw" if is_small(ckpt) else "sgd"


def run_length(cfg: TrainConfig, num_train: int) -> int:
    """Optimizer steps of the run: schedule.steps, or schedule.epochs; with neither, a fine-tune takes the paper's
    length for the data's size (``default_steps``) and a run from scratch DEFAULT_EPOCHS epochs."""
    per_epoch = max(num_train // cfg.optim.batch_size, 1)
    s = cfg.schedule
    if s.steps is not None:
        return s.steps
    if s.epochs is not None:
        return math.ceil(s.epochs * per_epoch)
    if cfg.run.init_from:
        return default_steps(num_train, cfg.optim.batch_size)
    return math.ceil(DEFAULT_EPOCHS * per_epoch)


# --------------------------------------------------------------------------------------------- the recipe
def recipe_values(cfg: TrainConfig, given: set[str]) -> dict[str, Any]:
    """The recipe's ``section.key`` values for a fine-tune of cfg (as the user gave it), for every key not in given
    (those the user set); the source and the training set are read only where they decide an open value."""
    assert cfg.run.init_from, "recipe_values resolves a fine-tune: run.init_from must be set"
    out: dict[str, Any] = {}
    ckpt: Checkpoint | None = None
    from_source = [*(f"data.{k}" for k in PREPROCESSING_KEYS), "optim.name", "optim.batch_size"]
    if any(key not in given for key in from_source):
        try:
            ckpt = read_checkpoint(cfg.run.init_from)
        except UserError as e:
            raise type(e)(f"run.init_from: {e}") from None
        fields = ckpt.preprocessing.data_fields(ckpt.metadata)  # resolution, mean / std, eval crop
        out.update({f"data.{k}": v for k, v in fields.items() if f"data.{k}" not in given})
        chans = ckpt.preprocessing.in_chans  # grey or RGB images are converted to the source's, as eval does
        if "data.in_chans" not in given:
            out["data.in_chans"] = chans
        elif cfg.data.in_chans not in (None, chans):
            raise UserError(channels_mismatch(cfg.run.init_from, chans, cfg.data.in_chans))
    optimizer = cfg.optim.name
    if "optim.name" not in given:
        assert ckpt is not None
        optimizer = out["optim.name"] = default_optimizer(ckpt)
    out.update({f"optim.{k}": v for k, v in OPTIMIZER_RECIPES.get(optimizer, {}).items()})
    out.update({f"schedule.{k}": v for k, v in SCHEDULE.items()})
    out.update(source_run_settings(cfg.run.init_from))

    length_given = {"schedule.steps", "schedule.epochs"} & given
    if {"optim.batch_size", "schedule.warmup_steps", "run.eval_every"} <= given and length_given:
        return {k: v for k, v in out.items() if k not in given}
    train_set, _, _ = build_datasets(cfg.data)
    assert isinstance(train_set, Sized)  # every training set vitkit builds has a length
    num_train = len(train_set)
    batch = cfg.optim.batch_size
    if "optim.batch_size" not in given:
        assert ckpt is not None
        per_epoch = SMALL_SOURCE_STEPS_PER_EPOCH if is_small(ckpt) else 1
        batch = out["optim.batch_size"] = default_batch_size(num_train, per_epoch)
        if batch % cfg.optim.accum_steps:
            out["optim.accum_steps"] = 1
    if "schedule.epochs" in given and cfg.schedule.epochs is not None:
        steps = math.ceil(cfg.schedule.epochs * max(num_train // batch, 1))
    elif "schedule.steps" in given and cfg.schedule.steps is not None:
        steps = cfg.schedule.steps
    else:
        steps = out["schedule.steps"] = default_steps(num_train, batch)
    out["schedule.warmup_steps"] = round(WARMUP_FRACTION * steps)
    out["run.eval_every"] = max(1, steps // EVALUATIONS)
    return {k: v for k, v in out.items() if k not in given}


def source_run_settings(source: str) -> dict[str, Any]:
    """The ``run.key`` settings a fine-tune keeps of a source run directory's config.yaml (CARRIED_RUN_KEYS)."""
    path = Path(source) / "config.yaml"
    if not path.is_file():
        return {}
    run = read_config_file(path).get("run") or {}
    if not isinstance(run, dict):
        raise UserError(f"{path}: the 'run' section must be a mapping of key: value")
    return {f"run.{k}": run[k] for k in CARRIED_RUN_KEYS if k in run}


def run_name(source: str) -> str:
    """A fine-tune's run name: ``finetune-`` and the source's name, lowercased, without a file's extension
    (``ViT-B_16.npz`` -> ``finetune-vit-b_16``, ``runs/digits`` -> ``finetune-digits``)."""
    path = Path(str(source).rstrip("/"))
    stem = path.stem if path.suffix.lower() in CHECKPOINT_SUFFIXES else path.name
    name = re.sub(r"[^a-z0-9_.-]+", "_", stem.lower()).strip("._-")
    return f"finetune-{name or 'model'}"


# ------------------------------------------------------------------------------------------------ loading
def config_from_dict(
    doc: dict[str, Any] | None,
    overrides: Sequence[str] = (),
    *,
    origin: str | None = None,
    listing: bool = False,
) -> TrainConfig:
    """A TrainConfig from nested plain values plus ``section.key=value`` strings (applied last). A value ``???`` marks a
    key the user must give; with run.init_from set, every key neither doc nor overrides give is the fine-tuning
    recipe's. ``origin`` (a file's path) is named in doc's errors. With ``listing`` (``vitkit config``) a ``???`` key is
    left at its default, not refused, and the recipe not applied while one is missing."""
    return _resolve(GivenValues.read(doc, overrides, origin), listing)


def _resolve(given: GivenValues, listing: bool) -> TrainConfig:
    """The config as given, then for a fine-tune with nothing missing the recipe in every key it leaves open."""
    cfg = given.build(listing)
    if not cfg.run.init_from or given.missing:
        return cfg
    filled = labelled(given.origin_of("run.init_from"), lambda: recipe_values(cfg, given.keys))
    return given.build(listing, filled)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a YAML config (a path or a shipped name; default: digits) and apply overrides.

    The run name defaults to the config's stem, so ``vitkit train`` writes to runs/digits (or runs/digits-1, ...).
    An error names where its value came from: the file's path, or the command line."""
    return _load(path, overrides, listing=False)[0]


def load_config_for_listing(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> tuple[TrainConfig, list[str]]:
    """load_config for ``vitkit config``: a ``???`` key left open is kept at its default and returned, not refused."""
    return _load(path, overrides, listing=True)


def _load(path: str | Path | None, overrides: Sequence[str], listing: bool) -> tuple[TrainConfig, list[str]]:
    path = resolve_config_path(str(path) if path is not None else "digits")
    given = GivenValues.read(read_config_file(path), overrides, origin=str(path))
    cfg = _resolve(given, listing)
    if cfg.run.name is None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=path.stem))
    if cfg.run.resume is True and (path.parent / STATE_NAME).is_file():  # a run's own config.yaml: that run
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(path.parent)))
    return cfg, given.missing if listing else []


def finetune_config(source: str, data: str, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config of ``vitkit finetune SOURCE --data DATA k=v``: data, source, run name; the rest the recipe's."""
    doc = {"data": data_section(data), "run": {"init_from": str(source), "name": run_name(source)}}
    return config_from_dict(doc, list(overrides))
