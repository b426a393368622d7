"""Do the regularisation levers help where labels are scarce? The embedded digits, 25% of the training labels.

Two arms, the same model, steps and optimizer (the digits config: AdamW, label smoothing 0.1, 1-pixel shifts,
60 epochs of the 359 kept images), on the same stratified 25% of the training images (data.train_fraction=0.25,
data.split_seed=0), scored on the 360 held-out images:

    default   the digits config as shipped
    levers    the same plus RandAugment (2 ops, magnitude 10 on kornia's 0-30 scale), mixup 0.2 and
              stochastic depth 0.1

    python benchmarks/levers_digits.py              # 3 seeds, one run at a time, about 1.5 minutes on 2 CPU cores
    python benchmarks/levers_digits.py --seeds 1    # a quick look (--workers 2: two runs at once)

Prints mean +- std of the held-out top-1 over seeds and the mean wall time per run; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

COMMON = ["run.progress=false", "run.plots=false", "run.threads=1", "run.eval_every=0", "run.log_every=0"]
SCARCE = ["data.train_fraction=0.25", "data.split_seed=0"]
ARMS = {
    "default": [],
    "levers": [
        "data.randaugment_ops=2",
        "data.randaugment_magnitude=10",
        "data.mixup_alpha=0.2",
        "model.drop_path=0.1",
    ],
}


def one_run(arm: str, seed: int, out: str) -> tuple[str, int, float, float, int]:
    from vitkit.train import load_config, train

    overrides = [*COMMON, *SCARCE, *ARMS[arm], f"run.seed={seed}", f"run.out_dir={out}", f"run.name={arm}-{seed}"]
    result = train(load_config("digits", overrides))
    return arm, seed, result.metrics["eval_top1"], result.wall_s, result.step


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} +- {100 * std:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="runs in parallel (one thread each)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out, ProcessPoolExecutor(args.workers) as pool:
        jobs = [pool.submit(one_run, arm, seed, out) for arm in ARMS for seed in range(args.seeds)]
        results = [job.result() for job in jobs]
    table: dict[str, dict[str, list[float]]] = {arm: {"top1": [], "wall_s": []} for arm in ARMS}
    steps = {}
    for arm, _seed, top1, wall, step in results:
        table[arm]["top1"].append(top1)
        table[arm]["wall_s"].append(wall)
        steps[arm] = step
    print(f"digits, 25% of the training labels, {args.seeds} seeds (held-out top-1 %, mean +- std)")
    print(f"{'arm':<8}  {'top-1 %':<15}  {'per seed':<24}  {'steps':>5}  {'s/run':>6}")
    for arm, row in table.items():
        per_seed = ", ".join(f"{100 * v:.2f}" for v in row["top1"])
        wall = statistics.mean(row["wall_s"])
        print(f"{arm:<8}  {mean_std(row['top1']):<15}  {per_seed:<24}  {steps[arm]:>5}  {wall:>6.1f}")
    if args.json:
        args.json.write_text(json.dumps({"arms": ARMS, "results": table, "steps": steps}, indent=2))


if __name__ == "__main__":
    main()
