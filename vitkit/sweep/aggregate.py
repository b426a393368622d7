"""A sweep's results, read from the runs' own files: one table (CSV, JSON, markdown) and one figure per metric.

A metric ``NAME`` is the last eval record's, ``train.NAME`` the last train record's, ``finetune.NAME`` the finetune
run's; ``fewshot.*`` and ``attention.*`` come from the probes' files. The cells that differ only in their seed form a
row: the mean, the sample standard deviation (none for one seed) and n, the seeds that have finished.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..checkpoint.base import CONFIG_NAME, read_config_json
from ..errors import UserError
from ..io import atomic_write_text
from ..models import count_params, model_from_config
from ..models.flops import model_flops
from ..train.metrics import METRICS_NAME, MetricsLog, save_figure
from ..train.overrides import value_text
from ..train.recipe import load_config
from .probes import FEWSHOT_FILE, is_probe_metric, probe_metric
from .run import run_status
from .spec import COMPUTE, FINETUNE, Cell, Claim, SweepSpec, finetune_name
from .stats import LEVEL, compare

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
    from matplotlib.figure import Figure

TABLE_NAME = "sweep"  # sweep.csv, sweep.json, sweep.md


def _meta_model(run_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """A run's model built on the meta device (shapes only) from its config.json, and the run's metadata."""
    doc = read_config_json(run_dir / CONFIG_NAME)
    with torch.device("meta"):
        model = model_from_config(doc["model"])
    return model, doc.get("metadata") or {}


def training_flops(run_dir: Path) -> float:
    """A finished run's training compute: 3 x its model's forward FLOPs an image (forward and backward) x the
    images it was trained on (batch x steps), from its config.json and config.yaml."""
    model, meta = _meta_model(run_dir)
    batch = load_config(run_dir / "config.yaml").optim.batch_size
    return 3.0 * model_flops(model, int(meta["img_size"])) * batch * int(meta["step"])


def cell_metrics(out: Path, cell: Cell, metrics: list[str]) -> dict[str, float | None] | None:
    """The cell's metrics (None where its model has none), or None while any of its runs is unfinished."""
    values: dict[str, float | None] = {}
    for metric in metrics:
        if not cell.pretrains and not metric.startswith(f"{FINETUNE}."):
            values[metric] = None  # a cell without a first run has none of its metrics
            continue
        if metric == COMPUTE:
            if run_status(out / cell.name) != "finished":
                return None
            values[metric] = training_flops(out / cell.name)
            continue
        if is_probe_metric(metric):
            if run_status(out / cell.name) != "finished":
                return None
            values[metric] = probe_metric(out / cell.name, metric)
            continue
        stage, _, name = metric.partition(".") if metric.startswith(f"{FINETUNE}.") else ("", "", metric)
        run_dir = out / (finetune_name(cell.name) if stage else cell.name)
        if run_status(run_dir) != "finished":
            return None
        kind, _, key = name.partition(".") if name.startswith("train.") else ("eval", "", name)
        records = [r for r in MetricsLog(run_dir).records() if r.get("kind") == kind]
        if not records or key not in records[-1]:
            have = sorted(records[-1]) if records else []
            raise UserError(
                f"metrics: {metric!r} is not in the last {kind} record of {run_dir / METRICS_NAME} (it has {have})"
            )
        value = records[-1][key]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise UserError(f"{run_dir / METRICS_NAME}: {key}={value!r} in its last {kind} record, expected a number")
        values[metric] = float(value)
    return values


@dataclass
class Row:
    values: dict[str, Any]  # the axes
    n: int
    mean: dict[str, float | None]
    std: dict[str, float | None]
    seeds: list[int]


def aggregate(
    spec: SweepSpec, cells: list[Cell], out: Path, failed: Collection[str] = ()
) -> tuple[list[Row], list[dict[str, Any]]]:
    """(one row per group of seeds, one record per finished cell), in the spec's order; the cells named in
    ``failed`` (by this sweep's run, which said why) count as unfinished."""
    groups: dict[tuple[tuple[str, Any], ...], list[tuple[Cell, dict[str, float | None]]]] = {}
    records = []
    for cell in cells:
        found = None if cell.name in failed else cell_metrics(out, cell, spec.metrics)
        groups.setdefault(cell.group, [])
        if found is not None:
            groups[cell.group].append((cell, found))
            records.append({"run": cell.name, "seed": cell.seed, **dict(cell.values), **found})
    rows = []
    for group, members in groups.items():
        mean: dict[str, float | None] = {}
        std: dict[str, float | None] = {}
        for metric in spec.metrics:
            xs = [x for _, found in members if (x := found[metric]) is not None]
            mean[metric] = statistics.fmean(xs) if xs else None
            std[metric] = statistics.stdev(xs) if len(xs) > 1 else None
        rows.append(Row(dict(group), len(members), mean, std, [c.seed for c, _ in members]))
    return rows, records


def claim_results(spec: SweepSpec, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each claim of the spec tested on the finished runs (stats.compare): its rows' labels, the difference of the
    means with its confidence interval, p, the test and the verdict (or why there is none)."""
    results = []
    for claim in spec.claims:
        metric = claim.metric
        sides = [
            {r["seed"]: float(r[metric]) for r in records if Claim.matches(side, r) and r[metric] is not None}
            for side in (claim.higher, claim.lower)
        ]
        found = compare(*sides)
        result: dict[str, Any] = {"metric": claim.metric, "higher": Claim.label(claim.higher)}
        result["lower"] = Claim.label(claim.lower)
        if found is None:
            result["verdict"] = f"untested: {len(sides[0])} and {len(sides[1])} seeds finished (2 or more each)"
        else:
            result.update(dataclasses.asdict(found), verdict=found.verdict)
        results.append(result)
    return results


def claim_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line per tested claim, as the command prints it."""
    lines = []
    for r in results:
        head = f"{r['metric']}: {r['higher']} > {r['lower']}"
        if "p" not in r:
            lines.append(f"{head}: {r['verdict']}")
            continue
        interval = f"[{_number(r['low'], 3)}, {_number(r['high'], 3)}]"
        lines.append(f"{head}: {r['verdict']} (difference {_number(r['diff'], 3)}, {LEVEL:.0%} CI {interval}, "
                     f"p = {_number(r['p'], 2)}, {r['test']})")  # fmt: skip
    return lines


def _number(x: float | None, digits: int = 4) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.{digits}g}"


def write_table(
    spec: SweepSpec, rows: list[Row], records: list[dict[str, Any]], claims: list[dict[str, Any]], out: Path
) -> list[Path]:
    """OUT/sweep.csv, .json and .md: one row per group, with mean, std and n of every metric (full precision in the
    CSV and JSON, four significant digits in the markdown), and the claims tested (claim_results)."""
    axes = spec.axes
    header = [*axes, "n", *(f"{m}_{s}" for m in spec.metrics for s in ("mean", "std"))]
    table = [
        [*(value_text(r.values.get(k, "")) for k in axes), str(r.n)]
        + ["" if v is None else repr(v) for m in spec.metrics for v in (r.mean[m], r.std[m])]  # full precision
        for r in rows
    ]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(table)
    csv_path, json_path, md_path = (out / f"{TABLE_NAME}.{ext}" for ext in ("csv", "json", "md"))
    atomic_write_text(csv_path, text.getvalue())
    doc = {
        "spec": str(spec.path),
        "options": spec.options,
        "axes": axes,
        "metrics": spec.metrics,
        "rows": [{**r.values, "n": r.n, "seeds": r.seeds, "mean": r.mean, "std": r.std} for r in rows],
        "runs": records,
        "claims": claims,
    }
    atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")
    md = [f"# {spec.name}", "", "| " + " | ".join([*axes, "n", *spec.metrics]) + " |"]
    md.append("|" + "---|" * (len(axes) + 1 + len(spec.metrics)))
    for r in rows:
        cells = [value_text(r.values.get(k, "")) for k in axes] + [str(r.n)]
        cells += [
            "" if r.mean[m] is None else _number(r.mean[m]) + (f" ± {_number(r.std[m], 2)}" if r.std[m] else "")
            for m in spec.metrics
        ]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", f"mean ± sample std over seeds; n: seeds finished of {len(spec.seeds)}."]
    if claims:
        md += ["", "## Claims", "", *(f"- {line}" for line in claim_lines(claims)), ""]
        md.append(
            f"Difference: the first row's mean minus the second's, with its {LEVEL:.0%} confidence interval; shown: "
            f"the interval lies above zero (two-sided p < {1 - LEVEL:.2g}). A paired t-test over the seeds both rows "
            "finished, else Welch's; each claim tested alone (no correction for their number)."
        )
    atomic_write_text(md_path, "\n".join(md) + "\n")
    return [csv_path, json_path, md_path]


def figure_name(metric: str) -> str:
    """The file write_figures draws a metric into."""
    return f"{metric.replace('.', '_')}.png"


@dataclass(frozen=True)
class ModelSummary:
    """What a run's model is, as a legend says it: its family, its parameters and its forward FLOPs an image."""

    family: str
    params: int
    flops: int

    def __str__(self) -> str:
        return f"{self.family} {''.join(_si(self.params))} params, {' '.join(_si(self.flops))}FLOPs"  # 4.9 MFLOPs


FAMILIES = {"vit": "ViT", "hybrid": "hybrid (ResNet+ViT)", "resnet": "ResNet", "bit": "ResNet (BiT)"}
SAID_BY_SUMMARY = ("model.name", "model.resnet_layers")  # a registered name the spec overrides; the family says it


def model_summary(run_dir: Path) -> ModelSummary:
    """A finished run's model as built from its config.json (on the meta device): family, parameters, FLOPs."""
    model, meta = _meta_model(run_dir)
    config: Any = model.config  # a ViTConfig, ResNetConfig or BiTConfig
    arch = "hybrid" if getattr(config, "resnet_layers", None) is not None else config.arch  # a ViT on a ResNet stem
    return ModelSummary(FAMILIES.get(arch, arch), count_params(model), model_flops(model, int(meta["img_size"])))


def write_figures(spec: SweepSpec, rows: list[Row], out: Path) -> list[Path]:
    """OUT/<metric>.png per metric (metric_figure); each run a legend describes is built once for all of them."""
    if not (spec.figure_x or spec.axes) or not any(r.n for r in rows):
        return []
    describe = functools.cache(model_summary)
    return [save_figure(metric_figure(spec, rows, m, out, describe), out / figure_name(m)) for m in spec.metrics]


def metric_figure(
    spec: SweepSpec, rows: list[Row], metric: str, out: Path, describe: Callable[[Path], ModelSummary] = model_summary
) -> Figure:
    """The metric against figure.x, one line per value of figure.lines (labelled by line_label); an accuracy on its
    whole scale, with a dashed line where guessing lands (chance)."""
    from matplotlib.figure import Figure

    x_key = spec.figure_x or spec.axes[-1]
    line_keys = spec.figure_lines or [k for k in spec.axes if k != x_key]

    def x_of(r: Row) -> Any:
        return r.mean.get(COMPUTE) if x_key == COMPUTE else r.values.get(x_key)

    xs = list(dict.fromkeys(x_of(r) for r in rows if x_key != COMPUTE or r.n))
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    cells = spec.expand()
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    lines: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        lines.setdefault(tuple(value_text(r.values.get(k)) for k in line_keys), []).append(r)
    for members in lines.values():
        members = [r for r in members if r.mean[metric] is not None]
        if not members:
            continue
        points = [(x_of(r), cast(float, r.mean[metric]), r.std[metric] or 0.0) for r in members]
        pos = [float(cast(float, p[0])) if numeric else float(xs.index(p[0])) for p in points]
        name = line_label(line_keys, members, metric_runs(cells, members, metric, out), describe) or metric
        style = "-" if numeric else "none"  # categories are points: no line joins them
        ax.errorbar(pos, [p[1] for p in points], yerr=[p[2] for p in points], marker="o", capsize=3, label=name,
                    linestyle=style)  # fmt: skip
    if not numeric:
        ax.set_xticks(range(len(xs)), [_category(x_key, x, rows) for x in xs])
    guess = None
    if metric.rsplit(".", 1)[-1].endswith(("top1", "top5", "acc")) or metric.startswith("fewshot."):
        ax.set_ylim(0, 1)  # an accuracy on its whole scale
        guess = chance(metric_runs(cells, rows, metric, out), metric)
        if guess is not None:
            ax.axhline(guess[0], color="0.5", linestyle="--", linewidth=1, label=guess[1])
    if numeric and spec.log_x:
        ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs: 3 x forward x images)" if x_key == COMPUTE else x_key)
    ax.set_ylabel(f"{metric} (mean ± std over seeds)")
    ax.set_title(spec.name)
    ax.grid(alpha=0.3)
    if len(lines) > 1 or guess is not None:
        ax.legend(fontsize=8)
    return fig


def metric_runs(cells: list[Cell], rows: list[Row], metric: str, out: Path) -> list[Path]:
    """The run directories the rows' metric was read from: each finished cell's first run, or its finetune run."""
    tuned = metric.startswith(f"{FINETUNE}.")
    finished = {(tuple(r.values.items()), seed) for r in rows for seed in r.seeds}  # a row's values: its cells' group
    cells = [c for c in cells if (c.group, c.seed) in finished and (tuned or c.pretrains)]
    return [out / (finetune_name(c.name) if tuned else c.name) for c in cells]


def line_label(
    line_keys: list[str], members: list[Row], runs: list[Path], describe: Callable[[Path], ModelSummary]
) -> str:
    """A line's legend: ``key=value`` of its keys (those its cells lack left out), led by what its model is
    (ModelSummary of its first run) where a key is a model's and the line holds one model; the model's registered
    name, which the spec overrides, is then left out."""
    given = [(k, v) for k in line_keys if (v := value_text(members[0].values.get(k))) != "null"]
    model_axes = sorted({k for r in members for k in r.values if k.startswith("model.")})
    one_model = len({tuple(value_text(r.values.get(k)) for k in model_axes) for r in members}) == 1
    parts = []
    if runs and one_model and any(k.startswith("model.") for k in line_keys):
        parts.append(str(describe(runs[0])))
        given = [(k, v) for k, v in given if k not in SAID_BY_SUMMARY]
    return ", ".join(parts + [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in given])


def chance(runs: list[Path], metric: str) -> tuple[float, str] | None:
    """Where guessing lands on an accuracy, and its legend ``chance (k/K)``: top-k of the K classes of the data it is
    measured on, as the runs record K (a fewshot probe's own record, else its cell's finetune run's model; the
    model's for the rest). None where a run does not record K or the runs differ: never a guess."""
    name, fewshot = metric.rsplit(".", 1)[-1], metric.startswith("fewshot.")
    if not fewshot and not name.endswith(("top1", "top5")):
        return None  # an accuracy over something else (MPP's colours), not the model's classes
    found = {_fewshot_classes(run) if fewshot else _model_classes(run) for run in runs}
    if len(found) != 1 or None in found:
        return None
    k, classes = (5 if name.endswith("top5") else 1), cast(int, found.pop())
    return min(k / classes, 1.0), f"chance ({k}/{classes})"


def _model_classes(run_dir: Path) -> int | None:
    path = run_dir / CONFIG_NAME
    n = (read_config_json(path).get("model") or {}).get("num_classes") if path.is_file() else None
    return n if type(n) is int and n > 0 else None


def _fewshot_classes(run_dir: Path) -> int | None:
    path = run_dir / FEWSHOT_FILE  # the probe's record (FewShotResult.record) says its classes
    n = json.loads(path.read_text()).get("num_classes") if path.is_file() else None
    return n if type(n) is int and n > 0 else _model_classes(run_dir.parent / finetune_name(run_dir.name))


def _si(x: float) -> tuple[str, str]:
    """Three significant digits and the SI prefix: ("4.87", "M") for 4,870,000."""
    x = float(f"{x:.3g}")  # rounded first: 999,999 is 1M, not 1e+03k
    prefix, size = next((p, s) for p, s in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 0)) if x >= s)
    return f"{x / (size or 1):.3g}", prefix


def _category(key: str, x: Any, rows: list[Row]) -> str:
    """A categorical tick: the value, or for rows without the key (a baseline cell) what they set instead."""
    if x is not None:
        return value_text(x)
    baselines = [r.values for r in rows if key not in r.values]
    said = {f"{k.rsplit('.', 1)[-1]}={value_text(v)}" for values in baselines for k, v in values.items()}
    return ", ".join(sorted(said)) or "none"


@dataclass
class Table:
    """A sweep's table as write_table wrote it to sweep.json."""

    spec: str
    axes: list[str]
    metrics: list[str]
    rows: list[Row]
    runs: list[dict[str, Any]]
    options: str = ""  # the spec's variant: --scale gpu, --quick


def read_table(out: Path) -> Table:
    """OUT/sweep.json back as the rows ``aggregate`` made (a UserError naming the file when it is not one)."""
    path = out / f"{TABLE_NAME}.json"
    try:
        doc = json.loads(path.read_text())
        axes, metrics = list(doc["axes"]), list(doc["metrics"])
        rows = [
            Row({k: r[k] for k in axes if k in r}, int(r["n"]), dict(r["mean"]), dict(r["std"]), list(r["seeds"]))
            for r in doc["rows"]
        ]
        runs = list(doc["runs"])
        names = [str(r["run"]) for r in runs]
    except FileNotFoundError:
        raise UserError(f"{path}: no such file (run vitkit sweep, or give the sweep's --out)") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not a sweep table written by vitkit sweep ({type(e).__name__}: {e})") from None
    for name in names:
        if Path(name).name != name or name in ("", ".", ".."):
            raise UserError(f"{path}: run {name!r} is not the name of a run directory inside the sweep")
    return Table(str(doc.get("spec", "")), axes, metrics, rows, runs, str(doc.get("options", "")))
