"""Where the main job's training step spends its time, what the shipped digits config's settings buy, and the step
of this checkout against another's.

Two trainers of the shipped digits config in one process, taking turns round by round on the same machine:

    shipped   the config as it is: attention written out (model.attn_impl=explicit), 2 threads
    sdpa-1    the same with torch's fused attention (SDPA) on one thread, as the config was before

    python benchmarks/main_job_step.py                  # under a minute on 2 CPU cores
    python benchmarks/main_job_step.py --profile 30     # then each arm's top ops (torch.profiler, 30 steps)
    python benchmarks/main_job_step.py --arm exact-gelu=model.gelu=exact   # shipped against other overrides
    python benchmarks/main_job_step.py --arm separate=run.contiguous_params=false   # AdamW over 56 tensors, not 2
    python benchmarks/main_job_step.py --allocator default   # glibc's own malloc settings, not vitkit train's
    python benchmarks/main_job_step.py --replay         # then every operator call of a step replayed alone
    python benchmarks/main_job_step.py --other-tree ../old --rounds 15   # this checkout's step against another's

Prints each arm's median ms per step (full training steps: data, forward, backward, clip, AdamW) and the
seconds that makes for all of that arm's steps (the main job's run), the paired ratio of those run times with its
95% interval, the fixed cost of a step (the shipped arm at batch 2), the floor the matmuls set (the shipped
step's matmuls replayed alone at their shapes) and the page faults and system time of a shipped step.
``--other-tree PATH`` instead times the shipped step of this checkout and of the one at PATH (its vitkit imported
from there), each in a process of its own, round by round in alternating order: both medians and the ratio of
this tree's step time over the other's with its 95% interval. The process keeps freed memory for reuse as
`vitkit train` does (tune_cpu_allocator) unless `--allocator default`, which is process-wide, so the two settings
compare across runs of this script, not within one. Speed needs a quiet machine: the load average is checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ARMS = {"shipped": [], "sdpa-1": ["model.attn_impl=sdpa", "run.threads=1"]}
QUIET = ["run.progress=false", "run.plots=false", "run.eval_every=0", "run.log_every=0"]


@contextlib.contextmanager
def trainer(overrides: list[str]) -> Iterator[tuple[Callable[[], float], int, int, int]]:
    """A Trainer of the digits config with these overrides: (one training step, its thread count, the run's steps,
    its batch size)."""
    from vitkit.train import load_config
    from vitkit.train.engine import Trainer

    with tempfile.TemporaryDirectory() as out:
        t = Trainer(load_config("digits", [*QUIET, f"run.out_dir={out}", *overrides]))
        threads = torch.get_num_threads()  # what the config asked for, capped at the usable cores
        try:
            batches = t.batches(0)
            yield (lambda: t.train_step(batches)), threads, t.total_steps, t.cfg.optim.batch_size
        finally:
            t.close()


def timed(step: Callable[[], float], threads: int, steps: int) -> float:
    """Seconds per step over ``steps`` steps after one untimed step, on ``threads`` threads."""
    torch.set_num_threads(threads)
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def faults_and_system_ms(step: Callable[[], float], threads: int, steps: int) -> tuple[float, float]:
    """Minor page faults and milliseconds of system time per step (the kernel's share: page faults, zeroing)."""
    torch.set_num_threads(threads)
    step()
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_minflt - before.ru_minflt) / steps, (after.ru_stime - before.ru_stime) * 1e3 / steps


def profile_table(step: Callable[[], float], threads: int, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


MATMULS = {"aten::mm": torch.mm, "aten::addmm": torch.addmm, "aten::bmm": torch.bmm}  # profiler name: the op


def matmul_floor(step: Callable[[], float], threads: int, rounds: int = 7) -> tuple[float, int, float]:
    """The matmuls of one training step replayed alone at their shapes (from the profiler): (median seconds for
    all of them, how many there are, their GFLOP). What the step would take if nothing but its matmuls ran."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    calls = []
    for event in prof.events():
        if event.name in MATMULS:
            shapes = [tuple(s) for s in event.input_shapes if s]  # addmm: (bias, a, b); mm, bmm: (a, b)
            calls.append((event.name, [torch.randn(s) for s in shapes]))
    flops = sum(2 * a.numel() * b.shape[-1] for _, (*_, a, b) in calls)  # a: (m, k) or (batch, m, k)

    def replay() -> None:
        for name, args in calls:
            MATMULS[name](*args)

    replay()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        replay()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(calls), flops / 1e9


def replayed_ops(step: Callable[[], float], threads: int, repeats: int = 20) -> tuple[int, dict[str, float]]:
    """Every ATen operator call of one training step, recorded below autograd (a TorchDispatchMode) and replayed
    alone on the same tensors, unprofiled: (how many calls, median seconds of each operator's calls summed by
    name). What the step would take if nothing ran but its operators: the rest of a step is the framework's own
    cost per call (Python, the autograd engine, the dispatcher above the kernels). Replaying writes to the
    trainer's tensors (in-place ops, the optimizer's update), so it runs last."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(threads)
    step()
    with Record():
        step()
    seconds: dict[str, float] = {}
    for func, args, kwargs in calls:
        func(*args, **kwargs)  # warm
        start = time.perf_counter()
        for _ in range(repeats):
            func(*args, **kwargs)
        name = func.overloadpacket.__name__
        seconds[name] = seconds.get(name, 0.0) + (time.perf_counter() - start) / repeats
    return len(calls), seconds


# ---------------------------------------------------------------------------------------- two checkouts
MARK = "main_job_step worker: "  # the prefix of a worker's replies; anything else it prints is not one


def tune_allocator(allocator: str) -> None:
    """Freed memory kept for reuse, as `vitkit train` does, with the tree's own function: vitkit.accel.training's,
    or vitkit.fast's in checkouts from before vitkit.accel."""
    if allocator != "tuned":
        return
    try:
        from vitkit.accel.training import tune_cpu_allocator
    except ImportError:  # a checkout from before vitkit.accel
        tune_cpu_allocator = importlib.import_module("vitkit.fast").tune_cpu_allocator
    tune_cpu_allocator()


def worker(allocator: str) -> None:
    """A shipped trainer of the vitkit that this process imports, timing ``N`` steps for each line N on stdin and
    answering each with a line MARK + JSON on stdout (its first: the trainer's threads, steps, batch and the vitkit
    it imported). Only torch and vitkit.train are imported, which every checkout has."""
    import vitkit

    tune_allocator(allocator)
    replies, sys.stdout = sys.stdout, sys.stderr  # what the trainer prints stays out of the replies

    def reply(doc: dict[str, Any]) -> None:
        replies.write(MARK + json.dumps(doc) + "\n")
        replies.flush()

    with trainer([]) as (step, threads, total, batch):
        reply({"threads": threads, "total_steps": total, "batch": batch, "vitkit": vitkit.__file__})
        for line in sys.stdin:
            reply({"seconds": timed(step, threads, int(line))})


class Checkout:
    """A worker process on the vitkit of the checkout at tree (its root put first on PYTHONPATH)."""

    def __init__(self, tree: Path, allocator: str) -> None:
        self.tree = tree
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--allocator", allocator]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise SystemExit(f"the worker on {self.tree} ended without an answer (exit status {self.proc.wait()})")

    def seconds(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps after one untimed step (``timed``), in the worker."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return float(self._read()["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def compare_trees(other: Path, rounds: int, steps: int, allocator: str) -> None:
    """This checkout's shipped step against the one at ``other``, alternating (see the module docstring)."""
    from harness import load_average, load_warnings, paired_ratio_stats

    from vitkit.device import usable_cores

    trees = {"this tree": Path(__file__).resolve().parents[1], "other tree": other.resolve()}
    before = load_average()
    with contextlib.ExitStack() as stack:
        workers: dict[str, Checkout] = {}
        for name, tree in trees.items():
            workers[name] = Checkout(tree, allocator)
            stack.callback(workers[name].close)
        if len({w.info["vitkit"] for w in workers.values()}) == 1:
            raise SystemExit(f"--other-tree {other}: both processes imported {workers['this tree'].info['vitkit']}")
        seconds: dict[str, list[float]] = {name: [] for name in workers}
        for i in range(rounds):
            for name in list(workers)[:: 1 if i % 2 == 0 else -1]:  # each goes first in every other round
                seconds[name].append(workers[name].seconds(steps))
    after = load_average()
    print(f"the main job's training step (digits config), {rounds} rounds of {steps} steps, allocator {allocator}")
    for name, w in workers.items():
        info = w.info
        print(
            f"  {name:10s} {statistics.median(seconds[name]) * 1e3:6.2f} ms a step ({info['threads']} thread(s), "
            f"batch {info['batch']}, {info['total_steps']:,} steps a run): vitkit from {Path(info['vitkit']).parent}"
        )
    print(f"  this tree / other tree, step time: {paired_ratio_stats(seconds['this tree'], seconds['other tree'])}")
    for line in load_warnings(before, after, max(w.info["threads"] for w in workers.values()), usable_cores()):
        print(line)


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15, help="rounds, each arm timed once a round (default 15)")
    p.add_argument("--steps", type=int, default=40, help="training steps an arm is timed for a round (default 40)")
    p.add_argument("--profile", type=int, default=0, help="then profile this many steps of each arm (default 0)")
    p.add_argument(
        "--replay",
        action="store_true",
        help="then replay each ATen operator call of a shipped step alone, unprofiled, and print the top ones",
    )
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE[,KEY=VALUE]",
        help="compare the shipped config with these overrides instead of sdpa-1 (repeatable)",
    )
    p.add_argument(
        "--allocator",
        choices=("tuned", "default"),
        default="tuned",
        help="tuned: freed memory kept for reuse, as vitkit train does (default); default: glibc's settings",
    )
    p.add_argument(
        "--other-tree", type=Path, metavar="PATH", help="time the shipped step here and in the checkout at PATH"
    )
    p.add_argument("--results", help="also write what is printed as a result file (benchmarks/results/)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a Checkout's process
    args = p.parse_args(argv)
    if args.other_tree is not None and not (args.other_tree / "vitkit" / "__init__.py").is_file():
        p.error(f"--other-tree {args.other_tree}: no vitkit package there (expected a checkout's root)")
    if args.other_tree is not None and (args.arm or args.profile or args.replay):
        p.error("--other-tree times the shipped config alone: not with --arm, --profile or --replay")
    args.arms = dict(ARMS)
    if args.arm:
        args.arms = {"shipped": []}
        for arm in args.arm:
            name, sep, overrides = arm.partition("=")
            if not sep or not name or not overrides or name in args.arms:
                p.error(f"--arm {arm!r}: expected a new NAME=KEY=VALUE[,KEY=VALUE]")
            args.arms[name] = overrides.split(",")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.allocator)
        return
    from harness import command_line, recorded

    with recorded(args.results, command_line(__file__, argv)):
        if args.other_tree is not None:
            compare_trees(args.other_tree, args.rounds, args.steps, args.allocator)
        else:
            compare_arms(args)


def compare_arms(args: argparse.Namespace) -> None:
    """The arms in one process, taking turns round by round, then the shipped step's costs (the module docstring)."""
    from harness import load_average

    tune_allocator(args.allocator)
    before = load_average()
    with contextlib.ExitStack() as stack:
        arms = {name: stack.enter_context(trainer(overrides)) for name, overrides in args.arms.items()}
        seconds: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, (step, threads, *_) in arms.items():
                seconds[name].append(timed(step, threads, args.steps))
        after = load_average()
        tables = {name: profile_table(*arm[:2], args.profile) for name, arm in arms.items()} if args.profile else {}
        floor = matmul_floor(*arms["shipped"][:2])
        faults, system_ms = faults_and_system_ms(*arms["shipped"][:2], args.steps)
        replay = replayed_ops(*arms["shipped"][:2]) if args.replay else None  # last: it writes to the tensors
    with trainer(["optim.batch_size=2"]) as (small, small_threads, *_):
        fixed = statistics.median(timed(small, small_threads, args.steps) for _ in range(5))
    info = {name: arm[1:] for name, arm in arms.items()}
    print_arms(args, seconds, info, fixed, floor, (faults, system_ms), replay, (before, after))
    for name, table in tables.items():
        print(f"\n{name}: {args.profile} steps\n{table}", flush=True)  # flushed: profiler teardown at exit may not


def print_arms(
    args: argparse.Namespace,
    seconds: dict[str, list[float]],
    info: dict[str, tuple[int, int, int]],
    fixed: float,
    floor: tuple[float, int, float],
    faults: tuple[float, float],
    replay: tuple[int, dict[str, float]] | None,
    load: tuple[float | None, float | None],
) -> None:
    """compare_arms' report: each arm's step and run, the ratios, the fixed cost, the matmul floor, page faults."""
    from harness import load_warnings, paired_ratio_stats

    from vitkit.device import usable_cores

    print(
        f"the main job's training step (digits config), {args.rounds} rounds of {args.steps} steps, "
        f"allocator {args.allocator}"
    )
    run_s = {name: [s * info[name][1] for s in per_step] for name, per_step in seconds.items()}  # a whole run's
    for name, per_step in seconds.items():
        ms, (threads, total, batch) = statistics.median(per_step) * 1e3, info[name]
        print(
            f"  {name:10s} {threads} thread(s), batch {batch:3d}: {ms:6.2f} ms a step -> "
            f"{ms * total / 1e3:5.1f} s for {total:,} steps"
        )
    for name in list(info)[1:]:  # of whole runs: arms of other batch sizes take other numbers of steps
        print(f"  shipped / {name} speed-up of a run: {paired_ratio_stats(run_s[name], run_s['shipped'])}")
    print(f"  fixed cost of a step (shipped, batch 2): {fixed * 1e3:.2f} ms")
    seconds_mm, count, gflop = floor
    print(
        f"  the shipped step's {count} matmuls alone (mm, addmm, bmm at its shapes, {gflop:.2f} GFLOP): "
        f"{seconds_mm * 1e3:.2f} ms, {gflop / seconds_mm:.0f} GFLOP/s"
    )
    print(f"  a shipped step's page faults: {faults[0]:,.1f}, system time {faults[1]:.2f} ms")
    if replay is not None:
        count, by_op = replay
        replayed_ms = sum(by_op.values()) * 1e3
        shipped_ms = statistics.median(seconds["shipped"]) * 1e3
        print(
            f"  a shipped step's {count} ATen operator calls replayed alone: {replayed_ms:.2f} ms of its "
            f"{shipped_ms:.2f} ms ({replayed_ms / shipped_ms:.0%}); the rest is the framework's cost per call"
        )
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
        print("    " + ", ".join(f"{name} {sec * 1e3:.2f}" for name, sec in top))
    for line in load_warnings(*load, max(i[0] for i in info.values()), usable_cores()):
        print(line)


if __name__ == "__main__":
    main()
