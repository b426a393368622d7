"""Typed ``section.key=value`` values: a config file's sections under the command line's, built into a TrainConfig.

A value takes its dataclass field's type (``optim.betas=0.9,0.95`` is a tuple, ``model.representation_size=none``
None); an unknown key or a wrong type is a ConfigError naming the key, what was expected, close matches and where
the value came from (the file's path, or the command line). A length on the command line replaces the file's in
either unit (``schedule.steps=400`` over ``schedule.epochs``); a value ``???`` is one the user must give.
"""

from __future__ import annotations

import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..data.transforms import AUGMENTS
from ..errors import ConfigError, UserError, did_you_mean
from ..models import ResNetConfig, ViTConfig
from ..models.registry import MODELS, config_class, model_config, unknown_model
from .config import MODEL_SECTION_KEYS, REQUIRED, SECTIONS, ModelConfig, TrainConfig, _section_types, type_name

COMMAND_LINE = "command line"  # where an override's value came from, as errors name it
LENGTH_KEYS = ("steps", "epochs")  # schedule: the run's length, one of the two
# keys whose own vocabulary has "none" (no augmentation): there it is that value; null is the source's default
NONE_IS_A_CHOICE = {"data.train_augment": AUGMENTS}
T = TypeVar("T")
Sections = dict[str, dict[str, Any]]


# ------------------------------------------------------------------------------------------------ typing
def _unknown(key: str, known: list[str]) -> ConfigError:
    """Unknown ``section.key`` (or section): the close matches, spelled in full as the user would type them."""
    section, _, name = key.rpartition(".")
    full = [f"{section}.{k}" if section else k for k in known]
    spell = (lambda k: f"{section}.{k}") if section else str
    hint = did_you_mean(name, known, f"known keys: {', '.join(full)}", spell, loose=False)  # keys are spelt one way
    return ConfigError(f"unknown config key {key!r}; {hint}")


def _split_items(value: Any) -> Any:
    """A command line's ``a,b,c`` (brackets allowed) as items; anything else as it is."""
    if isinstance(value, str):
        return [v for v in value.strip("()[] ").split(",") if v.strip()]
    return value


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
        raise UserError(errors[0] if len(errors) == 1 else f"{key}={value!r}: expected {type_name(tp)}")
    if origin is list:
        value = _split_items(value)
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key}={value!r}: expected a list ({type_name(tp)}, e.g. 0.5,0.5,0.5)")
        return [_coerce(v.strip() if isinstance(v, str) else v, args[0], key) for v in value]
    if origin is tuple:
        value = _split_items(value)
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key}={value!r}: expected {type_name(tp)} (e.g. 0.9,0.999)")
        item_types = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise UserError(f"{key}={value!r}: expected {len(item_types)} values ({type_name(tp)})")
        return tuple(_coerce(v.strip() if isinstance(v, str) else v, t, key) for v, t in zip(value, item_types))
    return _coerce_scalar(value, tp, key)


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
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


def value_text(value: Any) -> str:
    """A YAML value as the text of a ``key=value`` override (what this parser reads back)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(value_text(v) for v in value)
    return str(value)


def model_field_types(name: str | None) -> dict[str, Any]:
    """The model section's fields besides its own keys: the named row's config class's, or (no name: the
    architecture of run.init_from, checked when the model is built) those of either config class."""
    if name is None:
        types_ = {**_section_types(ResNetConfig), **_section_types(ViTConfig)}
    else:
        types_ = _section_types(config_class(MODELS[name]["arch"]))
    return {k: v for k, v in types_.items() if k not in MODEL_SECTION_KEYS}


# ---------------------------------------------------------------------------------------------- sections
def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    types_ = _section_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in types_:
            raise _unknown(f"{section}.{key}", sorted(types_))
        kwargs[key] = _coerce(value, types_[key], f"{section}.{key}")
    return cls(**kwargs)  # every key is a field, every value of its type: __post_init__ checks the rest


def _build_model_section(values: dict[str, Any]) -> ModelConfig:
    """The model section: ``name`` and ``token_merge``, then fields typed and checked by the row's config class."""
    name = values.get("name")
    name = None if name is None or str(name).lower() in ("none", "null") else _coerce(name, str, "model.name")
    if name is not None and name not in MODELS:
        raise UserError(f"model.name: {unknown_model(name)}")
    merge = values.get("token_merge")
    token_merge = 0 if merge is None else _coerce(merge, int, "model.token_merge")
    types_ = model_field_types(name)
    fields = {}
    for key, value in values.items():
        if key in MODEL_SECTION_KEYS:
            continue
        if key not in types_:
            raise _unknown(f"model.{key}", [*MODEL_SECTION_KEYS, *sorted(types_)])
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
    return ModelConfig(name=name, token_merge=token_merge, fields=fields)


def _build_config(merged: Sections) -> TrainConfig:
    sections = {name: _build_section(cls, merged[name], name) for name, cls in SECTIONS.items() if name != "model"}
    return TrainConfig(model=_build_model_section(merged["model"]), **sections)


# ------------------------------------------------------------------------------------ the file, the command line
def _file_values(doc: dict[str, Any] | None) -> Sections:
    """A document's sections, checked for shape (every section known, each a mapping)."""
    values: Sections = {name: {} for name in SECTIONS}
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


def _override_values(overrides: Sequence[str]) -> Sections:
    """``section.key=value`` strings as sections of raw strings (_coerce types each by its field)."""
    if isinstance(overrides, str):  # a str is a sequence too: each character would be read as an override
        raise TypeError(f"overrides: expected a list of section.key=value strings, got the string {overrides!r}")
    values: Sections = {name: {} for name in SECTIONS}
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


def _without_required(values: Sections) -> Sections:
    return {s: {k: v for k, v in items.items() if v != REQUIRED} for s, items in values.items()}


def labelled(label: str | None, build: Callable[[], T]) -> T:
    """build(), a UserError from it naming where the values came from (a file's path, the command line)."""
    try:
        return build()
    except UserError as e:  # the same kind of error; anything else is a bug and keeps its traceback
        if label is None:
            raise
        raise type(e)(f"{label}: {e}") from None


@dataclass(frozen=True)
class GivenValues:
    """A config's values as the user gave them, before they are typed: a file's (from ``origin``) under the
    command line's overrides. ``build`` types and checks them, naming where a wrong one came from."""

    file: Sections
    cli: Sections
    origin: str | None = None

    @classmethod
    def read(cls, doc: dict[str, Any] | None, overrides: Sequence[str] = (), origin: str | None = None) -> GivenValues:
        file = labelled(origin, lambda: _file_values(doc))
        return cls(file, labelled(COMMAND_LINE, lambda: _override_values(overrides)), origin)

    @property
    def merged(self) -> Sections:
        """The command line's values over the file's; a length given there replaces the file's in the other unit."""
        file, cli = self.file, self.cli
        merged = {section: {**file[section], **cli[section]} for section in SECTIONS}
        for key, other in (LENGTH_KEYS, LENGTH_KEYS[::-1]):
            if not _is_unset(cli["schedule"].get(key)) and other not in cli["schedule"] and other in file["schedule"]:
                del merged["schedule"][other]
        return merged

    @property
    def missing(self) -> list[str]:
        """The ``section.key`` names still marked ``???`` (REQUIRED)."""
        return [f"{s}.{k}" for s, items in self.merged.items() for k, v in items.items() if v == REQUIRED]

    @property
    def keys(self) -> set[str]:
        """Every ``section.key`` given, by the file or the command line."""
        return {f"{section}.{key}" for section, values in self.merged.items() for key in values}

    def origin_of(self, key: str) -> str | None:
        """Where the value of ``section.key`` came from: the command line, else the file."""
        section, _, name = key.partition(".")
        return COMMAND_LINE if name in self.cli[section] else self.origin

    def build(self, listing: bool = False, filled: dict[str, Any] | None = None) -> TrainConfig:
        """The TrainConfig, with ``filled`` (a recipe's ``section.key`` values) added; a key still marked ``???`` is
        refused, or with ``listing`` (``vitkit config``) left at its default."""
        missing = self.missing
        if missing and not listing:
            where = f"{self.origin}: " if self.origin else ""
            raise UserError(f"{where}{', '.join(missing)}: required by this config; pass e.g. {missing[0]}=...")
        label = COMMAND_LINE if any(self.cli.values()) else self.origin
        merged = _without_required(self.merged)
        if filled:
            for key, value in filled.items():
                section, _, name = key.partition(".")
                merged[section][name] = value
            return labelled(label, lambda: _build_config(merged))
        try:  # built once; the failing path alone works out whom to blame
            return _build_config(merged)
        except UserError:
            if any(self.cli.values()):
                self._blame_the_file()  # the file's own error, where the file is at fault
            labelled(label, lambda: _build_config(merged))  # else this error again, named by where it came from
            raise

    def _blame_the_file(self) -> None:
        """Raise the file's own error, named by origin, if the file is at fault (it fails as written and without the
        keys the command line replaced); else the command line is blamed. Values that build are never refused: an
        override may be what makes the file's fit (``model.num_heads=2`` over a ``width: 64`` 3 heads do not divide)."""
        kept = {s: {k: v for k, v in self.file[s].items() if k not in self.cli[s]} for s in SECTIONS}
        if _fails(_without_required(self.file)) and _fails(_without_required(kept)):
            labelled(self.origin, lambda: _build_config(_without_required(kept)))


def _fails(values: Sections) -> bool:
    try:
        _build_config(values)
    except UserError:
        return True
    return False
