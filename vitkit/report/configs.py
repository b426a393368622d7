"""A training config as rows of ``section.key = value``, and what in it differs from the defaults and from the
shipped config it was made from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..models.registry import MODELS, model_config
from ..train.config import ModelConfig, TrainConfig, flat_keys
from ..train.config_files import shipped_configs
from ..train.recipe import load_config
from ..train.rundir import PATH_KEYS
from .html import Html, Row, esc, join, table, tag


def default_values(cfg: TrainConfig) -> dict[str, Any]:
    """What each key of cfg would be had nothing set it: vitkit.train.config's defaults, and for the model's
    fields the registry row's values (what ``model.name`` alone builds)."""
    values = flat_keys(TrainConfig().to_dict())
    values["model.token_merge"] = ModelConfig().token_merge  # a default that to_dict leaves out
    name = cfg.model.name
    if name is not None and name in MODELS:
        row = model_config(name)
        for key in cfg.model.fields:
            value = getattr(row, key, None)
            values[f"model.{key}"] = list(value) if isinstance(value, tuple) else value
    return values


def shipped_for(cfg: TrainConfig) -> str | None:
    """The shipped config a run was made from, when its name says so (``vitkit train digits`` runs are named digits)."""
    name = cfg.run.name
    return name if name is not None and name in shipped_configs() else None


@dataclass
class ConfigDiff:
    """A config's values with the defaults and (when known) the shipped config's values beside them."""

    values: dict[str, Any]
    defaults: dict[str, Any]
    shipped_name: str | None
    shipped: dict[str, Any]

    def differs_from_default(self, key: str) -> bool:
        return not same_value(key, self.values.get(key), self.defaults.get(key))

    def differs_from_shipped(self, key: str) -> bool:
        return self.shipped_name is not None and not same_value(key, self.values.get(key), self.shipped.get(key))

    def changed(self) -> list[str]:
        return [k for k in self.values if self.differs_from_default(k) or self.differs_from_shipped(k)]


def same_value(key: str, value: Any, reference: Any) -> bool:
    """Equal as the page shows them (a mean of [0.5], one value for every channel, is the default 0.5); a path that
    config.yaml stores absolute is the relative default or shipped path it ends in, resolved where the run started."""
    if show_value(value) == show_value(reference):
        return True
    if key not in PATH_KEYS or not isinstance(value, str) or not isinstance(reference, str) or not reference:
        return False
    path, ref = Path(value), Path(reference)
    return (
        path.is_absolute()
        and not ref.is_absolute()
        and ".." not in ref.parts
        and path.parts[-len(ref.parts) :] == ref.parts
    )


def config_diff(cfg: TrainConfig) -> ConfigDiff:
    shipped_name, shipped = shipped_for(cfg), {}
    if shipped_name is not None:
        try:
            shipped = flat_keys(load_config(shipped_name).to_dict())
        except UserError:  # a recipe with keys the user must give (a data root): no values to compare with
            shipped_name = None
    return ConfigDiff(flat_keys(cfg.to_dict()), default_values(cfg), shipped_name, shipped)


def breakable(key: str) -> Html:
    """A dotted key that a narrow window may wrap after its dots (and nowhere else)."""
    return Html(esc(key).replace(".", ".<wbr>"))


def show_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"  # as config.yaml and the command line write it
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def config_section(cfg: TrainConfig) -> Html:
    """What the run changed (a table of the keys that differ), then every resolved key in a closed <details>."""
    diff = config_diff(cfg)
    header = ["key", "this run", "default"] + ([f"{diff.shipped_name}.yaml"] if diff.shipped_name else [])
    changed = diff.changed()
    rows = []
    for key in changed:
        default = show_value(diff.defaults.get(key, "(unset)"))
        cells: list[object] = [breakable(key), show_value(diff.values[key]), default]
        if diff.shipped_name:
            mark = tag("mark", "changed", cls="badge shipped") if diff.differs_from_shipped(key) else ""
            cells.append(join([show_value(diff.shipped.get(key, "(unset)")), " ", mark]))
        rows.append(Row(cells, "changed" if diff.differs_from_shipped(key) else None))
    if diff.shipped_name:
        intro = (
            f"Keys that differ from vitkit's defaults (vitkit.train.config) or from the shipped config "
            f"{diff.shipped_name}.yaml, whose name the run carries; highlighted: what differs from "
            f"{diff.shipped_name}.yaml (the command line's overrides)."
        )
    else:
        intro = "Keys that differ from vitkit's defaults (vitkit.train.config); the model's fields are compared "
        intro += "with the registry row model.name names."
    every = []
    for key, value in diff.values.items():
        mark = tag("mark", "changed", cls="badge") if key in changed else ""
        shipped_cls = "changed" if diff.differs_from_shipped(key) else None
        every.append(Row([breakable(key), show_value(value), mark], shipped_cls))
    full = table(["key", "value", ""], every, caption="config.yaml, every key")
    summary = tag("summary", f"The whole resolved config ({len(diff.values)} keys)")
    changes = table(header, rows, caption="What this run set") if rows else tag("p", "Every key has its default.")
    return join([tag("p", intro, cls="note"), changes, tag("details", join([summary, full]))])
