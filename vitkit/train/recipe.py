"""The fine-tuning recipe, resolved in one place for ``vitkit finetune`` and ``run.init_from`` alike.

``recipe_values`` is the one resolution: given a config that fine-tunes (run.init_from) and the keys the user
gave (on the command line, or in a YAML file: a file's explicit values count as the user's), it fills every
other key of the recipe. ``config_from_dict`` calls it whenever run.init_from is set, so
``vitkit finetune SOURCE --data DATA k=v`` and ``vitkit train FILE run.init_from=SOURCE`` with the same data
give the same resolved config, apart from what the user (or the file) set and the run's name.

What it fills, each only where not given:

* preprocessing: the source's resolution, channels' mean / std and eval crop (``preprocessing_fields``);
* optimizer and batch: for a source of at least SMALL_SOURCE parameters (every released ViT: ViT-Ti/16 has
  5.7M), the paper's fine-tuning recipe (Table 4): SGD momentum 0.9, lr 0.01, no weight decay, global-norm clip 1,
  batch 512 (or the largest power of two the training set fills). For a smaller source, the digits config's AdamW
  (lr 1.5e-3, weight decay 0.05, label smoothing 0.1, clip 1) in batches of at most a quarter of the training set
  (SMALL_SOURCE_STEPS_PER_EPOCH = 4 steps an epoch or more). Measured by ``python benchmarks/finetune_digits.py``:
  143 labelled digits (data.train_fraction=0.1), 458 steps of 32, 360 held-out images, seeds 0-2, top-1 %:

      source (136,906 parameters, MPP's head aside)       paper's SGD        AdamW (the small-source recipe)
      mpp_digits run (masked patch prediction, no labels)  81.20 +- 1.25      92.78 +- 0.28
      digits run (supervised on all 1,437 labels)         99.44 +- 0.00      98.15 +- 0.42

  SGD at lr 0.01 barely moves a small network: it keeps what a source already does (the digits run has seen
  every label) and cannot teach one what it does not (the MPP run's class token was never trained); AdamW
  costs 1.3 points on the first and gains 11.6 on the second, so a small source gets AdamW. The batch matters as
  much: in batches of 128 (one step an epoch, the paper's rule; the same images seen) the MPP source reached
  88.15 +- 0.70 with AdamW and 66.76 +- 1.12 with SGD, in batches of 64 89.26 +- 1.28 with AdamW (seeds 0-2;
  ``vitkit finetune RUN --data digits data.train_fraction=0.1 optim.batch_size=128 run.seed=S``). A named
  optimizer (``optim.name=sgd``) takes that optimizer's recipe whatever the source's size;
* schedule: cosine decay after a linear warmup of 5% of the run;
* length: the paper's for the data's size (``default_steps``), as images seen, capped at the passes over the
  data of the paper's CIFAR fine-tune;
* evaluation: EVALUATIONS (10) over the run (run.eval_every), so that the accuracy plot is a curve;
* run settings: those of a source run directory's config.yaml that a user set for their machine and outputs
  (CARRIED_RUN_KEYS: threads, device, amp, compile, log_every, eval_batch_size, progress, plots, tensorboard);
  never its out_dir, name, resume, init_from, seed, objective or step cadences.

``describe_plan`` says what a run will do before it starts (and on a CPU, how long its FLOPs take);
``run_name`` names a fine-tune after its source.

``init_from_checkpoint`` loads every weight a checkpoint holds (any format vitkit.load_pretrained reads, or a
pretrained tag), with the position embeddings resampled to the configured resolution (sec 3.2); then it
replaces the whole head by one zero-initialised Dense for the new classes, dropping the pre-logits layer
(sec 3.1). A pretraining head that is no part of a classifier (masked patch prediction's ``mpp.*`` keys) is
dropped and reported. Anything else that does not fit (another width, depth, patch size) is an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ..checkpoint.loader import Checkpoint
from ..data import DatasetInfo, build_datasets
from ..errors import UserError
from ..hub import load_pretrained
from ..hub import read_checkpoint as read_source  # a path or a pretrained tag (downloaded once)
from .mpp import MPP_PREFIX

if TYPE_CHECKING:
    from .config import TrainConfig

# The paper's fine-tuning lengths (appendix B.1.1, Table 4) at batch 512: 500 steps for the small sets (Pets,
# Flowers), 10k for CIFAR, 20k for ImageNet; as samples seen, so that another batch size sees as many.
PAPER_BATCH = 512
PAPER_STEPS = ((20_000, 500), (500_000, 10_000), (math.inf, 20_000))  # (training images below, steps)
# small data is not passed over thousands of times: never more passes than the paper's CIFAR fine-tune made
MAX_EPOCHS = 10_000 * PAPER_BATCH / 50_000  # 102.4
MIN_STEPS = 10
WARMUP_FRACTION = 0.05  # 500 of the paper's 10k steps
# Sources smaller than this are fine-tuned with AdamW, in batches that make several steps an epoch (module
# docstring: measured on the digits)
SMALL_SOURCE = 1_000_000
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
# What a fine-tune of a run directory keeps of that run's settings: how and where it runs and what it writes,
# which a user set for their machine. Not kept: out_dir, name, resume, resume_with_changes, init_from (this run's
# own), seed (a fine-tune is its own experiment: run.seed=S to choose), objective (a fine-tune classifies), and
# eval_every / save_every (steps of the source's length, not this one's).
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
# A rough training rate of one CPU thread, in FLOP/s (fp32; the digits config runs at about 35 GFLOP/s on one
# thread of a 2-core machine), for the duration a CPU run is told before it starts
CPU_FLOPS_PER_THREAD = 40e9


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
    """Whether the source is below ImageNet scale, where the paper's recipe does not hold (module docstring)."""
    return source_params(ckpt) < SMALL_SOURCE


def default_optimizer(ckpt: Checkpoint) -> str:
    """The paper's SGD for a source of ImageNet scale, AdamW for a small one (module docstring)."""
    return "adamw" if is_small(ckpt) else "sgd"


# ------------------------------------------------------------------------------------------------ sources
def init_from_checkpoint(model: nn.Module, source: str | Path | Checkpoint, num_classes: int) -> str:
    """Load a checkpoint into model for fine-tuning; returns a one-paragraph report of what was adapted."""
    try:
        ckpt = source if isinstance(source, Checkpoint) else read_source(source)
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


def preprocessing_fields(ckpt: Checkpoint) -> dict[str, Any]:
    """The data fields the weights expect: their resolution, mean / std and eval crop (the checkpoint's record)."""
    return ckpt.preprocessing.data_fields(ckpt.metadata)


# --------------------------------------------------------------------------------------------- the recipe
def recipe_values(cfg: TrainConfig, given: set[str]) -> dict[str, Any]:
    """The recipe's ``section.key`` values for a fine-tune of cfg.run.init_from, for every key not in given.

    given: the keys the user set (``optim.lr``, ...); cfg: the config as they gave it. The source is read only
    where its preprocessing or size decides a value, the training set only where the batch or length is open.
    """
    assert cfg.run.init_from, "recipe_values resolves a fine-tune: run.init_from must be set"
    out: dict[str, Any] = {}
    ckpt: Checkpoint | None = None
    from_source = [*(f"data.{k}" for k in PREPROCESSING_KEYS), "optim.name", "optim.batch_size"]
    if any(key not in given for key in from_source):
        try:
            ckpt = read_source(cfg.run.init_from)
        except UserError as e:
            raise type(e)(f"run.init_from: {e}") from None
        out.update({f"data.{k}": v for k, v in preprocessing_fields(ckpt).items() if f"data.{k}" not in given})
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
    """The settings of a source run directory's config.yaml that a fine-tune of it keeps (CARRIED_RUN_KEYS), as
    ``run.key`` values; nothing for a source that is no run directory."""
    path = Path(source) / "config.yaml"
    if not path.is_file():
        return {}
    from .config import read_config_file

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


def finetune_config(source: str, data: str, overrides: Sequence[str] = ()) -> TrainConfig:
    """The whole fine-tuning run of ``vitkit finetune SOURCE --data DATA key=value ...`` (module docstring):
    the data, the source, a run name; every other value is the recipe's (``recipe_values``) or the user's."""
    from .config import config_from_dict, data_section

    doc = {"data": data_section(data), "run": {"init_from": str(source), "name": run_name(source)}}
    return config_from_dict(doc, list(overrides))


# ------------------------------------------------------------------------------------------------ the plan
def format_duration(seconds: float) -> str:
    """A duration as a person says it: seconds, minutes, hours or days."""
    for unit, size, limit in (("s", 1, 90), ("min", 60, 90 * 60), ("hours", 3600, 48 * 3600)):
        if seconds < limit:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds / 86400:.0f} days"


def run_steps(cfg: TrainConfig, num_train: int) -> int:
    """The run's optimizer steps as the engine counts them on one process (Trainer._run_length)."""
    from .engine import DEFAULT_EPOCHS

    per_epoch = max(num_train // cfg.optim.batch_size, 1)
    s = cfg.schedule
    if s.steps is not None:
        return s.steps
    if s.epochs is not None:
        return math.ceil(s.epochs * per_epoch)
    if cfg.run.init_from:
        return default_steps(num_train, cfg.optim.batch_size)
    return math.ceil(DEFAULT_EPOCHS * per_epoch)


def describe_plan(cfg: TrainConfig) -> str:
    """What a run will do, said before it starts: source, data, classes, images, optimizer, batch, steps,
    warmup, resolution; on a CPU, the duration its FLOPs take at CPU_FLOPS_PER_THREAD (hours or days said
    plainly). The duration measured on the first steps follows once training runs (vitkit.train.metrics.Pace)."""
    import torch

    from .engine import build_model

    train_set, eval_set, info = build_datasets(cfg.data)
    assert isinstance(train_set, Sized) and isinstance(eval_set, Sized)
    source = read_source(cfg.run.init_from) if cfg.run.init_from else None
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = build_model(cfg, info, source)
    return plan_text(cfg, model, info, len(train_set), len(eval_set), run_steps(cfg, len(train_set)))


def plan_text(cfg: TrainConfig, model: nn.Module, info: DatasetInfo, num_train: int, num_eval: int, steps: int) -> str:
    """describe_plan's text for a run whose model and data are built already (the Trainer's, at its start)."""
    import torch

    from ..bench.flops import model_flops
    from ..models import count_params

    o, s, d = cfg.optim, cfg.schedule, cfg.data
    what = f"fine-tuning {cfg.run.init_from}" if cfg.run.init_from else f"training {cfg.model.name} from scratch"
    if cfg.run.objective == "mpp":  # no classes are learnt: the model is the ViT without its MPP head
        what = f"pretraining {cfg.model.name} by masked patch prediction (no labels)"
    extras = [f"layer decay {o.layer_decay:g}"] if o.layer_decay < 1 else []
    extras += [f"mixup {d.mixup_alpha:g}"] if d.mixup_alpha > 0 else []
    extras += [f"cutmix {d.cutmix_alpha:g}"] if d.cutmix_alpha > 0 else []
    lines = [
        f"{what} ({count_params(model):,} params) on {d.source}{f' ({d.root})' if d.root else ''}: "
        f"{info.num_classes} classes, {num_train:,} train / {num_eval:,} eval images at {info.img_size} px",
        f"  {o.name} lr {o.lr:g}, weight decay {o.weight_decay:g}{''.join(', ' + e for e in extras)}; batch "
        f"{o.batch_size}{f' ({o.accum_steps} micro-batches)' if o.accum_steps > 1 else ''}; {steps:,} steps "
        f"(warmup {s.warmup_steps}, {s.decay}); evaluated "
        + (f"every {cfg.run.eval_every} steps" if 0 < cfg.run.eval_every < steps else "at the end"),
    ]
    device = cfg.run.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        threads = cfg.run.threads or torch.get_num_threads()
        flops = 3 * model_flops(model, info.img_size)  # a training step: forward and backward
        seconds = flops * o.batch_size * steps / (threads * CPU_FLOPS_PER_THREAD)
        long = " -- a long job for a CPU; a GPU (run.device=cuda) is the place for it" if seconds > 3600 else ""
        lines.append(
            f"  on this CPU ({threads} thread{'s' if threads > 1 else ''}): about {format_duration(seconds)} by its "
            f"FLOPs ({flops * o.batch_size / 1e9:.3g} GFLOP a step at ~{CPU_FLOPS_PER_THREAD / 1e9:.0f} GFLOP/s a "
            f"thread){long}"
        )
    return "\n".join(lines)
