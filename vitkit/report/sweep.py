"""The page of one sweep: ``write_sweep_report(sweep_dir)`` writes sweep_dir/report.html: the table of sweep.json,
the claims it tested, the sweep's figures, every run with a relative link to its own page, and the commands that
rewrite the page."""

from __future__ import annotations

import os
import shlex
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch

from ..errors import UserError, UserFileNotFoundError
from ..io import atomic_write_text
from ..sweep.aggregate import TABLE_NAME, Table, claims_note, read_table
from ..sweep.figures import CURVES_NAME, figure_name
from ..sweep.probes import ATTENTION_FIGURE
from ..sweep.spec import finetune_name
from ..sweep.stats import LEVEL
from ..train.overrides import value_text
from .html import Html, Page, Row, code_block, definitions, fmt, image, join, table, tag
from .run import REPORT_NAME, write_run_report

SWEEP_MARKER = f"{TABLE_NAME}.json"  # what makes a directory a sweep's: the table vitkit sweep writes


def is_sweep_dir(path: str | Path) -> bool:
    return (Path(path) / SWEEP_MARKER).is_file()


def write_sweep_report(
    sweep_dir: str | Path,
    out: str | Path | None = None,
    write_missing: bool = True,
    device: str | torch.device = "auto",
) -> Path:
    """Write the sweep's page (default sweep_dir/report.html); returns its path. ``write_missing``: write the
    page of every run that has none first (else such a run is marked missing)."""
    sweep = Path(sweep_dir)
    path = Path(out) if out is not None else sweep / REPORT_NAME
    atomic_write_text(path, sweep_report(sweep, path.parent, write_missing, device))
    return path


def write_report(path: str | Path, out: str | Path | None = None, device: str | torch.device = "auto") -> Path:
    """``vitkit report PATH``: the page of the sweep or the training run that path holds; returns its path."""
    path = Path(path)
    if is_sweep_dir(path):
        return write_sweep_report(path, out, device=device)
    if (path / "config.yaml").is_file():
        return write_run_report(path, out, device)
    what = "no such directory" if not path.is_dir() else "neither config.yaml nor sweep.json in it"
    raise UserError(f"{path}: not a training run directory or a sweep directory ({what})")


def mean_std(mean: float | None, std: float | None) -> str:
    """A cell of the table: the mean to 4 significant figures, ± the std to 2 (none for one seed)."""
    if mean is None:
        return "–"
    return fmt(float(mean)) + ("" if std is None else f" ± {fmt(float(std), 2)}")


def sweep_report(
    sweep_dir: str | Path, base: Path | None = None, write_missing: bool = True, device: str | torch.device = "auto"
) -> str:
    """The HTML of a sweep's page; links are relative to ``base`` (the directory the page is written to)."""
    sweep = Path(sweep_dir)
    if not is_sweep_dir(sweep):
        what = "no such directory" if not sweep.is_dir() else f"no {SWEEP_MARKER} in it"
        raise UserFileNotFoundError(f"{sweep}: not a sweep directory ({what}); give the --out of vitkit sweep")
    base = sweep if base is None else base
    t = read_table(sweep)
    reports = _run_pages(sweep, t, write_missing, device)
    page = Page(f"vitkit sweep {sweep.resolve().name}", subtitle=str(sweep.resolve()))
    page.add("table", "Table", table_section(t, sweep, base, reports))
    if t.claims:
        page.add("claims", "Claims", claims_section(t))
    page.add("figures", "Figures", figures_section(t, sweep))
    page.add("runs", "Runs", runs_section(t, sweep, base, reports))
    page.add("commands", "Aggregate again", commands(t, sweep))
    return page.render()


def _run_dirs(sweep: Path, run: dict[str, Any]) -> list[Path]:
    first = sweep / str(run["run"])  # a plain name (read_table)
    if first.is_symlink():
        raise UserError(f"{first}: a symbolic link; a sweep's runs are directories inside it")
    second = sweep / finetune_name(first.name)
    return [d for d in (first, second) if d.is_dir()]  # a cell that does not pretrain has the second alone


def _run_pages(sweep: Path, t: Table, write_missing: bool, device: str | torch.device) -> dict[Path, str | None]:
    """Each run directory's page: None when it is there (or was just written), else why not."""
    found: dict[Path, str | None] = {}
    for run in t.runs:
        for d in _run_dirs(sweep, run):
            if (d / REPORT_NAME).is_file():
                found[d] = None
            elif not write_missing:
                found[d] = f"not written yet: vitkit report {shlex.quote(str(sweep))} writes it"
            else:
                try:
                    write_run_report(d, device=device)
                    found[d] = None
                except UserError as e:  # a run directory that cannot be read: the page says so, the others go on
                    found[d] = str(e)
                    warnings.warn(f"{d}: no {REPORT_NAME}: {e}", stacklevel=2)
    return found


def _run_links(dirs: list[Path], base: Path, reports: dict[Path, str | None]) -> Html:
    links = []
    for d in dirs:
        why = reports.get(d, "no page")
        missing = tag("span", f"{d.name} (page missing)", cls="missing", title=why)
        href = quote(os.path.relpath(d / REPORT_NAME, base).replace(os.sep, "/"))  # relative: the page moves with it
        links.append(tag("a", d.name, href=href) if why is None else missing)
    return Html("<br>".join(links))


def table_section(t: Table, sweep: Path, base: Path, reports: dict[Path, str | None]) -> Html:
    header = [*t.axes, "n", *t.metrics, "runs"]
    rows = []
    by_group: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for run in t.runs:
        by_group.setdefault(tuple(value_text(run.get(k)) for k in t.axes), []).append(run)
    seeds = max((len(r.seeds) for r in t.rows), default=0)
    for r in t.rows:
        key = tuple(value_text(r.values.get(k)) for k in t.axes)
        dirs = [d for run in by_group.get(key, []) for d in _run_dirs(sweep, run)]
        cells: list[object] = [*key, str(r.n)]
        cells += [tag("span", mean_std(r.mean[m], r.std[m]), data_metric=m) for m in t.metrics]
        cells.append(_run_links(dirs, base, reports) if dirs else tag("span", "none finished", cls="missing"))
        rows.append(Row(cells))
    note = (
        f"One row per setting: mean ± sample standard deviation over its finished seeds (n, of up to {seeds}), from "
        f"{SWEEP_MARKER}: the sweep's own aggregation of each run's final metrics.jsonl records."
    )
    return join([tag("p", note, cls="note"), table(header, rows, caption="The sweep", cls="sweep")])


def claims_section(t: Table) -> Html:
    """Each ordering the spec claims, as the aggregate tested it (sweep.json): the difference with its interval, p,
    Holm's p and the verdict; a claim without enough finished seeds says so."""
    rows = []
    for c in t.claims:
        head = [c.get("metric", "–"), f"{c.get('higher', '?')} > {c.get('lower', '?')}"]
        verdict = tag("strong", str(c.get("verdict", "–")), data_verdict=str(c.get("verdict", "")))
        if "p" not in c:  # untested: the verdict says why
            rows.append(Row([*head, "–", "–", "–", "–", "–", verdict]))
            continue
        interval = f"[{fmt(float(c['low']), 3)}, {fmt(float(c['high']), 3)}]"
        holm = fmt(float(c["p_holm"]), 2) if c.get("p_holm") is not None else "– (tested alone)"
        rows.append(Row([*head, fmt(float(c["diff"]), 3), interval, fmt(float(c["p"]), 2), holm, c["test"], verdict]))
    note = f"Each ordering the spec claims, first row > second on the metric. {claims_note(t.claims)}"
    header = ["metric", "claim", "difference", f"{LEVEL:.0%} CI", "p", "Holm p", "test", "verdict"]
    return join([tag("p", note, cls="note"), table(header, rows, caption="The claims tested", cls="sweep-claims")])


EXTRA_FIGURES = (
    (
        CURVES_NAME,
        "held-out top-1 against the training step, one line per setting, mean over its seeds; each seed thin",
    ),
    (ATTENTION_FIGURE, "mean attention distance of every head against depth, one line per setting"),
)


def figures_section(t: Table, sweep: Path) -> Html:
    figures, missing = [], []
    for metric in t.metrics:
        png = sweep / figure_name(metric)
        if png.is_file():
            alt = f"{metric} (mean ± std over seeds) against the sweep's figure axis, one line per other setting"
            figures.append(image(png.read_bytes(), alt, f"{metric}: {png.name}"))
        else:
            missing.append(metric)
    for name, alt in EXTRA_FIGURES:
        if (png := sweep / name).is_file():
            figures.append(image(png.read_bytes(), alt, name))
    parts: list[object] = [tag("div", join(figures), cls="figures")]
    if missing:
        parts.append(tag("p", f"No figure for {', '.join(missing)} (none drawn: no finished run yet).", cls="note"))
    return join(parts)


def runs_section(t: Table, sweep: Path, base: Path, reports: dict[Path, str | None]) -> Html:
    rows = []
    for run in t.runs:
        dirs = _run_dirs(sweep, run)
        values = [value_text(run.get(k)) for k in t.axes]
        metrics = [fmt(float(run[m])) if run.get(m) is not None else "–" for m in t.metrics]
        rows.append(Row([_run_links(dirs, base, reports), str(run.get("seed")), *values, *metrics]))
    listed = {d for run in t.runs for d in _run_dirs(sweep, run)}
    others = sorted(d.name for d in sweep.iterdir() if d.is_dir() and d not in listed and (d / "config.yaml").is_file())
    parts: list[object] = [
        table(["run", "seed", *t.axes, *t.metrics], rows, caption="Every finished run", cls="sweep-runs")
    ]
    if others:
        note = "Unfinished (not in the table; the same vitkit sweep command resumes them): " + ", ".join(others)
        parts.append(tag("p", note, cls="note"))
    return join(parts)


def commands(t: Table, sweep: Path) -> Html:
    q_out = shlex.quote(str(sweep))
    spec = shlex.quote(t.spec) if t.spec else "SPEC"
    facts = definitions(
        [("spec", t.spec or "–"), ("axes", ", ".join(t.axes) or "–"), ("metrics", ", ".join(t.metrics))]
    )
    options = f" {t.options}" if t.options else ""
    command = f"vitkit sweep {spec}{options} --out {q_out} --aggregate-only\nvitkit report {q_out}"
    note = (
        "Re-reads the runs (trains nothing) and writes the table, the figures and this page again; vitkit report "
        "writes this page and any missing run page."
    )
    return join([facts, code_block(command, "aggregate"), tag("p", note, cls="note")])
