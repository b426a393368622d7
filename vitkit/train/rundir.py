"""Run directories: where a run goes (out_dir/name, or name-1, name-2, ... when taken), which one a resume
continues, and the config.yaml each holds (paths absolute, a line per resume that changed it). A resume must keep
the config, apart from RESUMABLE keys or with run.resume_with_changes=true.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import Any

from ..errors import UserError, UserFileNotFoundError
from ..io import DirectoryLock, atomic_write_text, remove_stale_temp_files
from .config import RunConfig, TrainConfig, flat_keys
from .metrics import TENSORBOARD_DIR
from .recipe import load_config
from .state import STATE_NAME, read_train_state

# What a resume may change: the length of the run and how it is run, logged and shown; everything else must
# match the run's config.yaml (or run.resume_with_changes=true must say the change is meant).
RESUMABLE = frozenset(
    ["schedule.steps", "schedule.epochs", "run.resume", "run.resume_with_changes", "data.num_workers"]
    + [f"run.{k}" for k in ("threads", "device", "compile", "accel", "contiguous_params", "eval_batch_size")]
    + [f"run.{k}" for k in ("progress", "plots", "log_every", "eval_every", "save_every", "tensorboard")]
)
LOCATION = frozenset({"run.out_dir", "run.name"})  # where a run is, not what it is: never a change
PATH_KEYS = ("data.root", "data.val_root", "run.init_from", "run.out_dir")  # stored absolute in config.yaml
HISTORY_PREFIX = "# resumed at step "  # config.yaml's header lines that keep what a resume changed


def _runs_of(out_dir: str | Path, name: str) -> list[Path]:
    """out_dir/name and its taken name-1, name-2, ... in the order they were made."""
    base = Path(out_dir) / name
    taken = [base] if base.exists() else []
    k = 1
    while (base.parent / f"{name}-{k}").exists():
        taken.append(base.parent / f"{name}-{k}")
        k += 1
    return taken


def find_resume_dir(run: RunConfig) -> tuple[Path, list[Path]]:
    """The run directory run.resume names (DIR wherever it is, or for true the newest of out_dir/name, name-1, ...
    with a training state), and the other resumable runs of the same name (for the message)."""
    if isinstance(run.resume, str):
        run_dir = Path(run.resume)
        if not (run_dir / STATE_NAME).is_file():
            raise UserFileNotFoundError(f"run.resume={run.resume}: no {STATE_NAME} in it to resume from")
        return run_dir, []
    base = Path(run.out_dir) / (run.name or "run")
    with_state = [d for d in _runs_of(run.out_dir, run.name or "run") if (d / STATE_NAME).is_file()]
    if not with_state:
        raise UserFileNotFoundError(f"run.resume=true but no {STATE_NAME} under {base} or {base}-N to resume")
    return with_state[-1], with_state[:-1]


def choose_run_dir(out_dir: str | Path, name: str, resume: bool | str = False) -> Path:
    """A new out_dir/name, or name-1, name-2, ... if taken (never reuse silently); resume: find_resume_dir's."""
    if resume:
        return find_resume_dir(RunConfig(out_dir=str(out_dir), name=name, resume=resume))[0]
    base = Path(out_dir) / name
    taken = _runs_of(out_dir, name)
    base.parent.mkdir(parents=True, exist_ok=True)
    k = len(taken)
    run_dir = base if not taken else base.parent / f"{name}-{k}"
    while True:  # mkdir is the claim: of two processes choosing the same name, one moves on to the next
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            k += 1
            run_dir = base.parent / f"{name}-{k}"


def _absolute(value: str) -> str:
    """A path as an absolute one, so that it resolves from anywhere; a pretrained tag stays as it is."""
    path = Path(value)
    if "://" in value or path.is_absolute() or not (path.exists() or len(path.parts) > 1 or value.startswith(".")):
        return value
    return str(path.absolute())


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """cfg with its paths (PATH_KEYS) absolute: what config.yaml stores, and what a resume compares."""
    sections: dict[str, dict[str, Any]] = {}
    for key in PATH_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str) and value:
            sections.setdefault(section, {})[name] = _absolute(value)
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


def config_changes(saved: TrainConfig, current: TrainConfig, allowed: frozenset[str] = RESUMABLE) -> list[str]:
    """``key: saved -> current`` for each setting that differs, apart from those in allowed (default: what a
    resume may change, RESUMABLE) and the run's location; paths compare as absolute ones."""
    old, new = flat_keys(with_absolute_paths(saved).to_dict()), flat_keys(with_absolute_paths(current).to_dict())
    keys = sorted((set(old) | set(new)) - allowed - LOCATION)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def claim_run_dir(cfg: TrainConfig, resume_dir: Path | None) -> tuple[Path, DirectoryLock]:
    """The run directory, locked for the life of this process: resume_dir, or a new one (choose_run_dir). What a
    killed save left behind is cleared, and a resume's state and config are checked before anything is touched."""
    run_dir = resume_dir or choose_run_dir(cfg.run.out_dir, cfg.run.name or "run")
    lock = DirectoryLock(run_dir).acquire()
    try:
        remove_stale_temp_files(run_dir)
        if resume_dir is not None:
            read_train_state(run_dir / STATE_NAME)
            check_resumed_config(run_dir, cfg)
    except BaseException:
        lock.release()
        raise
    return run_dir, lock


def check_resumed_config(run_dir: Path, cfg: TrainConfig) -> None:
    """A UserError listing how cfg differs from the run's config.yaml beyond RESUMABLE, unless resume_with_changes."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file() or cfg.run.resume_with_changes:
        return
    changes = config_changes(load_config(saved_path), cfg)
    if changes:
        raise UserError(
            f"{run_dir}: run.resume with a config that differs from the run's ({'; '.join(changes)}); "
            "resume with the run's own config, or add run.resume_with_changes=true if the change is meant"
        )


def write_config(run_dir: Path, cfg: TrainConfig, resumed_at: int | None = None) -> None:
    """config.yaml: the resolved config, its paths absolute; a resume keeps the earlier header's history and
    adds a line with what it changed (the values before and after), so no earlier value is lost."""
    path = run_dir / "config.yaml"
    history: list[str] = []
    if resumed_at is not None and path.is_file():
        old = path.read_text(encoding="utf-8", errors="replace").splitlines()
        history = [line for line in old if line.startswith(HISTORY_PREFIX)]
        changes = config_changes(load_config(path), cfg, frozenset({"run.resume", "run.resume_with_changes"}))
        if changes:
            history.append(f"{HISTORY_PREFIX}{resumed_at} with changes: {'; '.join(changes)}")
    where = str(run_dir.parent.absolute())  # where the run is now: it may have been moved
    saved = with_absolute_paths(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=False, out_dir=where)))
    header = "".join(line + "\n" for line in [f"# resolved config of {run_dir}", *history])
    atomic_write_text(path, header + saved.to_yaml())


def discard_run_dir(run_dir: Path, lock: DirectoryLock | None) -> None:
    """Remove a failed new run's files, its lock, then its directory unless something else is in it."""
    (run_dir / "config.yaml").unlink(missing_ok=True)
    shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
    if lock is not None:
        lock.release()
    with contextlib.suppress(OSError):
        run_dir.rmdir()
