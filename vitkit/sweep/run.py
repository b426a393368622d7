"""Running a sweep: each cell is an ordinary training run in OUT/<cell name>, skipped when it has finished.

A rerun picks up where a killed sweep stopped: a finished run is never touched, one with a state short of the end is
resumed, one killed before its first save is removed (under its lock) and started again. A cell's finetune stage
starts from its first run's weights in OUT/<cell name>--finetune (with ``pretrain: false`` from scratch), after
its probes. ``--jobs N`` runs N cells at once in spawned processes, each on at most cores // N threads.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from ..device import usable_cores
from ..errors import UserError
from ..io import DirectoryLock
from ..train.config import TrainConfig
from ..train.engine import NO_HOOKS, NonFiniteLossError, RunHooks, train
from ..train.overrides import value_text
from ..train.recipe import config_from_dict, load_config
from ..train.state import STATE_NAME
from .probes import Probes, run_probes
from .spec import Cell, SweepSpec, finetune_name

# what stops one cell and lets the others go on: a setting that does not work (a config error, a diverged run);
# anything else is a bug and stops the sweep with its traceback
CELL_FAILURES = (UserError, NonFiniteLossError)
_STATE_META = "vitkit_train_state"  # the metadata key of a train_state.safetensors (vitkit.train.state)


def run_status(run_dir: Path) -> str:
    """ "finished", "partial" (a state to resume), "started" (a directory without one) or "absent"."""
    if not run_dir.is_dir():
        return "absent"
    state = run_dir / STATE_NAME
    if not state.is_file():
        return "started"
    from safetensors import safe_open

    with safe_open(str(state), framework="pt") as f:  # the header only: no tensor is read
        doc = json.loads((f.metadata() or {}).get(_STATE_META, "{}"))
    done = doc.get("step", 0) >= doc.get("total_steps", float("inf")) and bool(doc.get("metrics"))
    return "finished" if done else "partial"


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

    def run_dirs(self) -> list[Path]:
        first, second = self.out / self.name, self.out / finetune_name(self.name)
        return ([first] if self.first is not None else []) + ([second] if self.finetune else [])

    def finished(self) -> bool:
        done = all(run_status(d) == "finished" for d in self.run_dirs())
        return done and (self.first is None or self.probes.done(self.out / self.name))


def plan_cell(spec: SweepSpec, cell: Cell, out: Path, threads: int, hooks: RunHooks = NO_HOOKS) -> CellPlan:
    """The runs a plain ``vitkit train`` of the cell's overrides would make (the first one's config checked now)."""
    common = [f"run.seed={cell.seed}", f"run.out_dir={out}", "run.progress=false"]
    first = build_config(spec.base_config(), [*spec.overrides, *cell.overrides(), *common, f"run.name={cell.name}"])
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
    return CellPlan(first_plan, finetune, threads, out, cell.name, spec.probes, hooks)


def build_config(base: str | dict[str, Any], overrides: list[str]) -> TrainConfig:
    """A config file (path or shipped name) or an inline config mapping, with overrides."""
    if isinstance(base, dict):
        return config_from_dict(base, overrides)
    return load_config(base, overrides)


def _with_threads(cfg: TrainConfig, threads: int) -> TrainConfig:
    own = cfg.run.threads
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, threads=min(own, threads) if own else threads))


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
        base, overrides = plan.finetune
        done.append(_run_stage(_with_threads(build_config(base, overrides), plan.threads), plan.hooks))
    return done


def _run_stage(cfg: TrainConfig, hooks: RunHooks) -> str:
    run_dir = Path(cfg.run.out_dir) / str(cfg.run.name)
    status = run_status(run_dir)
    if status == "finished":
        return "skipped"
    if status == "started":
        lock = DirectoryLock(run_dir).acquire()  # a UserError if a live process runs it
        lock.release()
        shutil.rmtree(run_dir)
    resume = status == "partial"
    if resume:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
    result = train(cfg, hooks)
    if result.run_dir.resolve() != run_dir.resolve():  # the run took another directory: a bug, not the user's
        raise RuntimeError(f"cell run went to {result.run_dir}, expected {run_dir}")
    return "resumed" if resume else "ran"


@dataclass
class SweepRun:
    """What a sweep did: each cell's stage actions, and the cells that failed with their error."""

    actions: dict[str, list[str]]
    failed: dict[str, str]


def run_cells(
    spec: SweepSpec,
    cells: list[Cell],
    out: Path,
    jobs: int = 1,
    log: Callable[[str], object] = print,
    hooks: RunHooks = NO_HOOKS,
) -> SweepRun:
    """Run (or skip, or resume) every cell; a cell that fails (CELL_FAILURES) is reported and the others go on.
    SIGINT / SIGTERM stop the running cell at a step boundary with its state saved (TrainingInterrupted)."""
    if jobs < 1:
        raise UserError(f"--jobs: expected a positive number of parallel runs, got {jobs}")
    threads = default_threads(jobs)
    # every config checked before any run
    plans = [(cell, plan_cell(spec, cell, out, threads, hooks)) for cell in cells]
    actions: dict[str, list[str]] = {}
    failed: dict[str, str] = {}
    pending = []
    for cell, plan in plans:
        if plan.finished():
            actions[cell.name] = ["skipped"] * len(plan.run_dirs())
            log(f"{cell.name}: finished already, skipped")
        else:
            pending.append((cell, plan))
    if jobs == 1:
        for cell, plan in pending:
            log(f"{cell.name}: running")
            try:
                actions[cell.name] = run_cell(plan)
            except CELL_FAILURES as e:
                failed[cell.name] = str(e)
                log(f"{cell.name}: failed: {e}")
        return SweepRun(actions, failed)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures: dict[Future[list[str]], Cell] = {}
        for cell, plan in pending:
            log(f"{cell.name}: queued")
            futures[pool.submit(run_cell, plan)] = cell
        for future in as_completed(futures):
            cell = futures[future]
            error = future.exception()
            if isinstance(error, CELL_FAILURES):
                failed[cell.name] = str(error)
                log(f"{cell.name}: failed: {error}")
            elif error is not None:
                raise error
            else:
                actions[cell.name] = future.result()
                log(f"{cell.name}: {', '.join(actions[cell.name])}")
    return SweepRun(actions, failed)
