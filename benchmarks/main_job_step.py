"""Where the main job's training step spends its time, and what the shipped digits config's settings buy.

Two trainers of the shipped digits config in one process, taking turns round by round on the same machine:

    shipped   the config as it is: attention written out (model.attn_impl=explicit), 2 threads
    sdpa-1    the same with torch's fused attention (SDPA) on one thread, as the config was before

    python benchmarks/main_job_step.py                  # under a minute on 2 CPU cores
    python benchmarks/main_job_step.py --profile 30     # then each arm's top ops (torch.profiler, 30 steps)
    python benchmarks/main_job_step.py --arm exact-gelu=model.gelu=exact   # shipped against other overrides
    python benchmarks/main_job_step.py --arm separate=run.contiguous_params=false   # AdamW over 56 tensors, not 2
    python benchmarks/main_job_step.py --allocator default   # glibc's own malloc settings, not vitkit train's
    python benchmarks/main_job_step.py --replay         # then every operator call of a step replayed alone

Prints each arm's median ms per step (full training steps: data, forward, backward, clip, AdamW) and the
seconds that makes for all of that arm's steps (the main job's run), the paired ratio of those run times with its
95% interval, the fixed cost of a step (the shipped arm at batch 2), the floor the matmuls set (the shipped
step's matmuls replayed alone at their shapes) and the page faults and system time of a shipped step. The process
keeps freed memory for reuse as `vitkit train` does (vitkit.fast.tune_cpu_allocator) unless `--allocator default`,
which is process-wide, so the two settings compare across runs of this script, not within one.
Speed needs a quiet machine: the load average is checked before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
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


def main() -> None:
    from vitkit.bench.stats import load_average, load_warnings, paired_ratio_stats
    from vitkit.device import usable_cores

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
    args = p.parse_args()
    if args.allocator == "tuned":
        from vitkit.fast import tune_cpu_allocator

        tune_cpu_allocator()
    chosen = dict(ARMS)
    if args.arm:
        chosen = {"shipped": []}
        for arm in args.arm:
            name, sep, overrides = arm.partition("=")
            if not sep or not name or not overrides or name in chosen:
                p.error(f"--arm {arm!r}: expected a new NAME=KEY=VALUE[,KEY=VALUE]")
            chosen[name] = overrides.split(",")

    before = load_average()
    with contextlib.ExitStack() as stack:
        arms = {name: stack.enter_context(trainer(overrides)) for name, overrides in chosen.items()}
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

    print(
        f"the main job's training step (digits config), {args.rounds} rounds of {args.steps} steps, "
        f"allocator {args.allocator}"
    )
    run_s = {name: [s * arms[name][2] for s in per_step] for name, per_step in seconds.items()}  # a whole run's
    for name, per_step in seconds.items():
        ms, (_, threads, total, batch) = statistics.median(per_step) * 1e3, arms[name]
        print(
            f"  {name:10s} {threads} thread(s), batch {batch:3d}: {ms:6.2f} ms a step -> "
            f"{ms * total / 1e3:5.1f} s for {total:,} steps"
        )
    for name in list(arms)[1:]:  # of whole runs: arms of other batch sizes take other numbers of steps
        print(f"  shipped / {name} speed-up of a run: {paired_ratio_stats(run_s[name], run_s['shipped'])}")
    print(f"  fixed cost of a step (shipped, batch 2): {fixed * 1e3:.2f} ms")
    seconds_mm, count, gflop = floor
    print(
        f"  the shipped step's {count} matmuls alone (mm, addmm, bmm at its shapes, {gflop:.2f} GFLOP): "
        f"{seconds_mm * 1e3:.2f} ms, {gflop / seconds_mm:.0f} GFLOP/s"
    )
    print(f"  a shipped step's page faults: {faults:,.1f}, system time {system_ms:.2f} ms")
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
    for line in load_warnings(before, after, max(arm[1] for arm in arms.values()), usable_cores()):
        print(line)
    for name, table in tables.items():
        print(f"\n{name}: {args.profile} steps\n{table}", flush=True)  # flushed: profiler teardown at exit may not


if __name__ == "__main__":
    main()
