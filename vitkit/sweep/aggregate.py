"""A sweep's results, read from the runs' own files: one table (CSV, JSON, markdown); the figures are figures.py's.

A metric ``NAME`` is the last eval record's, ``train.NAME`` the last train record's, ``finetune.NAME`` the finetune
run's; ``fewshot.*`` and ``attention.*`` come from the probes' files. The cells that differ only in their seed form a
row: the mean, the sample standard deviation (none for one seed) and n, the seeds that have finished.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.base import CONFIG_NAME, read_config_json
from ..errors import UserError
from ..io import atomic_write_text
from ..models import model_from_config
from ..models.flops import training_flops
from ..train.metrics import METRICS_NAME, MetricsLog
from ..train.overrides import value_text
from ..train.recipe import load_config
from .probes import is_probe_metric, probe_metric
from .run import run_status
from .spec import COMPUTE, FINETUNE, Cell, Claim, SweepSpec, finetune_name
from .stats import LEVEL, compare, holm

TABLE_NAME = "sweep"  # sweep.csv, sweep.json, sweep.md


def meta_model(run_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """A run's model built on the meta device (shapes only) from its config.json, and the run's metadata."""
    doc = read_config_json(run_dir / CONFIG_NAME)
    with torch.device("meta"):
        model = model_from_config(doc["model"])
    return model, doc.get("metadata") or {}


def run_compute(run_dir: Path) -> float:
    """A finished run's training FLOPs (models.flops.training_flops), from its config.json and config.yaml."""
    model, meta = meta_model(run_dir)
    batch = load_config(run_dir / "config.yaml").optim.batch_size
    return training_flops(model, int(meta["img_size"]), batch * int(meta["step"]))


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
            values[metric] = run_compute(out / cell.name)
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
        every = MetricsLog(run_dir).records()
        records = [r for r in every if r.get("kind") == kind]
        if kind == "eval":  # a run that chose its weights (data.select_images): the evaluation of those
            records = [r for r in every if r.get("kind") == "selected"] or records
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
    each: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # metric: its finished seeds' values


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
        each: dict[str, list[float]] = {}
        for metric in spec.metrics:
            xs = each[metric] = [x for _, found in members if (x := found[metric]) is not None]
            mean[metric] = statistics.fmean(xs) if xs else None
            std[metric] = statistics.stdev(xs) if len(xs) > 1 else None
        rows.append(Row(dict(group), len(members), mean, std, [c.seed for c, _ in members], each))
    return rows, records


def claim_results(spec: SweepSpec, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each claim of the spec tested on the finished runs (stats.compare), the claims tested forming one family
    (stats.holm): its rows' labels, the difference of the means with its confidence interval, p, Holm's p, the test
    and the verdict (or why there is none)."""
    results, found = [], []
    for claim in spec.claims:
        metric = claim.metric
        sides = [
            {r["seed"]: float(r[metric]) for r in records if Claim.matches(side, r) and r[metric] is not None}
            for side in (claim.higher, claim.lower)
        ]
        found.append(compare(*sides))
        result: dict[str, Any] = {"metric": claim.metric, "higher": Claim.label(claim.higher)}
        result["lower"] = Claim.label(claim.lower)
        if found[-1] is None:
            result["verdict"] = f"untested: {len(sides[0])} and {len(sides[1])} seeds finished (2 or more each)"
        results.append(result)
    tested = [(result, c) for result, c in zip(results, found) if c is not None]
    for (result, c), p_holm in zip(tested, holm([c.p for _, c in tested])):
        c = dataclasses.replace(c, p_holm=p_holm)
        result.update(dataclasses.asdict(c), verdict=c.verdict)
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
                     f"p = {_number(r['p'], 2)}, Holm p = {_number(r['p_holm'], 2)}, {r['test']})")  # fmt: skip
    return lines


def claims_note(results: list[dict[str, Any]]) -> str:
    """How the claims (claim_results) are read, said under them wherever they are shown."""
    return (
        f"Difference: the first row's mean minus the second's, with its {LEVEL:.0%} confidence interval; p: "
        "two-sided, of a paired t-test over the seeds both rows finished, else Welch's; Holm p: p adjusted for "
        f"the {sum('p' in r for r in results)} claims tested (Holm's step-down). Shown: Holm p < {1 - LEVEL:.2g} "
        "and the difference above zero (reversed: below zero)."
    )


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
        md.append(claims_note(claims))
    atomic_write_text(md_path, "\n".join(md) + "\n")
    return [csv_path, json_path, md_path]


@dataclass
class Table:
    """A sweep's table as write_table wrote it to sweep.json."""

    spec: str
    axes: list[str]
    metrics: list[str]
    rows: list[Row]
    runs: list[dict[str, Any]]
    options: str = ""  # the spec's variant: --scale gpu, --quick
    claims: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # claim_results


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
        claims = [dict(c) for c in doc.get("claims", [])]
    except FileNotFoundError:
        raise UserError(f"{path}: no such file (run vitkit sweep, or give the sweep's --out)") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not a sweep table written by vitkit sweep ({type(e).__name__}: {e})") from None
    for name in names:
        if Path(name).name != name or name in ("", ".", ".."):
            raise UserError(f"{path}: run {name!r} is not the name of a run directory inside the sweep")
    return Table(str(doc.get("spec", "")), axes, metrics, rows, runs, str(doc.get("options", "")), claims)
