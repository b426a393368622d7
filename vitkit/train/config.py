"""Training configuration: dataclasses per section, loaded from YAML, with typed ``section.key=value`` overrides.

    model:    a registry name and any field of its model config to change (width, depth, resnet_layers, ...)
    data:     vitkit.data.DataConfig (source, root, split, preprocessing, augmentation)
    optim:    optimizer, lr, weight decay, clipping, label smoothing, global batch and accumulation
    schedule: length (steps or epochs), warmup, decay shape
    run:      where outputs go, seed, logging/eval/checkpoint cadence, precision, device, resume, init_from,
              and the objective (classification, or mpp: masked patch prediction)
    mpp:      the masked patch prediction objective's corruption rates and target (run.objective=mpp)

A value's type is the dataclass field's type, so ``optim.lr=3e-4`` is a float, ``optim.betas=0.9,0.95`` a
tuple and ``model.representation_size=none`` an Optional; an unknown key or a wrong type is a UserError
(ConfigError) naming the key, what was expected and (for a typo) the close matches, and where the value came from
(the config file's path, or the command line). Each section, and the whole TrainConfig, is a frozen value: change
one with ``dataclasses.replace``.

The command line's values replace the file's, and a length given there replaces the file's in either unit
(``schedule.steps=400`` over a file's ``schedule.epochs``); both units on one level are an error. A value ``???``
in a file is one the user must give; ``vitkit config`` lists such a config with ``<required>`` in their place.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ..data import DataConfig
from ..data.config import SOURCES, source_section
from ..data.transforms import AUGMENTS
from ..errors import ConfigError, UserError, UserFileNotFoundError
from ..fast import COMPILE_MODES
from ..models import ResNetConfig, ViTConfig
from ..models.registry import MODELS, config_class, model_config, unknown_model
from .state import STATE_NAME

OPTIMIZERS = ("adamw", "adam", "sgd")
DECAYS = ("cosine", "linear", "constant")
AMPS = ("none", "bf16", "fp16")
OBJECTIVES = ("classification", "mpp")
TRAIN_COMPILE_MODES = tuple(m for m in COMPILE_MODES if m != "none")  # run.compile's modes besides true/false
MPP_TARGETS = ("color", "color_grid", "pixels")
REQUIRED = "???"  # a config value the user must supply on the command line
T = TypeVar("T")


@dataclass(frozen=True)
class ModelConfig:
    """A registered model (or the architecture of run.init_from) and the fields of its config to change.

    Every field of the row's config class (ViTConfig, or ResNetConfig for a ResNet row) is a key of this
    section, typed and checked by that class: ``model.resnet_layers=3,4,9``, ``model.gelu=exact``,
    ``model.ln_eps=1e-12``. Fields left unset keep the registry's values, except ``img_size``, ``in_chans`` and
    ``num_classes``, which follow the data. Without a name, the model is the one run.init_from holds, read
    from the checkpoint itself (its fields checked when the model is built).
    """

    name: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.fields}


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

    With neither, a fine-tune (run.init_from) takes the paper's length for the data's size and a run from
    scratch 10 epochs (see vitkit.train.recipe). A warmup as long as the run is shortened to
    half of it, with a warning, so that the learning rate reaches optim.lr.
    """

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
    # a mode: "reduce-overhead" replays CUDA graphs (for GPU steps bound by launching kernels), "max-autotune" also
    # tunes the matrix products; true is mode "default"
    compile: bool | str = False  # torch.compile the training model: true, false, or a torch.compile mode
    # clipping and the optimizer step then run a kernel per group rather than per tensor (vitkit.train.contiguous)
    contiguous_params: bool = False  # one buffer per optimizer group: faster for small models; not under DDP
    device: str = "auto"  # "auto": cuda if available (the local rank's GPU under torchrun), else cpu
    threads: int = 0  # torch.set_num_threads on CPU (at most the usable cores); 0 keeps torch's default
    # true: continue the newest of out_dir/name, name-1, ... that holds a training state; a run directory
    # (run.resume=runs/digits-1, moved or copied ones too): continue that one. `vitkit train RUN/config.yaml
    # run.resume=true` resumes RUN. A resume never re-reads run.init_from: the state holds every weight.
    resume: bool | str = False
    resume_with_changes: bool = False  # resume even where the config differs from the run's (beyond RESUMABLE)
    init_from: str | None = None  # fine-tune from any checkpoint vitkit.load_pretrained reads
    progress: bool = True  # show a progress bar
    plots: bool = True  # write loss.png and accuracy.png at the end
    objective: str = "classification"  # "classification" (cross-entropy on labels) or "mpp" (masked patch prediction)
    tensorboard: bool = False  # also write the scalars to run_dir/tensorboard (needs the tensorboard package)

    def __post_init__(self) -> None:
        _check_choice("run.amp", self.amp, AMPS)
        _check_choice("run.objective", self.objective, OBJECTIVES)
        if isinstance(self.compile, str) and self.compile not in TRAIN_COMPILE_MODES:
            modes = ", ".join(TRAIN_COMPILE_MODES)
            raise UserError(f"run.compile={self.compile!r}: expected true, false or a torch.compile mode ({modes})")
        for key in ("threads", "log_every", "eval_every", "save_every"):
            _check_at_least(f"run.{key}", getattr(self, key), 0)
        _check_at_least("run.eval_batch_size", self.eval_batch_size, 1)


@dataclass(frozen=True)
class MPPConfig:
    """Masked patch prediction (paper sec 4.6, appendix B.1.2), used when run.objective=mpp (see train/mpp.py).

    mask_ratio of the patches of each image are corrupted; each corrupted patch is replaced by the [mask]
    embedding (mask_share), by another patch of the same image (random_share) or left as it is (the rest), and
    its output token predicts the target. The shares are of the corrupted patches: 0.8 / 0.1 / (0.1) as BERT.
    """

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


# --------------------------------------------------------------------------------------------- loading
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


def _unknown(key: str, known: list[str]) -> ConfigError:
    """Unknown ``section.key`` (or section): the close matches, spelled in full as the user would type them."""
    section, _, name = key.rpartition(".")
    full = [f"{section}.{k}" if section else k for k in known]
    close = [full[known.index(c)] for c in difflib.get_close_matches(name, known, n=3)]
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(full)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


# Keys whose own vocabulary has the word "none" (no augmentation): there it is that value, never null
# (null still leaves the choice to the source's default).
NONE_IS_A_CHOICE = {"data.train_augment": AUGMENTS}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert value (from YAML, or a raw CLI string) to the annotated type tp."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        nulls = ("null",) if "none" in NONE_IS_A_CHOICE.get(key, ()) else ("none", "null")
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in nulls)):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except UserError as e:
                errors.append(str(e))
        raise UserError(errors[0] if len(errors) == 1 else f"{key}={value!r}: expected {_type_name(tp)}")
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key}={value!r}: expected a list ({_type_name(tp)}, e.g. 0.5,0.5,0.5)")
        return [_coerce(v.strip() if isinstance(v, str) else v, args[0], key) for v in value]
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key}={value!r}: expected {_type_name(tp)} (e.g. 0.9,0.999)")
        item_types = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise UserError(f"{key}={value!r}: expected {len(item_types)} values ({_type_name(tp)})")
        return tuple(_coerce(v.strip() if isinstance(v, str) else v, t, key) for v, t in zip(value, item_types))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise UserError(f"{key}={value!r}: expected a bool (true/false)")
    if tp is int:
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            number = None
        if isinstance(number, (int, float)) and not isinstance(number, bool) and float(number).is_integer():
            return int(number)
        raise UserError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{key}={value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(f"{key}={value!r}: expected a number") from None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{key}={value!r}: expected a string")
    if tp is Any:
        return value
    raise UserError(f"{key}: unsupported field type {tp!r}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is None and hasattr(tp, "__name__"):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _section_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    types_ = _section_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in types_:
            raise _unknown(f"{section}.{key}", sorted(types_))
        kwargs[key] = _coerce(value, types_[key], f"{section}.{key}")
    return cls(**kwargs)  # every key is a field, every value of its type: __post_init__ checks the rest


def _build_model_section(values: dict[str, Any]) -> ModelConfig:
    """The model section: ``name``, then fields typed and checked by the named row's config class."""
    name = values.get("name")
    name = None if name is None or str(name).lower() in ("none", "null") else _coerce(name, str, "model.name")
    if name is not None and name not in MODELS:
        raise UserError(f"model.name: {unknown_model(name)}")
    if name is None:  # the checkpoint's architecture: a key of either config class, checked at build time
        types_ = {**_section_types(ResNetConfig), **_section_types(ViTConfig)}
    else:
        types_ = _section_types(config_class(MODELS[name]["arch"]))
    fields = {}
    for key, value in values.items():
        if key == "name":
            continue
        if key not in types_:
            raise _unknown(f"model.{key}", ["name", *sorted(types_)])
        if value is None and type(None) not in typing.get_args(types_[key]):
            continue  # a null for a field that cannot be None means "the registry's value", as older configs wrote it
        fields[key] = _coerce(value, types_[key], f"model.{key}")
    if name is not None:
        with warnings.catch_warnings():  # a border warning is for the model actually built, at the data's size
            warnings.simplefilter("ignore")
            try:
                model_config(name, **fields)
            except ConfigError as e:
                raise ConfigError(f"model: {e}") from None
    return ModelConfig(name, fields)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "run": RunConfig,
    "mpp": MPPConfig,
}


COMMAND_LINE = "command line"  # where an override's value came from, as errors name it
LENGTH_KEYS = ("steps", "epochs")  # schedule: the run's length, one of the two


def flat_keys(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections -> ``{"optim.lr": 0.001, ...}``, the keys as the command line spells them."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _file_values(doc: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A document's sections, checked for shape (every section known, each a mapping)."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, items in (doc or {}).items():
        if section not in SECTIONS:
            raise _unknown(section, list(SECTIONS))
        if not isinstance(items, dict):
            raise UserError(f"config section {section!r} must be a mapping of key: value, got {items!r}")
        values[section].update(items)
    steps, epochs = (values["schedule"].get(k) for k in LENGTH_KEYS)
    if not _is_unset(steps) and not _is_unset(epochs):  # a command line's length could not say which one it replaces
        raise UserError(f"schedule.steps={steps} and schedule.epochs={epochs} are both set; keep one of the two")
    return values


def _override_values(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``section.key=value`` strings as sections of raw strings (_coerce types each by its field)."""
    if isinstance(overrides, str):  # a str is a sequence too: each character would be read as an override
        raise TypeError(f"overrides: expected a list of section.key=value strings, got the string {overrides!r}")
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise UserError(f"override {item!r}: expected section.key=value (e.g. optim.lr=3e-4)")
        if section not in SECTIONS:
            raise _unknown(section, list(SECTIONS))
        values[section][name] = raw.strip()
    return values


def _is_unset(value: Any) -> bool:
    """None, or 0 for schedule.steps (older configs wrote it for "not set"), in YAML's or the command line's words."""
    if isinstance(value, str):
        return value.strip().lower() in ("none", "null", "0", "")
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def _merge(file: dict[str, dict[str, Any]], cli: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The command line's values over the file's. A length on the command line (schedule.steps or
    schedule.epochs) replaces the file's length in the other unit; both units on one level stay an error."""
    merged = {section: {**file[section], **cli[section]} for section in SECTIONS}
    for key, other in (LENGTH_KEYS, LENGTH_KEYS[::-1]):
        if not _is_unset(cli["schedule"].get(key)) and other not in cli["schedule"] and other in file["schedule"]:
            del merged["schedule"][other]
    return merged


def required_keys(values: dict[str, dict[str, Any]]) -> list[str]:
    """The ``section.key`` names still marked ``???`` (REQUIRED)."""
    return [f"{s}.{k}" for s, items in values.items() for k, v in items.items() if v == REQUIRED]


def _without_required(values: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s: {k: v for k, v in items.items() if v != REQUIRED} for s, items in values.items()}


def _labelled(label: str | None, build: Callable[[], T]) -> T:
    """build(), a UserError from it naming where the values came from (a file's path, the command line)."""
    try:
        return build()
    except UserError as e:  # the same kind of error; anything else is a bug and keeps its traceback
        if label is None:
            raise
        raise type(e)(f"{label}: {e}") from None


def config_from_dict(
    doc: dict[str, Any] | None,
    overrides: Sequence[str] = (),
    *,
    origin: str | None = None,
    listing: bool = False,
) -> TrainConfig:
    """A TrainConfig from nested plain values plus ``section.key=value`` strings (applied last).

    A value ``???`` marks a key the user must supply (e.g. the data root of a shipped recipe). With run.init_from
    set, every key of the fine-tuning recipe that neither doc nor overrides give is the recipe's
    (vitkit.train.recipe.recipe_values): a file's explicit values count as the user's. A length on the command
    line replaces doc's length in the other unit (schedule.steps=400 over a file's schedule.epochs).

    origin: where doc came from (a file's path), named in doc's errors; the overrides' errors name the command
    line. listing: a ``???`` key is left at its default rather than refused (``vitkit config``), and the recipe
    is resolved only once nothing is missing.
    """
    file = _labelled(origin, lambda: _file_values(doc))
    cli = _labelled(COMMAND_LINE, lambda: _override_values(overrides))
    merged = _merge(file, cli)
    missing = required_keys(merged)
    if missing and not listing:
        where = f"{origin}: " if origin else ""
        raise UserError(f"{where}{', '.join(missing)}: required by this config; pass e.g. {missing[0]}=...")
    label = COMMAND_LINE if any(cli.values()) else origin
    merged = _without_required(merged)
    try:  # built once; the failing path alone works out whom to blame
        cfg = _build_config(merged)
    except UserError:
        if any(cli.values()):
            _blame_the_file(file, cli, origin)  # the file's own error, where the file is at fault
        _labelled(label, lambda: _build_config(merged))  # else this error again, named by where it came from
        raise
    if not cfg.run.init_from or missing:
        return cfg
    from .recipe import recipe_values  # a fine-tune: the one resolution of its recipe fills what was not given

    given = {f"{section}.{key}" for section, values in merged.items() for key in values}
    init_label = COMMAND_LINE if "init_from" in cli["run"] else origin
    for key, value in _labelled(init_label, lambda: recipe_values(cfg, given)).items():
        section, _, name = key.partition(".")
        merged[section][name] = value
    return _labelled(label, lambda: _build_config(merged))


def _blame_the_file(file: dict[str, dict[str, Any]], cli: dict[str, dict[str, Any]], origin: str | None) -> None:
    """Where the merged values fail: raise the file's own error, named by origin, if the file is at fault (it
    fails as written and without the keys the command line replaced); else return, and the command line is blamed.
    Merged values that build are never refused: an override may be what makes the file's values fit
    (``model.num_heads=2`` over a file's ``width: 64``, which the registry's 3 heads do not divide)."""
    kept = {section: {k: v for k, v in file[section].items() if k not in cli[section]} for section in SECTIONS}
    if _fails(_without_required(file)) and _fails(_without_required(kept)):
        _labelled(origin, lambda: _build_config(_without_required(kept)))


def _fails(values: dict[str, dict[str, Any]]) -> bool:
    try:
        _build_config(values)
    except UserError:
        return True
    return False


def _build_config(merged: dict[str, dict[str, Any]]) -> TrainConfig:
    sections = {name: _build_section(cls, merged[name], name) for name, cls in SECTIONS.items() if name != "model"}
    return TrainConfig(model=_build_model_section(merged["model"]), **sections)


def shipped_configs() -> dict[str, Path]:
    """The configs shipped in vitkit/configs, by stem: digits, vit_b16_pretrain, vit_b16_finetune, ..."""
    folder = resources.files("vitkit") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the stem of a shipped config (``digits``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_configs()
    if name_or_path in shipped:
        return shipped[name_or_path]
    raise UserFileNotFoundError(
        f"config {name_or_path!r}: no such file, and not a shipped config ({', '.join(shipped)})"
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error.

    PyYAML keeps the last of two equal keys without a word, so a second ``lr:`` under ``optim:`` would silently
    override the first. Keys brought in by a merge (``<<: *defaults``) may still be overridden.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                earlier = first_line.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if earlier is not None:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r} (first given on line {earlier})", problem_mark=key_node.start_mark
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: where and what (PyYAML's own text spans several, with a snippet of the file)."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    return " ".join(str(error).split())


def read_config_file(path: Path) -> dict[str, Any]:
    """The sections of a YAML config file as plain values (safe_load's semantics, duplicate keys refused)."""
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); a YAML config must be saved as UTF-8") from None
    if doc is not None and not isinstance(doc, dict):
        raise UserError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)})")
    return doc or {}


def data_section(data: str) -> dict[str, Any]:
    """What ``--data`` names, as a data section: a source (digits, synthetic, folder, cifar10, cifar100), an image
    folder ``DIR/<class>/<images>`` (the folder source with that root), or a training config .yaml (its data
    section). One meaning for every command that takes ``--data``."""
    path = Path(data)
    if data in SOURCES:
        return {"source": data}
    if (prefixed := source_section(data)) is not None:  # hf:NAME, wds:PATTERN, manifest:FILE
        return prefixed
    if path.is_dir():
        return {"source": "folder", "root": data}
    if path.suffix in (".yaml", ".yml") and path.is_file():
        section = read_config_file(path).get("data") or {}
        if not isinstance(section, dict):
            raise UserError(f"{path}: the 'data' section must be a mapping of key: value")
        return dict(section)
    raise UserError(
        f"--data {data!r}: expected a source ({', '.join(SOURCES)}), an image folder, hf:NAME, wds:PATTERN, "
        "manifest:FILE or a config .yaml file"
    )


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a YAML config (a path or a shipped name; default: digits) and apply overrides.

    The run name defaults to the config's stem, so ``vitkit train`` writes to runs/digits (or runs/digits-1, ...).
    An error names where its value came from: the file's path, or the command line.
    """
    return _load(path, overrides, listing=False)[0]


def load_config_for_listing(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> tuple[TrainConfig, list[str]]:
    """load_config for ``vitkit config``: a key the file marks ``???`` and the overrides do not give is left at
    its default and returned among the required keys, rather than refused."""
    return _load(path, overrides, listing=True)


def _load(path: str | Path | None, overrides: Sequence[str], listing: bool) -> tuple[TrainConfig, list[str]]:
    path = resolve_config_path(str(path) if path is not None else "digits")
    doc = read_config_file(path)
    cfg = config_from_dict(doc, overrides, origin=str(path), listing=listing)
    if cfg.run.name is None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=path.stem))
    missing = required_keys(_merge(_file_values(doc), _override_values(overrides))) if listing else []
    if cfg.run.resume is True and (path.parent / STATE_NAME).is_file():  # a run's own config.yaml: that run
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(path.parent)))
    return cfg, missing


def config_purpose(path: Path) -> str:
    """A config file's one-line purpose: the first line of its header comment."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def describe_shipped_configs() -> str:
    """The shipped configs, one a line: name and purpose (each YAML's header comment is the one source)."""
    shipped = sorted(shipped_configs().items())
    width = max(len(name) for name, _ in shipped)
    return "\n".join(f"  {name:<{width}}  {config_purpose(path)}" for name, path in shipped)


# ------------------------------------------------------------------------------------------- describing
def field_comments(cls: type) -> dict[str, str]:
    """The comment on each field's declaration line: the one place a key's meaning is written."""
    import inspect
    import re

    comments = {}
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"^\s+(\w+): [^#]*#\s*(.*)$", line):
            comments[m.group(1)] = m.group(2).strip()
    return comments


def describe_config(cfg: TrainConfig | None = None, required: Sequence[str] = ()) -> str:
    """Every key of a training config: ``section.key  type  value  meaning``; values are the defaults, or
    cfg's; a key in required (one the config marks ``???``) reads ``<required>``. The model section lists the
    fields of ViTConfig (or of the named row's config class)."""
    cfg = cfg or TrainConfig()
    name = "<required>" if "model.name" in required else repr(cfg.model.name)
    rows = [("model.name", "str | None", name, "a registered model; none: run.init_from's own")]
    model_cls = config_class(MODELS[cfg.model.name]["arch"]) if cfg.model.name else ViTConfig
    notes = field_comments(model_cls)
    for key, tp in _section_types(model_cls).items():
        value = cfg.model.fields.get(key, "(row's)" if cfg.model.name else "(checkpoint's)")
        value = "<required>" if f"model.{key}" in required else value
        rows.append((f"model.{key}", _type_name(tp), str(value), notes.get(key, "")))
    for section, cls in SECTIONS.items():
        if section == "model":
            continue
        notes = field_comments(cls)
        for key, tp in _section_types(cls).items():
            shown = "<required>" if f"{section}.{key}" in required else repr(getattr(getattr(cfg, section), key))
            rows.append((f"{section}.{key}", _type_name(tp), shown, notes.get(key, "")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{k:<{widths[0]}}  {t:<{widths[1]}}  {v:<{widths[2]}}  {m}".rstrip() for k, t, v, m in rows)
