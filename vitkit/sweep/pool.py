"""Running a sweep's cells (run.py's plans): in which order, and ``--jobs N`` of them at once in spawned processes.

Cells run seed by seed (every setting of the spec's first seed, then of its next), and within a seed the largest
planned training first (train.plan.planned_flops): a sweep stopped early has whole seeds of every setting to compare,
and the longest runs start before the short ones that fill the gaps. A worker stops (its running cell's state saved
at a step boundary) when the sweep is interrupted, when its process dies, or at the sweep's time limit, after which
no queued cell starts and the sweep tabulates the cells that finished.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.synchronize import Event
from time import monotonic

from ..errors import UserError
from ..train.engine import TrainingInterrupted
from ..train.plan import planned_flops
from .run import CELL_FAILURES, CellPlan, claim_cells, run_cell


@dataclass
class SweepRun:
    """What a sweep did: each cell's stage actions, the cells that failed with their error, and whether its time
    limit stopped it before every cell had finished."""

    actions: dict[str, list[str]]
    failed: dict[str, str]
    timed_out: bool = False


def run_order(plans: list[CellPlan]) -> list[CellPlan]:
    """The plans seed by seed, in the order the spec lists its seeds, and the largest planned training FLOPs first
    within a seed (the first run's; a cell without pretraining, its fine-tune's)."""
    rank = {seed: i for i, seed in enumerate(dict.fromkeys(p.seed for p in plans))}
    memo: dict[str, float] = {}
    flops = {p.name: _planned(p, memo) for p in plans}
    return sorted(plans, key=lambda p: (rank[p.seed], -flops[p.name]))


def _planned(plan: CellPlan, memo: dict[str, float]) -> float:
    """The plan's training FLOPs, worked out once for the cells that share what decides them (their data and a
    source checkpoint are read for it): settings that differ in seed or learning rate alone. A cell whose data or
    source cannot be read counts 0 and runs last, to fail alone (CELL_FAILURES) when it runs."""
    try:
        cfg = plan.first if plan.first is not None else plan.finetune_config() if plan.finetune is not None else None
        if cfg is None:
            return 0.0
        key = repr((cfg.model, cfg.data, cfg.optim.batch_size, cfg.schedule, cfg.run.init_from, cfg.run.objective))
        if key not in memo:
            memo[key] = planned_flops(cfg)
        return memo[key]
    except UserError:
        return 0.0


def run_cells(
    plans: list[CellPlan],
    jobs: int = 1,
    log: Callable[[str], object] = print,
    force: bool = False,
    time_limit: float | None = None,
) -> SweepRun:
    """Run (or skip, or resume) every cell in run_order, once all are claimed (claim_cells); a cell that fails
    (CELL_FAILURES) is reported and the others go on. SIGINT / SIGTERM stop the running cells at a step boundary with
    their state saved (TrainingInterrupted); so does ``time_limit`` (seconds from now), which then returns, its
    stopped cells unfinished and the queued ones not started (run in worker processes, also for one job)."""
    claim_cells(plans, force)
    run = SweepRun({}, {})
    pending = []
    for plan in run_order(plans):
        try:
            finished = plan.finished()
        except UserError as e:  # a state or model file that cannot be read: this cell fails, the others go on
            run.failed[plan.name] = str(e)
            log(f"{plan.name}: failed: {e}")
            continue
        if finished:
            run.actions[plan.name] = ["skipped"] * len(plan.run_dirs())
            log(f"{plan.name}: finished already, skipped")
        else:
            pending.append(plan)
    if jobs == 1 and time_limit is None:
        for plan in pending:
            log(f"{plan.name}: running")
            try:
                run.actions[plan.name] = run_cell(plan)
            except CELL_FAILURES as e:
                run.failed[plan.name] = str(e)
                log(f"{plan.name}: failed: {e}")
        return run
    context, me = get_context("spawn"), os.getpid()
    stop = context.Event()
    deadline = None if time_limit is None else monotonic() + time_limit
    with (
        _ctrl_c_interrupts(),
        ProcessPoolExecutor(jobs, mp_context=context, initializer=_watch_parent, initargs=(me, stop)) as pool,
    ):
        futures: dict[Future[list[str]], CellPlan] = {}
        for plan in pending:
            log(f"{plan.name}: queued")
            futures[pool.submit(_run_in_worker, me, plan)] = plan
        try:
            _collect(futures, run, log, stop, deadline)
        except BaseException:  # Ctrl-C, a signal, a bug: the running cells save their state and stop, no new one starts
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return run


@contextlib.contextmanager
def _ctrl_c_interrupts() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the sweep's process while it waits for its workers, also where the process
    started with SIGINT ignored (a script's background job: ``vitkit sweep ... &``), as a training loop's own handler
    does for a cell run in the sweep's process: ``kill -INT`` stops a sweep whatever its ``--jobs``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _collect(
    futures: dict[Future[list[str]], CellPlan],
    run: SweepRun,
    log: Callable[[str], object],
    stop: Event,
    deadline: float | None,
) -> None:
    """Each cell's actions, or its failure, as the workers finish them; at the deadline, ``stop`` for every worker.
    The wait wakes every second: a Ctrl-C that one of the pool's threads receives runs its handler
    (KeyboardInterrupt) only once the main thread runs again."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
        if deadline is not None and not run.timed_out and monotonic() >= deadline and pending:
            run.timed_out = True
            stop.set()
            log("time limit reached: the running cells stop at their next step, their state saved; no other starts")
        for future in (f for f in futures if f in done):  # in the order the cells were queued
            name, error = futures[future].name, future.exception()
            if isinstance(error, CELL_FAILURES):
                run.failed[name] = str(error)
                log(f"{name}: failed: {error}")
            elif isinstance(error, TrainingInterrupted) and run.timed_out:
                log(f"{name}: stopped at the time limit, its state saved")
            elif error is not None:
                raise error
            elif not future.result():  # queued when the sweep stopped
                log(f"{name}: not started")
            else:
                run.actions[name] = future.result()
                log(f"{name}: {', '.join(run.actions[name])}")


def _watch_parent(parent: int, stop: Event) -> None:
    """A worker's initializer. The worker ignores SIGINT of its own: a Ctrl-C reaches the sweep's process, which
    sets ``stop``, and the worker's training loop installs its own handler. When ``stop`` is set or the sweep's
    process dies (the OOM killer, kill -9), the worker sends itself SIGINT: a running cell saves its state at its
    next step and stops (a second one, once the loop has restored the handlers, is ignored); then it exits
    (_run_in_worker)."""
    global _stop
    _stop = stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent and not stop.wait(0.5):
            pass
        while True:  # until a training loop hears it, or the worker ends
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)

    threading.Thread(target=watch, name="vitkit-sweep-parent", daemon=True).start()


_stop: Event | None = None  # in a worker: set when the sweep stops (_watch_parent)


def _run_in_worker(parent: int, plan: CellPlan) -> list[str]:
    if _stop is not None and _stop.is_set():  # queued before the sweep stopped: not started
        return []
    try:
        return run_cell(plan)
    finally:
        if os.getppid() != parent:  # nobody to report to
            os._exit(1)
