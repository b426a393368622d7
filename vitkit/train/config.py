"""Training configuration: one frozen dataclass per section of a YAML config (model, data, optim, schedule, run,
mpp); the comment on a field's line is its meaning, as ``vitkit config`` lists it.

Sections and the whole TrainConfig are values: change one with ``dataclasses.replace``. The typed
``section.key=value`` parser is overrides.py, the YAML files config_files.py, and a config as a run uses it (the
fine-tuning recipe filled in) comes from recipe.py (``load_config``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..data import DataConfig
from ..device import COMPILE_MODES
from ..errors import UserError
from ..models import ViTConfig
from ..models.registry import MODELS, config_class

OPTIMIZERS = ("adamw", "adam", "sgd")
DECAYS = ("cosine", "linear", "constant")
AMPS = ("none", "bf16", "fp16")
OBJECTIVES = ("classification", "mpp")
ACCELS = ("auto", "none")
TRAIN_COMPILE_MODES = tuple(m for m in COMPILE_MODES if m != "none")  # run.compile's modes besides true/false
MPP_TARGETS = ("color", "color_grid", "pixels")
REQUIRED = "???"  # a config value the user must supply on the command line
MODEL_SECTION_KEYS = ("name", "token_merge")  # declared by ModelConfig; the model section's other keys are fields


@dataclass(frozen=True)
class ModelConfig:
    """A registered model (or the architecture of run.init_from) and the fields of its config to change.

    Every field of the row's config class (ViTConfig, or ResNetConfig for a ResNet row) is a key of this section,
    typed and checked by that class (``model.gelu=exact``); unset fields keep the registry's values, except
    ``img_size``, ``in_chans`` and ``num_classes``, which follow the data. ``token_merge`` is no field of the model's
    config but a speed patch on the built ViT, for training and evaluation alike (vitkit.accel.tome)."""

    name: str | None = None  # a registered model; none: run.init_from's own
    token_merge: int = 0  # token merging (ToMe): tokens merged in each block; 0: off
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.token_merge >= 0:
            raise UserError(f"model.token_merge={self.token_merge}: expected the tokens merged in each block, >= 0")

    def to_dict(self) -> dict[str, Any]:
        merge = {"token_merge": self.token_merge} if self.token_merge else {}  # as configs without it wrote it
        return {"name": self.name, **merge, **self.fields}


@dataclass(frozen=True)
class OptimConfig:
    """``batch_size`` is the global batch per optimizer step: accum_steps micro-batches, split across ranks."""

    name: str = "adamw"  # adamw, adam or sgd
    lr: float = 1e-3  # peak learning rate (reached after the warmup)
    weight_decay: float = 0.05  # decoupled for adamw, L2 for adam/sgd; never on biases, norms, embeddings
    betas: tuple[float, float] = (0.9, 0.999)  # adam / adamw moment decay rates
    eps: float = 1e-8  # adam / adamw denominator epsilon
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only: Nesterov momentum
    grad_clip: float = 1.0  # global grad-norm clip; 0 turns it off
    label_smoothing: float = 0.0  # cross-entropy label smoothing in [0, 1) (with mixup/cutmix: of the soft targets)
    batch_size: int = 128  # images per optimizer step, over all ranks and micro-batches
    accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    polyak: float = 0.0  # Polyak (EMA) averaging of the weights, e.g. 0.9999 as the paper; 0: off
    polyak_warmup: bool = True  # average update t uses min(polyak, (1 + t) / (10 + t)), as TF's and timm's EMA
    layer_decay: float = 1.0  # layer-wise lr decay for fine-tuning: block i of L gets lr x layer_decay^(L-i); 1: off

    def __post_init__(self) -> None:
        _check_choice("optim.name", self.name, OPTIMIZERS)
        if not 0 < self.layer_decay <= 1:
            raise UserError(f"optim.layer_decay={self.layer_decay}: expected a factor in (0, 1] (1 turns it off)")
        if not 0 <= self.polyak < 1:
            raise UserError(f"optim.polyak={self.polyak}: expected a factor in [0, 1) (0 turns averaging off)")
        for key in ("lr", "weight_decay", "grad_clip"):
            _check_at_least(f"optim.{key}", getattr(self, key), 0)
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"optim.label_smoothing={self.label_smoothing}: expected a value in [0, 1)")
        if self.batch_size < 1 or self.accum_steps < 1 or self.batch_size % self.accum_steps:
            raise UserError(
                f"optim.batch_size={self.batch_size} must be a positive multiple of optim.accum_steps="
                f"{self.accum_steps}"
            )


@dataclass(frozen=True)
class ScheduleConfig:
    """The run's length, in optimizer steps or in epochs (one of the two); linear warmup, then decay to min_lr.

    With neither, a fine-tune takes the paper's length for the data's size and a run from scratch 10 epochs
    (vitkit.train.recipe). A warmup as long as the run is halved, with a warning, so the lr reaches optim.lr."""

    steps: int | None = None  # optimizer steps (0 or none: not set)
    epochs: float | None = None  # passes over the training data (none: not set)
    warmup_steps: int = 0  # linear warmup from optim.lr / warmup_steps to optim.lr
    decay: str = "cosine"  # after the warmup: cosine, linear or constant
    min_lr: float = 0.0  # the learning rate at the last step

    def __post_init__(self) -> None:
        _check_choice("schedule.decay", self.decay, DECAYS)
        if self.steps == 0:  # older configs wrote 0 for "not set"
            object.__setattr__(self, "steps", None)  # still being built: the one write a frozen value allows
        for key in ("steps", "warmup_steps", "min_lr"):
            if getattr(self, key) is not None:
                _check_at_least(f"schedule.{key}", getattr(self, key), 0)
        if self.epochs is not None and not self.epochs > 0:
            raise UserError(f"schedule.epochs={self.epochs}: expected a positive number (or none)")
        if self.steps is not None and self.epochs is not None:
            raise UserError(
                f"schedule.steps={self.steps} and schedule.epochs={self.epochs:g} are both set; give one: add "
                "schedule.steps=none to count in epochs, or schedule.epochs=none to count in steps"
            )


@dataclass(frozen=True)
class RunConfig:
    """Outputs and execution. Cadences are in optimizer steps; 0 means 'only at the end'."""

    out_dir: str = "runs"  # where run directories are made
    name: str | None = None  # run directory name; default: the config file's stem
    seed: int = 0  # seeds init, data order, augmentation and dropout (resume is exact)
    log_every: int = 10  # steps between train records in metrics.jsonl (0: only at the end)
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    save_every: int = 0  # steps between checkpoints (0: only at the end)
    eval_batch_size: int = 512  # images per evaluation forward pass
    amp: str = "none"  # "bf16" autocast (CPU or CUDA), "fp16" autocast + GradScaler (CUDA)
    # true is mode "default"; "reduce-overhead" replays CUDA graphs (launch-bound steps), "max-autotune" tunes matmuls
    compile: bool | str = False  # torch.compile the training model: true, false, or a torch.compile mode
    # the same function, faster: vitkit.optimize_for_training(model) and the allocator's reuse of freed memory
    accel: str = "auto"  # "auto": what a training step on this device gains (vitkit.accel); "none": the model as built
    # clipping and the optimizer step then run a kernel per group rather than per tensor (vitkit.accel.training)
    contiguous_params: bool = False  # one buffer per optimizer group: faster for small models; not under DDP
    device: str = "auto"  # "auto": cuda if available (the local rank's GPU under torchrun), else cpu
    threads: int = 0  # torch.set_num_threads on CPU (at most the usable cores); 0 keeps torch's default
    # true: the newest of out_dir/name, name-1, ... with a training state (`vitkit train RUN/config.yaml
    # run.resume=true`: RUN); a directory: that run, moved or not. A resume never re-reads run.init_from.
    resume: bool | str = False
    resume_with_changes: bool = False  # resume even where the config differs from the run's (beyond RESUMABLE)
    init_from: str | None = None  # fine-tune from any checkpoint vitkit.load_pretrained reads
    progress: bool = True  # show a progress bar
    plots: bool = True  # write loss.png and accuracy.png at the end
    objective: str = "classification"  # "classification" (cross-entropy on labels) or "mpp" (masked patch prediction)
    tensorboard: bool = False  # also write the scalars to run_dir/tensorboard (needs the tensorboard package)

    def __post_init__(self) -> None:
        _check_choice("run.amp", self.amp, AMPS)
        _check_choice("run.accel", self.accel, ACCELS)
        _check_choice("run.objective", self.objective, OBJECTIVES)
        if isinstance(self.compile, str) and self.compile not in TRAIN_COMPILE_MODES:
            modes = ", ".join(TRAIN_COMPILE_MODES)
            raise UserError(f"run.compile={self.compile!r}: expected true, false or a torch.compile mode ({modes})")
        for key in ("threads", "log_every", "eval_every", "save_every"):
            _check_at_least(f"run.{key}", getattr(self, key), 0)
        _check_at_least("run.eval_batch_size", self.eval_batch_size, 1)


@dataclass(frozen=True)
class MPPConfig:
    """Masked patch prediction (paper sec 4.6, appendix B.1.2) when run.objective=mpp (train/mpp.py): the shares are
    of the corrupted patches, the rest left as they are (0.8 / 0.1 / 0.1 as BERT)."""

    mask_ratio: float = 0.5  # fraction of each image's patches that are corrupted and predicted, in (0, 1]
    mask_share: float = 0.8  # of the corrupted patches: replaced by the learned [mask] embedding
    random_share: float = 0.1  # of the corrupted patches: replaced by another patch's embedding of the same image
    target: str = "color"  # "color" (mean colour), "color_grid" (4x4 sub-patch colours) or "pixels" (L2)
    bits: int = 3  # colour targets: bits per channel; 2^(bits x channels) classes (512 RGB, 8 grey at 3 bits)
    grid: int = 4  # color_grid: sub-patches per patch side (grid x grid colours predicted per patch)

    def __post_init__(self) -> None:
        _check_choice("mpp.target", self.target, MPP_TARGETS)
        if not 0 < self.mask_ratio <= 1:
            raise UserError(f"mpp.mask_ratio={self.mask_ratio}: expected a fraction in (0, 1]")
        for key in ("mask_share", "random_share"):
            if not 0 <= getattr(self, key) <= 1:
                raise UserError(f"mpp.{key}={getattr(self, key)}: expected a fraction in [0, 1]")
        if not self.mask_share + self.random_share <= 1 + 1e-9:
            raise UserError(
                f"mpp.mask_share={self.mask_share} + mpp.random_share={self.random_share} exceed 1; the rest of the "
                "corrupted patches is left unchanged, so the two shares must sum to at most 1"
            )
        if not 1 <= self.bits <= 8:
            raise UserError(f"mpp.bits={self.bits}: expected 1 to 8 bits per channel")
        _check_at_least("mpp.grid", self.grid, 1)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    run: RunConfig = field(default_factory=RunConfig)
    mpp: MPPConfig = field(default_factory=MPPConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain({**dataclasses.asdict(self), "model": self.model.to_dict()})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -------------------------------------------------------------------------------------------- checks
def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{key}={value!r}: expected one of {', '.join(allowed)}")


def _check_at_least(key: str, value: float, minimum: float) -> None:
    if not value >= minimum:  # written so that NaN fails too
        raise UserError(f"{key}={value}: expected >= {minimum}")


def _plain(x: Any) -> Any:
    """Tuples to lists (YAML safe_dump has no tuples), recursively."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def flat_keys(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections -> ``{"optim.lr": 0.001, ...}``, the keys as the command line spells them."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _section_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


SECTIONS: dict[str, type] = _section_types(TrainConfig)  # each YAML section's dataclass, in TrainConfig's order


def type_name(tp: Any) -> str:
    """A field's type as `vitkit config` and the errors write it (``float``, ``tuple[float, float]``)."""
    if typing.get_origin(tp) is None and hasattr(tp, "__name__"):
        return tp.__name__
    return str(tp).replace("typing.", "")


# ------------------------------------------------------------------------------------------- describing
def field_comments(cls: type) -> dict[str, str]:
    """The comment on each field's declaration line: the one place a key's meaning is written."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"^\s+(\w+): [^#]*#\s*(.*)$", line):
            comments[m.group(1)] = m.group(2).strip()
    return comments


def describe_config(cfg: TrainConfig | None = None, required: Sequence[str] = ()) -> str:
    """Every key of a training config: ``section.key  type  value  meaning``, values the defaults or cfg's (a key
    in required reads ``<required>``); the model section lists the fields of ViTConfig or the named row's class."""
    cfg = cfg or TrainConfig()
    own = field_comments(ModelConfig)
    rows = [
        (f"model.{key}", tp, "<required>" if f"model.{key}" in required else repr(getattr(cfg.model, key)), own[key])
        for key, tp in (("name", "str | None"), ("token_merge", "int"))
    ]
    model_cls = config_class(MODELS[cfg.model.name]["arch"]) if cfg.model.name else ViTConfig
    notes = field_comments(model_cls)
    for key, tp in _section_types(model_cls).items():
        if key in MODEL_SECTION_KEYS:
            continue
        value = cfg.model.fields.get(key, "(row's)" if cfg.model.name else "(checkpoint's)")
        value = "<required>" if f"model.{key}" in required else value
        rows.append((f"model.{key}", type_name(tp), str(value), notes.get(key, "")))
    for section, cls in SECTIONS.items():
        if section == "model":
            continue
        notes = field_comments(cls)
        for key, tp in _section_types(cls).items():
            shown = "<required>" if f"{section}.{key}" in required else repr(getattr(getattr(cfg, section), key))
            rows.append((f"{section}.{key}", type_name(tp), shown, notes.get(key, "")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{k:<{widths[0]}}  {t:<{widths[1]}}  {v:<{widths[2]}}  {m}".rstrip() for k, t, v, m in rows)
