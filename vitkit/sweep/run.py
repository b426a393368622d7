"""Running a sweep: each cell is an ordinary training run in OUT/<cell name>, skipped when it has finished.

A cell is recognised by what its run wrote there, its config.yaml: a directory that holds another config (an edited
spec) or none is refused before any work, naming the difference, unless ``force`` (then trained again). A rerun
picks up where a killed sweep stopped: a finished run is never touched, one with a state short of the end is resumed,
one killed before its first save is removed (under its lock; never a file no run writes) and started again. A cell's
finetune stage starts from its first run's weights in OUT/<cell name>--finetune (with ``pretrain: false`` from
scratch), after its probes; with ``--jobs N`` each run takes at most cores // N threads (pool.py runs the cells).
The cells keep the procedural images they draw in files under the download cache (``keep_drawn_shapes``): a sweep
on one set of shapes draws each image once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.base import read_config_json
from ..checkpoint.native import CONFIG_NAME, WEIGHTS_NAME
from ..data.procedural import CACHE_ENV
from ..device import usable_cores
from ..errors import UserError
from ..io import DirectoryLock, is_temp_name
from ..pretrained.cache import cache_dir
from ..train.config import TrainConfig
from ..train.engine import NO_HOOKS, NonFiniteLossError, RunHooks, train
from ..train.metrics import METRICS_NAME, PLOT_NAMES, TENSORBOARD_DIR
from ..train.overrides import COMMAND_LINE, value_text
from ..train.recipe import config_from_dict, load_config
from ..train.rundir import RESUMABLE, config_changes
from ..train.state import STATE_NAME, read_train_state
from .probes import Probes, run_probes
from .spec import Cell, SweepSpec, finetune_name

# what stops one cell and lets the others go on: a setting that does not work (a config error, a diverged run);
# anything else is a bug and stops the sweep with its traceback
CELL_FAILURES = (UserError, NonFiniteLossError)
# what a cell's run may differ from its plan in: how it is run, never what it trains (its length included)
HOW_IT_RUNS = RESUMABLE - {"schedule.steps", "schedule.epochs"}
RUN_CONFIG = "config.yaml"  # what a run writes first: how the sweep knows a cell's directory for its own
# what a run writes before its first save; anything else in a directory to be started again is someone's
EARLY_FILES = frozenset({RUN_CONFIG, METRICS_NAME, TENSORBOARD_DIR, *PLOT_NAMES})  # and what its hooks write


def run_status(run_dir: Path) -> str:
    """ "finished", "partial" (a state to resume), "started" (a directory with neither) or "absent". A finished run
    whose state was deleted to save space is known by its model's metadata; a state that is not one is a UserError
    naming it."""
    if not run_dir.is_dir():
        return "absent"
    if (run_dir / STATE_NAME).is_file():
        doc, _ = read_train_state(run_dir / STATE_NAME, tensors=False)
        done = doc["step"] >= doc.get("total_steps", doc["step"] + 1) and bool(doc.get("metrics"))
        return "finished" if done else "partial"
    meta = _model_metadata(run_dir)
    done = meta.get("step") is not None and meta.get("step") == meta.get("total_steps") and bool(meta.get("metrics"))
    return "finished" if done else "started"


def _model_metadata(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONFIG_NAME
    if not path.is_file() or not (run_dir / WEIGHTS_NAME).is_file():
        return {}
    meta = read_config_json(path).get("metadata")
    return meta if isinstance(meta, dict) else {}


def foreign(run_dir: Path, cfg: TrainConfig) -> str | None:
    """Why an existing run_dir is not the run of cfg, or None when it is (or is empty): its config.yaml must be
    cfg's apart from how the run was run (HOW_IT_RUNS)."""
    saved = run_dir / RUN_CONFIG
    if not saved.is_file():
        held = sorted(p.name for p in run_dir.iterdir())
        return f"no run's {RUN_CONFIG} in it, but {', '.join(held[:5])}" if held else None
    changes = config_changes(load_config(saved), cfg, HOW_IT_RUNS)
    return f"a run of another spec ({'; '.join(changes)})" if changes else None


def not_its_run(run_dir: Path, why: str) -> UserError:
    """The error for a cell directory that is not its cell's run (``why``: foreign's reason)."""
    return UserError(f"{run_dir}: {why}; sweep into a new --out, or add --force to train this cell again")


def remove_run(run_dir: Path, force: bool = True, hooks: RunHooks = NO_HOOKS) -> None:
    """Remove a run directory under its lock (a UserError if a live process runs it); without force only what a
    run writes before its first save (EARLY_FILES and its hooks' files), and a UserError naming anything else."""
    DirectoryLock(run_dir).acquire().release()
    own = EARLY_FILES | set(hooks.writes)
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in own and not is_temp_name(p.name))
    if others and not force:
        raise UserError(
            f"{run_dir}: a run killed before its first save, beside files no run writes ({', '.join(others[:5])}); "
            "move them out, or add --force to remove them with the run"
        )
    shutil.rmtree(run_dir)


def default_threads(jobs: int) -> int:
    return max(1, usable_cores() // jobs)


@dataclass(frozen=True)
class CellPlan:
    """What a cell runs: its first run's config (None without pretraining), and the finetune stage's (config,
    overrides), resolved only once the first run has finished (its recipe reads that checkpoint)."""

    first: TrainConfig | None
    finetune: tuple[str | dict[str, Any], list[str]] | None
    threads: int
    out: Path
    name: str
    probes: Probes = Probes()
    hooks: RunHooks = NO_HOOKS  # passed to each of its runs (the command line's: their report pages)
    seed: int = 0

    def run_dirs(self) -> list[Path]:
        first, second = self.out / self.name, self.out / finetune_name(self.name)
        return ([first] if self.first is not None else []) + ([second] if self.finetune else [])

    def finetune_config(self) -> TrainConfig:
        assert self.finetune is not None
        return _with_threads(build_config(*self.finetune), self.threads)

    def existing_runs(self) -> list[tuple[Path, TrainConfig]]:
        """(directory, config) of each stage whose directory exists; the finetune stage's once the first run's has
        finished (its config reads that run's checkpoint)."""
        found = []
        if self.first is not None and (self.out / self.name).is_dir():
            found.append((self.out / self.name, self.first))
        second = self.out / finetune_name(self.name)
        ready = self.finetune is not None and second.is_dir()  # and its first run finished, read only then
        if ready and (self.first is None or run_status(self.out / self.name) == "finished"):
            found.append((second, self.finetune_config()))
        return found

    def finished(self) -> bool:
        done = all(run_status(d) == "finished" for d in self.run_dirs())
        return done and (self.first is None or self.probes.done(self.out / self.name))


def plan_cell(spec: SweepSpec, cell: Cell, out: Path, threads: int, hooks: RunHooks = NO_HOOKS) -> CellPlan:
    """The runs a plain ``vitkit train`` of the cell's overrides would make (the first one's config checked now)."""
    common = [f"run.seed={cell.seed}", f"run.out_dir={out}", "run.progress=false"]
    try:
        first = build_config(spec.base_config(), [*spec.overrides, *cell.overrides(), *common, f"run.name={cell.name}"])
    except UserError as e:  # a value of the grid: named as the spec's, not the command line's
        message = str(e)
        for key in dict(cell.values):
            message = message.replace(f"{COMMAND_LINE}: {key}=", f"{key}=")
        raise UserError(f"{spec.path}: cell {cell.name}: {message}") from None
    finetune = None
    if spec.finetune_config is not None:
        ft_base = spec.base_config(spec.finetune_config)
        ft_overrides = [*spec.finetune_overrides, *common, f"run.name={finetune_name(cell.name)}"]
        if cell.pretrains:
            ft_overrides.append(f"run.init_from={out / cell.name}")
        else:  # the same model, from scratch: what the first stage's model section resolved to (name and fields)
            model = [f"model.{k}={value_text(v)}" for k, v in first.model.to_dict().items() if v is not None]
            ft_overrides[:0] = model
        finetune = (ft_base, ft_overrides)
    first_plan = _with_threads(first, threads) if cell.pretrains else None
    return CellPlan(first_plan, finetune, threads, out, cell.name, spec.probes, hooks, cell.seed)


def build_config(base: str | dict[str, Any], overrides: list[str]) -> TrainConfig:
    """A config file (path or shipped name) or an inline config mapping, with overrides."""
    if isinstance(base, dict):
        return config_from_dict(base, overrides)
    return load_config(base, overrides)


def _with_threads(cfg: TrainConfig, threads: int) -> TrainConfig:
    own = cfg.run.threads
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, threads=min(own, threads) if own else threads))


def claim_cells(plans: list[CellPlan], force: bool) -> None:
    """Before any work: every existing cell directory must be its cell's run (foreign), else a UserError naming the
    first that is not and how; with force such a cell's directories are removed, to be trained again."""
    for plan in plans:
        for run_dir, cfg in plan.existing_runs():
            why = foreign(run_dir, cfg)
            if why is None:
                continue
            if not force:
                raise not_its_run(run_dir, why)
            for d in plan.run_dirs():
                if d.is_dir():
                    remove_run(d)
            break


def run_cell(plan: CellPlan) -> list[str]:
    """Bring every stage of a cell to its end; returns what was done to each ("skipped", "resumed", "ran")."""
    done = []
    if plan.first is not None:
        done.append(_run_stage(plan.first, plan.hooks))
        if not plan.probes.done(plan.out / plan.name):
            before = torch.get_num_threads()
            torch.set_num_threads(plan.threads)  # as the run had; restored after, as the trainer does
            try:
                run_probes(plan.probes, plan.out / plan.name)
            finally:
                torch.set_num_threads(before)
    if plan.finetune is not None:
        done.append(_run_stage(plan.finetune_config(), plan.hooks))
    return done


def _run_stage(cfg: TrainConfig, hooks: RunHooks) -> str:
    run_dir = Path(cfg.run.out_dir) / str(cfg.run.name)
    status = run_status(run_dir)
    if status != "absent" and (why := foreign(run_dir, cfg)):  # the finetune stage's, first seen here
        raise not_its_run(run_dir, why)
    if status == "finished":
        return "skipped"
    if status == "started":
        remove_run(run_dir, force=False, hooks=hooks)
    resume = status == "partial"
    if resume:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
    result = train(cfg, hooks)
    if result.run_dir.resolve() != run_dir.resolve():  # the run took another directory: a bug, not the user's
        raise RuntimeError(f"cell run went to {result.run_dir}, expected {run_dir}")
    return "resumed" if resume else "ran"


@contextlib.contextmanager
def keep_drawn_shapes() -> Iterator[None]:
    """$VITKIT_SHAPES_CACHE, unless already set (to a directory, or empty for none), is <download cache>/shapes
    while the sweep runs: its cells (spawned workers included) and later sweeps share the images drawn."""
    if CACHE_ENV in os.environ:
        yield
        return
    os.environ[CACHE_ENV] = str(cache_dir() / "shapes")
    try:
        yield
    finally:
        os.environ.pop(CACHE_ENV, None)


def plan_cells(spec: SweepSpec, cells: list[Cell], out: Path, jobs: int, hooks: RunHooks = NO_HOOKS) -> list[CellPlan]:
    """Every cell's plan, each config checked: a UserError before anything is written."""
    if jobs < 1:
        raise UserError(f"--jobs: expected a positive number of parallel runs, got {jobs}")
    return [plan_cell(spec, cell, out, default_threads(jobs), hooks) for cell in cells]
