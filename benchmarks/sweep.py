"""One shipped experiment, run as its sweep command and recorded: the wall time, the table with its tested claims, and
each claimed metric per seed, with the machine (and GPU) that ran it.

    python benchmarks/sweep.py hybrids --jobs 2 --results benchmarks/results/DATE-cpu-sweep-hybrids.md
    python benchmarks/sweep.py hybrids --scale gpu --results benchmarks/results/DATE-h200-sweep-hybrids.md
    python benchmarks/sweep.py hybrids --scale gpu --device cpu --quick     # the same code path, in seconds

The second is the GPU scale's prepared command: the spec's own jobs share the GPU, and the file names the GPU. It
stops its cells at 8.5 minutes (``--time-limit``, the sweep's own: exit status 3), so that it ends, its record of the
cells finished by then written, within 10 minutes. Finished cells are skipped, so a rerun after an interruption or a
time limit records only the time of its own part. Where vitkit is not installed, ``PYTHONPATH=.`` runs it from the
checkout (the workers inherit it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harness.results import command_line, write_results

from vitkit.cli import main
from vitkit.sweep import load_spec

GPU_TIME_LIMIT = 8.5  # minutes: the GPU scale's sweep stops its cells then, to end with its record within 10


def per_seed(out: Path, metrics: list[str]) -> list[str]:
    """Each metric a claim names, per row and seed, from OUT/sweep.json's runs (in %, as the README quotes them)."""
    doc = json.loads((out / "sweep.json").read_text())
    lines = []
    for metric in metrics:
        lines += ["", f"{metric} per seed (x 100):"]
        rows: dict[str, list[str]] = {}
        for run in doc["runs"]:
            label = ", ".join(f"{k}={run[k]}" for k in doc["axes"] if run.get(k) is not None)
            value = run.get(metric)
            rows.setdefault(label, []).append(f"{run['seed']}: {'-' if value is None else f'{100 * value:.1f}'}")
        lines += [f"  {label}: {'  '.join(values)}" for label, values in rows.items()]
    return lines


def main_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="a shipped sweep (data_regime, posemb, mpp, hybrids) or a spec file")
    p.add_argument("--scale", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--jobs", type=int, help="cells at once (default: the scale's)")
    p.add_argument("--device", help="where every run trains (default: a GPU if there is one)")
    p.add_argument("--quick", action="store_true", help="the spec's quick variant: this script's code path in seconds")
    p.add_argument("--out", help="the sweep's folder (default runs/sweeps/SPEC[_gpu])")
    p.add_argument("--results", help="write the record to this Markdown file (benchmarks/results/...)")
    p.add_argument("--time-limit", type=float, metavar="MINUTES", help="the sweep's (default: 8.5 at --scale gpu)")
    args = p.parse_args(argv)
    limit = GPU_TIME_LIMIT if args.time_limit is None and args.scale == "gpu" else args.time_limit
    spec = load_spec(args.spec, quick=args.quick, scale=args.scale)
    out = Path(
        args.out or Path("runs") / "sweeps" / (spec.name + "_gpu" * (args.scale == "gpu") + "_quick" * args.quick)
    )
    command = ["sweep", args.spec, "--scale", args.scale, "--out", str(out), *["--quick"] * args.quick]
    for flag, value in (("--jobs", args.jobs), ("--device", args.device), ("--time-limit", limit)):
        command += [flag, f"{value:g}" if isinstance(value, float) else str(value)] if value else []
    start = time.perf_counter()
    status = main(command)  # the runs' own output goes by; the record is what follows
    wall = time.perf_counter() - start
    text = "\n".join(
        [
            f"vitkit {' '.join(command)}: exit status {status}, wall time {wall:.0f} s ({wall / 60:.1f} min)"
            + (" (stopped at its time limit: the table holds the cells finished by then)" if status == 3 else ""),
            "",
            (out / "sweep.md").read_text().rstrip(),
            *per_seed(out, list(dict.fromkeys(c.metric for c in spec.claims))),
        ]
    )
    print(text)
    if args.results:
        print(f"wrote {write_results(args.results, text, command_line(__file__, argv), f'The {spec.name} sweep')}")
    return status


if __name__ == "__main__":
    sys.exit(main_cli())
