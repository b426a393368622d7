"""A sweep spec: a YAML file naming a base config, the overrides every cell shares, those that vary, the seeds, the
metrics and the figure's axes; its header says what it measures, the command, the runtime and the result.

    config: digits                          # a shipped name, a path (beside the spec first) or an inline mapping
    overrides: [schedule.steps=200]         # every cell: key=value strings, or a mapping key: value
    grid: {model.pos_embed: [none, learned]}  # a cross product of values, times the ``cells`` (sets, or lists of)
    skip: [{model.pos_embed: none, model.pos_embed_where: every_layer}]  # combinations left out
    seeds: [0, 1, 2]                        # run.seed of each repeat
    metrics: [eval_top1, train.loss, finetune.eval_top1, fewshot.5shot, attention.layer0]
    figure: {x: model.pos_embed, lines: [model.pos_embed_where], log_x: false}
    finetune: {config: {data: {source: digits}}, overrides: [...]}  # a second run per cell, from the first's model
    probes: {fewshot: {data: digits, shots: [5, 10]}, attention: {images: 256}}  # on each first run (probes.py)
    gpu: {overrides: [data.img_size=32], seeds: [0, 1, 2, 3, 4], jobs: 4}  # --scale gpu; the spec itself is cpu

A cell's run directory is OUT/<name>, named by its varying values and seed: ``pos_embed-learned_seed-0``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..train.config_files import read_yaml
from ..train.overrides import value_text
from .probes import ATTENTION_METRICS, Probes, parse_probes

MAX_RUNS = 10_000  # runs in one sweep: each is a training run; a bigger grid is a typo or a job for a cluster
SPEC_KEYS = ("config", "overrides", "grid", "cells", "skip", "seeds", "metrics", "figure", "finetune", "probes",
             "claims", "gpu", "quick")  # fmt: skip
QUICK_KEYS = ("overrides", "grid", "cells", "seeds", "finetune_overrides")  # quick: --quick, applied after the scale
SCALES = ("cpu", "gpu")  # cpu: the spec as written (minutes on 2 cores); gpu: its ``gpu`` section (one GPU)
# what a scale section may set: overrides add to the spec's, the others replace them; jobs: cells at once by default
SCALE_KEYS = (*QUICK_KEYS, "skip", "claims", "metrics", "probes", "jobs")
LATER_KEYS = ("claims", "metrics", "probes")  # read once the variant's sections are applied
PRETRAIN = "pretrain"  # a cell key, not a config key: ``pretrain: false`` trains the finetune stage from scratch
# ``pretrain: untrained``: the first run is its model's initialisation, saved, probed and fine-tuned like a trained
# one (the untrained-features baseline): one step at learning rate 0, which leaves every weight as it was drawn
UNTRAINED = "untrained"
CELL_DEFAULTS = {PRETRAIN: True}  # what a cell without the key does: it pre-trains
UNTRAINED_OVERRIDES = ("schedule.steps=1", "schedule.epochs=none", "schedule.warmup_steps=0", "optim.lr=0")
FINETUNE = "finetune"  # the prefix of the finetune stage's metrics, and the suffix of its run directories
COMPUTE = "compute"  # a metric and a figure x: the first run's training FLOPs (aggregate.run_compute)


def finetune_name(first: str) -> str:
    """The run directory name of a cell's finetune stage, beside its first run's."""
    return f"{first}--{FINETUNE}"


def shipped_sweeps() -> dict[str, Path]:
    """The specs shipped in vitkit/sweeps, by stem."""
    folder = Path(__file__).resolve().parent.parent / "sweeps"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def _override_list(doc: Any, where: str) -> list[str]:
    if doc is None:
        return []
    if isinstance(doc, dict):
        return [f"{k}={value_text(v)}" for k, v in doc.items()]
    if isinstance(doc, list) and all(isinstance(item, str) and "=" in item for item in doc):
        return list(doc)
    raise UserError(f"{where}: expected a list of section.key=value strings or a mapping of key: value, got {doc!r}")


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: its varying overrides (key -> value, in axis order), its seed and its name."""

    values: tuple[tuple[str, Any], ...]
    seed: int
    name: str

    @property
    def group(self) -> tuple[tuple[str, Any], ...]:
        """What the cell's seeds share: the cells of one group are averaged."""
        return self.values

    @property
    def pretrains(self) -> bool:
        """False for a cell with ``pretrain: false``: its finetune stage alone, from scratch (the baseline)."""
        return dict(self.values).get(PRETRAIN, CELL_DEFAULTS[PRETRAIN]) is not False

    def overrides(self) -> list[str]:
        untrained = dict(self.values).get(PRETRAIN) == UNTRAINED
        return [f"{k}={value_text(v)}" for k, v in self.values if k != PRETRAIN] + [*UNTRAINED_OVERRIDES] * untrained


@dataclass(frozen=True)
class Claim:
    """An ordering the experiment tests (stats.py): the row whose values match ``higher`` has the larger ``metric``
    than the row matching ``lower``."""

    metric: str
    higher: tuple[tuple[str, Any], ...]
    lower: tuple[tuple[str, Any], ...]

    @staticmethod
    def label(side: tuple[tuple[str, Any], ...]) -> str:
        return ", ".join(f"{k}={value_text(v)}" for k, v in side)

    @staticmethod
    def matches(side: tuple[tuple[str, Any], ...], values: dict[str, Any]) -> bool:
        return all(k in values and values[k] == v for k, v in side)


@dataclass(frozen=True)
class SweepSpec:
    path: Path
    config: str | dict[str, Any]
    overrides: list[str]
    grid: dict[str, list[Any]]
    cells: list[dict[str, Any]]
    skip: list[dict[str, Any]]
    seeds: list[int]
    metrics: list[str]
    figure_x: str | None = None
    figure_lines: list[str] = field(default_factory=list)
    log_x: bool = False
    finetune_config: str | dict[str, Any] | None = None
    finetune_overrides: list[str] = field(default_factory=list)
    probes: Probes = field(default_factory=Probes)
    claims: list[Claim] = field(default_factory=list)
    scale: str = "cpu"
    quick: bool = False
    jobs: int = 1  # cells at once unless the command line says

    @property
    def options(self) -> str:
        """The command-line options that load this variant of the spec."""
        return " ".join(["--scale gpu"] * (self.scale == "gpu") + ["--quick"] * self.quick)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def axes(self) -> list[str]:
        """The keys that vary, list cells' keys first, then the grid's, each once."""
        return list(dict.fromkeys([*(k for cell in self.cells for k in cell), *self.grid]))

    def base_config(self, which: str | dict[str, Any] | None = None) -> str | dict[str, Any]:
        """The config of the first stage (or ``which``): an inline mapping as it is; a name, a file next to the
        spec if there is one, else as the config loader finds it (a path or a shipped name)."""
        name = self.config if which is None else which
        if isinstance(name, dict):
            return name
        beside = self.path.parent / name
        return str(beside) if beside.is_file() else name

    def expand(self) -> list[Cell]:
        """Every cell: list cells x grid points x seeds, minus the skipped combinations, named; more than MAX_RUNS
        is refused before any is made."""
        runs = max(len(self.cells), 1) * math.prod(len(v) for v in self.grid.values()) * len(self.seeds)
        if runs > MAX_RUNS:
            sizes = " x ".join([*(f"{len(v)} {k}" for k, v in self.grid.items()), f"{len(self.seeds)} seeds"])
            raise UserError(f"{self.path}: {runs:,} runs ({sizes}); a sweep runs at most {MAX_RUNS:,}")
        axes = self.axes
        grid_points = [dict(zip(self.grid, combo)) for combo in itertools.product(*self.grid.values())]
        combos: list[dict[str, Any]] = []
        for listed in self.cells or [{}]:
            for point in grid_points:
                clash = sorted(set(listed) & set(point))
                if clash:
                    raise UserError(f"{self.path}: keys {clash} are in both grid and cells; give each in one place")
                combo = {**listed, **point}
                if not any(all(k in combo and combo[k] == v for k, v in s.items()) for s in self.skip):
                    combos.append(combo)
        last = [k.rsplit(".", 1)[-1] for k in axes]  # a key by its last part where that is unique
        short = {k: (s if last.count(s) == 1 else k) for k, s in zip(axes, last)}
        cells: list[Cell] = []
        seen: dict[str, dict[str, Any]] = {}
        for combo in combos:
            values = tuple((k, _frozen(combo[k])) for k in axes if k in combo)
            for seed in self.seeds:
                name = "_".join([*(f"{short[k]}-{_slug(v)}" for k, v in values), f"seed-{seed}"])
                if name in seen:
                    raise UserError(f"{self.path}: cells {seen[name]} and {dict(values)} would share run {name!r}")
                seen[name] = dict(values)
                cells.append(Cell(values, seed, name))
        return cells


def _frozen(value: Any) -> Any:
    """A YAML value as a hashable one (lists as tuples): cells group by their values."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _slug(value: Any) -> str:
    text = value_text(value).replace(",", "x").replace("/", "-")
    return re.sub(r"[^A-Za-z0-9.+-]", "", text) or "none"


def _mapping(doc: Any, where: str) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise UserError(f"{where}: expected a mapping, got {doc!r}")
    return doc


def _grid(doc: Any, where: str) -> dict[str, list[Any]]:
    grid = _mapping(doc, where)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"{where}.{key}: expected a non-empty list of values, got {values!r}")
    return {str(k): list(v) for k, v in grid.items()}


def _seeds(doc: Any, where: str) -> list[int]:
    seeds = [0] if doc is None else doc
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds):  # a bool is no seed
        raise UserError(f"{where}: expected a non-empty list of integer seeds, got {seeds!r}")
    return list(seeds)


def _mappings(doc: Any, where: str) -> list[dict[str, Any]]:
    """A list of mappings key: value (cells, skip), keys as strings."""
    items = doc or []
    if not isinstance(items, list) or not all(isinstance(c, dict) for c in items):
        raise UserError(f"{where}: expected a list of mappings key: value, got {items!r}")
    return [{str(k): v for k, v in c.items()} for c in items]


def _cells(doc: Any, where: str) -> list[dict[str, Any]]:
    """``cells``: a list of override sets, or a list of such lists, whose product is taken (a model per set of one
    list, a data size and its budget per set of another): each product merges one set of every list."""
    if not isinstance(doc, list) or not doc or not all(isinstance(item, list) for item in doc):
        return _mappings(doc, where)
    product: list[dict[str, Any]] = [{}]
    for i, factor in enumerate(doc):
        sets = _mappings(factor, f"{where}[{i}]")
        clash = sorted({k for a in product for b in sets for k in set(a) & set(b)})
        if clash:
            raise UserError(f"{where}[{i}]: keys {clash} are in more than one of the lists; give each in one")
        product = [{**a, **b} for a in product for b in sets]
    return product


def _claims(doc: Any, where: str, metrics: list[str], axes: list[str]) -> list[Claim]:
    """``claims: [{metric: M, higher: {key: value, ...}, lower: {...}}]``, each side naming keys that vary."""
    claims = []
    for i, item in enumerate(_mappings(doc, where)):
        at = f"{where}[{i}]"
        if set(item) != {"metric", "higher", "lower"}:
            raise UserError(f"{at}: expected the keys metric, higher and lower, got {sorted(item)}")
        if item["metric"] not in metrics:
            raise UserError(f"{at}: metric {item['metric']!r} is not one of the spec's metrics ({', '.join(metrics)})")
        sides = []
        for side in ("higher", "lower"):
            chosen = _mapping(item[side], f"{at}.{side}")
            if not chosen or not set(map(str, chosen)) <= set(axes):
                raise UserError(f"{at}.{side}: expected values of keys that vary ({', '.join(axes)}), got {chosen!r}")
            sides.append(tuple((str(k), _frozen(v)) for k, v in chosen.items()))
        claims.append(Claim(str(item["metric"]), sides[0], sides[1]))
    return claims


def _check_claims(spec: SweepSpec, quick: bool) -> None:
    """Each side of a claim is one row of the sweep (none is allowed in the quick variant, which may drop rows)."""
    groups = [dict(g) for g in dict.fromkeys(c.group for c in spec.expand())] if spec.claims else []
    for claim in spec.claims:
        for side in (claim.higher, claim.lower):
            found = sum(Claim.matches(side, g) for g in groups)
            if found > 1 or (found == 0 and not quick):
                raise UserError(f"{spec.path}: claims: {Claim.label(side)} is {found} rows of the sweep, not one")


def _read_spec(name_or_path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The spec's path (a file, or a shipped spec's stem) and its top-level keys, checked."""
    name, path = str(name_or_path), Path(name_or_path)
    if not path.is_file():
        shipped = shipped_sweeps()
        if name not in shipped:
            raise UserError(f"sweep {name!r}: no such file, and not a shipped sweep ({', '.join(shipped)})")
        path = shipped[name]
    doc = _mapping(read_yaml(path, "a sweep spec"), str(path))
    unknown = sorted(set(doc) - set(SPEC_KEYS))
    if unknown:
        raise UserError(f"{path}: unknown keys {unknown}; a sweep spec has {', '.join(SPEC_KEYS)}")
    if not isinstance(doc.get("config"), (str, dict)):
        raise UserError(f"{path}: config: expected the base config (a shipped name, a .yaml path or a mapping)")
    return path, doc


def _variant(path: Path, doc: dict[str, Any], section: str, values: dict[str, Any]) -> None:
    """The spec's ``section`` (quick, gpu) applied to its parsed values: overrides add, the rest replace."""
    q = _mapping(doc.get(section), f"{path}: {section}")
    if not q:
        what = "no --quick variant" if section == "quick" else f"no --scale {section}"
        raise UserError(f"{path}: no {section} section, so {what}")
    allowed = QUICK_KEYS if section == "quick" else SCALE_KEYS
    bad = sorted(set(q) - set(allowed))
    if bad:
        raise UserError(f"{path}: {section}: unknown keys {bad}; expected some of {', '.join(allowed)}")
    at = f"{path}: {section}"
    values["overrides"] += _override_list(q.get("overrides"), f"{at}.overrides")
    values["finetune_overrides"] += _override_list(q.get("finetune_overrides"), f"{at}.finetune_overrides")
    values["grid"] = {**values["grid"], **_grid(q.get("grid"), f"{at}.grid")}
    for key, parse in (("cells", _cells), ("skip", _mappings), ("seeds", _seeds)):
        if key in q:
            values[key] = parse(q[key], f"{at}.{key}")
    values["later"].update({k: q[k] for k in LATER_KEYS if k in q})
    if "jobs" in q:
        if type(q["jobs"]) is not int or q["jobs"] < 1:
            raise UserError(f"{at}.jobs: expected a positive number of cells at once, got {q['jobs']!r}")
        values["jobs"] = q["jobs"]


def _check_metrics(path: Path, metrics: list[str], probes: Probes, has_finetune: bool) -> None:
    if any(m.startswith(f"{FINETUNE}.") for m in metrics) and not has_finetune:
        raise UserError(f"{path}: metrics name the {FINETUNE} stage but the spec has no {FINETUNE} section")
    for m in metrics:
        kind, _, name = m.partition(".")
        if kind in ("fewshot", "parts") and m not in probes.metrics(kind):
            raise UserError(f"{path}: metrics: {m!r}: not one of the {kind} probe's ({probes.metrics(kind) or 'none'})")
        if kind == "attention" and (not probes.attention_images or not ATTENTION_METRICS.fullmatch(name)):
            raise UserError(f"{path}: metrics: {m!r} needs probes.attention and the form attention.layer<i>, "
                            "attention.spread<i>, attention.local<i> or attention.rise")  # fmt: skip


def load_spec(name_or_path: str | Path, quick: bool = False, scale: str = "cpu") -> SweepSpec:
    """A spec file (or the stem of a shipped one) at ``scale`` (its ``gpu`` section applied for "gpu"), then its
    ``quick`` section when asked."""
    if scale not in SCALES:
        raise UserError(f"--scale {scale}: expected one of {', '.join(SCALES)}")
    path, doc = _read_spec(name_or_path)
    values: dict[str, Any] = {
        "later": {k: doc.get(k) for k in LATER_KEYS},
        "overrides": _override_list(doc.get("overrides"), f"{path}: overrides"),
        "grid": _grid(doc.get("grid"), f"{path}: grid"),
        "cells": _cells(doc.get("cells"), f"{path}: cells"),
        "skip": _mappings(doc.get("skip"), f"{path}: skip"),
        "seeds": _seeds(doc.get("seeds"), f"{path}: seeds"),
    }
    finetune = _mapping(doc.get("finetune"), f"{path}: finetune")
    values["finetune_overrides"] = _override_list(finetune.get("overrides"), f"{path}: finetune.overrides")
    if finetune and not isinstance(finetune.get("config"), (str, dict)):
        raise UserError(f"{path}: finetune.config: expected the finetune stage's config (a name, a path or a mapping)")
    if scale != "cpu":
        _variant(path, doc, scale, values)
    if quick:
        _variant(path, doc, "quick", values)
    later = values.pop("later")
    metrics = later["metrics"] or ["eval_top1"]
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise UserError(f"{path}: metrics: expected a list of metric names, got {metrics!r}")
    probes = parse_probes(later["probes"], f"{path}: probes")
    _check_metrics(path, metrics, probes, bool(finetune))
    figure = _mapping(doc.get("figure"), f"{path}: figure")
    spec = SweepSpec(
        path=path,
        config=doc["config"],
        metrics=list(metrics),
        figure_x=figure.get("x"),
        figure_lines=list(figure.get("lines") or []),
        log_x=bool(figure.get("log_x", False)),
        finetune_config=finetune.get("config"),
        probes=probes,
        scale=scale,
        quick=quick,
        **values,
    )
    if any(c.get(PRETRAIN, CELL_DEFAULTS[PRETRAIN]) not in (True, False, UNTRAINED) for c in spec.cells):
        raise UserError(f"{path}: cells: {PRETRAIN} is true, false or {UNTRAINED}")
    if any(c.get(PRETRAIN) is False for c in spec.cells) and not finetune:
        raise UserError(f"{path}: a cell with {PRETRAIN}: false needs a {FINETUNE} stage to run")
    if spec.figure_x == COMPUTE and COMPUTE not in spec.metrics:
        raise UserError(f"{path}: figure: x {COMPUTE} needs {COMPUTE} among the metrics")
    for key in [k for k in (spec.figure_x, *spec.figure_lines) if k is not None and k != COMPUTE]:
        if key not in spec.axes:
            raise UserError(f"{path}: figure: {key!r} is not a key that varies ({', '.join(spec.axes) or 'none'})")
    spec = replace(spec, claims=_claims(later["claims"], f"{path}: claims", spec.metrics, spec.axes))
    _check_claims(spec, quick)
    return spec
