"""Sweeps: a grid (or list) of config overrides times seeds, each cell an ordinary run directory.

    vitkit sweep posemb --quick --jobs 2 --out runs/sweeps/posemb
    vitkit sweep posemb --scale gpu                # the GPU scale: the spec's gpu section, its jobs at once

``run_sweep`` expands a spec (spec.py), brings every cell to its end (run.py) and writes the table and figures from
the runs' own metrics (aggregate.py). The shipped specs, one per experiment of the paper, are in vitkit/sweeps/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..io import DirectoryLock
from ..train.engine import NO_HOOKS, RunHooks
from .aggregate import Row, aggregate, claim_lines, claim_results, write_table
from .figures import write_figures
from .pool import SweepRun, run_cells
from .probes import write_attention_figures
from .run import keep_drawn_shapes, plan_cells
from .spec import Cell, SweepSpec, load_spec, shipped_sweeps


@dataclass
class SweepResult:
    out: Path
    rows: list[Row]
    files: list[Path]
    actions: dict[str, list[str]] = field(default_factory=dict)  # cell name -> per stage: skipped / resumed / ran
    failed: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False  # its time limit stopped cells short of their end: the table holds those finished
    finished: int = 0  # of the cells it ran (none with --aggregate-only)
    cells: int = 0


def run_sweep(
    spec: str | Path | SweepSpec,
    out: str | Path | None = None,
    jobs: int | None = None,
    aggregate_only: bool = False,
    quick: bool = False,
    log: Callable[[str], object] = print,
    overrides: Sequence[str] = (),
    run_hooks: RunHooks = NO_HOOKS,
    page: Callable[[Path], Path] | None = None,
    force: bool = False,
    scale: str = "cpu",
    time_limit: float | None = None,
) -> SweepResult:
    """Run (or only aggregate) a sweep at ``scale`` (spec.py) into ``out`` (default runs/sweeps/<spec name>[_gpu]
    [_quick]), ``jobs`` cells at once (default: the scale's), locked for the life of this process. ``overrides``
    (``section.key=value``) go to every run after the spec's own: how this machine runs them (``run.device=cuda``),
    not what is compared; the GPU scale without a GPU needs one naming run.device. ``run_hooks`` go to every run;
    ``page(out)``, when given, writes the sweep's page last (the command line's writes report.html; sweep/ imports
    no report). ``force`` trains again the cells whose directories hold another spec's run; ``time_limit``
    (seconds) stops the cells then, their state saved, and tabulates those finished (pool.run_cells)."""
    if not isinstance(spec, SweepSpec):
        spec = load_spec(spec, quick=quick, scale=scale)
    spec = _with_overrides(spec, list(overrides), aggregate_only)
    if out is None:
        out = Path("runs") / "sweeps" / (spec.name + ("_gpu" if spec.scale == "gpu" else "") + ("_quick" * spec.quick))
    out, jobs = Path(out), spec.jobs if jobs is None else jobs
    cells = spec.expand()
    if aggregate_only and not out.is_dir():
        raise UserError(f"{out}: no sweep here to aggregate (run it first, or give its --out)")
    if time_limit is not None and (aggregate_only or not time_limit > 0):
        why = "--aggregate-only trains nothing to stop" if aggregate_only else "expected a positive number of minutes"
        raise UserError(f"--time-limit: {why}, got {time_limit / 60:g}")
    plans = [] if aggregate_only else plan_cells(spec, cells, out, jobs, run_hooks)  # every config checked first
    if out.is_symlink():
        raise UserError(f"{out}: a symbolic link; a sweep writes into a directory of its own")
    out.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(out).acquire()  # one process at a time: a second sweep here is refused
    try:
        done = SweepRun({}, {})
        if not aggregate_only:
            settings = len(cells) // len(spec.seeds)
            log(f"{spec.name}: {len(cells)} runs ({settings} settings x {len(spec.seeds)} seeds) in {out}")
            with keep_drawn_shapes():
                done = run_cells(plans, jobs, log, force, time_limit)
        rows, records = aggregate(spec, cells, out, done.failed)
        claims = claim_results(spec, records)
        files = write_table(spec, rows, records, claims, out) + write_figures(spec, rows, out)
        for line in claim_lines(claims):
            log(line)
        if spec.probes.attention_images:
            files += _attention_figures(spec.name, cells, out)
        if page is not None:
            files.append(page(out))
    finally:
        lock.release()
    finished = len(done.actions)  # the cells skipped as finished, or brought to their end by this sweep
    timed_out = done.timed_out and finished < len(plans)
    return SweepResult(out, rows, files, done.actions, done.failed, timed_out, finished, len(plans))


def _attention_figures(name: str, cells: list[Cell], out: Path) -> list[Path]:
    """The attention probe's figures of the sweep, a group of seeds a setting."""
    groups: dict[str, tuple[str, dict[str, Any], list[Path]]] = {}
    for cell in cells:
        label = cell.name.rsplit("_seed-", 1)[0]
        groups.setdefault(label, (label, dict(cell.values), []))[2].append(out / cell.name)
    return write_attention_figures(name, list(groups.values()), out)


def _with_overrides(spec: SweepSpec, overrides: list[str], aggregate_only: bool) -> SweepSpec:
    """The spec with the command line's overrides for every run, checked (_check_overrides); the GPU scale on a
    machine without a GPU is refused unless they name run.device."""
    named_device = any(o.partition("=")[0].strip() == "run.device" for o in overrides)
    if spec.scale == "gpu" and not (aggregate_only or named_device or torch.cuda.is_available()):
        raise UserError(
            "--scale gpu: no GPU here; add --device cpu to run it on this machine anyway (with --quick: the GPU "
            "scale's code path in seconds)"
        )
    if not overrides:
        return spec
    _check_overrides(spec, overrides)
    return replace(spec, overrides=spec.overrides + overrides, finetune_overrides=spec.finetune_overrides + overrides)


def _check_overrides(spec: SweepSpec, overrides: list[str]) -> None:
    """What the command line may not set: a key the spec varies, or what each cell sets itself."""
    owned = {*spec.axes, "run.seed", "run.name", "run.out_dir"}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in owned:
            raise UserError(
                f"command line: {item}: {key} is set by each cell (its grid, cells, seeds or --out); "
                "change it in the spec instead"
            )


__all__ = ["Cell", "Row", "SweepResult", "SweepSpec", "aggregate", "load_spec", "run_sweep", "shipped_sweeps"]
